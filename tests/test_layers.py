"""The subpackages' import directions (src/mixprec/__init__.py): a module imports its own
subpackage and those on lower floors, never one on its floor or above, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path, me: str) -> set[str]:
    """Every mixprec module a file imports, wherever the import stands (relative ones resolved)."""
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names if _is_module(f"{name}.{a.name}"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("mixprec.")}


def _floor_of(module: str) -> tuple[int, str] | None:
    """(floor, subpackage) of a mixprec module; the entry-point modules at the top level sit
    above every subpackage."""
    head = module.split(".")[1]
    for floor, names in enumerate(mixprec.FLOORS):
        if head in names:
            return floor, head
    if (SRC / f"{head}.py").exists():
        return len(mixprec.FLOORS), head
    return None  # a name from a package's namespace (mixprec.__version__)


def test_every_subpackage_has_a_floor_and_says_what_lives_there():
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    floored = {name for names in mixprec.FLOORS for name in names}
    assert packages == floored
    for name in packages:
        doc = ast.get_docstring(ast.parse((SRC / name / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"{name}/__init__.py: say what lives there"
        assert "May import" in doc, f"{name}/__init__.py: say what it may import"


def violations(path: Path, name: str) -> list[str]:
    """The imports of one file (module `name`) that go to its own floor or above."""
    me = _floor_of(name) if "." in name.removeprefix("mixprec.") else (len(mixprec.FLOORS), "")
    wrong = []
    for target in _imports(path, name):
        there = _floor_of(target)
        if there is not None and there[1] != me[1] and there[0] >= me[0]:
            wrong.append(f"{name} imports {target} (floor {there[0]} >= {me[0]})")
    return wrong


def test_imports_run_only_downward():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        if path != SRC / "__init__.py":
            wrong += violations(path, _module_name(path))
    assert not wrong, "\n".join(wrong)


def test_an_upward_import_is_found_lazy_and_relative_ones_too(tmp_path):
    """The check can fail: a core module importing the run (relative, inside a function), or a
    precision importing the trainer, is reported; a downward import is not."""
    path = tmp_path / "fake.py"
    from mixprec import FLOORS

    floor = {pkg: n for n, pkgs in enumerate(FLOORS) for pkg in pkgs}
    path.write_text("def f():\n    from ..run import session\n")
    run, core = floor["run"], floor["core"]
    assert f"mixprec.core.fake imports mixprec.run.session (floor {run} >= {core})" in violations(
        path, "mixprec.core.fake"
    )
    path.write_text("from mixprec.training.loop import train\nfrom mixprec.models import parts\n")
    train, prec = floor["training"], floor["precision"]
    assert violations(path, "mixprec.precision.fake") == [
        f"mixprec.precision.fake imports mixprec.training.loop (floor {train} >= {prec})"
    ]
    assert violations(path, "mixprec.run.fake") == []
