# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# make test runs the suite in this many pytest-xdist processes, one per core: the suite is bound
# by CPU, not by its waits on subprocesses (a third process on 2 cores made it slower).
TEST_WORKERS ?= 2
# A machine without a GPU can take torch's CPU-only wheels (a few hundred MB instead of the ~6 GB
# venv with the CUDA wheels): make train TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

# GPU targets check first, and stop at once on a machine without one (make exits 2): with none
# of the GPU device nodes (NVIDIA's, WSL's, ROCm's) in 0.01 s; with one, torch says (2 s: its import)
GPU_NODES ?= /dev/nvidiactl /dev/dxg /dev/kfd
NO_GPU = make $@ needs a CUDA GPU and none is visible
ON_CPU = On this machine: make train, make test, make lint, make bench-headline, make bench-cpu
NEEDS_GPU = @if ls -d $(GPU_NODES) 2>/dev/null | grep -q .; then \
	$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('$(NO_GPU) (torch.cuda.is_available() is False). $(ON_CPU)')"; \
	else echo "$(NO_GPU) (none of $(GPU_NODES)). $(ON_CPU)" >&2; exit 1; fi

# make test-min: the fast tests on the oldest torch the code declares (pyproject.toml), in a venv
# of its own (CI runs it after the full suite)
MIN_VENV ?= .venv-min
MIN_CONSTRAINTS := .ci/min-constraints.txt

.PHONY: install train test test-all test-min lint format test-gpu bench bench-headline bench-cpu bench-memory bench-loader bench-profile bench-fast bench-prepared bench-scaling bench-peers clean

install: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install -q torch torchvision --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

train: $(STAMP)          ## the embedded default: digits, fp32, W&B offline (about 15 s on a 2-core CPU)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)           ## the fast tests: no end-to-end runs, torchrun or SLURM (about 3 min on 2 cores)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow and not slurm" $(PYTEST_ARGS)

test-all: $(STAMP)       ## every CPU test, end-to-end runs included (CI; GPU tests skip without CUDA, SLURM tests without a cluster)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-min:                ## the fast tests on the declared minimum torch (.ci/min-constraints.txt), in $(MIN_VENV)
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(MIN_VENV)/bin/python -m pip install -q -c $(MIN_CONSTRAINTS) torch torchvision
	$(MIN_VENV)/bin/python -m pip install -q -c $(MIN_CONSTRAINTS) -e ".[test]"
	$(MIN_VENV)/bin/python -c "import torch; print('test-min: torch', torch.__version__)"
	$(MIN_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not slow and not slurm" $(PYTEST_ARGS)

lint: $(STAMP)           ## ruff: lint and format check (CI runs it before the tests)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)         ## ruff: fix what it can and format the tree
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

test-gpu: $(STAMP)       ## only the tests marked gpu (GPU)
	$(NEEDS_GPU)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

bench-headline: $(STAMP) ## (CPU or GPU; ~5 min on a 2-core CPU, the sum of the README table's CPU runs) train.py precision=P batch=B on the default: fp32/amp/bf16 x batch 16..1024
	$(BIN)/python benchmarks/headline.py

bench-cpu: $(STAMP)      ## (CPU) train.py vs a bare PyTorch loop on this CPU
	$(BIN)/python benchmarks/bare_vs_train.py --preset cpu

bench: $(STAMP)          ## (GPU) train.py vs a bare loop: fp32/tf32/amp/bf16 x channels_last x compile, every GPU
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/bare_vs_train.py --preset gpu --matrix --gpus all

bench-memory: $(STAMP)   ## (GPU) batch=auto vs an independent bisection under a 24 GiB cap (fp32, amp, amp+ckpt)
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/batch_search.py

bench-loader: $(STAMP)   ## (GPU) every data path (original / prepared copy, workers / nvJPEG) next to the GPU's rate
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/loader.py

bench-profile: $(STAMP)  ## (GPU) where experiment=fast's step goes (kernels by kind, GPU idle)
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/profile_step.py

bench-fast: $(STAMP)     ## (GPU) experiment=fast next to variants of it (kernel tuning on, batch 768)
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/fast_variants.py

bench-prepared: $(STAMP) ## (GPU) accuracy on the original JPEGs vs the prepared copy (generated digit photos)
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/prepared_accuracy.py

bench-peers: $(STAMP)    ## (GPU) mixprec beside Hugging Face, torchtitan (where installed) and Lightning: one table
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/peers.py --rows lm_bf16,lm_fp8,vision_amp $(ARGS)

bench-scaling: $(STAMP)  ## (2 GPUs) DDP: 1 GPU vs torchrun on 2 GPUs, same per-GPU batch
	$(NEEDS_GPU)
	$(BIN)/python benchmarks/scaling.py

clean:
	rm -rf outputs/2* outputs/multirun .pytest_cache
