"""The dtype plan (diagnostics/dtype_plan.py): read from the live objects after the first
optimizer step, it matches what each precision and optimizer setting promises, and a precision
that silently does not do what it says stops the run (exit 10) naming both."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec.core.errors import DtypeMismatch
from mixprec.diagnostics import dtype_plan
from mixprec.run import session as run

from conftest import LM_CPU, ROOT, run_train

PLUGINS = ROOT / "tests" / "plugins"
STEPS = ["trainer.max_steps=2", "ckpt.at_end=false"]


def plan_of(cfg) -> dict:
    return run.run(cfg)["dtype_plan"]


def kinds(census: dict) -> set[str]:
    return {k.split(" on ")[0] for k in census}


@pytest.mark.parametrize(
    "precision,compute",
    [("fp32", "float32"), ("amp", "float16"), ("bf16", "bfloat16")],
)
def test_each_precision_computes_what_it_promises_with_fp32_weights_grads_and_state(
    cfg_factory, precision, compute
):
    plan = plan_of(cfg_factory(f"precision={precision}", *STEPS))
    assert plan["mismatches"] == []
    for g in plan["groups"]:
        assert kinds(g["weights"]) == {"float32"} and kinds(g["gradients"]) == {"float32"}
    assert kinds(plan["optimizer_state"]) == {"float32"}
    assert plan["compute"]["Conv2d"] == {compute: 2} and plan["compute"]["Linear"] == {compute: 1}
    assert plan["master_copy"] == {}


def test_bf16_weights_and_state_are_read_as_bf16(cfg_factory):
    """optimizer.state=bf16 (torchao, no fp32 master copy): weights, gradients and moments are
    bf16 on the live objects, and that is what it promises."""
    plan = plan_of(cfg_factory("precision=bf16", "optimizer=adamw", "optimizer.state=bf16", *STEPS))
    assert plan["mismatches"] == []
    assert {k for g in plan["groups"] for k in kinds(g["weights"])} == {"bfloat16"}
    assert kinds(plan["optimizer_state"]) == {"bfloat16"}


def test_8bit_state_is_torchaos_8bit_tensors(cfg_factory):
    plan = plan_of(cfg_factory("precision=bf16", "optimizer=adamw", "optimizer.state=8bit", *STEPS))
    assert plan["mismatches"] == []
    assert "OptimState8bit" in kinds(plan["optimizer_state"])  # small tensors stay fp32 (torchao)


def test_a_sharded_bf16_run_gathers_bf16_weights_for_its_forward(tmp_path):
    """FSDP2 over gloo (a world of one): the weights between steps are fp32 shards, the ones
    the forward computes with are gathered in bf16 (its MixedPrecisionPolicy)."""
    run_dir = tmp_path / "fsdp"
    args = [*LM_CPU, "data.max_mb=1", *STEPS, "parallel=fsdp", "precision=bf16"]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((run_dir / "summary.json").read_text())["dtype_plan"]
    assert plan["mismatches"] == []
    assert kinds(plan["forward_weights"]) == {"bfloat16"}
    assert {k for g in plan["groups"] for k in kinds(g["weights"])} == {"float32"}
    assert plan["promise"]["reduce"] == "float32"


def test_a_precision_that_silently_does_not_cast_stops_the_run_naming_both(tmp_path):
    """precision=silent_autocast promises bf16 autocast and does nothing: after step 1 the run
    stops with exit 10, naming the promise and what the layers computed in."""
    run_dir = tmp_path / "silent"
    proc = run_train(
        [
            f"hydra.searchpath=[file://{PLUGINS / 'conf'}]",
            "precision=silent_autocast",
            "hardware=cpu",
            "logger=none",
            *STEPS,
            f"hydra.run.dir={run_dir}",
        ],
        env_extra={"PYTHONPATH": str(PLUGINS)},
    )
    assert proc.returncode == DtypeMismatch.exit_code == 10
    log = (run_dir / "train.log").read_text()
    assert "Linear compute: promised bfloat16, found float32" in log
    assert "debug.dtype_plan=log" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 10
    # debug.dtype_plan=log: recorded, and the run trains on
    again = run_train(
        [
            f"hydra.searchpath=[file://{PLUGINS / 'conf'}]",
            "precision=silent_autocast",
            "hardware=cpu",
            "logger=none",
            *STEPS,
            "debug.dtype_plan=log",
            f"hydra.run.dir={tmp_path / 'logged'}",
        ],
        env_extra={"PYTHONPATH": str(PLUGINS)},
    )
    assert again.returncode == 0, again.stderr[-2000:]
    logged = json.loads((tmp_path / "logged" / "summary.json").read_text())["dtype_plan"]
    assert logged["mismatches"][0]["found"] == "float32"


def test_off_reads_nothing_and_registers_no_optimizer_hook(cfg_factory):
    cfg = cfg_factory("debug.dtype_plan=off", *STEPS)
    assert run.run(cfg)["dtype_plan"] is None
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class L:
        optimizer = opt

    dtype_plan.Watch(L(), None, "off")
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_a_promise_broken_in_each_part_is_named():
    """mismatches() on a plan whose every part breaks a float32 / bf16-compute promise."""
    promise = dtype_plan.Promise(
        weights=["float32"],
        compute="bfloat16",
        state="8bit",
        state_device="cuda",
        forward_weights=["bfloat16"],
    )
    plan = {
        "groups": [{"group": 0, "weights": {"float16 on cuda": 3}, "gradients": {}}],
        "optimizer_state": {"bfloat16 on cpu": 4},  # neither 8-bit nor fp32
        "optimizer_state_elements": {"cpu": 100, "cuda": 10},
        "forward_weights": {"float32": 3},
        "compute": {"Linear": {"float32": 2, "float8": 1}},
        "labels": ["float8"],
    }
    wrong = {m["what"]: (m["promised"], m["found"]) for m in dtype_plan.mismatches(plan, promise)}
    assert wrong["group 0 weights"] == ("float32", "float16")
    assert wrong["optimizer state"] == ("8bit", "bfloat16")
    assert wrong["optimizer state device"] == ("cuda", "100 elements on cpu, 10 elements on cuda")
    assert set(wrong) == {
        "group 0 weights",
        "optimizer state",
        "optimizer state device",
        "weights in the forward",
        "Linear compute",
    }
    assert wrong["Linear compute"] == ("bfloat16", "float32")  # float8: the precision's own


def test_layers_kept_in_fp32_and_the_layers_inside_them_are_the_precisions_own(cfg_factory):
    """precision.keep_fp32=[head]: the head's Linear computes in fp32 under fp16 autocast, as
    promised; the plan labels it kept (it sits inside the kept module) and finds no mismatch."""
    plan = plan_of(cfg_factory("precision=amp", "precision.keep_fp32=[head]", *STEPS))
    assert plan["mismatches"] == []
    assert plan["compute"]["Linear"] == {"float32 (kept)": 1}
    assert plan["compute"]["Conv2d"] == {"float16": 2}
    assert dtype_plan.label_of("a.b.c", {"a.b": "kept"}) == "kept"
    assert dtype_plan.label_of("a.bc", {"a.b": "kept"}) is None


def test_the_plan_as_a_table_has_one_type_per_column_as_wandb_needs():
    """W&B's tables refuse a column of mixed types (a TypeError would drop the W&B sink): the
    FSDP2 plan's configured-reduce row has no count, not a string one."""
    wandb = pytest.importorskip("wandb")
    plan = {
        "groups": [{"group": 0, "weights": {"float32 on cuda": 3}, "gradients": {}}],
        "optimizer_state": {"float32 on cuda": 6},
        "master_copy": {},
        "forward_weights": {"bfloat16": 3},
        "compute": {"Linear": {"bfloat16": 3}},
        "promise": {"reduce": "float32"},
    }
    table = dtype_plan.rows(plan)
    assert table[-1] == {
        "what": "gradients reduced in (as configured)",
        "dtype": "float32",
        "count": None,
    }
    wandb.Table(columns=list(table[0]), data=[list(r.values()) for r in table])  # no TypeError
    assert "| gradients reduced in (as configured) | float32 | - |" in dtype_plan.markdown(plan)


def test_the_rerun_forward_takes_16_samples_and_finds_the_full_batchs_plan(cfg_factory):
    """The plan's eager re-run reads dtypes, which do not depend on the batch: a run of batch 64
    re-runs its first 16 samples (before any validation) and reads the same plan as a run whose
    whole batch is 16."""
    from mixprec.models.zoo import DigitsCNN

    seen = []

    def note(module, args):
        if isinstance(module, DigitsCNN) and not torch.is_grad_enabled():
            seen.append(args[0].shape[0])

    hook = torch.nn.modules.module.register_module_forward_pre_hook(note)
    try:
        plans = {b: plan_of(cfg_factory("precision=bf16", f"batch={b}", *STEPS)) for b in (64, 16)}
    finally:
        hook.remove()
    # the 64-batch run: the build's one sample (it sizes the LazyLinear), the plan's re-run,
    # then validation's batches
    assert seen[:3] == [1, 16, 64], seen
    for key in ("compute", "forward_weights", "groups", "optimizer_state", "mismatches"):
        assert plans[64][key] == plans[16][key], key
