"""The one place that changes process-wide state: TF32, cuDNN autotuning, the GPU memory cap,
dynamo's recompile limit and autograd's anomaly mode. Builders (precision, models, batch probes)
return values and never flip a global switch; build.py derives these Settings from the config
and applies them once, before anything is built, so a batch probe runs under the same switches as
training and a second run in the same process starts from its own settings."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from mixprec.core.errors import ConfigError
from mixprec.internals import torch_private

log = logging.getLogger("mixprec")
GIB = 1024**3


@dataclass(frozen=True)
class Settings:
    tf32: bool  # TF32 tensor cores for fp32 matmuls and convolutions (the precision's)
    cudnn_benchmark: bool  # cuDNN times its algorithms per new shape (the hardware profile's)
    memory_gib: float | None  # cap this process's GPU memory (emulate a smaller card)
    profile: str  # the hardware profile, for messages
    recompile_limit: int | None  # dynamo's recompile limit (compile_scope=blocks needs more)
    detect_anomaly: bool  # autograd anomaly mode (debug.detect_anomaly)
    cpu_fp16: bool = False  # float16 autocast on a CPU: oneDNN off for the run (below)
    deterministic: bool = False  # trainer.deterministic (set_deterministic)


class _EnumConstantNotice(logging.Filter):
    """torch 2.14 warns on every register_constant() of an Enum, which torchao 0.18 makes at
    import (and transformers imports torchao where it is installed): two lines on every run,
    none of them the user's to act on. Only that notice is dropped; the logger's other warnings
    stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


def quiet_known_noise() -> None:
    """Drop the notices of other libraries that no user can act on (once per process)."""
    pytree = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, _EnumConstantNotice) for f in pytree.filters):
        pytree.addFilter(_EnumConstantNotice())


def apply(s: Settings, device: torch.device) -> None:
    set_tf32(s.tf32)
    torch.autograd.set_detect_anomaly(s.detect_anomaly)
    set_deterministic(s.deterministic)
    if s.recompile_limit is not None:
        torch_private.raise_recompile_limit(s.recompile_limit)
    if device.type != "cuda":
        set_onednn(not s.cpu_fp16)
        return
    torch.backends.cudnn.benchmark = s.cudnn_benchmark and not s.deterministic
    torch.backends.cudnn.deterministic = s.deterministic
    log.info(
        "cudnn.benchmark=%s (%s)",
        s.cudnn_benchmark and not s.deterministic,
        "cuDNN times its algorithms for each new shape"
        if s.cudnn_benchmark
        else "cuDNN's heuristics",
    )
    if s.memory_gib is not None:
        cap_memory(s.memory_gib, s.profile, device)


CUBLAS_WORKSPACE = ":4096:8"  # what torch's reproducibility notes ask of cuBLAS (CUDA >= 10.2)


def set_deterministic(on: bool) -> None:
    """trainer.deterministic: torch's deterministic algorithms (an op with none warns, once,
    rather than stopping the run) and the fixed cuBLAS workspace they need, set before the
    run's first GPU matmul creates its handle. Off restores torch's default for the next run
    in this process."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        log.info(
            "trainer.deterministic=true: torch's deterministic algorithms, cuDNN's, "
            "CUBLAS_WORKSPACE_CONFIG=%s (slower; torch.compile's kernels and atomics in "
            "some ops may still differ between runs)",
            os.environ["CUBLAS_WORKSPACE_CONFIG"],
        )
    torch.use_deterministic_algorithms(on, warn_only=True)


def set_onednn(enabled: bool) -> None:
    """oneDNN (torch.backends.mkldnn) for this run's CPU kernels. Off for float16 autocast: on
    a CPU with AVX512-FP16, torch sends float16 convolutions to oneDNN, whose backward there
    is several times slower than torch's own kernels (benchmarks/RESULTS.md, "fp16 autocast on
    a CPU"); a CPU without AVX512-FP16 never sends them, so nothing changes there. bf16 and
    fp32 keep oneDNN, which is much faster for them."""
    if torch.backends.mkldnn.enabled and not enabled:
        log.info(
            "float16 autocast on a CPU: oneDNN is off for this run (its float16 convolution "
            "backward is slower than torch's own kernels; benchmarks/RESULTS.md)"
        )
    torch.backends.mkldnn.enabled = enabled


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions; explicit both ways (cuDNN defaults to on)."""
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: the new API only
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.rnn.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool:
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return torch.backends.cuda.matmul.allow_tf32


def cap_memory(memory_gib: float, profile: str, device: torch.device) -> None:
    """Emulate a smaller card: this process may use at most memory_gib of the GPU."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    if memory_gib > total * 1.02:  # datasheet GB vs GiB rounding
        raise ConfigError(
            f"hardware={profile} wants {memory_gib:g} GiB but this GPU "
            f"({torch.cuda.get_device_name(device)}) has {total:.1f} GiB; "
            "lower hardware.memory_gib or pick a smaller profile"
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, memory_gib / total), device)
