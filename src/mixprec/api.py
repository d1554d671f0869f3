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

from mixprec.core import targets
from mixprec.core.errors import ConfigError, MixprecError

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
    names = _Names()  # messages name your objects, not the placeholders that carry them
    try:
        extra = _model_overrides(model, keys)
        extra += _data_overrides(data, num_classes, vocab_size, keys, model)
        extra += _loss_overrides(loss, keys)
        names.of(model, data, loss, keys)
        try:
            cfg = compose_config([*extra, *overrides])
        except CompactHydraException as e:  # an unknown option, a wrong type: as train.py's exit 2
            raise ConfigError(str(e).split("\nConfig search path:")[0]) from None
        cfg.run_dir = str(run_dir)
        validate(cfg)  # a bad value is refused before the run dir is made
        with _logged_to(), names:  # .hydra/ and train.log: the run's, once it is accepted
            for note in _NOTES:
                log.info("%s", note)
            return session.run(cfg)
    except MixprecError as e:
        e.args = (names.said(str(e)),)
        raise
    finally:
        _NOTES.clear()
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
    report.write([sweep_dir], sweep_dir, to_sinks=False, echo=False)
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


def _data_overrides(data, num_classes, vocab_size, keys: list, model=None) -> list[str]:
    if data is None:
        return []
    if isinstance(data, (tuple, list)):
        if len(data) == 2 and num_classes is None and vocab_size is None:
            num_classes = inferred_classes(model, data)
        if len(data) != 2 or (num_classes is None) == (vocab_size is None):
            raise ConfigError(
                "mixprec.train(data=(train, val)) needs both datasets and one of num_classes= "
                "(classification) or vocab_size= (tokens); neither the model's output "
                "nor integer labels of the datasets showed the classes"
            )
        what = {"num_classes": num_classes} if num_classes else {"vocab_size": vocab_size}
        data = {"train": data[0], "val": data[1], **what}
    key = _keep(data, keys)
    return ["data=custom", "data.target=mixprec.api:data_object", f"+data.kwargs.key={key}"]


_NOTES: list[str] = []  # what train() inferred, said in the run's first lines
MAX_SCAN = 100_000  # samples read to find the classes of a dataset that is no TensorDataset


def inferred_classes(model, data) -> int | None:
    """num_classes where it can be read safely: the width of the model's output for the first
    training sample (a module given as an object; one forward pass, no gradient, eval mode),
    else 1 + the largest integer label of (train, val) (a TensorDataset's label tensor, or up
    to MAX_SCAN samples of (input, int label)); None where neither shows it. The labels must
    fit the classes: a negative label, one above the model's outputs, a one-output head or a
    dataset that raises while its labels are read is a ConfigError here, before training.
    Said in the run's first lines."""
    width = _output_width(model, data[0])
    try:
        low, top = _label_range(data)
    except MixprecError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's dataset)
        if width is None:
            return None  # no classes to check them against: the run's own checks apply
        raise ConfigError(
            f"mixprec.train(data=(train, val)) without num_classes=: reading the labels to check "
            f"them against the model's {width} outputs raised {type(e).__name__}: {e}"
        ) from None
    if width is not None:
        _check_labels(width, low, top)
        _NOTES.append(
            f"num_classes={width}: the width of the model's output for the first sample "
            "(mixprec.train(data=(train, val)) without num_classes=)"
        )
        return width
    if top is None:
        return None
    _NOTES.append(
        f"num_classes={top + 1}: 1 + the largest integer label of the datasets "
        "(mixprec.train(data=(train, val)) without num_classes=)"
    )
    return top + 1


def _output_width(model, train) -> int | None:
    """The last dimension of the model's output for train[0] (None where it cannot be had)."""
    import torch
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    try:
        x = train[0][0]
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(x.unsqueeze(0) if isinstance(x, torch.Tensor) else x)
        finally:
            model.train(was)
    except Exception:  # noqa: BLE001 (not a tensor model of (input, label) pairs: the labels)
        return None
    return int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.ndim >= 1 else None


def _check_labels(width: int, low: int | None, top: int | None) -> None:
    where = f"mixprec.train(data=(train, val)) without num_classes=: the model outputs {width}"
    if width < 2:
        raise ConfigError(
            f"{where} value(s) per sample, a one-output head: classification needs one logit "
            "per class (num_classes >= 2); for a binary score give your own loss (loss=...)"
        )
    if low is not None and low < 0:
        raise ConfigError(f"{where} classes, and a label is {low}: labels are 0..{width - 1}")
    if top is not None and top >= width:
        raise ConfigError(
            f"{where} classes, and a label is {top}: labels are 0..{width - 1} (the model's "
            "last layer has fewer outputs than the data has classes)"
        )


def _label_range(data) -> tuple[int | None, int | None]:
    """The smallest and largest integer label over (train, val); (None, None) where the
    labels are not integers or too many to read."""
    lows, tops = [], []
    for ds in data:
        got = _largest_label(ds)
        if got is None:
            return None, None
        lows.append(got[0])
        tops.append(got[1])
    return min(lows), max(tops)


def _largest_label(ds) -> tuple[int, int] | None:
    """(smallest, largest) integer label of a dataset; None where they are not integers."""
    import torch
    from torch.utils.data import TensorDataset

    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        y = ds.tensors[1]
        ok = y.ndim == 1 and not y.is_floating_point() and not y.is_complex()
        return (int(y.min()), int(y.max())) if ok and y.numel() else None
    if not hasattr(ds, "__len__") or len(ds) > MAX_SCAN:
        return None
    low, top = None, None
    for i in range(len(ds)):
        y = ds[i][1]
        if isinstance(y, torch.Tensor):
            if y.ndim or y.is_floating_point():
                return None
            y = int(y)
        if not isinstance(y, int) or isinstance(y, bool):
            return None
        low, top = min(y, low if low is not None else y), max(y, top if top is not None else y)
    return (low, top) if top is not None else None


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


class _Names(logging.Filter):
    """The user's names for what train() was given, in every message of the run (the
    "mixprec" logger's records and the error raised): `mixprec.train(model=Tuple3)`, not
    model.target='mixprec.api:model_object'."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[str, str]] = []

    def of(self, model, data, loss, keys: list) -> None:
        slots = iter(keys)  # in the order _model/_data/_loss_overrides kept them
        for given, key, arg, place in (
            (model, "model.target", "model", "model_object"),
            (data, "data.target", "data", "data_object"),
            (loss if callable(loss) else None, "model.loss", "loss", None),
        ):
            if given is None:
                continue
            slot = place or f"{LOSS}{next(slots)}"
            if place:
                next(slots)
            shown = f"mixprec.train({arg}={_shown(given)})"
            self.pairs += [(f"{key}='mixprec.api:{slot}'", shown), (f"mixprec.api:{slot}", shown)]

    def said(self, text: str) -> str:
        for placeholder, name in self.pairs:
            text = text.replace(placeholder, name)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pairs:
            record.msg, record.args = self.said(record.getMessage()), ()
        return True

    def __enter__(self):
        logging.getLogger("mixprec").addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("mixprec").removeFilter(self)


def _shown(obj) -> str:
    """A given object as its user knows it: a class or function by its name, a dataset pair
    or dict by its datasets' types."""
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(type(v).__name__ for v in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in obj.items()) + "}"
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "forward")):
        return getattr(obj, "__qualname__", type(obj).__name__)
    return type(obj).__name__


def _keep(obj, keys: list) -> str:
    # its own key (the data loader's cache keys on it), never a number to Hydra's grammar:
    # a bare hex like 9e99999999 would be read as the float inf
    key = "k" + uuid.uuid4().hex[:12]
    _OBJECTS[key] = obj
    keys.append(key)
    return key


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _default_dir(root: str) -> Path:
    return Path(root) / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")


class _logged_to:
    """The run's log lines on the console where nothing else prints them, as Hydra's job
    logging does for train.py (its train.log is the run's own: rundir.Journal)."""

    def __init__(self) -> None:
        self.handlers: list[logging.Handler] = []

    def __enter__(self):
        fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        root = logging.getLogger()
        self.handlers = []
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
