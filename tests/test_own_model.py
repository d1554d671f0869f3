"""Your own model and data: a model and datasets defined outside src/ (tests/plugins/) train
through train.py under each precision, compiled per block, checkpointed and resumed bit-exact,
under torchrun with DDP and FSDP2; keep_fp32 reaches them by glob; their FLOPs are torch's
count; Hugging Face models built from a config train on the CPU; every mistake is a config
error naming the key."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import models
from mixprec.core.errors import ConfigError
from mixprec.models import flops
from mixprec.parallel import distributed
from mixprec.run import build
from mixprec.run import session as run
from mixprec.run.config import validate

from conftest import (
    ROOT,
    TINY_BERT,
    compose_cfg,
    last_weights,
    run_module,
    run_torchrun,
    run_train,
    train_losses,
)

PLUGINS = ROOT / "tests" / "plugins"
PLUGINS_DIR = f"data.path={PLUGINS}"  # the folder holding the user's code
CONV = [
    "model.target=own_models:TinyConvNet",
    "data=custom",
    "data.target=own_data:blobs",
    PLUGINS_DIR,
]
LM = [
    "model.target=own_models:TinyLM",
    "data=custom",
    "data.target=own_data:counting",
    PLUGINS_DIR,
    "scheduler=constant",
    "optimizer.lr=0.003",
]
PATHS = [f"model.path={PLUGINS}"]
SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=2", "trainer.perf_warmup_steps=0"]


def user_env() -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}


def cfg(tmp_path: Path, *overrides: str, name: str = "run"):
    return compose_cfg([*SMALL, *PATHS, *overrides], tmp_path / name)


@pytest.mark.slow
def test_own_model_and_data_train_with_train_py_under_each_cpu_precision(tmp_path):
    """The user's way in: a multirun over precisions with the code found on PYTHONPATH."""
    sweep = tmp_path / "sweep"
    p = run_train(
        [
            "-m",
            *SMALL,
            *CONV,
            "precision=fp32,bf16,amp",
            "trainer.max_steps=30",
            f"hydra.sweep.dir={sweep}",
        ],
        env_extra=user_env(),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    for job in ("0_precision=fp32", "1_precision=bf16", "2_precision=amp"):
        s = json.loads((sweep / job / "summary.json").read_text())
        assert s["status"] == "completed" and s["model"] == "own_models:TinyConvNet"
        losses = train_losses(sweep / job)
        assert losses[-1] < losses[0] - 0.1, (s["precision"], losses)
        assert s["val_acc1"] > 0.5, s  # 4 classes: chance is 0.25
    assert (sweep / "report.md").is_file()


def test_an_own_lm_resumes_bit_exact_from_a_mid_run_checkpoint(tmp_path):
    base = [*LM, "trainer.max_steps=8", "ckpt.every_steps=4", "ckpt.keep=3", "batch=8"]
    run.run(cfg(tmp_path, *base, "model.grad_checkpointing=true", name="ref"))
    half = tmp_path / "ref" / "checkpoints" / "step_00000004.pt"
    again = cfg(tmp_path, *base, "model.grad_checkpointing=true", f"resume={half}", name="again")
    assert run.run(again)["steps"] == 8
    a, b = last_weights(tmp_path / "ref"), last_weights(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_declared_blocks_compile_one_by_one_and_checkpoint(tmp_path, caplog):
    over = [*LM, "trainer.max_steps=3", "batch=8", "model.compile=true"]
    with caplog.at_level("INFO", logger="mixprec.models"):
        s = run.run(
            cfg(tmp_path, *over, "model.compile_scope=blocks", "model.grad_checkpointing=true")
        )
    assert s["status"] == "completed" and s["compile_s"] > 0
    assert "2 repeated blocks (Block) one by one" in caplog.text
    # a builder function declaring nothing: blocks are found by shape, or refused by name
    with pytest.raises(ConfigError, match="model.compile_scope=blocks: own_models:plain_mlp has"):
        run.run(
            cfg(
                tmp_path,
                *CONV[1:],
                "model.target=own_models:plain_mlp",
                "model.compile=true",
                "model.compile_scope=blocks",
                name="mlp",
            )
        )


def test_declared_blocks_are_recomputed_in_the_backward_with_the_same_gradients(tmp_path):
    """grad_checkpointing on a model without timm's interface: each declared block runs again
    in the backward (a layer inside it is called twice), and the gradients do not change."""
    grads, calls = {}, {}
    for ckpt in (False, True):
        c = validate(cfg(tmp_path, *CONV, f"model.grad_checkpointing={ckpt}"))
        torch.manual_seed(0)
        model = models.build(c.model, 4, (1, 8, 8), torch.device("cpu"))
        calls[ckpt] = 0
        model.blocks[1].conv.register_forward_hook(
            lambda *a, k=ckpt: calls.update({k: calls[k] + 1})
        )
        torch.manual_seed(1)
        model(torch.randn(4, 1, 8, 8)).square().sum().backward()
        grads[ckpt] = [p.grad for p in model.parameters()]
    assert calls == {False: 1, True: 2}
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b)


def test_a_builder_that_declares_nothing_gets_its_head_and_blocks_from_the_config(tmp_path):
    c = validate(
        cfg(
            tmp_path,
            *CONV[1:],
            "model.target=own_models:plain_mlp",
            "model.blocks='[13]'",
            "model.head=3",
        )
    )
    model = models.build(c.model, 4, (1, 8, 8), torch.device("cpu"))
    assert models.head_of(model) == "3"
    assert [type(b) for b in models.blocks_of(model)] == [nn.Linear] * 2
    with pytest.raises(ConfigError, match="model.head='output' is not allowed"):
        models.build(
            validate(cfg(tmp_path, *CONV, "model.head=output")).model,
            4,
            (1, 8, 8),
            torch.device("cpu"),
        )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_own_lm_trains_under_torchrun_as_one_process(tmp_path, strategy):
    """2 processes x batch 4 (gloo) give the losses of 1 process x batch 8: the user's dataset
    is dealt by rank like the built-in ones, and FSDP2 shards the declared blocks."""
    steps = [*SMALL, *LM, "trainer.max_steps=4", "ckpt.at_end=false"]
    one = run_train([*steps, "batch=8", f"hydra.run.dir={tmp_path / 'one'}"], env_extra=user_env())
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_torchrun(
        [
            str(ROOT / "train.py"),
            *steps,
            "batch=4",
            f"parallel={strategy}",
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        env_extra=user_env(),
    )
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    s = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (s["status"], s["world_size"], s["effective_batch"]) == ("completed", 2, 8)
    torch.testing.assert_close(
        train_losses(tmp_path / "two"), train_losses(tmp_path / "one"), rtol=1e-4, atol=1e-4
    )


def test_keep_fp32_by_glob_reaches_the_users_modules(tmp_path):
    """Under bf16 autocast the user's head and second block compute in fp32 when kept by glob,
    in bf16 when not (seen by hooks on the layers inside them)."""
    seen = {}

    def dtypes(keep: str) -> dict:
        c = validate(cfg(tmp_path, *CONV, "precision=bf16", f"precision.keep_fp32={keep}"))
        prec = build.new_precision(c, torch.device("cpu"))
        spec = build.Spec(4, (1, 8, 8), 2)
        model, _ = build.assemble(c, prec, spec, torch.device("cpu"), distributed.Dist(), 1e-3)
        for name in ("head.1", "blocks.0.conv", "blocks.1.conv"):
            model.get_submodule(name).register_forward_hook(
                lambda m, a, out, name=name: seen.update({name: out.dtype})
            )
        with prec.autocast():
            model(torch.randn(2, 1, 8, 8))
        return dict(seen)

    assert dtypes("[head,'blocks.1*']") == {
        "head.1": torch.float32,
        "blocks.0.conv": torch.bfloat16,
        "blocks.1.conv": torch.float32,
    }
    assert set(dtypes("[]").values()) == {torch.bfloat16}


def test_the_flop_count_of_a_users_model_is_torchs_counter():
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(PLUGINS))
    from own_models import TinyConvNet

    torch.manual_seed(0)
    model = TinyConvNet(num_classes=4, in_chans=1)
    model(torch.zeros(1, 1, 8, 8))  # the lazy head gets its shape
    total, in_head = flops.train_flops(
        model, (1, 8, 8), 4, torch.device("cpu"), contextlib.nullcontext, {"head"}
    )
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), y).backward()
    assert total == counter.get_total_flops() // 16 and 0 < in_head < total


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["model.target=no_such_module:Net"],
            "model.target='no_such_module:Net': module 'no_such_module' cannot be imported",
        ),
        (["model.target=own_models:Missing"], "own_models has no attribute 'Missing'"),
        (["model.target=own_models:not_a_module"], "returned dict, not a torch.nn.Module"),
        (
            ["+model.kwargs.wdth=3"],
            "model.target='own_models:TinyConvNet' with kwargs .*unexpected keyword",
        ),
        (["model.target=own_models"], "must be 'package.module:callable'"),
        (["model.target=own_models:FixedChannels"], "cannot take this data's input of shape"),
        (
            ["model.target=own_models:FiveWay"],
            r"returns \(1, 5\) .* this data needs logits \(1, 4\)",
        ),
        (["data.target=own_data:rgb", "+model.kwargs.in_chans=1"], "cannot take this data's input"),
        (["data.target=own_data:bad_labels"], r"label 7 is outside \[0, num_classes=4\)"),
        (["data.target=own_data:no_val"], "must give 'train' and 'val' datasets"),
        (["data.target=null"], "data.target=None is not allowed"),
    ],
)
def test_a_users_code_that_cannot_run_is_a_config_error_naming_the_key(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        run.run(cfg(tmp_path, *CONV, *overrides))


def test_a_dataset_that_does_not_pickle_is_refused_where_workers_start_from_a_forkserver(
    tmp_path, monkeypatch, gloo_world_of_one
):
    """In a process group (torchrun, SLURM) on a Python before 3.11.10, loader workers start
    from a forkserver (data/workers.py), which pickles the dataset to each of them: a dataset
    with a lambda transform is a config error naming hardware.num_workers before any worker
    starts. Finding out copies no tensor's data (torch's own reducers would move it to shared
    memory). On a fixed Python workers are forked and inherit the dataset: nothing is checked."""
    from torch.utils.data import TensorDataset

    from mixprec.data import workers

    lambdas = [*CONV, "data.target=own_data:lambda_transform", "hardware.num_workers=2"]
    monkeypatch.setattr(workers, "PYTHON", (3, 12, 1))
    assert workers.start_method(lambda x: x) is None  # forked: anything goes
    monkeypatch.setattr(workers, "PYTHON", (3, 11, 7))
    x = torch.randn(64, 1, 8, 8)
    picklable = TensorDataset(x, torch.zeros(64, dtype=torch.long))
    assert workers.start_method(picklable).get_start_method() == "forkserver"
    assert not x.is_shared()
    with pytest.raises(ConfigError, match=r"hardware.num_workers: on Python 3.11.7 .*lambda"):
        run.run(cfg(tmp_path, *lambdas, "trainer.max_steps=2"))  # (it ends the group)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_data_target_on_a_built_in_dataset_points_to_data_custom(tmp_path):
    with pytest.raises(ConfigError, match="data.target is not a key of data=digits.*data=custom"):
        validate(cfg(tmp_path, "+data.target=own_data:blobs"))


@pytest.mark.slow
def test_a_target_that_cannot_be_imported_exits_2_through_train_py(tmp_path):
    p = run_train([*SMALL, "model.target=nowhere:Net", f"hydra.run.dir={tmp_path / 'r'}"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "model.target='nowhere:Net': module 'nowhere' cannot be imported" in p.stdout + p.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


HF_LM = ["model=hf_llama_tiny", "data=text", "data.seq_len=32", "data.max_mb=1", "batch=8"]


@pytest.mark.parametrize(
    "overrides",
    [HF_LM, ["model=hf_vit_tiny"]],
    ids=["llama", "vit"],
)
@pytest.mark.slow
def test_hugging_face_models_from_a_config_train_on_the_cpu(tmp_path, overrides):
    pytest.importorskip("transformers")
    over = [*overrides, "trainer.max_steps=12", "optimizer.lr=0.003", "scheduler=constant"]
    c = cfg(tmp_path, *over, "model.grad_checkpointing=true")
    s = run.run(c)
    assert s["status"] == "completed" and s["model"].startswith("hf:")
    losses = train_losses(Path(c.run_dir))
    assert losses[-1] < losses[0], losses
    weights = last_weights(Path(c.run_dir))
    assert any(k.startswith("hf.") for k in weights)


def test_an_hf_model_declares_its_head_and_blocks_and_fp8_would_keep_the_head():
    pytest.importorskip("transformers")
    from mixprec.core.tasks import LanguageModel
    from mixprec.precision.fp8 import eligible

    c = validate(compose_cfg(HF_LM))
    model = models.build(c.model, 256, (32,), torch.device("cpu"), LanguageModel())
    assert models.head_of(model) == "hf.lm_head"
    assert len(models.blocks_of(model)) == 4
    assert type(models.blocks_of(model)[0]).__name__ == "LlamaDecoderLayer"
    assert not eligible(model.hf.lm_head, "hf.lm_head", models.head_of(model), False)
    assert eligible(
        model.hf.model.layers[0].mlp.up_proj, "hf.model.layers.0.mlp.up_proj", "hf.lm_head", False
    )
    with pytest.raises(ConfigError, match="model.hf.overrides.hiden_size: LlamaConfig has no such"):
        models.build(
            validate(compose_cfg([*HF_LM, "+model.hf.overrides.hiden_size=8"])).model,
            256,
            (32,),
            torch.device("cpu"),
            LanguageModel(),
        )
    with pytest.raises(ConfigError, match="model.hf.config='lama' is neither a transformers"):
        models.build(
            validate(compose_cfg([*HF_LM, "model.hf.config=lama"])).model,
            256,
            (32,),
            torch.device("cpu"),
            LanguageModel(),
        )


def test_an_hf_config_json_of_the_users_builds_its_model(tmp_path):
    pytest.importorskip("transformers")
    from mixprec.core.tasks import LanguageModel

    conf = tmp_path / "config.json"
    conf.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            }
        )
    )
    c = validate(compose_cfg(["model=hf", f"model.hf.config={conf}", "data=text"]))
    model = models.build(c.model, 256, (16,), torch.device("cpu"), LanguageModel())
    assert len(models.blocks_of(model)) == 3 and model.hf.config.hidden_size == 32


def test_without_transformers_model_hf_names_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ConfigError, match=r"model=hf needs Hugging Face transformers: pip install"):
        run.run(compose_cfg([*SMALL, "model=hf_vit_tiny"], tmp_path / "run"))


@pytest.mark.gpu
def test_an_own_lm_and_an_hf_llama_train_in_fp8_compiled_per_block_on_the_gpu(tmp_path, caplog):
    """fp8 converts the user's (and HF's) Linear layers but the declared head; compiled per
    block; the loss falls as bf16's does."""
    pytest.importorskip("transformers")
    gpu = ["hardware=auto", "logger=none", "trainer.log_every=10", "trainer.perf_warmup_steps=2"]
    common = [*gpu, "model.compile=true", "model.compile_scope=blocks", "trainer.max_steps=40"]
    own = [*LM, f"model.path={PLUGINS}", "+model.kwargs.dim=64", "batch=32"]
    hf = [*HF_LM[:-1], "data.seq_len=64", "batch=16", "optimizer.lr=0.003"]
    for name, over in (("own", own), ("hf", hf)):
        losses = {}
        for prec in ("bf16", "fp8"):
            c = compose_cfg([*common, *over, f"precision={prec}"], tmp_path / f"{name}-{prec}")
            with caplog.at_level("INFO", logger="mixprec.precision.fp8"):
                s = run.run(c)
            assert s["status"] == "completed" and s["device"].startswith("cuda"), s
            losses[prec] = s["val_loss"]
        head = "lm_head" if name == "own" else "hf.lm_head"
        assert f"Linear layers compute in float8; kept in bf16: {head}" in caplog.text
        caplog.clear()
        assert abs(losses["fp8"] - losses["bf16"]) < 0.1 * losses["bf16"], (name, losses)


@pytest.mark.slow
def test_the_dtype_audit_the_doctor_and_export_take_a_users_model(tmp_path):
    """diagnose=true (the dtype audit and tensor-core check), debug.locate=true (the doctor's
    hooks) and `python -m mixprec.export`, on a model from tests/plugins under amp."""

    c = cfg(
        tmp_path,
        *CONV,
        "precision=amp",
        "diagnose=true",
        "debug.locate=true",
        "trainer.max_steps=6",
    )
    s = run.run(c)
    d = Path(c.run_dir)
    audit = json.loads((d / "diagnose.json").read_text())
    modules = {m["module"]: m for m in audit["modules"]}  # read from the user's live modules
    assert s["status"] == "completed" and modules["blocks.0.conv"]["dtype"] == "float16"
    out = run_module("mixprec.export", [str(d)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "from own_models import TinyConvNet" in out.stdout


@pytest.mark.gpu
def test_a_users_model_with_batch_auto_and_cuda_graphs_on_the_gpu(tmp_path):
    """batch=auto searches the user's model under a memory cap and trains at what it found;
    CUDA graphs replay the user's model and track its eager losses."""
    gpu = ["hardware=auto", "logger=none", "trainer.log_every=1", "trainer.perf_warmup_steps=2"]
    over = [*gpu, *PATHS, *CONV, "precision=amp", "trainer.max_steps=12"]
    try:
        auto = compose_cfg(
            [*over, "batch=auto", "hardware.memory_gib=2", f"batch_search.cache={tmp_path}/c"],
            tmp_path / "auto",
        )
        s = run.run(auto)
        assert s["status"] == "completed" and s["max_batch"] >= s["batch"] >= 8, s
        assert s["peak_mem_gib"] < 2
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    losses = []
    for name, extra in (("eager", []), ("graphs", ["model.cuda_graphs=true"])):
        c = compose_cfg([*over, "batch=32", *extra], tmp_path / name)
        s = run.run(c)
        assert s["status"] == "completed" and s["steps"] == 12, s
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(r)["train/loss"] for r in rows if "train/loss" in r])
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


def test_a_buffer_non_finite_by_design_trains_checkpoints_and_resumes(tmp_path):
    """An additive causal mask (-inf) is the model's design: checkpoints are written, the run
    completes (it was refused every checkpoint and ended as diverged, exit 3)."""
    masked = [*LM, "model.target=own_models:MaskedLM", "batch=8", "ckpt.every_steps=2"]
    s = run.run(cfg(tmp_path, *masked, "trainer.max_steps=4", name="m"))
    assert s["status"] == "completed" and math.isfinite(s["val_loss"]), s
    ckpts = sorted(p.name for p in (tmp_path / "m" / "checkpoints").glob("step_*.pt"))
    assert ckpts[-1] == "step_00000004.pt", ckpts
    assert torch.isinf(last_weights(tmp_path / "m")["mask"]).sum() == 15 * 16 // 2
    s = run.run(cfg(tmp_path, *masked, "trainer.max_steps=6", "resume=auto", name="m"))
    assert s["status"] == "completed" and s["steps"] == 6


def test_the_guard_leaves_out_only_what_was_non_finite_before_training():
    from own_models import MaskedLM

    from mixprec.training.safety import DivergenceGuard

    model = MaskedLM(vocab_size=8, max_seq_len=4)
    model.register_buffer("stat", torch.ones(3))
    guard = DivergenceGuard(torch.device("cpu"), 3, 1.0, model=model)
    assert guard.healthy(model)
    model.mask[3, 0] = float("nan")  # below the diagonal: a value the mask had finite
    assert not guard.healthy(model)
    model.mask[3, 0] = 0.0
    model.stat[1] = float("inf")
    assert not guard.healthy(model)
    model.stat[1] = 1.0
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    assert not guard.healthy(model)


@pytest.mark.parametrize(
    "overrides",
    [
        [*LM, "model.target=own_models:gpt2_output", "batch=8"],
        [*CONV, "model.target=own_models:DictLogits", "batch=16"],
        [
            "model.target=torchvision.models:resnet18",
            "data=synthetic",
            "data.shape=[3,32,32]",
            "data.num_classes=10",
            "batch=4",
        ],
    ],
    ids=["hf-output-object", "dict-of-logits", "torchvision-kwargs-builder"],
)
def test_outputs_and_builders_as_they_come_train(tmp_path, overrides):
    """An HF output object's .logits, a dict's "logits", and a torchvision builder that takes
    only **kwargs (it gets the data's num_classes: it failed with "(1, 1000) ... needs (1,
    10)") train as they are: refused before."""
    if any("gpt2" in o for o in overrides):
        pytest.importorskip("transformers")
    s = run.run(cfg(tmp_path, "model=own", *overrides, "trainer.max_steps=4"))
    assert s["status"] == "completed" and s["val_loss"] is not None, s


def test_a_run_says_its_parameters_total_and_trainable(tmp_path, caplog):
    """What a newcomer reads first: the model's parameters, all and trainable, in the first
    lines and in summary.json (here a model whose first layer is frozen)."""
    import logging

    c = cfg(tmp_path, *CONV, "model.target=own_models:half_frozen", "trainer.max_steps=2")
    with caplog.at_level(logging.INFO):
        s = run.run(c)
    weights = last_weights(Path(c.run_dir))  # the model's parameters (it has no buffers)
    total = sum(w.numel() for w in weights.values())
    frozen = weights["1.weight"].numel() + weights["1.bias"].numel()
    assert (s["params"], s["params_trainable"]) == (total, total - frozen)
    assert f"({total:,} parameters, {total - frozen:,} trainable)" in caplog.text


def test_dict_samples_train_through_workers_and_resume_bit_exact(tmp_path):
    """Hugging Face-style dict samples ({"input_ids", "labels", "attention_mask", "idx"}): the
    usual names are the (input, target) pair, read in two DataLoader workers; a resume from a
    mid-run checkpoint ends on the uninterrupted run's weights."""
    lm = [o for o in LM if "data.target" not in o]
    base = [*lm, "data.target=own_data:counting_dicts", "hardware.num_workers=2", "batch=8"]
    base += ["trainer.max_steps=8", "ckpt.every_steps=4", "ckpt.keep=3"]
    assert run.run(cfg(tmp_path, *base, name="ref"))["status"] == "completed"
    losses = train_losses(tmp_path / "ref")
    assert losses[-1] < losses[0]  # it learns from the pairs it was given
    half = tmp_path / "ref" / "checkpoints" / "step_00000004.pt"
    run.run(cfg(tmp_path, *base, f"resume={half}", name="again"))
    a, b = last_weights(tmp_path / "ref"), last_weights(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


RENAMED = "+data.kwargs={input_key: img_, target_key: cls}"  # keys no usual name matches


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ([], None),  # pixel_values / label: the usual names
        ([RENAMED, "data.input_key=img_", "data.target_key=cls"], None),
        ([RENAMED, "data.input_key=img_"], "data.target_key=None is null and none of the usual"),
        ([RENAMED], "data.input_key=None is null and none of the usual"),
        (["data.target_key=klass"], "data.target_key='klass' is not one of them"),
    ],
)
def test_dict_samples_name_their_pair_or_the_key_to_set(tmp_path, overrides, needle):
    conv = [o for o in CONV if "data.target" not in o]
    c = cfg(tmp_path, *conv, "data.target=own_data:blobs_dicts", "trainer.max_steps=2", *overrides)
    if needle is None:
        assert run.run(c)["status"] == "completed"
        return
    with pytest.raises(ConfigError, match=needle) as e:
        run.run(c)
    assert "keys ['attention_mask', " in str(e.value)


def test_a_model_that_computes_its_own_loss_trains_on_it_under_the_precision(tmp_path):
    """model.loss=own: the model is called with labels and its loss is the one trained on,
    scaled and unscaled by amp's GradScaler like any loss: its fixed auxiliary term (+10.0,
    no gradient) is in every logged loss, the gradients (hence the weights) are the task
    loss's, and val/loss is its own too."""
    conv = [o for o in CONV if not o.startswith("model.target")]
    base = [*conv, "model.target=own_models:AuxLossNet", "precision=amp", "batch=16"]
    base += ["trainer.max_steps=4", "trainer.log_every=1", "trainer.perf_warmup_steps=0"]
    own = run.run(cfg(tmp_path, *base, "model.loss=own", name="own"))
    task = run.run(cfg(tmp_path, *base, name="task"))
    a, b = train_losses(tmp_path / "own"), train_losses(tmp_path / "task")
    assert all(abs(x - y - 10.0) < 1e-3 for x, y in zip(a, b)), (a, b)
    assert abs(own["val_loss"] - task["val_loss"] - 10.0) < 1e-3
    assert own["loss_scale"] > 1  # the GradScaler scaled the model's own loss
    wa, wb = last_weights(tmp_path / "own"), last_weights(tmp_path / "task")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_model_loss_own_with_a_model_that_returns_none_names_the_key(tmp_path):
    from mixprec.run.config import validate

    with pytest.raises(ConfigError, match="model.loss='mine' is not allowed.*one of task, own"):
        validate(cfg(tmp_path, "model.loss=mine"))
    with pytest.raises(ConfigError, match="model.loss='own'.*task with model.cuda_graphs=true"):
        validate(cfg(tmp_path, "model.loss=own", "model.cuda_graphs=true"))
    conv = [o for o in CONV if not o.startswith("model.target")]
    over = [*conv, "model.target=own_models:AuxLossNet", "+model.kwargs.with_loss=false"]
    with pytest.raises(ConfigError, match=r"model.loss=own: the model, called with labels"):
        run.run(cfg(tmp_path, *over, "model.loss=own", "trainer.max_steps=2"))


@pytest.mark.slow
def test_bert_sequence_classification_with_its_own_loss_from_dict_samples(tmp_path):
    """transformers' BERT for sequence classification (model=hf, random init) on dict samples
    of token ids and a label, trained on the loss it computes itself; it learns the rule."""
    pytest.importorskip("transformers")
    over = [
        *TINY_BERT,
        "model.loss=own",
        "data=custom",
        "data.target=own_data:marked",
        PLUGINS_DIR,
        "batch=32",
        "trainer.max_steps=120",
        "optimizer.lr=0.003",
    ]
    s = run.run(cfg(tmp_path, *over))
    assert s["status"] == "completed" and s["val_acc1"] > 0.9, s
    losses = train_losses(tmp_path / "run")
    assert losses[-1] < losses[0] / 3


def test_hf_special_tokens_fit_the_datas_vocabulary_and_known_notices_are_dropped(caplog, capfd):
    """GPT-2's special tokens (50256) name its own tokenizer's: on a 256-token vocabulary they
    are unset, with no transformers warning, and one the user sets stays. torch's notice about
    torchao's Enums is dropped; the same logger's other warnings are not."""
    import logging

    pytest.importorskip("transformers")
    from mixprec.core import process, tasks
    from mixprec.models import hf

    small = {"n_embd": 32, "n_layer": 1, "n_head": 2}
    config = hf.make_config("gpt2", small, tasks.LanguageModel(), 256, (32,))
    assert config.bos_token_id is None and config.eos_token_id is None
    assert "bos_token_id" not in capfd.readouterr().err  # transformers' own handler: stderr
    kept = hf.make_config("gpt2", {**small, "bos_token_id": 3}, tasks.LanguageModel(), 256, (32,))
    assert kept.bos_token_id == 3
    process.quiet_known_noise()
    pytree = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        pytree.warning("<enum 'X'> is an Enum subclass and is now natively supported by torch")
        pytree.warning("something else")
    assert "Enum subclass" not in caplog.text and "something else" in caplog.text


def test_a_typo_in_a_hugging_face_config_field_gets_a_did_you_mean():
    """Issue 93, item 8: `model.hf.overrides.hiden_size` said only "no such field"."""
    from mixprec.core.errors import ConfigError
    from mixprec.core.tasks import LanguageModel
    from mixprec.models.hf import make_config

    with pytest.raises(
        ConfigError, match="LlamaConfig has no such field; did you mean hidden_size"
    ):
        make_config("llama", {"hiden_size": 64}, LanguageModel(), 256, (64,))
