"""callbacks: (training/callbacks.py): code of the user's own at the loop's step boundaries,
named in the config. tests/plugins/ema.py is such a callback, written outside src/: it trains,
logs its keys under its name, and its state is checkpointed and resumed exactly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mixprec.core.errors import ConfigError
from mixprec.run import session as run

PLUGINS = Path(__file__).resolve().parent / "plugins"
EMA = ["+callbacks.ema._target_=ema:EMA", f"+callbacks.ema.path={PLUGINS}"]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def shadow(run_dir) -> dict:
    blob = torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=False)
    return blob["callbacks"]["ema"]


def test_an_outside_callback_hears_every_step_that_ran_and_logs_under_its_name(cfg_factory):
    cfg = cfg_factory(
        *EMA, "+callbacks.ema.decay=0.9", "trainer.max_steps=6", "trainer.log_every=3"
    )
    s = run.run(cfg)
    assert s["status"] == "completed"
    logged = [r for r in rows(cfg.run_dir) if "ema/updates" in r]
    assert [(r["step"], r["ema/updates"]) for r in logged] == [(3, 3), (6, 6)]
    assert all(r["ema/distance"] > 0 for r in logged)  # the average trails the weights


def test_its_state_is_checkpointed_and_a_resume_continues_it_exactly(cfg_factory):
    common = [*EMA, "+callbacks.ema.decay=0.8", "trainer.log_every=2", "ckpt.every_steps=3"]
    common += ["scheduler=constant"]  # (a cosine over 3 steps would differ from one over 6)
    straight = cfg_factory(*common, "trainer.max_steps=6")
    run.run(straight)
    first = cfg_factory(*common, "trainer.max_steps=3")
    run.run(first)
    again = cfg_factory(*common, "trainer.max_steps=6", f"resume={first.run_dir}")
    run.run(again)
    a, b = shadow(straight.run_dir), shadow(again.run_dir)
    assert a["updates"] == b["updates"] == 6
    assert a["shadow"].keys() == b["shadow"].keys()
    for name in a["shadow"]:
        assert torch.equal(a["shadow"][name], b["shadow"][name]), name


def test_a_checkpoint_without_its_state_says_so_and_the_callback_starts_as_built(
    cfg_factory, caplog
):
    first = cfg_factory("trainer.max_steps=2")  # no callback: its checkpoint holds none
    run.run(first)
    again = cfg_factory(*EMA, "trainer.max_steps=4", f"resume={first.run_dir}")
    with caplog.at_level(logging.WARNING):
        assert run.run(again)["status"] == "completed"
    assert "callbacks.ema: checkpoint" in caplog.text and "holds no state for it" in caplog.text
    assert shadow(again.run_dir)["updates"] == 2


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["+callbacks.ema._target_=no_such_mod:EMA"], "callbacks.ema._target_='no_such_mod:EMA'"),
        ([*EMA, "+callbacks.ema.decay=2"], "callbacks.ema._target_='ema:EMA' raised ValueError"),
        ([*EMA, "+callbacks.ema.nope=1"], "callbacks.ema._target_='ema:EMA' with kwargs"),
        (["+callbacks.ema=3"], "callbacks.ema=3: it must be a mapping with _target_"),
    ],
)
def test_a_callback_that_cannot_be_built_is_a_config_error_naming_it(
    cfg_factory, overrides, needle
):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        run.run(cfg_factory(*overrides, "trainer.max_steps=1"))


def test_hydras_dotted_target_names_the_same_class(cfg_factory):
    cfg = cfg_factory(
        "+callbacks.ema._target_=ema.EMA", f"+callbacks.ema.path={PLUGINS}", "trainer.max_steps=2"
    )
    assert run.run(cfg)["status"] == "completed"
