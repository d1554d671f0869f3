"""What a newcomer reads names only what exists: every repository path and Python file named in
docs/, the README, RESULTS.md and the library's docstrings and comments is there (a path shown
as `git show <commit>:<path>` is history, and may be gone)."""

from __future__ import annotations

import re

from conftest import ROOT

PATH = re.compile(r"(?<![\w/.:-])((?:src/mixprec|conf|tests|benchmarks|docs)/[\w./-]*\w)")
# RESULTS.md names its raw files relative to benchmarks/, often as NAME{.md,.json} or NAME-*.json
RAW = re.compile(r"(?<![\w/.:-])((?:benchmarks/)?results/[\w./{},*-]*[\w}*])")
PY = re.compile(r"(?<![\w/.:-])([\w/]+\.py)\b")
MODULE = re.compile(r"python -m (mixprec(?:\.\w+)*)")
HISTORY = re.compile(r"git show \w+:\S+")


def texts() -> list:
    return [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        ROOT / "benchmarks" / "RESULTS.md",
        *ROOT.glob("src/mixprec/**/*.py"),
        *ROOT.glob("conf/**/*.yaml"),
    ]


def test_every_path_module_and_file_the_docs_and_docstrings_name_exists():
    names = {p.name for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")}
    names |= {p.name for p in ROOT.glob("*.py")}
    missing = []
    for f in texts():
        text = HISTORY.sub("", f.read_text())
        where = f.relative_to(ROOT)
        for m in PATH.finditer(text):
            pattern = text[m.end() : m.end() + 1] in ("*", "<", "{")  # a glob or a placeholder
            if not pattern and not (ROOT / m.group(1)).exists():
                missing.append(f"{where}: {m.group(1)}")
        for m in PY.finditer(text):
            ref = m.group(1)
            if ref.split("/")[-1] not in names and not (ROOT / ref).exists():
                missing.append(f"{where}: {ref}")
        for m in MODULE.finditer(text):
            if text[m.end() : m.end() + 2] == ".<":  # python -m mixprec.<name>
                continue
            mod = ROOT / "src" / m.group(1).replace(".", "/")
            if not (mod.with_suffix(".py").exists() or (mod / "__main__.py").exists()):
                missing.append(f"{where}: python -m {m.group(1)}")
    assert missing == [], "\n".join(sorted(set(missing)))


def expand(name: str) -> list[str]:
    """NAME{a,b}c -> [NAMEac, NAMEbc], each brace in turn."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [
        e
        for alt in m.group(1).split(",")
        for e in expand(name[: m.start()] + alt + name[m.end() :])
    ]


def test_every_raw_file_the_results_name_exists_braces_and_globs_included():
    """`results/NAME{.md,.json}` and `results/NAME-*.json` in RESULTS.md and the docs: each
    name the braces spell is a file, and each glob matches one."""
    missing = []
    for f in [f for f in texts() if f.suffix == ".md"]:
        text = HISTORY.sub("", f.read_text())
        for m in RAW.finditer(text):
            name = m.group(1).removeprefix("benchmarks/")
            for e in expand(name):
                if not list((ROOT / "benchmarks").glob(e)):
                    missing.append(f"{f.relative_to(ROOT)}: {e}")
    assert missing == [], "\n".join(sorted(set(missing)))
