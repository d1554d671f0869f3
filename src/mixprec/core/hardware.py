"""Hardware profiles: which device, cuDNN/loader defaults, peak TFLOP/s per dtype, memory.

The profiles are the options of conf/hardware/ (one card each); `auto` picks the one whose
`gpu_match` occurs in the CUDA device name (or `cpu` without a GPU) and falls back to the generic
`cuda` profile for unknown GPUs. Profiles are loaded through Hydra (run/build.py hands `resolve` the
loader), so a profile added on Hydra's search path is found like the shipped ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
from omegaconf import MISSING

from mixprec.core.errors import ConfigError, check, one_of

log = logging.getLogger(__name__)
GIB = 1024**3
PEAK_KEYS = (
    "fp32",
    "tf32",
    "fp16",
    "bf16",
    "fp8",
)  # the shipped precisions' (a plugin may add one)


@dataclass
class HardwareConfig:
    """conf/hardware/*.yaml (the GPU cards extend the generic `cuda` profile)"""

    name: str = MISSING  # the profile (auto, cpu, cuda, rtx3090, a100, h100, h200)
    device: str = MISSING  # auto, cpu or cuda
    gpu_match: Optional[str] = None  # substring of torch.cuda.get_device_name() this profile is for
    memory_gib: Optional[float] = None  # the card's memory; caps this process (emulates the card)
    peak_tflops: Dict[str, float] = field(default_factory=dict)  # dense peak per dtype, for MFU
    cudnn_benchmark: bool = MISSING  # let cuDNN time its conv algorithms (static shapes)
    num_workers: int = MISSING  # DataLoader worker processes for on-disk datasets
    pin_memory: bool = MISSING  # page-locked host batches for async host->device copies
    persistent_workers: bool = MISSING  # keep loader workers alive across epochs

    def __post_init__(self) -> None:
        one_of("hardware.device", self.device, ("auto", "cpu", "cuda"))
        check(
            self.memory_gib is None or self.memory_gib > 0,
            "hardware.memory_gib",
            self.memory_gib,
            "null or > 0",
        )
        bad = sorted(k for k, v in self.peak_tflops.items() if not (k.isidentifier() and v > 0))
        check(
            not bad,
            "hardware.peak_tflops",
            bad,
            "keyed by the peak keys precisions use "
            f"({', '.join(PEAK_KEYS)}, or a plugin's own), each > 0",
        )
        check(self.num_workers >= 0, "hardware.num_workers", self.num_workers, ">= 0")


Load = Callable[[str], HardwareConfig]  # profile name -> the profile (through Hydra)


@dataclass
class Profiles:
    """The hardware profiles Hydra knows: `names` and a loader for one of them."""

    names: list[str]
    load: Load

    def match(self, gpu_name: str) -> str | None:
        """The profile whose gpu_match occurs in gpu_name (longest match wins), else None."""
        best = None
        for name in self.names:
            match = self.load(name).gpu_match
            if (
                match
                and match.lower() in gpu_name.lower()
                and (best is None or len(match) > best[0])
            ):
                best = (len(match), name)
        return best[1] if best else None


def resolve(hw: HardwareConfig, profiles: Profiles) -> HardwareConfig:
    """Turn `auto` into a concrete profile, keeping what the user overrode (hardware.memory_gib=3
    with hardware=auto still caps memory); check that a CUDA profile has a GPU to run on."""
    if hw.device == "cuda" and not torch.cuda.is_available():
        asked = "hardware.device=cuda" if hw.name == "auto" else f"hardware={hw.name}"
        raise ConfigError(
            f"{asked} needs a CUDA GPU and none is visible; use hardware=auto or hardware=cpu"
        )
    if hw.name == "auto" or hw.device == "auto":
        base = profiles.load("auto")
        overrides = {
            f.name: getattr(hw, f.name)
            for f in dataclasses.fields(hw)
            if f.name not in ("name", "device", "gpu_match")
            and getattr(hw, f.name) != getattr(base, f.name)
        }
        chosen = profiles.load("cpu") if hw.device == "cpu" else _auto(profiles)
        return dataclasses.replace(chosen, **overrides)  # device=cpu: the CPU even with a GPU
    return _emulated(hw, profiles) if hw.device == "cuda" else hw


def _emulated(hw: HardwareConfig, profiles: Profiles) -> HardwareConfig:
    """A profile for another card (hardware=rtx3090 on an H200) emulates its memory, not its
    speed: MFU is measured against the peaks of the GPU that really runs (unless overridden)."""
    gpu = torch.cuda.get_device_name()
    if not hw.gpu_match or hw.gpu_match.lower() in gpu.lower():
        return hw
    if hw.peak_tflops != profiles.load(hw.name).peak_tflops:  # the user set them: keep them
        return hw
    real = profiles.match(gpu)
    peaks = profiles.load(real).peak_tflops if real else {}
    log.info(
        "hardware=%s on a %s: its memory is emulated; MFU uses the %s peaks",
        hw.name,
        gpu,
        real or "unknown (so MFU is null)",
    )
    return dataclasses.replace(hw, peak_tflops=peaks)


def _auto(profiles: Profiles) -> HardwareConfig:
    if not torch.cuda.is_available():
        return profiles.load("cpu")
    gpu = torch.cuda.get_device_name()
    name = profiles.match(gpu)
    if name is None:
        log.warning(
            "hardware=auto: no profile matches %r; using generic CUDA defaults "
            "(no peak TFLOP/s, so MFU is null)",
            gpu,
        )
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        return dataclasses.replace(profiles.load("cuda"), memory_gib=round(total, 1))
    return profiles.load(name)


CPUINFO = Path("/proc/cpuinfo")
# the CPU flags Linux gives for bfloat16 arithmetic in hardware: x86's AVX512-BF16 and AMX,
# Arm's BF16 (ARMv8.6); without one, torch computes bf16 through float32 conversions
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


# oneDNN's instruction-set caps below bfloat16 arithmetic (ONEDNN_MAX_CPU_ISA, its names)
NO_BF16_ISA = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
)


def cpu_native_bf16() -> bool | None:
    """Whether this CPU computes bfloat16 natively (None where Linux's cpuinfo is not there to
    tell, e.g. macOS). oneDNN capped below it (ONEDNN_MAX_CPU_ISA=AVX2: how an AVX2-only host
    is emulated) counts as without."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in NO_BF16_ISA:
        return False
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return any(f in flags for f in BF16_FLAGS) if flags else None


def setup(hw: HardwareConfig, local_rank: int = 0) -> torch.device:
    """The device to train on (the process settings are process.apply's)."""
    device = torch.device(hw.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def memory_limit(device: torch.device, memory_gib: float | None) -> int:
    """Bytes this process may allocate on the GPU: the card, or the emulated card's cap."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(min(total, memory_gib * GIB)) if memory_gib else total


def available_bytes(device: torch.device, memory_gib: float | None = None) -> int | None:
    """What this process can still allocate: the GPU's free memory (under the emulated card's
    cap), or the host's available memory (MemAvailable, within a cgroup's limit) on a CPU;
    None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(free, int(memory_gib * GIB)) if memory_gib else free
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a container's limit, where it is lower than the host's memory (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


@contextmanager
def cudnn_benchmark(enabled: bool):
    """cudnn.benchmark set for a block and restored after it, also on an error."""
    before, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def memory_stats(device: torch.device) -> dict[str, float]:
    """GPU allocator stats on CUDA; process resident memory (current and peak) on the CPU."""
    if device.type == "cuda":
        return {
            "mem/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem/peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        }
    rss = _rss_bytes() / GIB
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = peak_kib / (GIB if sys.platform == "darwin" else 1024**2)
    return {"mem/allocated_gib": rss, "mem/reserved_gib": rss, "mem/peak_gib": max(peak, rss)}


def memory_kind(device: torch.device) -> str:
    """What the mem/* numbers measure on this device."""
    return "CUDA allocator" if device.type == "cuda" else "process RSS"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: fall back to the peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class PhaseMemory:
    """Memory after forward, after backward and after the optimizer step, read once (on the first
    step) through hooks, so the training step itself carries no measuring code."""

    def __init__(self, model, optimizer, device: torch.device) -> None:
        self.device, self.result = device, {}
        read = lambda: (
            (
                torch.cuda.memory_allocated(device)
                if device.type == "cuda"  # noqa: E731
                else _rss_bytes()
            )
            / GIB
        )
        self._handles = [
            model.register_forward_hook(lambda *a: self._forward(read)),
            optimizer.register_step_pre_hook(
                lambda *a: self._record("mem/after_backward_gib", read)
            ),
            optimizer.register_step_post_hook(lambda *a: self._record("mem/after_step_gib", read)),
        ]

    def _record(self, key: str, read) -> None:
        self.result.setdefault(key, read())

    def _forward(self, read) -> None:
        if len(self.result) == 3:  # done: drop the hooks (not from inside the optimizer's own loop)
            for h in self._handles:
                h.remove()
        else:
            self._record("mem/after_forward_gib", read)
