"""The Python entry: the run train.py makes, from objects, for notebooks and scripts.

    import mixprec
    summary = mixprec.train(
        model=net,                                   # an nn.Module, or a callable returning one
        data={"train": train_ds, "val": val_ds, "num_classes": 10},  # or (train_ds, val_ds)
        overrides=["precision=bf16", "trainer.max_steps=200"],       # as on the command line
        loss=my_loss,  # optional: fn(logits, targets) -> mean loss, "own" (the model's) or "task"
    )
    runs = mixprec.sweep(model=net, data=..., precisions=["fp32", "bf16"])  # + report.md

The same config is composed (conf/, every override train.py takes), the same checks refuse the
same bad inputs (a ConfigError naming the key is raised, not an exit code), the same run dir is
written (train.log, metrics.jsonl, summary.json, checkpoints, .hydra/config.yaml), and the
summary is returned. The objects reach the run through `model.target` and `data.target`, as
your own code does from the command line (docs/own-model.md): a module passed as an object is
copied for each build (batch=auto's probes build several), so your `net` is left as it was; the
trained weights are the run dir's checkpoint (`python -m mixprec.export RUN_DIR`).
"""

from __future__ import annotations

import copy
import datetime
import logging
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from mixprec.core import targets
from mixprec.core.errors import ConfigError

log = logging.getLogger("mixprec")
_OBJECTS: dict[str, object] = {}  # what train() was given, by a key of this call's own


def train(
    model=None, data=None, overrides=(), run_dir=None, num_classes=None, vocab_size=None, loss=None
):
    """One run, as `python train.py OVERRIDES` with your objects; returns its summary.
    `data` is a dict as a data.target callable returns it (a "collate_fn" too), or (train, val)
    with `num_classes` or `vocab_size`; None keeps the config's data. `loss`: a function
    fn(logits, targets) -> the mean loss, or model.loss's words ("task", "own",
    "package.module:fn"). `run_dir`: outputs/python/<time> if None."""
    from hydra.errors import CompactHydraException

    from mixprec.run import session
    from mixprec.run.config import compose_config, validate

    run_dir = Path(run_dir or _default_dir("outputs/python"))
    keys: list[str] = []
    try:
        extra = _model_overrides(model, keys) + _data_overrides(data, num_classes, vocab_size, keys)
        extra += _loss_overrides(loss, keys)
        try:
            cfg = compose_config([*extra, *overrides])
        except CompactHydraException as e:  # an unknown option, a wrong type: as train.py's exit 2
            raise ConfigError(str(e).split("\nConfig search path:")[0]) from None
        cfg.run_dir = str(run_dir)
        validate(cfg)  # a bad value is refused before the run dir is made
        _write_hydra_config(run_dir, cfg)
        with _logged_to(run_dir / "train.log"):
            return session.run(cfg)
    finally:
        for k in keys:
            _OBJECTS.pop(k, None)


def sweep(model=None, data=None, precisions=("fp32", "bf16"), overrides=(), sweep_dir=None, **kw):
    """train() once per precision, each in <sweep_dir>/<precision>, then the sweep's report
    (report.md and its plots, as a multirun writes them); returns {precision: summary}."""
    from mixprec.report import report

    sweep_dir = Path(sweep_dir or _default_dir("outputs/python-sweeps"))
    done = {}
    for p in precisions:
        done[p] = train(model, data, [f"precision={p}", *overrides], sweep_dir / p, **kw)
    report.write([sweep_dir], sweep_dir, to_wandb=False, echo=False)
    return done


def model_object(
    key: str, num_classes=None, vocab_size=None, max_seq_len=None, in_chans=None, input_shape=None
):
    """model.target for train(model=...): a copy of the module, or what the callable returns
    for the run's facts (those its signature names)."""
    from torch import nn

    given = _OBJECTS[key]
    if not isinstance(given, nn.Module):
        facts = dict(
            num_classes=num_classes,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            in_chans=in_chans,
            input_shape=input_shape,
        )
        facts = {k: v for k, v in facts.items() if v is not None}
        return targets.call("model", _name(given), given, {}, facts, ("num_classes",))
    return copy.deepcopy(given)


def data_object(key: str):
    """data.target for train(data=...)."""
    return _OBJECTS[key]


def _model_overrides(model, keys: list) -> list[str]:
    from torch import nn

    if model is None:
        return []
    if not (callable(model) or isinstance(model, nn.Module)):
        raise ConfigError(
            f"mixprec.train(model=...) got {type(model).__name__}: give a torch.nn.Module or a "
            "callable returning one"
        )
    key = _keep(model, keys)
    return ["model=own", "model.target=mixprec.api:model_object", f"+model.kwargs.key={key}"]


def _data_overrides(data, num_classes, vocab_size, keys: list) -> list[str]:
    if data is None:
        return []
    if isinstance(data, (tuple, list)):
        if len(data) != 2 or (num_classes is None) == (vocab_size is None):
            raise ConfigError(
                "mixprec.train(data=(train, val)) needs both datasets and one of num_classes= "
                "(classification) or vocab_size= (tokens)"
            )
        what = {"num_classes": num_classes} if num_classes else {"vocab_size": vocab_size}
        data = {"train": data[0], "val": data[1], **what}
    key = _keep(data, keys)
    return ["data=custom", "data.target=mixprec.api:data_object", f"+data.kwargs.key={key}"]


def _loss_overrides(loss, keys: list) -> list[str]:
    if loss is None:
        return []
    if isinstance(loss, str):
        return [f"model.loss={loss}"]
    if not callable(loss):
        raise ConfigError(
            f"mixprec.train(loss=...) got {type(loss).__name__}: give a function "
            "fn(logits, targets) -> the batch's mean loss, or 'task', 'own', 'package.module:fn'"
        )
    return [f"model.loss=mixprec.api:{LOSS}{_keep(loss, keys)}"]


LOSS = "loss_"  # model.loss=mixprec.api:loss_<key>: the function train(loss=...) was given


def __getattr__(name: str):
    """train(loss=fn)'s function, as model.loss finds it (PEP 562: a module's own getattr)."""
    if name.startswith(LOSS) and name[len(LOSS) :] in _OBJECTS:
        return _OBJECTS[name[len(LOSS) :]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _keep(obj, keys: list) -> str:
    key = uuid.uuid4().hex[:12]  # its own key: the data loader's cache keys on it
    _OBJECTS[key] = obj
    keys.append(key)
    return key


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _default_dir(root: str) -> Path:
    return Path(root) / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")


def _write_hydra_config(run_dir: Path, cfg) -> None:
    """.hydra/config.yaml, as Hydra writes it for train.py: the report and the study read a
    run's precision and seed from it."""
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml", resolve=False)


class _logged_to:
    """The run's log lines into its train.log (and on the console, where nothing else
    prints them), as Hydra's job logging does for train.py."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handlers: list[logging.Handler] = []

    def __enter__(self):
        fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        root = logging.getLogger()
        self.handlers = [logging.FileHandler(self.path)]
        if not root.handlers:
            self.handlers.append(logging.StreamHandler())
        for h in self.handlers:
            h.setFormatter(fmt)
            root.addHandler(h)
        self.level = root.level
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
        return self

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        for h in self.handlers:
            root.removeHandler(h)
            h.close()
        root.setLevel(self.level)
