"""Your own code as a plugin: `pkg.module:callable` strings (`model.target`, `data.target`),
imported from PYTHONPATH or a folder the config names (`model.path`, `data.path`), called with
the config's kwargs plus the run's facts its signature asks for by name."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from mixprec.core.errors import ConfigError

TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def check_target(key: str, target: str | None) -> None:
    if target is not None and not TARGET.match(target):
        raise ConfigError(
            f"{key}={target!r} is not allowed; it must be 'package.module:callable' "
            "(e.g. mynets:TinyNet, a module on PYTHONPATH or in the folder named by "
            f"{key.rsplit('.', 1)[0]}.path)"
        )


def add_path(folder: str | None) -> None:
    """Put a user's folder first on the module path, here and in every process started later
    (DataLoader workers from a forkserver import the dataset's module anew)."""
    if not folder:
        return
    path = str(Path(folder).expanduser().resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *filter(None, parts)])


def plugin(key: str, path: str, attrs: tuple[str, ...], kind: str, what: str, hint: str):
    """The module `path` names as a plugin (precision.plugin, logger.sinks.<name>), with the
    attributes its kind must define; a ConfigError naming `key` where it is not one."""
    module = imported(key, path, path, f"; it must be a module with {what}{hint}")
    if not all(hasattr(module, a) for a in attrs):
        raise ConfigError(f"{key}={path!r} is not a {kind} plugin: it must define {what}")
    return module


def parse_plugin(group: str, node: dict, name_key: str, module: Callable[[str], Any]) -> Any:
    """A plugin group's node (precision, parallel, data) parsed by its plugin module's own
    Config (`module(path)`: the group's checked loader): a missing `plugin`, unknown keys and
    bad values are ConfigErrors naming the key."""
    from mixprec.core import schema

    name, path = node.get(name_key), node.get("plugin")
    if not isinstance(path, str):
        raise ConfigError(
            f"{group}={name}: {group}.plugin is missing; it names the module that implements "
            f"it, e.g. mixprec.{group}.{'base' if group == 'precision' else name}"
        )
    return schema.parse(module(path).Config, node, group, f"{group}={name}")


def imported(key: str, value: str, module_name: str, hint: str = ""):
    """`module_name` imported for the config's `key` (set to `value`): whatever a user's module
    does at import (raises, calls sys.exit, runs argparse on train.py's arguments) is a
    ConfigError naming the key. What it prints meanwhile is held back, and let through once the
    import succeeded: argparse's usage would read as train.py's."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module = importlib.import_module(module_name)
    except SystemExit as e:
        said = (err.getvalue() or out.getvalue()).strip().splitlines()
        raise ConfigError(
            f"{key}={value!r}: importing {module_name} called sys.exit({e.code!r})"
            + (f" after printing {said[-1][:160]!r}" if said else "")
            + "; code that parses arguments or exits belongs under "
            "`if __name__ == '__main__':` in that module"
        ) from None
    except ImportError as e:
        if value == module_name:  # a plugin named by its module
            raise ConfigError(f"{key}={value!r} cannot be imported ({e}){hint}") from None
        raise ConfigError(
            f"{key}={value!r}: module {module_name!r} cannot be imported{hint}: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ) from None
    except Exception as e:  # noqa: BLE001  (a user's module may raise anything on import)
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise ConfigError(
            f"{key}={value!r}: importing {module_name} raised {type(e).__name__}: {first}{hint}"
        ) from None
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    return module


def load(key: str, target: str, folder: str | None) -> Callable:
    """The callable `target` names; a ConfigError naming `key` where it cannot be had."""
    check_target(key, target)
    add_path(folder)
    module_name, attr = target.split(":")
    where = f" (looked on PYTHONPATH and in {folder})" if folder else " (on PYTHONPATH)"
    obj: Any = imported(key, target, module_name, where)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={target!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={target!r} is not callable ({type(obj).__name__})")
    return obj


def call(
    key: str, target: str, fn: Callable, kwargs: dict, facts: dict, forwarded: tuple = ()
) -> Any:
    """fn(**kwargs, **the facts its signature names and kwargs does not set). A callable that
    takes **kwargs (torchvision's builders, which forward them to the model's class) also gets
    the facts `forwarded` names, unless it then refuses them. Arguments that do not fit its
    signature (a kwarg it does not take, one it needs and did not get), or an exception the call
    raises, are a ConfigError naming `key`."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    params = sig.parameters if sig is not None else {}
    given = {k: v for k, v in facts.items() if k in params and k not in kwargs}
    keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    passed = {k: facts[k] for k in forwarded if k in facts and k not in kwargs} if keywords else {}
    try:
        if sig is not None:
            sig.bind(**kwargs, **given)
    except TypeError as e:
        group = key.split(".")[0]
        hint = (
            f"; kwargs the chosen {group} option set stay with {key}: start from {group}=own"
            if kwargs and group == "model"
            else ""
        )
        raise ConfigError(
            f"{key}={target!r} with kwargs {dict(kwargs)}: {str(e).splitlines()[0][:200]} "
            f"(mixprec passes, where the signature names them: {', '.join(facts)}){hint}"
        ) from None
    try:
        try:
            return fn(**kwargs, **given, **passed)
        except TypeError as e:  # (its **kwargs did not take what it was passed)
            if not any(f"'{k}'" in str(e) for k in passed):
                raise
            return fn(**kwargs, **given)
    except Exception as e:  # noqa: BLE001  (the user's code may raise anything)
        hint = (
            "; return it on the CPU, where it is made: mixprec moves it to the run's device"
            if any(w in str(e).lower() for w in ("cuda", "nvidia"))
            else ""
        )
        raise ConfigError(
            f"{key}={target!r} raised {type(e).__name__}: {_first(e)}{hint}"
        ) from None


def instance(key: str, node: Any) -> Any:
    """An object the config names by `_target_` (callbacks.<name>): `package.module:Class`, or
    Hydra's dotted `package.module.Class`, built with the node's other keys as its arguments
    (`path`: a folder put first on the module path, as model.path); a ConfigError naming `key`
    where it cannot be built."""
    if hasattr(node, "items") and not isinstance(node, dict):  # (an OmegaConf node)
        from omegaconf import OmegaConf

        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise ConfigError(
            f"{key}={node!r}: it must be a mapping with _target_: package.module:Class and the "
            f"class's arguments, e.g. +{key}._target_=mypkg.ema:EMA"
        )
    kwargs = dict(node)
    target, folder = kwargs.pop("_target_"), kwargs.pop("path", None)
    if ":" not in target and "." in target:  # Hydra's spelling
        target = ":".join(target.rsplit(".", 1))
    fn = load(f"{key}._target_", target, folder)
    return call(f"{key}._target_", target, fn, kwargs, {})


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
