"""Work a precision begins before the training process's heavy imports, reached through its
YAML: `early: package.module` in conf/precision/<name>.yaml (or an option it builds on, through
its `defaults`) names a module that imports no torch, with `start(argv)` and `release()`.

train.py's first lines call start(sys.argv[1:]): the precision the command line chooses
(`precision=NAME`) is looked up in conf/, and its early module is started with the command line
(it decides from it whether there is work: fp8_auto's timing processes, precision/fp8_early.py,
start only for a plan still to be measured on a GPU). The precision's plugin claims that work
in its warm_up (it knows its early module); build.py then calls release() for what was not
claimed (another GPU, a cached plan), and the process's end ends it too. So a precision with
early work is its module, its YAML and its early module: train.py and build.py name none.

Nothing here imports torch or Hydra: it runs before anything heavy is imported (PyYAML, which
OmegaConf reads conf/ with, is light; core/targets.py loads the module, as every plugin's)."""

from __future__ import annotations

from pathlib import Path

from mixprec.core import targets
from mixprec.core.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"  # the repository's conf/ (pip install -e)
_started: list = []  # the early modules start() started, for release()


def choice(argv: list[str]) -> str | None:
    """The precision option the command line names (the last `precision=NAME`), if any."""
    names = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("precision=")]
    return names[-1] if names else None


def search_path(argv: list[str]) -> list[Path]:
    """The config folders the command line adds (`hydra.searchpath=[file://DIR,...]`, where a
    plugin outside the repository keeps its YAML), then the repository's conf/."""
    dirs = []
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            entries = value.strip().strip("[]").split(",")
            dirs += [
                Path(e.strip().strip("'\"")[len("file://") :]) for e in entries if "file://" in e
            ]
    return [*dirs, CONF_DIR]


def declared(name: str, conf_dirs: list[Path] | None = None) -> str | None:
    """The early module precision/<name>.yaml names (in the first of `conf_dirs` holding it),
    its own or that of an option of the group it builds on (its `defaults`); None where there
    is none, or no such file."""
    import yaml

    seen = set()
    todo = [name]
    while todo:
        option = todo.pop(0)
        if option in seen:
            continue
        seen.add(option)
        found = [d / "precision" / f"{option}.yaml" for d in conf_dirs or [CONF_DIR]]
        path = next((p for p in found if p.is_file()), None)
        if path is None:
            continue
        node = yaml.safe_load(path.read_text()) or {}
        if node.get("early"):
            return str(node["early"])
        todo += [d for d in node.get("defaults") or () if isinstance(d, str) and d != "_self_"]
    return None


def start(argv: list[str]) -> None:
    """train.py's first lines: start the chosen precision's early work, if it declares any."""
    name = choice(argv)
    module = declared(name, search_path(argv)) if name else None
    if module is None:
        return
    try:
        early = load(module)
    except ConfigError:
        return  # the config's check says so, as a config error (exit 2), once Hydra has run
    early.start(argv)
    _started.append(early)


def load(module: str):
    """The early module `module` names, checked for its two functions."""
    what = "start(argv) and release()"
    return targets.plugin("precision.early", module, ("start", "release"), "pre-import", what, "")


def release() -> None:
    """End the early work no plugin claimed (build.py, after the precision's warm_up)."""
    while _started:
        _started.pop().release()
