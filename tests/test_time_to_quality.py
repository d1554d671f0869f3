"""Time to the same quality: every log row carries wall and training time, evaluation runs every
N steps (and resumes exactly across one), and the study's loss-matched arithmetic gives the
known answer on synthetic curves."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mixprec import run

from conftest import last_weights

VAL = ["trainer.max_steps=12", "trainer.val_every=4", "trainer.log_every=2"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_val_every_evaluates_at_its_steps_and_every_row_has_the_time_keys(cfg_factory):
    cfg = cfg_factory(*VAL)  # an epoch of the digits is 22 steps of 64: all 3 mid-epoch
    s = run.run(cfg)
    got = rows(Path(cfg.run_dir))
    assert [r["step"] for r in got if "val/loss" in r] == [4, 8, 12]
    assert all("time/elapsed_s" in r and "time/train_s" in r for r in got)
    train = [r for r in got if "train/loss" in r]
    elapsed = [r["time/elapsed_s"] for r in got]
    assert elapsed == sorted(elapsed) and all(r["time/train_s"] <= r["time/elapsed_s"] for r in got)
    assert 0 < train[-1]["time/train_s"] <= s["wall_s"] and s["train_s"] >= train[-1]["time/train_s"]
    # evaluation is not training time: train_s stands (nearly) still across an evaluation,
    # and the next window's train_s grows by its own steps only
    at_4 = [r["time/train_s"] for r in got if r["step"] == 4]
    at_6 = next(r["time/train_s"] for r in got if r["step"] == 6)
    assert len(at_4) == 2 and abs(at_4[1] - at_4[0]) < 0.02 and at_6 > at_4[1]


def test_a_resume_across_a_mid_epoch_evaluation_is_bit_exact_and_time_continues(
    cfg_factory, tmp_path
):
    base = [*VAL, "trainer.val_every=3", "ckpt.every_steps=6", "ckpt.keep=3", "scheduler=constant"]
    run.run(cfg_factory(*base, f"run_dir={tmp_path / 'ref'}"))
    half = tmp_path / "ref" / "checkpoints" / "step_00000006.pt"
    # the same run stopped at step 6 and resumed (a constant lr: the schedule ignores the end)
    again = tmp_path / "again"
    run.run(cfg_factory(*base, "trainer.max_steps=6", f"run_dir={again}"))
    before = rows(again)[-1]["time/elapsed_s"]
    run.run(cfg_factory(*base, "resume=auto", f"run_dir={again}"))
    a, b = last_weights(tmp_path / "ref"), last_weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    val = lambda d: [(r["step"], r["val/loss"]) for r in rows(d) if "val/loss" in r]  # noqa: E731
    assert val(again) == val(tmp_path / "ref")  # steps 3, 6, 9, 12 with the same losses
    after = [r for r in rows(again) if r["step"] > 6]
    assert after and all(r["time/elapsed_s"] > before for r in after)
    assert torch.load(half, weights_only=True)["state"]["train_s"] > 0
