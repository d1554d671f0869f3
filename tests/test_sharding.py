"""parallel=fsdp (FSDP2) on the CPU: torch's fully_shard runs with gloo, so two processes train
the Llama sharded here. They give the losses and weights of one process with the same global
batch; checkpoints hold the full state and resume bit-exact; export writes a plain file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import timm
import torch

from mixprec import export
from mixprec.checkpoint import store as checkpoint
from mixprec.core.errors import CheckpointError, ConfigError
from mixprec.parallel import sharding
from mixprec.run import build
from mixprec.run import session as run
from mixprec.run.config import validate
from mixprec.training import loop

from conftest import (
    LM_CPU,
    ROOT,
    compose_cfg,
    last_weights,
    run_module,
    run_torchrun,
    run_train,
    train_losses,
)

LM = [*LM_CPU, "data.max_mb=1", "trainer.max_steps=4", "trainer.perf_warmup_steps=0"]
losses, weights = train_losses, last_weights


def torchrun(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return run_torchrun([str(ROOT / "train.py"), *LM, *args, f"hydra.run.dir={run_dir}"])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["+parallel.reduce_dtype=float32"], "parallel.reduce_dtype is not a key of parallel=ddp"),
        (
            ["parallel=fsdp", "parallel.reduce_dtype=float16"],
            "parallel.reduce_dtype='float16'.*float32",
        ),
        (["parallel.plugin=no_such_module"], "parallel.plugin='no_such_module' cannot be imported"),
        (
            ["parallel.plugin=mixprec.core.errors"],
            "is not a parallel strategy plugin: it must define",
        ),
        (["parallel.plugin=mixprec.parallel.sharding"], "is not a parallel strategy plugin"),
        (["parallel.plugin=null"], "parallel=ddp: parallel.plugin is missing"),
        (["data.plugin=null"], "data=digits: data.plugin is missing"),
    ],
)
def test_bad_parallel_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(compose_cfg(overrides))


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.compile=true", "model.compile_scope=model"], "model.compile_scope=model"),
    ],
)
def test_what_fsdp_cannot_take_is_refused_before_training(cfg_factory, extra, needle):
    with pytest.raises(ConfigError, match=f"parallel=fsdp cannot run with this config: .*{needle}"):
        run.run(cfg_factory("parallel=fsdp", *extra))


@pytest.mark.slow
def test_two_sharded_processes_match_one_process_and_resume_bit_exact(tmp_path):
    """2 ranks x batch 4 x accum 2 under FSDP2 (each rank holds half of every block) train as
    one process with batch 8 x accum 2: the same losses and final weights (to float rounding:
    sums over shards come in another order); so does parallel=fsdp without torchrun (a group
    of one). Resumed from its step-2 checkpoint, the sharded run ends bit-identical to the
    uninterrupted one."""
    one = run_train([*LM, "batch=8", "accum=2", f"hydra.run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    sharded = ["parallel=fsdp", "batch=4", "accum=2", "ckpt.every_steps=2", "ckpt.keep=2"]
    two = torchrun(sharded, tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    assert "4 blocks and the root sharded (FSDP2)" in two.stdout + two.stderr
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5, atol=1e-5
    )
    # without torchrun: FSDP2 over a process group of one (one GPU's code path) trains alike
    alone = run_train(
        [*LM, "parallel=fsdp", "batch=8", "accum=2", f"hydra.run.dir={tmp_path / 'alone'}"]
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "4 blocks and the root sharded (FSDP2)" in alone.stdout + alone.stderr
    torch.testing.assert_close(
        losses(tmp_path / "alone"), losses(tmp_path / "one"), rtol=1e-5, atol=1e-5
    )
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert w1.keys() == w2.keys()  # the plain names: a sharded run's checkpoint is a full one
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    step2 = tmp_path / "two" / "checkpoints" / "step_00000002.pt"
    again = torchrun([*sharded, f"resume={step2}"], tmp_path / "again")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    w3 = weights(tmp_path / "again")
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
    s = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert (s["world_size"], s["effective_batch"], s["steps"]) == (2, 16, 4)

    out, model = export.export(str(tmp_path / "two"), "bfloat16")  # outside mixprec
    plain = timm.create_model(model["name"], num_classes=256, max_seq_len=32, **model["kwargs"])
    exported = torch.load(out, weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in exported.values() if t.is_floating_point())
    plain.load_state_dict(exported)  # strict: every name fits
    assert torch.equal(plain.output.weight, w2["output.weight"].to(torch.bfloat16).float())


def test_a_checkpoint_resumes_only_under_the_strategy_that_wrote_it(cfg_factory):
    first = cfg_factory("model=digits_mlp", "trainer.max_steps=2")
    run.run(first)
    again = ["model=digits_mlp", "trainer.max_steps=4", "parallel=fsdp", f"resume={first.run_dir}"]
    wanted = "parallel.strategy=ddp; this run has parallel.strategy=fsdp"
    with pytest.raises(CheckpointError, match=wanted):
        run.run(cfg_factory(*again))


@pytest.mark.slow
def test_export_writes_plain_weights_and_refuses_a_dir_without_a_checkpoint(cfg_factory, tmp_path):
    cfg = cfg_factory("model=digits_mlp", "trainer.max_steps=2")
    run.run(cfg)
    done = run_module("mixprec.export", [cfg.run_dir])
    assert done.returncode == 0, done.stderr
    out = Path(cfg.run_dir) / "model-step2.pt"
    assert f"wrote {out}" in done.stdout and "load_state_dict" in done.stdout
    saved = torch.load(Path(cfg.run_dir) / "checkpoints" / "last.pt", weights_only=True)["model"]
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == saved.keys() and all(
        torch.equal(exported[k], saved[k]) for k in saved
    )
    empty = run_module("mixprec.export", [str(tmp_path)])
    assert empty.returncode == 2 and "no checkpoint" in empty.stderr


@pytest.mark.slow
def test_a_sharded_run_resumes_on_another_world_size_with_the_same_global_batch(tmp_path):
    """Written by 2 sharded processes (batch 4) at step 2, resumed by 1 process (batch 8), and
    the other way round: the same global batch, so the same samples per step; the state is spread
    anew, so the end matches the uninterrupted run to float rounding, not bit for bit."""
    sharded = ["parallel=fsdp", "accum=2", "ckpt.every_steps=2", "ckpt.keep=2"]
    two = torchrun([*sharded, "batch=4"], tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    step2 = tmp_path / "two" / "checkpoints" / "step_00000002.pt"
    one = run_train(
        [*LM, *sharded, "batch=8", f"resume={step2}", f"hydra.run.dir={tmp_path / 'one'}"]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resume on 1 processes (written on 2) with batch 8 (was 4)" in one.stdout + one.stderr
    torch.testing.assert_close(
        losses(tmp_path / "one"), losses(tmp_path / "two")[2:], rtol=1e-5, atol=1e-5
    )
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in w2:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
    solo = run_train([*LM, *sharded, "batch=8", f"hydra.run.dir={tmp_path / 'solo'}"])
    assert solo.returncode == 0, solo.stderr[-3000:]
    solo2 = tmp_path / "solo" / "checkpoints" / "step_00000002.pt"
    back = torchrun([*sharded, "batch=4", f"resume={solo2}"], tmp_path / "back")  # 1 -> 2
    assert back.returncode == 0, (back.stdout + back.stderr)[-4000:]
    w_solo, w_back = weights(tmp_path / "solo"), weights(tmp_path / "back")
    for k in w_solo:
        torch.testing.assert_close(w_back[k], w_solo[k], rtol=1e-4, atol=1e-5)


def test_another_global_batch_is_still_refused_on_resume():
    from mixprec.checkpoint import store as checkpoint

    blob = {"state": {"layout": {"batch": 4, "accum": 2, "world": 2}}}
    checkpoint.check_fits(blob, Path("x.pt"), {"batch": 8, "accum": 2, "world": 1})  # same
    with pytest.raises(CheckpointError, match="another batch layout"):
        checkpoint.check_fits(blob, Path("x.pt"), {"batch": 4, "accum": 2, "world": 1})
    with pytest.raises(CheckpointError, match="another batch layout"):
        checkpoint.check_fits(blob, Path("x.pt"), {"batch": 8, "accum": 1, "world": 2})


@pytest.mark.slow
def test_fp16_under_sharding_skips_on_every_rank_when_one_shard_overflows(tmp_path):
    """Each rank holds only its shard of the gradients: an overflow in rank 1's shard alone must
    make both ranks skip the step and back off the same scale. torch's own GradScaler does it
    for FSDP2's DTensor gradients (its inf check on a DTensor is reduced over the ranks)."""
    env = {
        "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT / 'src'}",
        "MIXPREC_TEST_FSDP_OVERFLOW_OUT": str(tmp_path),
    }
    p = run_torchrun([str(ROOT / "tests" / "fsdp_overflow.py")], env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["ran"] == [False, False] for r in rows)  # rank 0 skipped too
    assert {r["scale"] for r in rows} == {16384.0}  # 65536 halved twice, the same on both


@pytest.mark.slow
def test_fp16_with_a_grad_scaler_trains_sharded_as_one_process(tmp_path):
    amp = ["precision=amp", "accum=2", "trainer.max_steps=3"]
    one = run_train([*LM, *amp, "batch=8", f"hydra.run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun([*amp, "parallel=fsdp", "batch=4"], tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-4, atol=1e-4
    )
    s = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (
        s["loss_scale"] == json.loads((tmp_path / "one" / "summary.json").read_text())["loss_scale"]
    )


@pytest.mark.slow
def test_each_sharded_block_compiles_and_trains_as_one_eager_process(tmp_path):
    """compile_scope=blocks under FSDP2: each sharded block compiled in place (inductor on the
    CPU here), the losses of one eager process to compile's rounding."""
    one = run_train([*LM, "batch=8", "accum=2", f"hydra.run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    compiled = ["parallel=fsdp", "batch=4", "accum=2", "model.compile=true"]
    two = torchrun([*compiled, "model.compile_scope=blocks"], tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    assert "wraps 4 repeated blocks (FSDPBlock)" in (tmp_path / "two" / "train.log").read_text()
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_sharded_checkpoints_each_rank_writes_its_shard_and_resume_reshards(tmp_path):
    """ckpt.sharded=true under 2 FSDP2 ranks: each checkpoint is a DCP directory with one shard
    file per rank, its metadata and meta.pt, renamed into place whole (no partial dir left),
    last.dcp naming the newest, `keep` of them kept. Resumed from step 2 on the same world
    size it ends bit-identical to the uninterrupted run; on one process (batch 8: the same
    global batch) it reshards and ends within 1e-4; export joins the shards into the plain
    model's weights."""
    sharded = ["parallel=fsdp", "batch=4", "ckpt.sharded=true", "ckpt.every_steps=2", "ckpt.keep=2"]
    two = torchrun(sharded, tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    ckpts = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.dcp",
        "step_00000002.dcp",
        "step_00000004.dcp",
    ]
    assert (ckpts / "last.dcp").resolve() == (ckpts / "step_00000004.dcp").resolve()
    files = sorted(p.name for p in (ckpts / "step_00000002.dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    s = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s["checkpoint"] == str(ckpts / "last.dcp")

    step2 = ckpts / "step_00000002.dcp"
    again = torchrun([*sharded, f"resume={step2}"], tmp_path / "again")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    out2, _ = export.export(str(tmp_path / "two"))
    out3, model = export.export(str(tmp_path / "again"))
    w2, w3 = torch.load(out2, weights_only=True), torch.load(out3, weights_only=True)
    assert w2.keys() == w3.keys() and all(torch.equal(w3[k], w2[k]) for k in w2)

    one = run_train(
        [*LM, "parallel=fsdp", "batch=8", f"resume={step2}", f"hydra.run.dir={tmp_path / 'one'}"]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "not bit-identical" in one.stdout + one.stderr
    w1 = torch.load(export.export(str(tmp_path / "one"))[0], weights_only=True)
    for k in w2:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
    plain = timm.create_model(model["name"], num_classes=256, max_seq_len=32, **model["kwargs"])
    plain.load_state_dict(w2)  # strict: every name fits


def test_a_half_written_sharded_checkpoint_is_never_the_one_resumed(tmp_path):
    """A crash while writing leaves .step_N.dcp.partial (or a directory without meta.pt):
    resume=auto takes last.dcp, the newest whole one, and a path to the half-written one is
    refused naming it."""
    ckpts = tmp_path / "checkpoints"
    whole, half = ckpts / "step_00000002.dcp", ckpts / ".step_00000004.dcp.partial"
    for d in (whole, half, ckpts / "step_00000006.dcp"):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"shard")
    (whole / "meta.pt").write_bytes(b"meta")
    (whole / ".metadata").write_bytes(b"metadata")  # DCP writes it, meta.pt comes last
    (ckpts / "last.dcp").symlink_to(whole.name)
    assert checkpoint.find("auto", tmp_path) == ckpts / "last.dcp"
    with pytest.raises(ConfigError, match=r"no checkpoint at .*step_00000006.dcp"):
        checkpoint.find(str(ckpts / "step_00000006.dcp"), tmp_path)


def test_sharded_checkpoints_without_sharding_are_refused_naming_the_key(cfg_factory):
    with pytest.raises(
        ConfigError,
        match=r"ckpt.sharded=True .*unless the strategy shards \(parallel=fsdp\); parallel=ddp",
    ):
        run.run(cfg_factory("model=digits_mlp", "ckpt.sharded=true"))


def test_a_dir_holding_only_sharded_checkpoints_holds_a_run_and_overwrite_removes_them(tmp_path):
    """A run dir with checkpoints/last.dcp is a run's (refused without resume or overwrite);
    overwrite removes the .dcp directories, the link and a crash's partial dir, and leaves
    what no run made."""
    from mixprec.run import rundir

    ckpts = tmp_path / "checkpoints"
    for d in ("step_00000002.dcp", "step_00000004.dcp", ".step_00000006.dcp.partial"):
        (ckpts / d).mkdir(parents=True)
        (ckpts / d / "__0_0.distcp").write_bytes(b"shard")
    (ckpts / "last.dcp").symlink_to("step_00000004.dcp")
    (ckpts / "notes.txt").write_text("mine")
    assert rundir.holds_a_run(tmp_path)
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.prepare(tmp_path, None, overwrite=False)
    rundir.prepare(tmp_path, None, overwrite=True)
    assert sorted(p.name for p in ckpts.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_batch_auto_probes_fsdp2_over_each_rank_alone_and_waits_on_no_other_rank(tmp_path):
    """batch=auto under parallel=fsdp: the probes are FSDP2 over a mesh of this rank alone (all
    of the state, where training gives each rank a share: an upper bound on its memory), and a
    probe on one rank runs while the other waits in a barrier (as after running out of memory):
    no collective of the probe spans both ranks, or the run would hang here."""
    env = {
        "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT / 'src'}",
        "MIXPREC_TEST_FSDP_PROBE_OUT": str(tmp_path),
    }
    p = run_torchrun([str(ROOT / "tests" / "fsdp_probe.py")], env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = {r["rank"]: r for r in (json.loads(f.read_text()) for f in tmp_path.glob("rank*.json"))}
    assert sorted(rows) == [0, 1]
    probe = rows[1]
    assert probe["sharded"] and probe["mesh_sizes"] == [1] and probe["holds_all"]
    assert probe["stepped"] == [True, True]
    assert not rows[0]["world_holds_all"] and not rows[1]["world_holds_all"]  # training: shares


def test_batch_auto_probes_a_world_of_one_sharded_as_its_run(cfg_factory, gloo_world_of_one):
    """parallel=fsdp without torchrun (a group of one): the probe is the run's own FSDP2 model,
    not the plain one (FSDP2 adds gather buffers and an fp32 gradient copy: a plain probe picks
    a batch the sharded run cannot hold)."""
    c = validate(cfg_factory(*LM_CPU, "parallel=fsdp", "batch=4"))
    new_learner, inputs = build.probes(c, torch.device("cpu"))
    learner = new_learner(4)
    assert sharding.is_sharded(learner.model)
    assert loop.train_step(learner, [inputs(4)], None).stepped
