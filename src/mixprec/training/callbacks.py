"""Your code at the training loop's step boundaries, named in the config instead of edited in:

    python train.py +callbacks.ema._target_=mypkg.ema.EMA +callbacks.ema.decay=0.999

`callbacks:` in conf/train.yaml maps a name to a class (Hydra's `_target_`) and its arguments;
each one is built once per run (run/build.py) and called, on every rank, at these points:

- on_train_start(learner, state): before the first step (a resumed run: after its state is back);
- on_step_end(learner, state): after each optimizer step that ran (state.step is its number;
  a step GradScaler skipped is not one). The weights are that step's: the next step's forward
  may be queued on the GPU, its optimizer step is not;
- on_log(step, row) -> dict | None: on a logged step; the keys it returns go into that row, each
  under the callback's name (`ema/val_gap`), to every sink;
- on_validation_end(step, metrics) -> dict | None: after an evaluation; the same for its keys;
- on_train_end(learner, state): after the last step, before the summary;
- state_dict() / load_state_dict(state): what the checkpoint keeps for it (under its name), so a
  resumed run continues it; a checkpoint without it (an older run, a callback added since) leaves
  the callback as it was built, with one line saying so.

Every method is optional (Callback's do nothing). tests/plugins/ema.py is a whole example.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Callback:
    """The methods the loop calls; override those you need."""

    def on_train_start(self, learner, state) -> None:
        pass

    def on_step_end(self, learner, state) -> None:
        pass

    def on_log(self, step: int, row: dict) -> dict | None:
        return None

    def on_validation_end(self, step: int, metrics: dict) -> dict | None:
        return None

    def on_train_end(self, learner, state) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Callbacks:
    """The run's callbacks by name, called in the order the config lists them."""

    def __init__(self, named: dict[str, Any] | None = None) -> None:
        self.named = dict(named or {})

    def __bool__(self) -> bool:
        return bool(self.named)

    def _call(self, method: str, *args) -> None:
        for cb in self.named.values():
            fn = getattr(cb, method, None)
            if fn is not None:
                fn(*args)

    def on_train_start(self, learner, state) -> None:
        self._call("on_train_start", learner, state)

    def on_step_end(self, learner, state) -> None:
        self._call("on_step_end", learner, state)

    def on_train_end(self, learner, state) -> None:
        self._call("on_train_end", learner, state)

    def keys(self, method: str, step: int, values: dict) -> dict:
        """on_log / on_validation_end: the keys each callback returns, under its name."""
        out = {}
        for name, cb in self.named.items():
            fn = getattr(cb, method, None)
            got = fn(step, dict(values)) if fn is not None else None
            out.update({f"{name}/{k}": v for k, v in (got or {}).items()})
        return out

    def state_dict(self) -> dict:
        return {
            name: cb.state_dict() for name, cb in self.named.items() if hasattr(cb, "state_dict")
        }

    def load_state_dict(self, saved: dict | None, where: str) -> None:
        saved = saved or {}
        for name, cb in self.named.items():
            if name in saved and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(saved[name])
            elif hasattr(cb, "state_dict") and cb.state_dict():
                log.warning(
                    "callbacks.%s: %s holds no state for it; it goes on as built", name, where
                )
