"""torch.compile and CUDA graphs for a built model (build.assemble calls `compiled` after the
parallel wrap): the whole model as one graph, or each repeated block in place
(compile_scope=blocks: regional compilation), with inductor options on top of a mode; and
model.cuda_graphs, forward and backward captured once and replayed."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from mixprec.core import files
from mixprec.core.errors import ConfigError
from mixprec.internals import inductor_fix, torch_private
from mixprec.models import ModelConfig, blocks_of, unwrap
from mixprec.models.parts import repeated_blocks  # noqa: F401  (tests and benchmarks use it here)

log = logging.getLogger("mixprec.models")
# compile_scope=blocks: one graph per distinct block shape (ResNet-50: 8)
BLOCK_RECOMPILE_LIMIT = 64


def compiled(model: nn.Module, mcfg: ModelConfig) -> nn.Module:
    """torch.compile as configured, over the (possibly wrapped) model: the whole of it, or each
    repeated block in place (compile_scope=blocks). Returns the model to train."""
    if not mcfg.compile:
        if mcfg.compile_options:  # e.g. experiment=fast model.compile=false: the eager baseline
            log.info(
                "model.compile=false: model.compile_options %s unused", dict(mcfg.compile_options)
            )
        return model
    inductor_fix.apply()  # torch <= 2.11: a warm start would tune every kernel again
    t0 = time.perf_counter()
    if mcfg.compile_scope == "blocks":
        blocks = compile_blocks(
            unwrap(model), mcfg.label, mcfg.compile_mode, dict(mcfg.compile_options)
        )
        what = f"{len(blocks)} repeated blocks ({type(blocks[0]).__name__}) one by one"
    else:
        model = compile_model(model, mcfg.compile_mode, dict(mcfg.compile_options))
        what = "the model"
    log.info(
        "model.compile: torch.compile(mode=%s, options=%s) wraps %s in %.1fs; the first "
        "steps compile (excluded from samples_per_s by trainer.perf_warmup_steps)",
        mcfg.compile_mode,
        dict(mcfg.compile_options),
        what,
        time.perf_counter() - t0,
    )
    return model


def load_cache(path: str | None) -> None:
    """model.compile_cache: the compiled and tuned kernels of an earlier run
    (torch.compiler.save_cache_artifacts: inductor's graphs, Triton's binaries, the autotuning
    results), loaded into this process's caches before anything compiles. No file yet: this run
    writes it at its end (save_cache). torch checks that the artifacts match its version, Triton
    and the GPU; a file that does not load is a warning, and the run compiles as without it."""
    if not path or not os.path.isfile(os.path.expanduser(path)):
        if path:
            log.info("model.compile_cache: %s does not exist yet; this run will write it", path)
        return
    t0 = time.perf_counter()
    blob = Path(path).expanduser().read_bytes()
    outside = _keys_outside(blob)
    if outside:
        log.warning(
            "model.compile_cache: %s is refused, nothing of it loaded: %d of its entries name "
            "paths outside torch's cache dirs (e.g. %r), as only a crafted file does; "
            "compiling from scratch",
            path,
            len(outside),
            outside[0],
        )
        return
    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # noqa: BLE001 (a stale or foreign file must not stop the run)
        log.warning("model.compile_cache: %s did not load (%s); compiling from scratch", path, e)
        return
    what = {k: len(v) for k, v in getattr(info, "artifacts", {}).items() if v}
    if not what:  # torch reads a file of another version, or not of artifacts, as nothing
        log.warning(
            "model.compile_cache: %s did not load (no artifacts this torch, Triton and GPU "
            "can use); compiling from scratch",
            path,
        )
        return
    log.info("model.compile_cache: loaded %s in %.1fs: %s", path, time.perf_counter() - t0, what)


def _keys_outside(blob: bytes) -> list[str]:
    """The keys of a cache file's entries that would not stay inside their cache's own dir:
    each is one or two plain names (inductor's graph hash; the autotuner's `dir/name`)."""
    keys = torch_private.cache_artifact_keys(blob)
    if keys is None:
        return []  # nothing torch can read: it loads nothing either
    return [key for _, key in keys if not _plain_key(key)]


def _plain_key(key: str) -> bool:
    parts = key.split("/")
    return 0 < len(parts) <= 2 and all(p not in ("", ".", "..") and "\0" not in p for p in parts)


def save_cache(path: str | None) -> None:
    """model.compile_cache after a completed run: what this process compiled and tuned, written
    where the next run (on this machine, or another with the same GPU, torch and Triton) loads
    it; an existing file is kept (the run loaded it)."""
    if not path or os.path.exists(os.path.expanduser(path)):
        return
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        log.info("model.compile_cache: nothing compiled to save")
        return
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(target, saved[0])
    log.info("model.compile_cache: %.1f MB of compiled kernels -> %s", len(saved[0]) / 1e6, path)


def compile_kwargs(mode: str | None, options: dict) -> dict:
    """torch.compile's arguments for a mode and, on top of it, inductor options
    (model.compile_options, e.g. conv_1x1_as_mm). torch.compile takes a mode or options, not
    both, so the mode's own options (torch_private.inductor_mode_options) go under the user's."""
    if not options:
        return {"mode": mode}
    return {"options": {**torch_private.inductor_mode_options(mode or "default"), **options}}


def compile_model(model: nn.Module, mode: str | None, options: dict) -> nn.Module:
    """torch.compile(model) with compile_kwargs(mode, options)."""
    try:
        return torch.compile(model, **compile_kwargs(mode, options))
    except RuntimeError as e:  # torch names every known option; keep the message short
        raise ConfigError(
            f"model.compile_options: {str(e).split(', known options')[0]} "
            "(allowed: inductor's config keys, the names torch.compile's options= takes)"
        ) from None


def compile_blocks(model: nn.Module, name: str, mode: str | None, options: dict) -> list[nn.Module]:
    """model.compile_scope=blocks (regional compilation): each repeated block is compiled in
    place (nn.Module.compile: the state_dict keeps its names) with static shapes; identical
    blocks share one compiled graph, so a 24-block ViT compiles one block instead of 24. The
    rest of the model (stem, head) runs eagerly. Each distinct block shape is one recompile:
    process.apply raises dynamo's limit to BLOCK_RECOMPILE_LIMIT for this scope."""
    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError(
            f"model.compile_scope=blocks: {name} has no repeated blocks (a Sequential "
            "or ModuleList of one block class, or what the model declares in mixprec_blocks "
            "or model.blocks=GLOB); use model.compile_scope=model"
        )
    kwargs = compile_kwargs(mode, options)
    for block in blocks:
        block.compile(dynamic=False, **kwargs)
    return blocks


def capture_graphs(model: nn.Module, example: torch.Tensor, prec) -> nn.Module:
    """model.cuda_graphs: forward and backward captured once as CUDA graphs
    (torch.cuda.make_graphed_callables) and replayed every training step, so the CPU launches
    one graph instead of hundreds of kernels. Evaluation (model.eval()) runs the eager forward.
    `prec` must be built with cache=False (torch: no autocast cast cache around graphs)."""
    if example.device.type != "cuda":
        raise ConfigError(
            "model.cuda_graphs=true captures CUDA graphs and needs a GPU; set it false on the CPU"
        )
    if prec.cache:
        raise ValueError("capture_graphs needs a precision built with cache=False")
    t0 = time.perf_counter()
    with prec.autocast():
        graphed = torch.cuda.make_graphed_callables(model, (example,))
    log.info(
        "model.cuda_graphs: forward+backward captured for a batch of %d in %.1fs (3 warm-up "
        "passes); every training step now replays them",
        len(example),
        time.perf_counter() - t0,
    )
    return graphed
