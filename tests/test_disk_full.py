"""A disk that fills up mid-run, on a real (small tmpfs) file system: one clear error, exit 8,
the last good checkpoint kept, no temp files left, and the resume after freeing space works."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import fill, run_train

ARGS = ["logger=none", "trainer.max_steps=40", "ckpt.every_steps=10", "trainer.log_every=10"]


@pytest.mark.slow
def test_a_checkpoint_that_fills_the_disk_fails_clearly_and_resumes(small_disk, tmp_path):
    run_dir = small_disk / "run"
    filler = fill(small_disk, 600_000)  # the first checkpoint fits, the second does not
    p = run_train([*ARGS, f"hydra.run.dir={run_dir}"])
    out = p.stdout + p.stderr
    assert p.returncode == 8, out[-2000:]
    assert "Traceback" not in out
    assert "disk full: no space left to write" in out and "step_00000020.pt" in out
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["exit_code"], s["steps"]) == ("failed", 8, 20)
    assert "no space left" in s["error"]
    assert not [f for f in run_dir.rglob("*") if f.name.endswith(".tmp")]
    kept = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert kept["state"]["step"] == 10  # the last good one, whole

    filler.unlink()  # space freed: the printed advice works
    p = run_train([*ARGS, f"hydra.run.dir={run_dir}", "resume=auto"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    ref = tmp_path / "ref"
    assert run_train([*ARGS, f"hydra.run.dir={ref}"]).returncode == 0
    a = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(ref / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,full",
    [([], "metrics.jsonl"), (["precision=amp", "debug.numerics=true"], "numerics.jsonl")],
)
def test_metrics_on_a_full_disk_stop_the_run_with_one_message(small_disk, extra, full):
    """The rows of metrics.jsonl, or of numerics.jsonl (a probe's rows are the larger: it
    fills first), meet the full disk: exit 8 naming the file (numerics: a traceback, exit 1)."""
    run_dir = small_disk / "run"
    fill(small_disk, 45_000)  # the run's small files fit; the metrics rows soon do not
    p = run_train(
        [
            "logger=none",
            "trainer.max_steps=300",
            "trainer.log_every=1",
            "ckpt.every_steps=1000",
            *extra,
            f"hydra.run.dir={run_dir}",
        ]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 8, out[-2000:]
    assert "Traceback" not in out and "--- Logging error ---" not in out
    assert "disk full: no space left to write" in out and full in out
    assert "failed in" in p.stdout.strip().splitlines()[-1]  # the final line still comes


@pytest.mark.slow
def test_no_room_for_the_lock_is_the_same_error_and_leaves_no_run_dir(small_disk):
    fill(small_disk, 0)
    p = run_train(["logger=none", "trainer.max_steps=2", f"hydra.run.dir={small_disk / 'run'}"])
    out = p.stdout + p.stderr
    assert p.returncode == 8 and "Traceback" not in out
    assert "disk full" in out and not (small_disk / "run").exists()
