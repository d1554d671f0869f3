"""The extension seams: a precision from outside src/ trains through train.py; checkpoints carry
plain keys under any wrapper; the build order; TensorBoard as a second sink, read back from its
event files; the metric registry (every logged key declared, a new objective in one line);
batch=auto's cache key from the resolved objects; builders without process-wide side effects;
atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import models
from mixprec.checkpoint import store as checkpoint
from mixprec.compile import compiling
from mixprec.core import files, metrics
from mixprec.core.errors import ConfigError, DiskFull
from mixprec.optim import optimizers as optim
from mixprec.precision import base as precision
from mixprec.run import build, layout
from mixprec.run import session as run
from mixprec.run.config import validate
from mixprec.training import loop

from conftest import ROOT, compose_cfg, group, run_train, run_train_fresh

PLUGINS = ROOT / "tests" / "plugins"
QUICK = ["trainer.max_steps=12", "trainer.log_every=4", "trainer.perf_warmup_steps=1"]


def outside(*args: str, run_dir: Path):
    """train.py with tests/plugins on the module path and its conf/ on Hydra's search path: how
    a user adds a precision without touching mixprec."""
    return run_train(
        [f"hydra.searchpath=[file://{PLUGINS / 'conf'}]", *args, f"hydra.run.dir={run_dir}"],
        env_extra={"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])},
    )


@pytest.mark.slow
def test_a_precisions_early_module_starts_before_torch_and_is_released(tmp_path):
    """precision.early (core/early.py): the module a precision's YAML names, from outside src/
    (tests/plugins/early_probe.py), is started on train.py's first lines, before torch is
    imported, with the command line, and released once the build is past the warm-up; a
    precision that names none starts nothing. train.py as users start it (not the zygote,
    which has torch imported)."""
    probe = tmp_path / "probe.jsonl"
    env = {"EARLY_PROBE": str(probe)}
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])
    for option in ("early_probe", "bf16"):
        args = [f"hydra.searchpath=[file://{PLUGINS / 'conf'}]", f"precision={option}"]
        args += ["trainer.max_steps=2", "logger=none", f"hydra.run.dir={tmp_path / option}"]
        proc = run_train_fresh(args, env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if option == "bf16":
            assert not probe.exists()
            break
        events = [json.loads(line) for line in probe.read_text().splitlines()]
        assert [e["event"] for e in events] == ["start", "release"], events
        assert events[0]["torch_imported"] is False and "precision=early_probe" in events[0]["argv"]
        probe.unlink()


def test_each_precision_reaches_its_early_module_through_its_yaml():
    """fp8_auto's timing processes are declared by conf/precision/fp8.yaml (fp8_auto builds on
    it), found through `defaults` and the command line's search path; the last precision= on
    the command line is the one; the built-in precisions without early work declare none."""
    from mixprec.core import early

    assert early.declared("fp8_auto") == early.declared("fp8") == "mixprec.precision.fp8_early"
    assert {early.declared(p) for p in ("fp32", "tf32", "amp", "amp_accum", "bf16")} == {None}
    assert early.declared("early_probe") is None  # not in conf/: in tests/plugins/conf
    dirs = early.search_path([f"hydra.searchpath=[file://{PLUGINS / 'conf'}]"])
    assert dirs[0] == PLUGINS / "conf" and early.declared("early_probe", dirs) == "early_probe"
    assert early.choice(["precision=bf16", "seed=1", "+precision=fp8_auto"]) == "fp8_auto"
    assert early.choice(["precision.fp8_layers=auto"]) is None
    bad = compose_cfg(["precision=bf16", "+precision.early=os.path"])
    with pytest.raises(ConfigError, match=r"precision.early='os.path' is not a pre-import plugin"):
        validate(bad)


@pytest.mark.slow
def test_a_precision_defined_outside_src_trains_with_train_py(tmp_path):
    proc = outside(
        "precision=pure_bf16", "logger=none", "diagnose=true", *QUICK, run_dir=tmp_path / "ok"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert (summary["status"], summary["precision"]) == ("completed", "pure_bf16")
    weights = torch.load(tmp_path / "ok" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert weights["head.2.weight"].dtype == torch.bfloat16  # its conversion ran
    assert weights["features.0.weight"].dtype == torch.float32
    audit = json.loads((tmp_path / "ok" / "diagnose.json").read_text())
    assert audit["converted"] == [{"module": "head.2", "dtype": "bfloat16-weights"}]
    bad = outside("precision=pure_bf16", "precision.min_features=0", run_dir=tmp_path / "bad")
    assert (
        bad.returncode == 2 and "precision.min_features=0 is not allowed" in bad.stdout + bad.stderr
    )
    typo = outside("precision=pure_bf16", "+precision.min_feature=8", run_dir=tmp_path / "typo")
    assert typo.returncode == 2 and "did you mean min_features" in typo.stdout + typo.stderr


@pytest.mark.slow
def test_a_dataset_defined_outside_src_trains_with_train_py(tmp_path):
    """tests/plugins/stripes_data.py and its YAML: found through data.plugin as a precision is
    through precision.plugin; its own key is validated."""
    args = ["data=stripes", "logger=none", "model=digits_mlp", *QUICK]
    proc = outside(*args, run_dir=tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["val_acc1"] > 0.9  # stripes are easy
    bad = outside(*args, "data.samples=2", run_dir=tmp_path / "bad")
    assert bad.returncode == 2 and "data.samples=2 is not allowed" in bad.stdout + bad.stderr


def test_a_precision_plugin_that_cannot_be_imported_is_a_config_error():
    from mixprec.core.errors import ConfigError

    with pytest.raises(ConfigError, match="precision.plugin='no_such_module' cannot be imported"):
        validate(compose_cfg(["precision.plugin=no_such_module"]))
    with pytest.raises(ConfigError, match="is not a precision plugin"):
        validate(compose_cfg(["precision.plugin=mixprec.core.errors"]))


def test_checkpoint_keys_are_plain_under_ddp_and_compile_in_any_nesting(
    gloo_world_of_one, tmp_path
):
    """DDP over a compiled model and a compiled DDP (what build.assemble makes): unwrap peels
    every wrapper, and a checkpoint loads into the plain model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    for wrapped in (
        torch.compile(DDP(plain)),
        DDP(torch.compile(plain)),
        torch.compile(DDP(torch.compile(plain))),
    ):
        assert models.unwrap(wrapped) is plain
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        prec = precision.build(group("precision", "fp32"), group("scaler"), torch.device("cpu"))
        learner = loop.Learner(
            wrapped, opt, optim.build_scheduler(group("scheduler"), opt, 2), prec
        )
        path = checkpoint.save(tmp_path / "last.pt", learner, loop.TrainState(), {"model": {}})
        keys = list(torch.load(path, weights_only=True)["model"])
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
        fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        fresh.load_state_dict(torch.load(path, weights_only=True)["model"])


def test_the_build_order_converts_before_the_wrap_and_the_optimizer_sees_the_result(
    gloo_world_of_one,
):
    """assemble: model, the precision's conversion, the parallel wrap, compile, the optimizer
    (over the parameters the model ends up with: FSDP2 will replace them in the wrap)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mixprec.parallel.distributed import Dist

    c = validate(compose_cfg(["model=digits_mlp", "hardware=cpu", "model.compile=true"]))
    order = []

    class Recording(precision.Precision):
        def prepare(self, ctx):
            super().prepare(ctx)  # a micro-batch of the run's shape, and how it will run
            order.append(("prepare", tuple(ctx.example().shape), ctx.compiled, ctx.sharded))

        def convert(self, model):
            order.append(("convert", type(model).__name__))
            return model

    prec = precision.build(c.precision, c.scaler, torch.device("cpu"))
    prec = Recording(prec.cfg, "cpu", prec.scaler, guard_bn_stats=False)
    world2 = Dist(rank=0, local_rank=0, world=2)  # wrap as a data-parallel run does
    model, opt = build.assemble(
        c,
        prec,
        build.Spec(10, (1, 8, 8), 4),
        torch.device("cpu"),
        world2,
        0.1,
        inspect=lambda m: order.append(("inspect", type(m).__name__)),
    )
    assert order == [
        ("prepare", (4, 1, 8, 8), True, False),
        ("convert", "DigitsMLP"),
        ("inspect", "DigitsMLP"),
    ]
    assert isinstance(model._orig_mod, DDP)  # compile wraps the parallel module
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert params == {id(p) for p in models.unwrap(model).parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("logger", ["tensorboard", "[wandb,tensorboard]"])
def test_tensorboard_receives_what_metrics_jsonl_holds(tmp_path, logger):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_train([f"logger={logger}", "precision=amp", *QUICK, f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("train/loss", "amp/loss_scale", "val/acc1"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want] and want
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    assert (
        "summary" in events.Tags()["tensors"] or "summary/text_summary" in events.Tags()["tensors"]
    )
    assert (tmp_path / "wandb").is_dir() == ("wandb" in logger)
    assert (tmp_path / "wandb.json").exists() == ("wandb" in logger)


def test_a_logger_key_no_chosen_sink_reads_is_a_config_error():
    from mixprec.core.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"logger.project is not read by the chosen loggers "
        r"\(tensorboard\)",
    ):
        validate(compose_cfg(["logger=tensorboard", "+logger.project=x"]))
    assert validate(compose_cfg(["logger=none"])).logger.names == []
    assert validate(compose_cfg(["logger=[wandb,tensorboard]"])).logger.names == [
        "wandb",
        "tensorboard",
    ]


@pytest.mark.slow
def test_every_key_a_run_logs_is_declared_in_the_metric_registry(cfg_factory):
    cfg = cfg_factory(
        "precision=amp", "diagnose=true", "trainer.max_steps=6", "trainer.log_every=2"
    )
    out = run.run(cfg)
    rows = [json.loads(r) for r in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = {k for r in rows for k in r} - {"step"}
    assert logged and all(metrics.declared(k) for k in logged), logged - metrics.keys()
    assert {"grad/abs_max", "amp/loss_scale", "val/acc1", "val/loss", "train/loss"} <= logged
    declared = {m.summary for m in metrics.METRICS if m.summary}
    assert declared - {"max_batch"} <= set(out)  # every summary value the registry names


@pytest.mark.slow
def test_val_acc5_as_an_objective_is_one_registry_line(cfg_factory, monkeypatch):
    monkeypatch.setattr(
        metrics,
        "METRICS",
        [
            *metrics.METRICS,
            metrics.Metric("val/acc5", "val_acc5", goal="max", batch_sum=metrics.correct(5)),
        ],
    )
    cfg = cfg_factory("objective=val_acc5", "trainer.max_steps=6")
    out = run.run(cfg)
    assert 0 < out["val_acc1"] <= out["val_acc5"] <= 1
    assert run.main(cfg_factory("objective=val_acc5", "trainer.max_steps=6")) == pytest.approx(
        out["val_acc5"]
    )  # what a sweeper optimises


def test_batch_auto_cache_keys_tell_apart_precisions_that_share_an_autocast_dtype():
    """bf16, fp8 and fp8_rowwise all autocast to bfloat16; fp8 takes a third less memory, so
    they must not share a cached batch. amp and amp_accum differ in accum only (the same
    micro-batch memory) and may."""
    keys = {}
    for name in ("bf16", "fp8", "fp8_rowwise", "amp", "amp_accum"):
        c = validate(compose_cfg([f"precision={name}", "model=resnet18"]))
        prec = precision.build(c.precision, c.scaler, torch.device("cpu"), check_device=False)
        keys[name] = json.dumps(
            layout.memory_key(c, prec, (1000, 3, 224, 224), "GPU", 24.0), sort_keys=True
        )
    assert len({keys[n] for n in ("bf16", "fp8", "fp8_rowwise", "amp")}) == 4
    assert keys["amp"] == keys["amp_accum"]
    c = validate(compose_cfg(["precision=bf16", "model=resnet18", "model.grad_checkpointing=true"]))
    prec = precision.build(c.precision, c.scaler, torch.device("cpu"))
    assert (
        json.dumps(layout.memory_key(c, prec, (1000, 3, 224, 224), "GPU", 24.0), sort_keys=True)
        != keys["bf16"]
    )


def test_builders_leave_process_settings_alone():
    """compile_blocks does not raise dynamo's recompile limit (process.apply does, once, from
    the config); building a precision does not flip TF32 (test_precision checks that)."""
    limits = torch._dynamo.config
    key = "recompile_limit" if hasattr(limits, "recompile_limit") else "cache_size_limit"
    before = getattr(limits, key)
    net = nn.Sequential(nn.Sequential(*[nn.Sequential(nn.Linear(4, 4)) for _ in range(80)]))
    compiling.compile_blocks(net, "net", None, {})
    assert getattr(limits, key) == before
    c = validate(compose_cfg(["model.compile=true", "model.compile_scope=blocks"]))
    assert build.process_settings(c, c.hardware).recompile_limit == compiling.BLOCK_RECOMPILE_LIMIT
    assert build.process_settings(validate(compose_cfg([])), c.hardware).recompile_limit is None


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "summary.json"
    files.write_json(path, {"status": "completed"})

    def broken(f):
        f.write(b'{"status": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(DiskFull, match="no space left to write .*summary.json"):
        files.write_atomic(path, broken)
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    files.write_json(path, {"loss": float("nan")})  # JSON has no nan: written as a string
    assert json.loads(path.read_text()) == {"loss": "nan"}


def test_a_precision_hears_after_every_optimizer_step_attempted_skipped_ones_too():
    """Precision.after_optimizer_step: once per step train_step attempts, a step GradScaler
    skipped included (a stateful recipe's hook, without editing the loop)."""
    from torch import nn

    from mixprec.training import loop

    calls = []

    class Counting(precision.Precision):
        def after_optimizer_step(self, optimizer):
            calls.append(self.scaler.get_scale())

    base = precision.build(
        group("precision", "amp"), group("scaler", init_scale=2.0**30), torch.device("cpu")
    )
    prec = Counting(base.cfg, "cpu", base.scaler, guard_bn_stats=False)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = loop.Learner(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1), prec)
    batch = [(torch.randn(4, 8), torch.randint(0, 4, (4,)))]
    ran = [loop.train_step(learner, batch).stepped for _ in range(30)]
    assert len(calls) == 30 and not all(ran) and any(ran)  # skipped steps heard too


def test_a_precisions_own_state_is_checkpointed_and_a_resume_continues_it(tmp_path):
    """Precision.state_dict: an outside recipe's state (tests/plugins/counted_bf16.py counts
    the steps it heard) is in each checkpoint and comes back on resume; a checkpoint of another
    precision, without it, is resumed with one line saying so."""
    args = ["precision=counted_bf16", "logger=none", "trainer.log_every=2", "scheduler=constant"]
    first = outside(*args, "trainer.max_steps=4", run_dir=tmp_path / "a")
    assert first.returncode == 0, first.stderr[-3000:]
    again = outside(*args, "trainer.max_steps=7", "resume=auto", run_dir=tmp_path / "a")
    assert again.returncode == 0, again.stderr[-3000:]
    blob = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=False)
    assert blob["precision"] == {"attempts": 7} and blob["state"]["step"] == 7
    plain = outside("precision=bf16", *args[1:], "trainer.max_steps=2", run_dir=tmp_path / "b")
    assert plain.returncode == 0, plain.stderr[-3000:]
    later = outside(*args, "trainer.max_steps=3", "resume=auto", run_dir=tmp_path / "b")
    assert later.returncode == 0, later.stderr[-3000:]
    assert "holds no state of precision=counted_bf16" in later.stdout + later.stderr


@pytest.mark.slow
def test_a_logger_defined_outside_src_receives_the_runs_rows(tmp_path):
    """logger=csv from tests/plugins (its sink names its module): every row metrics.jsonl has
    reaches it, and the summary; beside W&B's sink as logger=[csv,none] would be."""
    import csv

    proc = outside("logger=csv", *QUICK, run_dir=tmp_path / "csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    jsonl = (tmp_path / "csv" / "metrics.jsonl").read_text().splitlines()
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(rows) == len(jsonl) and len(losses) == 3 and all(v > 0 for v in losses)
    assert json.loads((tmp_path / "csv" / "metrics.summary.json").read_text())["status"] == (
        "completed"
    )
    bad = outside("logger=csv", "logger.sinks.csv=no_such_module", *QUICK, run_dir=tmp_path / "b")
    assert bad.returncode == 2 and "logger.sinks.csv='no_such_module' cannot be imported" in (
        bad.stdout + bad.stderr
    )


def test_a_sweeps_report_reaches_an_outside_sink_that_takes_one(tmp_path):
    """A sink module may define log_report: a sweep's report then goes to it too (W&B's report
    run is one such); tests/plugins/csv_logger.py writes the table as one more CSV."""
    import csv

    sweep = tmp_path / "sweep"
    proc = run_train(
        ["-m", f"hydra.searchpath=[file://{PLUGINS / 'conf'}]", "logger=csv"]
        + ["precision=fp32,bf16", *QUICK, f"hydra.sweep.dir={sweep}"],
        env_extra={"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(sweep / "report.csv_logger.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["precision"] for r in rows) == ["bf16", "fp32"]
    assert all(r["status"] == "completed" for r in rows)


def test_an_optimizer_defined_outside_src_trains_and_resumes(cfg_factory):
    """optimizer=own: a user's optimizer from a folder (optimizer.path), with its kwargs; one of
    torch's by name; and a target that returns something else is a config error naming it."""
    from mixprec.core.errors import ConfigError

    own = [f"optimizer.path={PLUGINS}", "optimizer=own", "optimizer.target=own_optim:sign_sgd"]
    first = cfg_factory(*own, "+optimizer.kwargs.scale=0.5", "trainer.max_steps=4")
    s = run.run(first)
    from conftest import train_losses

    losses = train_losses(Path(first.run_dir))
    assert s["status"] == "completed" and losses[-1] < losses[0]  # it optimises
    again = cfg_factory(
        *own, "+optimizer.kwargs.scale=0.5", "trainer.max_steps=6", f"resume={first.run_dir}"
    )
    assert run.run(again)["steps"] == 6
    rms = cfg_factory(
        "optimizer=own", "optimizer.target=torch.optim:RMSprop", "trainer.max_steps=2"
    )
    assert run.run(rms)["status"] == "completed"
    bad = cfg_factory(*own[:2], "optimizer.target=own_optim:not_an_optimizer")
    with pytest.raises(
        ConfigError, match="optimizer.target='own_optim:not_an_optimizer' returned str"
    ):
        run.run(bad)
    with pytest.raises(ConfigError, match="optimizer.target=None is not allowed"):
        validate(cfg_factory("optimizer=own"))


def test_the_layout_and_the_data_dealing_use_the_strategys_data_parallel_size(
    cfg_factory, monkeypatch
):
    """A strategy whose ranks are not all data-parallel (as tensor parallel would be) says so in
    data_parallel(); the effective batch and the samples each rank is dealt follow it, not the
    world. Here, in a world of one process, a strategy that calls it rank 1 of 2: the effective
    batch doubles, and the rank trains on half the samples (half the steps of an epoch)."""
    monkeypatch.syspath_prepend(str(PLUGINS))  # tests/plugins/half_data_parallel.py
    args = ("batch=32", "trainer.epochs=1", "trainer.min_steps=0")
    alone = run.run(cfg_factory(*args))
    half = run.run(cfg_factory(*args, "parallel.plugin=half_data_parallel"))
    assert alone["effective_batch"] == 32 and half["effective_batch"] == 64
    assert half["steps"] == alone["steps"] // 2 or half["steps"] == (alone["steps"] + 1) // 2


def test_a_run_builds_its_strategy_once_and_every_part_gets_that_one(cfg_factory, monkeypatch):
    """A strategy that holds state (a mesh) must be one object: the layout, the build and the
    checkpoint ask for it, and get the one the run built first."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    import half_data_parallel

    made = []

    class Counted(half_data_parallel.Strategy):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            made.append(self)

    monkeypatch.setattr(half_data_parallel, "Strategy", Counted)
    s = run.run(cfg_factory("parallel.plugin=half_data_parallel", "trainer.max_steps=2"))
    assert s["status"] == "completed" and len(made) == 1


@pytest.mark.slow
def test_a_ddp_variant_defined_outside_src_trains_under_torchrun(tmp_path):
    """tests/plugins/ddp_fp16.py (a module) and its YAML are all a new strategy takes: two
    ranks train through it, its own key is validated, and its hook is the one that
    all-reduced (it says so from inside the all-reduce, in rank 0's log)."""
    from conftest import LM_CPU, run_torchrun

    env = {"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    args = [
        str(ROOT / "train.py"),
        f"hydra.searchpath=[file://{PLUGINS / 'conf'}]",
        "parallel=ddp_fp16",
        *LM_CPU,
        "data.max_mb=1",
        "trainer.max_steps=3",
        "accum=2",
    ]
    done = run_torchrun([*args, f"hydra.run.dir={tmp_path / 'ok'}"], env_extra=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["steps"]) == ("completed", 2, 3)
    assert "ddp_fp16: gradients all-reduced in float16" in out  # rank 0's log
    bad = run_torchrun(
        [*args, "parallel.bucket_cap_mb=0", f"hydra.run.dir={tmp_path / 'bad'}"], env
    )
    assert (
        bad.returncode != 0
        and "parallel.bucket_cap_mb=0.0 is not allowed" in bad.stdout + bad.stderr
    )


def test_a_precision_owns_its_scaler_and_its_input_conversion(cfg_factory, monkeypatch):
    """tests/plugins/scaled_bf16.py scales bf16's loss with a GradScaler of its own
    (make_scaler): the loss scale the run logs grows as the scaler group says, where the
    built-in bf16 logs none. Its input conversion moves a float64 batch as float32."""
    from mixprec.data.loaders import to_device

    monkeypatch.syspath_prepend(str(PLUGINS))
    args = ["precision=bf16", "scaler.init_scale=1024", "scaler.growth_interval=2"]
    args += ["trainer.max_steps=6", "trainer.log_every=1"]
    plain, own = cfg_factory(*args), cfg_factory(*args, "precision.plugin=scaled_bf16")
    run.run(plain)
    run.run(own)
    rows = lambda c: [  # noqa: E731
        json.loads(line) for line in (Path(c.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    scales = [r["amp/loss_scale"] for r in rows(own) if "amp/loss_scale" in r]
    plain_scales = {r.get("amp/loss_scale") for r in rows(plain)} - {None}
    assert scales[0] == 1024 and scales[-1] > scales[0], scales  # grown every 2 clean steps
    assert plain_scales <= {1.0}, plain_scales  # bf16's own rule: no scaling
    prec = precision.build(group("precision", "bf16"), group("scaler"), torch.device("cpu"))
    x, _ = to_device(
        (torch.ones(2, 3, dtype=torch.float64), torch.zeros(2)),
        torch.device("cpu"),
        torch.contiguous_format,
        prec.convert_input,
    )
    assert x.dtype == torch.float32


def test_float16_autocast_on_a_cpu_runs_without_onednn_and_the_next_run_gets_it_back(
    cfg_factory, caplog
):
    """oneDNN's float16 convolution backward is several times slower than torch's own kernels
    on a CPU with AVX512-FP16 (benchmarks/RESULTS.md): precision=amp on a CPU turns it off for
    its run, says so, and the next run of the process (an in-process sweep) has it again."""
    seen = {}  # oneDNN's state as each run left it (apply sets it at every run's start)
    with caplog.at_level("INFO", logger="mixprec"):
        run.run(cfg_factory("precision=amp", "trainer.max_steps=2"))
        seen["amp"] = torch.backends.mkldnn.enabled
        run.run(cfg_factory("precision=bf16", "trainer.max_steps=2"))
        seen["bf16"] = torch.backends.mkldnn.enabled
    assert seen == {"amp": False, "bf16": True}
    assert "float16 autocast on a CPU: oneDNN is off for this run" in caplog.text
