"""optimizer.state (AdamW's moments in 8 bit, 4 bit or fp8) and optimizer.offload=cpu, through
torchao's optimizers: validation, what the state really weighs, and checkpoints that resume
bit-exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mixprec.core.errors import CheckpointError, ConfigError
from mixprec.optim import optimizers as optim
from mixprec.optim import states as optim_states
from mixprec.precision import base as precision
from mixprec.run import session as run

from conftest import group


@pytest.mark.parametrize(
    "keys, needle",
    [
        (dict(state="16bit"), "optimizer.state='16bit'.*fp32, bf16, 8bit, 4bit, fp8"),
        (dict(offload="disk"), "optimizer.offload='disk'.*none, cpu"),
        (dict(state="8bit", fused=True), "optimizer.fused=True cannot be used"),
        (dict(offload="cpu", foreach=True), "optimizer.foreach=True cannot be used"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(keys, needle):
    with pytest.raises(ConfigError, match=needle):
        group("optimizer", "adamw", **keys)


def test_low_bit_states_are_adamws_only():
    with pytest.raises(ConfigError, match="optimizer.state=8bit needs optimizer=adamw"):
        group("optimizer", "sgd", state="8bit")


def prec(scaling: bool, name: str = "amp"):
    """A precision of the kind the checks read (amp's GradScaler on or off)."""
    scaler = group("scaler", "dynamic" if scaling else "off")
    return precision.build(group("precision", name), scaler, torch.device("cpu"))


@pytest.mark.parametrize(
    "device, world, scaling, clipping, needle",
    [
        ("cpu", 1, False, False, "this run has no GPU"),
        ("cuda", 2, False, False, "one process only"),
        ("cuda", 1, True, False, "GradScaler"),
        ("cuda", 1, False, True, "trainer.clip_grad_norm=null"),
    ],
)
def test_offload_refuses_what_it_cannot_do(device, world, scaling, clipping, needle):
    ocfg = group("optimizer", "adamw", offload="cpu")
    with pytest.raises(ConfigError, match=f"optimizer.offload=cpu cannot run here: .*{needle}"):
        optim_states.check_run(ocfg, prec(scaling), torch.device(device), world, clipping)
    optim_states.check_run(ocfg, prec(False), torch.device("cuda"), 1, False)  # what it can do


def test_offload_on_a_cpu_run_is_a_config_error_before_anything_is_written(cfg_factory):
    cfg = cfg_factory("optimizer=adamw", "optimizer.offload=cpu")
    with pytest.raises(ConfigError, match="no GPU"):
        run.run(cfg)
    assert not Path(cfg.run_dir).exists() or not any(Path(cfg.run_dir).iterdir())


def state_bytes(optimizer) -> int:
    return sum(
        t.untyped_storage().nbytes()
        if type(t) is torch.Tensor
        else sum(getattr(t, n).untyped_storage().nbytes() for n in t.__tensor_flatten__()[0])
        for s in optimizer.state.values()
        for k, t in s.items()
        if k.startswith("exp_avg")
    )


@pytest.mark.parametrize("state, at_most", [("8bit", 0.27), ("4bit", 0.15), ("fp8", 0.27)])
@pytest.mark.slow
def test_low_bit_moments_weigh_what_they_claim(state, at_most):
    """After one step the moments of a 1M-parameter layer weigh a quarter (8 bit, fp8) or an
    eighth (4 bit) of fp32's, plus the block scales."""

    def stepped(ocfg):
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 1024)
        opt = optim.build_optimizer(ocfg, model, 1e-3, torch.device("cpu"))
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        return opt, model

    fp32, _ = stepped(group("optimizer", "adamw"))
    low, model = stepped(group("optimizer", "adamw", state=state))
    assert (
        type(low).__name__ == {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}[state]
    )
    assert state_bytes(low) <= at_most * state_bytes(fp32)
    assert torch.isfinite(model.weight).all()


@pytest.mark.slow
def test_8bit_states_train_checkpoint_and_resume_bit_exact(cfg_factory):
    common = ["optimizer=adamw", "optimizer.state=8bit", "trainer.max_steps=6"]
    whole = cfg_factory(*common, "ckpt.every_steps=3", "ckpt.keep=2")
    s = run.run(whole)
    assert s["status"] == "completed"
    ckpts = Path(whole.run_dir) / "checkpoints"
    blob = torch.load(
        ckpts / "step_00000003.pt", weights_only=True
    )  # torchao's subclasses load safely
    kinds = {type(t).__name__ for st in blob["optimizer"]["state"].values() for t in st.values()}
    assert "OptimState8bit" in kinds
    resumed = cfg_factory(*common, f"resume={ckpts / 'step_00000003.pt'}")
    assert run.run(resumed)["train_loss"] == s["train_loss"]
    a = torch.load(ckpts / "last.pt", weights_only=True)
    b = torch.load(Path(resumed.run_dir) / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for p, st in a["optimizer"]["state"].items():
        for k, t in st.items():
            other = b["optimizer"]["state"][p][k]
            assert (
                torch.equal(t.dequantize(), other.dequantize())
                if hasattr(t, "dequantize")
                else torch.equal(t, other)
            )
    with pytest.raises(
        CheckpointError, match="optimizer.state=8bit; this run has optimizer.state=fp32"
    ):
        run.run(
            cfg_factory("optimizer=adamw", "trainer.max_steps=8", f"resume={ckpts / 'last.pt'}")
        )


def test_fp32_states_keep_torchs_own_adamw():
    c = group("optimizer", "adamw")
    opt = optim.build_optimizer(c, torch.nn.Linear(4, 4), 1e-3, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and not optim_states.used(c)


def test_torchao_optimizers_get_timms_groups_no_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))

    def decay_of(opt) -> dict:
        return {id(p): float(g["weight_decay"]) for g in opt.param_groups for p in g["params"]}

    cpu = torch.device("cpu")
    plain = optim.build_optimizer(group("optimizer", "adamw"), model, 1e-3, cpu)
    low = optim.build_optimizer(group("optimizer", "adamw", state="4bit"), model, 1e-3, cpu)
    assert decay_of(low) == decay_of(plain)
    assert sorted(set(decay_of(low).values())) == [0.0, 0.05]


@pytest.mark.slow
def test_bf16_state_keeps_bf16_weights_rounds_stochastically_and_resumes_bit_exact(cfg_factory):
    """optimizer.state=bf16: weights and moments in bf16 (no fp32 copy), and it learns: the
    digits CNN reaches a val top-1 far above chance in 30 steps. Resumed from step 15 of 30, it
    ends bit-identical (stochastic rounding draws from the restored RNG)."""
    common = ["optimizer=adamw", "optimizer.state=bf16", "precision=bf16", "trainer.max_steps=30"]
    whole = cfg_factory(*common, "ckpt.every_steps=15", "ckpt.keep=2")
    s = run.run(whole)
    assert s["status"] == "completed" and s["val_acc1"] > 0.5
    ckpts = Path(whole.run_dir) / "checkpoints"
    blob = torch.load(ckpts / "last.pt", weights_only=True)
    assert {
        t.dtype for k, t in blob["model"].items() if "running" not in k and t.is_floating_point()
    } == {torch.bfloat16}
    moments = {
        t.dtype for st in blob["optimizer"]["state"].values() for k, t in st.items() if "exp" in k
    }
    assert moments == {torch.bfloat16}
    resumed = cfg_factory(*common, f"resume={ckpts / 'step_00000015.pt'}")
    run.run(resumed)
    b = torch.load(Path(resumed.run_dir) / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(blob["model"][k], b[k]) for k in b)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["precision=fp32"], "needs precision=bf16"),
        (["precision=bf16", "precision.keep_fp32=[head]"], "weights are not fp32"),
    ],
)
def test_bf16_state_refuses_what_it_cannot_take(cfg_factory, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        run.run(cfg_factory("optimizer=adamw", "optimizer.state=bf16", *extra))


def test_offload_after_a_resume_schedules_the_lr_of_the_tensors_kept_on_the_gpu():
    """CPUOffloadOptimizer keeps tensors under 4,096 elements (biases, norms) in an ordinary
    optimizer on the device. torch's load_state_dict gives that optimizer new group dicts; the
    LR schedule sets the groups `param_groups` lists, which must be those (they were the old
    ones: a resumed run trained its biases at the checkpoint's lr). Built on the CPU without
    its CUDA parts: the small-tensor optimizer alone, as a resume meets it."""
    offload = optim_states._offload_optimizer()
    opt = object.__new__(offload)  # __init__ needs CUDA; the resume path needs only these
    bias = torch.nn.Parameter(torch.zeros(8))
    opt.d_opt = torch.optim.AdamW([bias], lr=1.0)
    opt.d_param_groups, opt.optim_dict, opt.param_d2h_map = opt.d_opt.param_groups, {}, {}
    opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = {}, {}
    saved = {"offloaded": [], "on-device": opt.d_opt.state_dict()}
    opt.load_state_dict(saved)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    schedule.step()
    assert opt.d_opt.param_groups[0]["lr"] == 0.5  # the schedule reaches the device optimizer


def test_without_torchao_the_options_are_a_config_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim fails
    ocfg = group("optimizer", "adamw", state="8bit")
    with pytest.raises(ConfigError, match=r"optimizer.state=8bit .*needs torchao: pip install"):
        optim_states.check_run(ocfg, prec(False, "bf16"), torch.device("cpu"), 1, False)
    optim_states.check_run(group("optimizer", "adamw"), prec(False), torch.device("cpu"), 1, False)
