# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# make test runs the suite in this many pytest-xdist processes: most tests wait on subprocesses
# (train.py runs, torchrun, SLURM), so 2 cut the 2-core CI machine's 10.5 min to 7.5 min.
TEST_WORKERS ?= 2

.PHONY: install train test lint format test-gpu bench bench-headline bench-cpu bench-memory bench-loader bench-profile bench-fast bench-prepared bench-scaling clean

install: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

train: $(STAMP)          ## the embedded default: digits, fp32, W&B offline (about 15 s on a 2-core CPU)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)           ## the CPU suite (GPU tests skip without CUDA, SLURM tests without a cluster)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)           ## ruff: lint and format check (CI runs it before the tests)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)         ## ruff: fix what it can and format the tree
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

test-gpu: $(STAMP)       ## only the tests marked gpu (on a CUDA machine)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

bench-headline: $(STAMP) ## train.py precision=P batch=B on the default: fp32/amp/bf16 x batch 16..1024
	$(BIN)/python benchmarks/headline.py

bench-cpu: $(STAMP)      ## train.py vs a bare PyTorch loop on this CPU
	$(BIN)/python benchmarks/bare_vs_train.py --preset cpu

bench: $(STAMP)          ## train.py vs a bare loop: fp32/tf32/amp/bf16 x channels_last x compile, every GPU
	$(BIN)/python benchmarks/bare_vs_train.py --preset gpu --matrix --gpus all

bench-memory: $(STAMP)   ## batch=auto vs an independent bisection under a 24 GiB cap (fp32, amp, amp+ckpt)
	$(BIN)/python benchmarks/batch_search.py

bench-loader: $(STAMP)   ## every data path (original / prepared copy, workers / nvJPEG) next to the GPU's rate
	$(BIN)/python benchmarks/loader.py

bench-profile: $(STAMP)  ## where experiment=fast's step goes (kernels by kind, GPU idle)
	$(BIN)/python benchmarks/profile_step.py

bench-fast: $(STAMP)     ## experiment=fast next to variants of it (no kernel tuning, batch 768)
	$(BIN)/python benchmarks/fast_variants.py

bench-prepared: $(STAMP) ## accuracy on the original JPEGs vs the prepared copy (generated digit photos)
	$(BIN)/python benchmarks/prepared_accuracy.py

bench-scaling: $(STAMP)  ## DDP: 1 GPU vs torchrun on 2 GPUs, same per-GPU batch
	$(BIN)/python benchmarks/scaling.py

clean:
	rm -rf outputs/2* outputs/multirun .pytest_cache
