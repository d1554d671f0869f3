"""Max-pooling with our own Triton kernels, as one custom op that torch.compile leaves alone.

Why: in experiment=fast's profile (benchmarks/RESULTS.md) the backward of ResNet's stem max-pool
(3x3, stride 2, on a channels-last 64x112x112 fp16 activation) is one inductor kernel of 3.1 ms
per step at batch 512 on an H200, where its bytes need about 0.25 ms. That kernel evaluates a
long window-index expression for every channel of every pixel; these kernels work on a block
of pixels times a block of channels, so the index arithmetic is done once per pixel and every
load and store is a contiguous run of channels. Measured alone (benchmarks/maxpool_backward.py):
backward 0.66 ms against inductor's 2.88 and aten's 3.75; forward 0.71, as inductor's.

`model.triton_max_pool=true` makes every nn.MaxPool2d a TritonMaxPool2d. The op saves the
argmax as an int8 offset inside the window (as inductor does), not aten's int64 index, so
windows of more than 127 elements keep nn.MaxPool2d. Channels-last CUDA inputs with square
windows and no dilation run the Triton kernels; everything else (CPU, NCHW, dilation) runs
aten's kernels and converts the indices, so results are the same everywhere: NaN propagates
and ties go to the first maximum, as in aten.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mixprec.models.triton_pool import _backward_kernel, _forward_kernel, _launch, triton  # noqa: F401


def _pooled(x: torch.Tensor, k, s, p, d, ceil) -> torch.Tensor:
    """An empty output for pooling x, shaped by aten's own shape rule (its meta kernel), in x's
    memory format."""
    meta = torch.ops.aten.max_pool2d_with_indices(x.to("meta"), k, s, p, d, ceil)[0]
    return _out_like(meta.shape, x, x.dtype)


def _format(t: torch.Tensor) -> torch.memory_format:
    """The op's outputs take its input's memory format: channels-last or contiguous."""
    return torch.channels_last if _is_nhwc(t) else torch.contiguous_format


def _out_like(shape, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of `shape` in ref's memory format (allocated so: no copy)."""
    return torch.empty(shape, dtype=dtype, device=ref.device, memory_format=_format(ref))


def _is_nhwc(t: torch.Tensor) -> bool:
    return (
        t.dim() == 4
        and t.size(1) > 1
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    )


def _use_triton(t: torch.Tensor, kernel_size, stride, padding, dilation) -> bool:
    """The kernels take channels-last tensors and square windows without dilation."""
    square = all(v[0] == v[1] for v in (kernel_size, stride, padding))
    return (
        triton is not None
        and _is_nhwc(t)
        and square
        and list(dilation) == [1, 1]
        and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    )


# ----- the aten path, converting between aten's flat input index and the window offset -----
def _corners(n_out: int, s: int, p: int, device) -> torch.Tensor:
    return torch.arange(n_out, device=device) * s - p


def _aten_forward(x, k, s, p, d, ceil):
    out, index = torch.ops.aten.max_pool2d_with_indices(x, k, s, p, d, ceil)
    out, index = (t.contiguous(memory_format=_format(x)) for t in (out, index))
    oh, ow = out.shape[-2:]
    ih, iw = index // x.size(-1), index % x.size(-1)
    kh = (ih - _corners(oh, s[0], p[0], x.device)[:, None]) // d[0]
    kw = (iw - _corners(ow, s[1], p[1], x.device)[None, :]) // d[1]
    return out, (kh * k[1] + kw).to(torch.int8)


def _aten_backward(grad, offsets, x_size, k, s, p, d, ceil):
    oh, ow = grad.shape[-2:]
    off = offsets.long()
    ih = _corners(oh, s[0], p[0], grad.device)[:, None] + off // k[1] * d[0]
    iw = _corners(ow, s[1], p[1], grad.device)[None, :] + off % k[1] * d[1]
    like = _out_like(x_size, offsets, grad.dtype)  # aten reads only its shape and layout
    return torch.ops.aten.max_pool2d_with_indices_backward(
        grad, like, k, s, p, d, ceil, ih * x_size[-1] + iw
    ).contiguous(memory_format=_format(offsets))


# ----- the custom ops -----
@torch.library.custom_op("mixprec::max_pool2d", mutates_args=())
def max_pool2d(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled output and, per output element, its argmax's offset in the window (int8)."""
    if not _use_triton(x, kernel_size, stride, padding, dilation):
        return _aten_forward(x, kernel_size, stride, padding, dilation, ceil_mode)
    out = _pooled(x, kernel_size, stride, padding, dilation, ceil_mode)
    offsets = torch.empty_like(out, dtype=torch.int8)
    n, c, h, w = x.shape
    oh, ow = out.shape[-2:]
    _launch(
        _forward_kernel,
        n * oh * ow,
        c,
        x,
        out,
        offsets,
        n * oh * ow,
        h,
        w,
        oh,
        ow,
        c,
        kernel_size[0],
        stride[0],
        padding[0],
    )
    return out, offsets


@max_pool2d.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    out = _pooled(x, kernel_size, stride, padding, dilation, ceil_mode)
    return out, torch.empty_like(out, dtype=torch.int8)


@torch.library.custom_op("mixprec::max_pool2d_backward", mutates_args=())
def max_pool2d_backward(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    x_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> torch.Tensor:
    """The input's gradient (in the layout of the forward's input, which the offsets keep):
    each output's gradient goes to its argmax."""
    if not _use_triton(offsets, kernel_size, stride, padding, dilation):
        return _aten_backward(
            grad, offsets, x_size, kernel_size, stride, padding, dilation, ceil_mode
        )
    grad = grad.contiguous(memory_format=torch.channels_last)  # usually already
    n, c, h, w = x_size
    dx = _out_like(x_size, offsets, grad.dtype)
    _launch(
        _backward_kernel,
        n * h * w,
        c,
        grad,
        offsets,
        dx,
        n * h * w,
        h,
        w,
        grad.size(2),
        grad.size(3),
        c,
        kernel_size[0],
        stride[0],
        padding[0],
        -(-kernel_size[0] // stride[0]),
    )
    return dx


@max_pool2d_backward.register_fake
def _(grad, offsets, x_size, kernel_size, stride, padding, dilation, ceil_mode):
    return _out_like(x_size, offsets, grad.dtype)


def _setup_context(ctx, inputs, output):
    x, *ctx.pool_args = inputs
    ctx.x_size = list(x.shape)
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the offsets


def _backward(ctx, grad, _grad_offsets):
    if grad is None:  # the output was not used in the loss
        return None, None, None, None, None, None
    (offsets,) = ctx.saved_tensors
    return (
        max_pool2d_backward(grad, offsets, ctx.x_size, *ctx.pool_args),
        None,
        None,
        None,
        None,
        None,
    )


max_pool2d.register_autograd(_backward, setup_context=_setup_context)


def _pair(v) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


class TritonMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (same arguments, same state) through mixprec::max_pool2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stride = self.stride if self.stride is not None else self.kernel_size
        return max_pool2d(
            x,
            _pair(self.kernel_size),
            _pair(stride),
            _pair(self.padding),
            _pair(self.dilation),
            self.ceil_mode,
        )[0]


def use_triton_max_pool(model: nn.Module) -> int:
    """Makes every nn.MaxPool2d of `model` (that returns no indices, with a window of at most 127
    elements: the int8 offsets) a TritonMaxPool2d, in place; returns how many it changed."""
    pools = [
        m
        for m in model.modules()  # the exact class: not a subclass with its own forward
        if type(m) is nn.MaxPool2d
        and not m.return_indices  # noqa: E721
        and _pair(m.kernel_size)[0] * _pair(m.kernel_size)[1] <= 127
    ]
    for m in pools:
        m.__class__ = TritonMaxPool2d
    return len(pools)
