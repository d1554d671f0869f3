"""The Triton kernels of mixprec::max_pool2d (ops.py): a block of output (forward) or input
(backward) pixels times a block of channels of a channels-last tensor, the window offset of the
maximum saved as int8. `triton` is None on a torch without Triton (the aten path only)."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the aten path only
    triton = None


# The Triton kernels keep their dense, hand-aligned layout.
# fmt: off
# ----- the kernels: a block of pixels (rows) times a block of channels (columns), NHWC -----
if triton is None:  # no kernels; ops.py takes the aten path
    _forward_kernel = _backward_kernel = None
else:
    _CONFIGS = [triton.Config({"BLOCK_P": bp}, num_warps=w) for bp, w in
                ((16, 4), (32, 4), (64, 8), (128, 8))]

    @triton.autotune(configs=_CONFIGS, key=["C", "H", "W"])
    @triton.jit
    def _forward_kernel(x_ptr, out_ptr, off_ptr, NPIX, H, W, OH, OW, C, K: tl.constexpr,
                        S: tl.constexpr, PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels n*OH*OW + ...
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        pmask, cmask = p < NPIX, c < C
        ow, oh, n = p % OW, (p // OW) % OH, p // (OW * OH)
        best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
        arg = tl.zeros([BLOCK_P, BLOCK_C], tl.int32)
        seen = tl.zeros([BLOCK_P, BLOCK_C], tl.int32)
        for kh in tl.static_range(K):
            ih = oh * S - PAD + kh
            for kw in tl.static_range(K):
                iw = ow * S - PAD + kw
                ok = (pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))[:, None] & cmask[None, :]
                row = ((n * H + ih) * W + iw).to(tl.int64) * C
                v = tl.load(x_ptr + row[:, None] + c[None, :], mask=ok).to(tl.float32)
                take = ok & ((v > best) | (v != v) | (seen == 0))  # aten: first max, NaN wins
                best = tl.where(take, v, best)
                arg = tl.where(take, kh * K + kw, arg)
                seen = tl.where(ok, 1, seen)
        at = p.to(tl.int64)[:, None] * C + c[None, :]
        mask = pmask[:, None] & cmask[None, :]
        tl.store(out_ptr + at, best.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(off_ptr + at, arg.to(tl.int8), mask=mask)

    @triton.autotune(configs=_CONFIGS, key=["C", "H", "W"])
    @triton.jit
    def _backward_kernel(g_ptr, off_ptr, dx_ptr, NPIX, H, W, OH, OW, C, K: tl.constexpr,
                         S: tl.constexpr, PAD: tl.constexpr, SPAN: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """SPAN = ceil(K / S): the windows along one axis that can hold a pixel."""
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # input pixels n*H*W + ...
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        pmask, cmask = p < NPIX, c < C
        w, h, n = p % W, (p // W) % H, p // (W * H)
        acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        for i in tl.static_range(SPAN):
            oh = (h + PAD) // S - (SPAN - 1 - i)  # ascending, as aten sums them
            kh = h + PAD - oh * S
            okh = (oh >= 0) & (oh < OH) & (kh < K)
            for j in tl.static_range(SPAN):
                ow = (w + PAD) // S - (SPAN - 1 - j)
                kw = w + PAD - ow * S
                ok = pmask & okh & (ow >= 0) & (ow < OW) & (kw < K)
                at = ((n * OH + oh) * OW + ow).to(tl.int64)[:, None] * C + c[None, :]
                mask = ok[:, None] & cmask[None, :]
                hit = mask & (tl.load(off_ptr + at, mask=mask, other=-1) == (kh * K + kw)[:, None])
                acc += tl.load(g_ptr + at, mask=hit, other=0.0).to(tl.float32)
        out = p.to(tl.int64)[:, None] * C + c[None, :]
        tl.store(dx_ptr + out, acc.to(dx_ptr.dtype.element_ty),
                 mask=pmask[:, None] & cmask[None, :])
# fmt: on


def _launch(kernel, npix: int, channels: int, *args) -> None:
    block_c = min(64, triton.next_power_of_2(channels))
    grid = lambda meta: (triton.cdiv(npix, meta["BLOCK_P"]), triton.cdiv(channels, block_c))  # noqa: E731
    if os.environ.get("TRITON_INTERPRET") == "1":  # the tests' CPU interpreter: no autotuning
        kernel.fn[(triton.cdiv(npix, 16), triton.cdiv(channels, block_c))](
            *args, BLOCK_P=16, BLOCK_C=block_c
        )
    else:
        kernel[grid](*args, BLOCK_C=block_c)
