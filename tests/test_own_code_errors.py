"""Your own model, data and plugins fail with a named error, never a traceback (issue 66, items
11-16, 18, 19, 21-23): each user's module is written into the test's folder as a user writes
one, and the run is started as train.py starts it (run.main: exit codes, or train.py itself)."""

from __future__ import annotations

import json
import multiprocessing
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from mixprec.core.errors import ConfigError, DataError
from mixprec.precision import fp8_layers
from mixprec.run import session as run

from conftest import ROOT, compose_cfg, run_module, run_train

SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=1", "trainer.perf_warmup_steps=0"]
DIGITS = ["data=digits", "trainer.max_steps=2", "batch=16"]


def module(tmp_path: Path, body: str) -> str:
    """A module of the user's in tmp_path under a fresh name (imports are cached per process);
    returns its name."""
    name = f"users_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return name


NET = textwrap.dedent(
    """
    import torch
    from torch import nn

    def net(num_classes, input_shape):
        n = input_shape[-1] * input_shape[-2] * input_shape[0]
        return nn.Sequential(nn.Flatten(), nn.Linear(n, num_classes))
    """
)


def refused(tmp_path: Path, *overrides: str) -> str:
    """The run's ConfigError message (run.run raises it before training; nothing trained)."""
    cfg = compose_cfg([*SMALL, *DIGITS, *overrides], tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        run.run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return str(e.value)


@pytest.mark.parametrize(
    "at_import,needle",
    [
        ("import sys; sys.exit(0)", "called sys.exit(0)"),
        ("import sys; sys.exit(3)", "called sys.exit(3)"),
        ("raise ValueError('no GPU config here')", "raised ValueError: no GPU config here"),
    ],
)
def test_a_module_that_exits_or_raises_at_import_names_model_target(tmp_path, at_import, needle):
    name = module(tmp_path, NET + "\n" + at_import + "\n")
    msg = refused(tmp_path, "model=own", f"model.target={name}:net", f"model.path={tmp_path}")
    assert msg.startswith(f"model.target='{name}:net'") and needle in msg, msg


@pytest.mark.slow
def test_argparse_at_import_is_exit_2_naming_the_key_not_train_pys_usage(tmp_path):
    name = module(
        tmp_path,
        NET + "\nimport argparse\nap = argparse.ArgumentParser(prog='mine')\nap.parse_args()\n",
    )
    p = run_train(
        [*SMALL, *DIGITS, "model=own", f"model.target={name}:net", f"model.path={tmp_path}"]
        + [f"hydra.run.dir={tmp_path / 'run'}"]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert f"model.target='{name}:net': importing {name} called sys.exit(2)" in out
    assert "usage: mine" not in out.replace("'usage: mine", "")  # quoted in the message only
    assert "if __name__ == '__main__':" in out


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            "class Net(nn.Module):\n"
            "    def forward(self, x):\n        return torch.zeros(x.shape[0], 10)\n"
            "def net():\n    return Net()\n",
            "has no trainable parameters (it has none)",
        ),
        (
            "def net(num_classes, input_shape):\n"
            "    m = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n"
            "    m.requires_grad_(False)\n    return m\n",
            "has no trainable parameters (all 2 of its parameters are frozen)",
        ),
        (
            "class Net(nn.Module):\n"
            "    def __init__(self):\n        super().__init__(); self.fc = nn.Linear(64, 10)\n"
            "    def forward(self, x):\n        return self.fc(x.flatten(1)).round().long()\n"
            "def net():\n    return Net()\n",
            "returns torch.int64 logits",
        ),
        (
            "class Net(nn.Module):\n"
            "    def __init__(self):\n        super().__init__(); self.fc = nn.Linear(64, 10)\n"
            "    def forward(self, x):\n        return self.fc(x.flatten(1)).detach()\n"
            "def net():\n    return Net()\n",
            "returns logits that do not require grad",
        ),
        (
            "def net():\n    raise ValueError('depth must be even')\n",
            "raised ValueError: depth must be even",
        ),
        (
            "def net():\n    return nn.Linear(64, 10).to('cuda')\n",
            "return it on the CPU, where it is made",
        ),
    ],
    ids=["no-params", "all-frozen", "int-logits", "detached", "builder-raises", "to-cuda"],
)
def test_a_model_that_cannot_train_is_named_before_training(tmp_path, body, needle):
    if "cuda" in body and torch.cuda.is_available():
        pytest.skip("a builder's .to('cuda') works where there is a GPU")
    name = module(tmp_path, "import torch\nfrom torch import nn\n\n" + body)
    msg = refused(tmp_path, "model=own", f"model.target={name}:net", f"model.path={tmp_path}")
    assert msg.startswith(f"model.target='{name}:net'") and needle in msg, msg


def test_fp16_weights_with_a_grad_scaler_are_refused_naming_both(tmp_path):
    name = module(
        tmp_path,
        """
        from torch import nn

        class Half(nn.Module):  # fp16 weights, and a forward that casts its input to them
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(64, 10).half()

            def forward(self, x):
                return self.fc(x.flatten(1).half()).float()

        def net():
            return Half()
        """,
    )
    over = ["model=own", f"model.target={name}:net", f"model.path={tmp_path}"]
    msg = refused(tmp_path, "precision=amp", *over)
    assert "weights are float16 (fc.weight and more)" in msg, msg
    assert "precision=amp" in msg and "GradScaler" in msg


def test_a_float64_dataset_from_numpy_trains(tmp_path):
    data = module(
        tmp_path,
        """
        import numpy as np
        from torch.utils.data import Dataset

        class Blobs(Dataset):
            def __init__(self, n, seed):
                rng = np.random.default_rng(seed)
                self.y = rng.integers(0, 3, n)
                self.x = rng.normal(size=(n, 8)) + self.y[:, None]  # float64, numpy's default

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return self.x[i], int(self.y[i])

        def blobs():
            return {"train": Blobs(96, 0), "val": Blobs(32, 1), "num_classes": 3}
        """,
    )
    net = module(
        tmp_path,
        "from torch import nn\n\ndef net(num_classes, input_shape):\n"
        "    hidden = nn.Linear(input_shape[0], 16)\n"
        "    return nn.Sequential(hidden, nn.ReLU(), nn.Linear(16, num_classes))\n",
    )
    for precision in ("fp32", "amp"):
        cfg = compose_cfg(
            [
                *SMALL,
                f"precision={precision}",
                "data=custom",
                f"data.target={data}:blobs",
                f"data.path={tmp_path}",
                "model=own",
                f"model.target={net}:net",
                "trainer.max_steps=6",
                "batch=16",
            ],
            tmp_path / precision,
        )
        s = run.run(cfg)
        assert s["status"] == "completed" and s["val_loss"] is not None, s


@pytest.mark.parametrize(
    "hf,needle",
    [
        ("list", "holds a JSON list, not an object"),
        ("+model.hf.overrides.hidden_size=30", "not a multiple of the number of attention heads"),
        ("+model.hf.overrides.hidden_size=-32", "negative dimension"),
        ("+model.hf.overrides.hidden_size=abc", "expected int, got str"),
    ],
)
def test_an_hf_config_transformers_refuses_is_a_config_error(tmp_path, hf, needle):
    pytest.importorskip("transformers")
    if hf == "list":
        conf = tmp_path / "config.json"
        conf.write_text(json.dumps([{"model_type": "llama"}]))
        over = ["model=hf", f"model.hf.config={conf}"]
    else:
        over = ["model=hf_llama_tiny", hf.replace("+model", "model")]
    cfg = compose_cfg(
        [*SMALL, *over, "data=text", "data.seq_len=16", "data.max_mb=1", "trainer.max_steps=1"],
        tmp_path / "run",
    )
    with pytest.raises(ConfigError, match="model.hf.config=") as e:
        run.run(cfg)
    assert needle in str(e.value), str(e.value)


def test_a_logger_module_that_raises_at_import_names_its_key(tmp_path, monkeypatch):
    name = module(tmp_path, "raise RuntimeError('sink misconfigured')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = refused(tmp_path, f"+logger.sinks.mine={name}")
    assert f"logger.sinks.mine='{name}'" in msg and "RuntimeError: sink misconfigured" in msg


def test_a_plan_cache_entry_that_is_not_a_timing_is_timed_again(tmp_path, caplog):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"a": 12.5, "b": "fast", "c": None, "d": {"us": 3}, "e": -1}))
    cache = fp8_layers.TimingCache(str(path))
    assert cache.data == {"a": 12.5}
    assert "4 entries" in caplog.text
    path.write_text(json.dumps(["a", 1]))  # not an object at all
    assert fp8_layers.TimingCache(str(path)).data == {}


def _write_timings(path: str, worker: int, start, n: int) -> None:
    cache = fp8_layers.TimingCache(path)  # each reads the file before any has written
    start.wait()
    for i in range(n):
        cache.data[f"w{worker}-{i}"] = float(i + 1)
        cache.save()


def test_runs_that_save_the_plan_cache_at_once_keep_every_timing(tmp_path):
    path = str(tmp_path / "plan.json")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_write_timings, args=(path, w, start, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(json.loads(Path(path).read_text())) == 4 * 25


@pytest.mark.slow
def test_export_into_an_existing_folder_writes_the_file_there(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_cfg([*SMALL, *DIGITS], run_dir)
    run.run(cfg)
    out = tmp_path / "exports"
    out.mkdir()
    p = run_module("mixprec.export", [run_dir, "--out", out])
    assert p.returncode == 0, p.stderr[-2000:]
    (written,) = out.iterdir()
    assert written.name == "model-step2.pt"
    assert torch.load(written, weights_only=True).keys()
    assert str(ROOT)  # (the module runs from the repo root)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model=hf", "data=text", "data.seq_len=16", "data.max_mb=1"], "B parameters (with the"),
        (
            ["data=synthetic", "data.num_classes=200000000", "data.shape=[3,32,32]"],
            "(with the data's 200000000 classes)",
        ),
    ],
    ids=["llama-7b-shape", "200M-classes"],
)
def test_a_model_too_large_for_this_machine_is_refused_before_it_is_allocated(
    tmp_path, overrides, needle
):
    """model=hf alone is Llama-2-7B's shape: about 100 GiB of weights, gradients and Adam state,
    where the kernel killed the run after minutes without a word. Refused from the parameter
    count on the meta device, before a byte is allocated."""
    pytest.importorskip("transformers")
    cfg = compose_cfg([*SMALL, *overrides, "trainer.max_steps=1"], tmp_path / "run")
    with pytest.raises(ConfigError, match="GiB available") as e:
        run.run(cfg)
    assert needle in str(e.value) and "optimizer.state=8bit" in str(e.value), str(e.value)


def test_the_bytes_a_parameter_costs_follow_the_optimizers_state():
    from mixprec.optim import states

    from conftest import group

    assert states.bytes_per_param(group("optimizer", "adamw")) == 16
    assert states.bytes_per_param(group("optimizer", "adamw", state="8bit")) == 10
    assert states.bytes_per_param(group("optimizer", "adamw", state="bf16")) == 8
    assert states.bytes_per_param(group("optimizer", "adamw", offload="cpu")) == 8
    assert states.bytes_per_param(group("optimizer", "sgd", momentum=0.9)) == 12


PLUGINS = ["data=custom", "data.path=tests/plugins", "hardware=cpu", "logger=none"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dict_sample_past_the_first_without_its_target_is_named_by_its_index(tmp_path, workers):
    """Sample 7 of the training set lacks its label (the first sample has it): one line naming
    train[7] and its keys, exit 2, read in the main process or in a loader worker alike."""
    p = run_train(
        [
            *PLUGINS,
            "data.target=own_data:holey_dicts",
            "batch=16",
            "trainer.max_steps=30",
            f"hardware.num_workers={workers}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "train[7] is a dict with keys ['pixel_values']: it lacks ['label']" in out
    assert "Traceback" not in out and "KeyError" not in out


def test_your_collate_fn_raising_mid_run_is_one_line_and_the_last_checkpoint_stays(tmp_path):
    """The dataset's own collate_fn fails on a worker's second batch (batch 2 of the epoch):
    one line naming the function and its exception with the epoch and batch, exit 4 (a fault
    in the data found while training), the checkpoint of step 2 kept for a resume."""
    run_dir = tmp_path / "run"
    p = run_train(
        [
            *PLUGINS,
            "data.target=own_data:exploding_collate",
            "batch=16",
            "trainer.max_steps=30",
            "hardware.num_workers=2",
            "ckpt.every_steps=2",
            f"hydra.run.dir={run_dir}",
        ]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 4, out[-2000:]
    said = "its collate_fn Exploding raised RuntimeError: collate exploded on call 4"
    assert f"{said} (epoch 0, batch 2)" in out
    assert "Traceback" not in out
    assert (run_dir / "checkpoints" / "step_00000002.pt").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_a_loss_refused_at_its_first_call_leaves_nothing_and_the_fixed_command_runs(tmp_path):
    """model.loss=users:per_sample returns a loss per sample: refused at the first step (exit 2)
    with nothing left where the run was (no .hydra/, train.log, .lock, metrics or summary),
    so the same command with the loss fixed trains into that dir; a clean exit leaves no
    .lock."""
    name = module(
        tmp_path,
        """
        import torch.nn.functional as F

        def per_sample(logits, targets):
            return F.cross_entropy(logits, targets, reduction="none")
        """,
    )
    run_dir = tmp_path / "run"
    args = ["hardware=cpu", "logger=wandb", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"]
    env = {"PYTHONPATH": str(tmp_path)}
    bad = run_train([*args, f"model.loss={name}:per_sample"], env_extra=env)
    assert bad.returncode == 2 and "returned torch.float32 (64,)" in bad.stdout + bad.stderr
    assert not run_dir.exists()
    good = run_train(args, env_extra=env)
    assert good.returncode == 0, (good.stdout + good.stderr)[-2000:]
    assert (run_dir / "summary.json").is_file() and not (run_dir / ".lock").exists()


@pytest.mark.parametrize(
    "precision,said",
    [
        ("amp", "and the loss computed from them is not (nan): your loss function"),
        ("fp32", "an earlier step overflowed, or your loss function"),
    ],
)
def test_a_loss_function_that_returns_nan_is_named_as_the_cause(tmp_path, precision, said):
    """The user's loss returns NaN from step 6 on while the model's outputs stay finite: the
    run stops (exit 3) and the doctor names the loss function, not the loss scale (amp: the
    weights are still finite, the step is re-run) nor only an earlier overflow (fp32: the NaN
    already reached the weights)."""
    name = module(
        tmp_path,
        """
        import torch.nn.functional as F
        calls = 0

        def nan_after(logits, targets):
            global calls
            calls += 1
            loss = F.cross_entropy(logits, targets)
            return loss * float("nan") if calls > 5 else loss
        """,
    )
    p = run_train(
        [
            "hardware=cpu",
            "logger=none",
            f"precision={precision}",
            "trainer.max_steps=20",
            f"model.loss={name}:nan_after",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        env_extra={"PYTHONPATH": str(tmp_path)},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-2000:]
    assert said in out and f"(model.loss={name}:nan_after)" in out
    assert "the loss scale itself overflowed" not in out


def test_a_collate_fn_raising_at_mixprecs_first_sample_check_is_one_data_error(tmp_path):
    """Issue 90, item 14: the build's check of the first sample calls your collate_fn; its
    KeyError was a traceback (exit 1). One DataError (exit 4) naming it, before training."""
    cfg = compose_cfg([*PLUGINS, "data.target=own_data:keyless_collate", "batch=16"], tmp_path)
    with pytest.raises(DataError) as e:
        run.run(cfg)
    said = "its collate_fn Exploding raised KeyError: 'input_ids' (mixprec's check of the first"
    assert said in str(e.value), e.value
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_collate_fn_calling_sys_exit_0_is_a_data_error_not_a_clean_exit(tmp_path):
    """Issue 90, item 9: sys.exit(0) in your collate_fn mid-run ended the run with exit 0 and
    status `failed`; it is a DataError (exit 4) naming the function, the batch and the epoch."""
    cfg = compose_cfg(
        [*PLUGINS, "data.target=own_data:exiting_collate", "batch=16", "trainer.max_steps=8"],
        tmp_path,
    )
    with pytest.raises(DataError) as e:
        run.run(cfg)
    assert "its collate_fn Exploding raised SystemExit: 0" in str(e.value), e.value
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_collate_fn_calling_sys_exit_in_a_loader_worker_is_exit_4_and_one_line(tmp_path):
    """Issue 90, item 14: sys.exit in a loader worker killed the worker; one line, exit 4."""
    p = run_train(
        [
            *PLUGINS,
            "data.target=own_data:exiting_collate",
            "batch=16",
            "trainer.max_steps=30",
            "hardware.num_workers=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 4, out[-2000:]
    assert "its collate_fn Exploding raised SystemExit: 0" in out and "Traceback" not in out
