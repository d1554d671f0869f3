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
    assert missing_refs(texts()) == [], "\n".join(missing_refs(texts()))


def missing_refs(files: list) -> list[str]:
    names = {p.name for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")}
    names |= {p.name for p in ROOT.glob("*.py")}
    missing = []
    for f in files:
        text = HISTORY.sub("", f.read_text())
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        for m in PATH.finditer(text):
            pattern = text[m.end() : m.end() + 1] in ("*", "<", "{")  # a glob or a placeholder
            if not pattern and not (ROOT / m.group(1)).exists():
                missing.append(f"{where}: {m.group(1)}")
        for m in PY.finditer(text):
            ref = m.group(1)
            if "/" in ref:  # a path: in one of the folders a reader would look from
                bases = (ROOT, ROOT / "src" / "mixprec", ROOT / "src", f.parent, *SUBDIRS)
                if not any((base / ref).exists() for base in bases):
                    missing.append(f"{where}: {ref}")
            elif ref not in names:
                missing.append(f"{where}: {ref}")
        for m in MODULE.finditer(text):
            if text[m.end() : m.end() + 2] == ".<":  # python -m mixprec.<name>
                continue
            mod = ROOT / "src" / m.group(1).replace(".", "/")
            if not (mod.with_suffix(".py").exists() or (mod / "__main__.py").exists()):
                missing.append(f"{where}: python -m {m.group(1)}")
    return sorted(set(missing))


SUBDIRS = (ROOT / "tests", ROOT / "benchmarks")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target


def test_every_relative_link_in_the_markdown_resolves():
    """`[x](nothere.md)` in docs/ (relative to the doc's own folder), README and RESULTS."""
    assert broken_links(texts()) == [], "\n".join(broken_links(texts()))


def broken_links(files: list) -> list[str]:
    missing = []
    for f in [f for f in files if f.suffix == ".md"]:
        for m in LINK.finditer(f.read_text()):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):  # an anchor, a URL, mailto:
                continue
            if not (f.parent / target).exists():
                missing.append(f"{f.name}: ({m.group(1)})")
    return sorted(set(missing))


def test_the_checks_catch_a_file_in_the_wrong_folder_and_a_dead_relative_link(tmp_path):
    """Issue 90, item 16: `scripts/train.py` passed (train.py exists elsewhere), and a relative
    link inside docs/ was never read."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `python scripts/train.py` or `python train.py`; see [usage](usage.md), "
        "[nowhere](nothere.md) and [the web](https://example.org/x.md).\n"
    )
    (tmp_path / "usage.md").write_text("here\n")
    assert missing_refs([doc]) == [f"{doc}: scripts/train.py"]
    assert broken_links([doc]) == ["doc.md: (nothere.md)"]


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
