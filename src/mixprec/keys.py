"""`python -m mixprec.keys [PREFIX | group=option ...]`: every config key with its default and
what it means, read from the YAML files' own comments (conf/train.yaml and
conf/<group>/<option>.yaml), in a tenth of a second: nothing is composed and torch is not
imported (train.py --help composes the config first and shows the main keys only).

    python -m mixprec.keys                 # every key of conf/train.yaml
    python -m mixprec.keys trainer ckpt    # the keys under trainer. and ckpt.
    python -m mixprec.keys data=text       # the keys of one group option (data.*)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mixprec.core.early import CONF_DIR

CONF = CONF_DIR
LINE = re.compile(
    r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w-]*):(?P<value>[^#]*?)\s*(#\s?(?P<note>.*))?$"
)


def keys(path: Path, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as written, its comment) of every key in a YAML file, nested keys
    under their parents; a defaults list and comment-only lines are skipped."""
    out, stack = [], []  # stack: (indent, key) of the open parents
    in_defaults = False
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent, key = len(m["indent"]), m["key"]
        if indent == 0:
            in_defaults = key == "defaults"
        if in_defaults:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join(
            [prefix, *(k for _, k in stack), key] if prefix else [*(k for _, k in stack), key]
        )
        out.append((dotted, m["value"].strip(), (m["note"] or "").strip()))
        stack.append((indent, key))
    return out


def show(args: list[str]) -> str:
    rows: list[tuple[str, str, str]] = []
    prefixes = []
    for a in args:
        if "=" in a:
            group, option = a.split("=", 1)
            path = CONF / group / f"{option}.yaml"
            if not path.is_file():
                options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
                refuse(f"{a}: no such option (the options of {group}: {', '.join(options)})")
            rows += keys(path, group)
        else:
            prefixes.append(a)
    if not any("=" in a for a in args):
        rows = [
            r for r in keys(CONF / "train.yaml") if not prefixes or r[0].startswith(tuple(prefixes))
        ]
        if not rows:
            refuse(f"no key starts with {' or '.join(prefixes)} (python -m mixprec.keys: all)")
    width = max(len(_key(k, v)) for k, v, _ in rows)
    return "\n".join(f"{_key(k, v):<{width}}  {note}".rstrip() for k, v, note in rows)


def _key(key: str, value: str) -> str:
    return f"{key}={value}" if value else f"{key}:"  # (a parent: its keys follow)


def refuse(why: str) -> str:
    print(f"config error: {why}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    print(show(sys.argv[1:]))


if __name__ == "__main__":
    main()
