"""Every option of every group composes and validates; bad input fails with a clear message."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException

from mixprec import models
from mixprec.core import hardware
from mixprec.core.errors import ConfigError
from mixprec.precision import base as precision
from mixprec.run import config
from mixprec.run import session as run
from mixprec.run.config import TrainConfig, validate

from conftest import compose_cfg, group, group_options, run_train

GROUPS = [
    "precision",
    "scaler",
    "optimizer",
    "scheduler",
    "hardware",
    "model",
    "data",
    "logger",
    "experiment",
]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_option_composes_and_validates(group, option):
    if (group, option) in (("data", "imagenet"), ("data", "cifar10"), ("data", "tokens")):
        with pytest.raises(ConfigError, match=f"data.root=None is not allowed.*data={option}"):
            validate(compose_cfg([f"{group}={option}"]))
        cfg = compose_cfg([f"{group}={option}", "data.root=/some/dir"])
    elif (group, option) == ("model", "own"):
        with pytest.raises(ConfigError, match="no model chosen; set model.target"):
            validate(compose_cfg(["model=own"]))
        cfg = compose_cfg(["model=own", "model.target=mynets:Net"])
    elif (group, option) == ("optimizer", "own"):
        with pytest.raises(ConfigError, match="optimizer.target=None is not allowed"):
            validate(compose_cfg(["optimizer=own"]))
        cfg = compose_cfg(["optimizer=own", "optimizer.target=torch.optim:RMSprop"])
    elif (group, option) == ("data", "custom"):
        with pytest.raises(ConfigError, match="data.target=None is not allowed"):
            validate(compose_cfg(["data=custom"]))
        cfg = compose_cfg(["data=custom", "data.target=mydata:make"])
    else:
        cfg = compose_cfg([f"{group}={option}"])
    c = validate(cfg)
    assert isinstance(c, TrainConfig)
    if group == "precision":
        assert c.precision.name == option


def test_groups_have_the_required_options():
    """The contract's options are there (a new one is added without editing this test: it is
    trained by test_every_option_of_a_plugin_group_trains_two_steps)."""
    assert {"fp32", "tf32", "amp", "amp_accum", "bf16", "fp8"} <= set(group_options("precision"))
    assert {"dynamic", "conservative", "static", "off"} <= set(group_options("scaler"))
    assert {"sgd", "adamw"} <= set(group_options("optimizer"))
    assert {"cosine", "step", "onecycle", "constant", "wsd"} <= set(group_options("scheduler"))
    assert {"auto", "cpu", "rtx3090", "a100", "h100", "h200"} <= set(group_options("hardware"))
    assert {"wandb", "none"} <= set(group_options("logger"))


def test_precision_semantics_table():
    want = {
        "fp32": (None, False, 1),
        "tf32": (None, True, 1),
        "amp": ("float16", True, 1),
        "amp_accum": ("float16", True, 4),
        "bf16": ("bfloat16", True, 1),
    }
    for name, (autocast, tf32, accum) in want.items():
        c = validate(compose_cfg([f"precision={name}"]))
        assert (c.precision.autocast, c.precision.tf32, c.accum) == (autocast, tf32, accum)


def test_amp_accum_respects_an_explicit_accum():
    assert validate(compose_cfg(["precision=amp_accum", "accum=2"])).accum == 2


def test_scaler_presets_follow_the_seeds():
    dyn = validate(compose_cfg(["scaler=dynamic"])).scaler
    assert (dyn.init_scale, dyn.growth_factor, dyn.backoff_factor, dyn.growth_interval) == (
        65536.0,
        2.0,
        0.5,
        2000,
    )
    assert validate(compose_cfg(["scaler=conservative"])).scaler.init_scale == 2.0**12
    assert validate(compose_cfg(["scaler=static"])).scaler.static is True
    assert validate(compose_cfg(["scaler=off"])).scaler.enabled is False


@pytest.mark.parametrize(
    "override,key",
    [
        ("batch=0", "batch"),
        ("batch=-3", "batch"),
        ("batch=abc", "batch"),
        ("effective_batch=0", "effective_batch"),
        ("accum=0", "accum"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("scaler.backoff_factor=1.5", "scaler.backoff_factor"),
        ("optimizer.scale_lr=cubic", "optimizer.scale_lr"),
        ("data=synthetic data.shape=[3,0,4]", "data.shape"),
        ("seed=-1", "seed"),
        ("seed=4294967296", "seed"),
        ("optimizer.lr=inf", "optimizer.lr"),
        ("scaler.init_scale=nan", "scaler.init_scale"),
        ("optimizer.momentum=0.9", "optimizer.momentum"),
        # values that used to pass validation and crash later (exit 1) or that the message's
        # stated range excludes (issue 26)
        ("scheduler=onecycle scheduler.pct_start=1.0", "scheduler.pct_start"),
        ("scheduler=onecycle scheduler.pct_start=0", "scheduler.pct_start"),
        ("scheduler=wsd scheduler.decay_fraction=0", "scheduler.decay_fraction"),
        ("scheduler=step scheduler.gamma=0", "scheduler.gamma"),
        ("scheduler.warmup_fraction=1", "scheduler.warmup_fraction"),
        ("scaler.init_scale=1e39", "scaler.init_scale"),
        ("optimizer=sgd optimizer.momentum=-0.1", "optimizer.momentum"),
        ("optimizer.betas=[0.9,1.0]", "optimizer.betas"),
        ("optimizer.betas=[-0.1,0.999]", "optimizer.betas"),
        ("optimizer.eps=-1e-8", "optimizer.eps"),
        ("data.val_fraction=0.001", "data.val_fraction"),
        ("data.data_seed=-1", "data.data_seed"),
        ("logger.timeout_s=null", "logger"),
        ("study.smooth=spline", "study.smooth"),
        ("study.fit_from=0", "study.fit_from"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg(override.split()))


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="trainer.epochs"):
        compose_cfg(["trainer.epochs=many"])


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="optimizer.lrr"):
        compose_cfg(["optimizer.lrr=0.1"])


def test_unknown_group_option_lists_the_allowed_ones():
    with pytest.raises(MissingConfigException) as e:
        compose_cfg(["precision=fp16"])
    assert "bf16" in str(e.value.options) and "amp" in str(e.value.options)


def test_unknown_timm_model_suggests_names():
    with pytest.raises(ConfigError, match=r"model.name='resnet5O'.*resnet50"):
        models.check_name("resnet5O")


def test_bf16_on_a_gpu_without_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    c = validate(compose_cfg(["precision=bf16"]))
    with pytest.raises(ConfigError, match="bfloat16.*fp32, tf32, amp"):
        precision.build(c.precision, c.scaler, torch.device("cuda"))


def test_amp_without_scaler_warns(caplog):
    import torch

    c = validate(compose_cfg(["precision=amp", "scaler=off"]))
    amp = precision.build(c.precision, c.scaler, torch.device("cpu"))
    assert not amp.scaler.is_enabled()
    assert "scaler=off" in caplog.text


def test_hardware_auto_detection_by_gpu_name():
    profiles = config.hardware_profiles()
    assert profiles.match("NVIDIA H200") == "h200"
    assert profiles.match("NVIDIA H100 80GB HBM3") == "h100"
    assert profiles.match("NVIDIA A100-SXM4-80GB") == "a100"
    assert profiles.match("NVIDIA GeForce RTX 3090") == "rtx3090"
    assert profiles.match("Tesla T4") is None
    profile = profiles.load("h200")
    assert profile.peak_tflops["bf16"] > profile.peak_tflops["fp32"] > 0
    assert profile.pin_memory and profile.num_workers == 12  # the generic cuda profile, extended


def test_cuda_profile_without_a_gpu_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = validate(compose_cfg(["hardware=h100"]))
    with pytest.raises(ConfigError, match="hardware=h100 needs a CUDA GPU"):
        hardware.resolve(c.hardware, config.hardware_profiles())
    auto = validate(compose_cfg(["hardware=auto"])).hardware
    assert hardware.resolve(auto, config.hardware_profiles()).name == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["batch=0"], 2, "batch=0 is not allowed; batch must be an int >= 1 or auto"),
        (["model.name=resnet5O"], 2, "did you mean"),
        (["precision=fp16"], 2, "Available options in 'precision'"),  # Hydra's: 2 as well
    ],
)
def test_cli_rejects_bad_input_before_training(tmp_path, args, code, needle):
    proc = run_train([*args, f"hydra.run.dir={tmp_path}", "logger=wandb"])
    assert proc.returncode == code, proc.stderr[-2000:]
    assert needle in proc.stdout + proc.stderr
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "wandb").exists()


def test_hardware_auto_keeps_what_the_user_overrode():
    """hardware=auto picks a profile but must not drop `hardware.num_workers=5`-style overrides
    (a lost `hardware.memory_gib` once let batch=auto fill a whole H200)."""
    profiles = config.hardware_profiles()
    picked = hardware.resolve(group("hardware", "auto"), profiles)
    mine = hardware.resolve(group("hardware", "auto", num_workers=5, memory_gib=3.0), profiles)
    assert mine.name == picked.name and mine.num_workers == 5 and mine.memory_gib == 3.0
    assert mine.peak_tflops == picked.peak_tflops  # the rest is the detected profile's


def test_an_emulated_card_keeps_its_memory_but_mfu_uses_the_real_gpus_peaks(monkeypatch):
    """hardware=rtx3090 on an H200 caps memory at 24 GiB; MFU against a 3090's 71 TFLOP/s would
    exceed 1 (the seed table once printed 1.04), so the real GPU's peaks are used."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H200")
    profiles = config.hardware_profiles()
    emulated = hardware.resolve(group("hardware", "rtx3090"), profiles)
    assert emulated.memory_gib == 24 and emulated.name == "rtx3090"
    assert emulated.peak_tflops == profiles.load("h200").peak_tflops
    mine = hardware.resolve(
        validate(compose_cfg(["hardware=rtx3090", "hardware.peak_tflops={fp16: 1.0}"])).hardware,
        profiles,
    )
    assert mine.peak_tflops["fp16"] == 1.0  # an explicit override keeps the profile's peaks
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA GeForce RTX 3090")
    native = hardware.resolve(group("hardware", "rtx3090"), profiles)
    assert native.peak_tflops == profiles.load("rtx3090").peak_tflops
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    unknown = hardware.resolve(group("hardware", "rtx3090"), profiles)
    assert unknown.peak_tflops == {}  # no known peaks: MFU null rather than wrong


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.slow
def test_hardware_device_cuda_without_a_gpu_is_refused_not_ignored(cfg_factory):
    with pytest.raises(ConfigError, match=r"hardware.device=cuda needs a CUDA GPU"):
        run.run(cfg_factory("hardware=auto", "hardware.device=cuda"))
    s = run.run(cfg_factory("hardware=auto", "hardware.device=cpu", "trainer.max_steps=1"))
    assert s["device"] == "cpu"


@pytest.mark.slow
def test_an_unknown_model_kwarg_is_a_config_error_and_a_known_one_applies(cfg_factory):
    with pytest.raises(ConfigError, match=r"model.kwargs=\{'depth': 3\}.*unexpected keyword"):
        run.run(cfg_factory("+model.kwargs.depth=3"))
    cfg = cfg_factory("+model.kwargs.width=8", "trainer.max_steps=1")
    run.run(cfg)
    saved = torch.load(f"{cfg.run_dir}/checkpoints/last.pt", weights_only=True)["model"]
    assert saved["features.0.weight"].shape[0] == 8


TRAINED = ("precision", "scaler", "optimizer", "scheduler", "parallel")
NEEDS_A_GPU = ("compute capability", "CUDA GPU", "needs CUDA", "float8")  # check_device's words


@pytest.mark.slow
@pytest.mark.parametrize("group,option", [(g, o) for g in TRAINED for o in group_options(g)])
def test_every_option_of_a_plugin_group_trains_two_steps(group, option, tmp_path):
    """Every option in conf/<group> of the groups a plugin extends trains two steps on this
    machine, or says before anything is built that it needs a GPU (fp8 on a CPU). An option
    added as a module and its YAML is tested here with no edit to any test."""
    extra = (
        ["optimizer.target=torch.optim:RMSprop"] if (group, option) == ("optimizer", "own") else []
    )
    args = ["hardware=cpu", "logger=none", "trainer.max_steps=2", "batch=16", "trainer.log_every=1"]
    p = run_train([*args, f"{group}={option}", *extra, f"hydra.run.dir={tmp_path}"])
    out = p.stdout + p.stderr
    if p.returncode == 2 and group == "precision" and any(w in out for w in NEEDS_A_GPU):
        pytest.skip(f"precision={option} needs a GPU: {out.strip().splitlines()[-1][-160:]}")
    assert p.returncode == 0, out[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("completed", 2)
