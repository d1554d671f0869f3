"""mixprec: measure what mixed precision buys on your GPU, through one Hydra-configured loop.

The code lives in subpackages by concern, on floors: a module may import its own subpackage and
any subpackage on a lower floor, never one on its own floor or above (tests/test_layers.py checks
every import, lazy ones included). The entry points at this level (diagnose, export, keys, prepare,
study, sync: `python -m mixprec.<name>`; api: `mixprec.train(...)` from Python) sit above
them all.

  0 internals     torch's private state: every read of it (torch_private.py) and every patch
                  of it behind version gates; it imports nothing of mixprec's but itself
  1 core          errors, atomic files, plugin schemas and targets, metrics, tasks, hardware
  2 models data optim parallel
                  what is trained, on what, by which optimizer, across which ranks
  3 precision checkpoint compile sinks
                  the precision plugins, checkpoints, torch.compile, the loggers
  4 diagnostics   the precision doctor and the dtype audit
  5 training      the loop, each step's ledger, batch=auto's search, stop signals, throughput
  6 report        reading run dirs: the sweep report, its plots, the time-to-quality study
  7 run           the config schema, the builder and a run's life in its run dir
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`mixprec.train(...)` and `mixprec.sweep(...)`, the Python entry (api.py), loaded on first
    use (PEP 562): `import mixprec` stays light (no torch, no Hydra), and the package's own
    module imports nothing of the floors below it."""
    if name in ("train", "sweep"):
        import importlib

        return getattr(importlib.import_module("mixprec.api"), name)
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")


FLOORS = (
    ("internals",),
    ("core",),
    ("models", "data", "optim", "parallel"),
    ("precision", "checkpoint", "compile", "sinks"),
    ("diagnostics",),
    ("training",),
    ("report",),
    ("run",),
)
