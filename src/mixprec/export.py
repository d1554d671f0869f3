"""`python -m mixprec.export RUN_DIR [--dtype bfloat16] [--out FILE]`: a run's weights as one
plain state-dict file, for use outside mixprec: `torch.load(FILE, weights_only=True)` gives
{name: tensor}, the names of the model timm (or mixprec's Llama) builds, whatever the run was
(single process, DDP or FSDP2; a ckpt.sharded checkpoint's shards are joined here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.core import files
from mixprec.core.errors import MixprecError


def export(source: str, dtype: str | None = None, out: Path | None = None) -> tuple[Path, dict]:
    """Writes the weights of the checkpoint `source` (a run dir or a .pt) and returns (the file,
    the model config that built them). torch is imported here, not above: `--help` and a bad
    argument are answered without its seconds of imports."""
    import torch

    from mixprec.checkpoint import dcp as checkpoint_dcp
    from mixprec.checkpoint import store as checkpoint

    path = checkpoint.find(source, Path(source))
    blob = checkpoint.load(path)
    model = checkpoint_dcp.full_model(path) if blob["model"] == "dcp" else blob["model"]
    cast = getattr(torch, dtype) if dtype else None
    weights = {
        k: v.to(cast) if cast is not None and v.is_floating_point() else v for k, v in model.items()
    }
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    name = f"model-step{blob['state']['step']}{'-' + dtype if dtype else ''}.pt"
    out = out / name if out is not None and out.is_dir() else out or run_dir / name
    out.parent.mkdir(parents=True, exist_ok=True)  # --out into a folder not made yet
    files.write_atomic(out, lambda f: torch.save(weights, f))
    return out, blob["config"].get("model") or {}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mixprec.export", description=__doc__.split("\n")[0]
    )
    ap.add_argument("run", help="a run dir (its newest checkpoint), a .pt file or a .dcp dir")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="a file, or a folder to write model-stepN.pt into (default: RUN_DIR)",
    )
    a = ap.parse_args(argv)
    try:
        out, model = export(a.run, a.dtype, a.out)
    except MixprecError as e:  # no checkpoint there, or not a mixprec checkpoint
        print(f"{e.label}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    print(f"wrote {out}")
    print(f"load it: {how_to_load(model, out)}")


def how_to_load(model: dict, out: Path) -> str:
    """The line that rebuilds the model the weights belong to (by where it came from)."""
    kwargs = ", ".join(f"{k}={v!r}" for k, v in (model.get("kwargs") or {}).items())
    load = f"model.load_state_dict(torch.load({str(out)!r}, weights_only=True))"
    if model.get("target"):
        module, fn = model["target"].split(":")
        return f"from {module} import {fn}; model = {fn}({kwargs}); {load}"
    if (model.get("hf") or {}).get("config"):
        return (
            "the weights are named hf.<transformers' name>: strip the 'hf.' prefix and load "
            "them into the transformers model built from the same config"
        )
    extra = f", {kwargs}" if kwargs else ""
    return f"model = timm.create_model({model.get('name')!r}, num_classes=...{extra}); {load}"


if __name__ == "__main__":
    main()
