"""A Llama-style decoder, written as torchtitan and nanoGPT write theirs: RMSNorm before
attention and feed-forward, rotary position embeddings, grouped-query attention through
F.scaled_dot_product_attention (causal), a SwiGLU feed-forward, untied input embedding and
output head. Every projection is an nn.Linear, so a precision's conversion (torchao float8)
reaches them; the blocks are one ModuleList of one class, so compile_scope=blocks compiles one
block and model.grad_checkpointing recomputes each block's activations in the backward.

`model=llama_tiny` (CPU) ... `model=llama_8b_slice` (d_model 4096, FFN 14336, 32 heads / 8 KV
heads: Llama-3-8B's layer, a few of them): conf/model/llama_*.yaml. The vocabulary and the
sequence length come from the data (`data=text`: bytes, 256)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models import register_model
from torch import nn
from torch.utils.checkpoint import checkpoint


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, (seq_len, head_dim / 2), in fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of x (batch, heads, seq, head_dim) by its position's angle,
    in fp32, back in x's dtype."""
    t = x.shape[-2]
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:t], sin[:t]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention. `fused`: q, k and v from one Linear (wqkv), one GEMM of their
    widths together instead of three (k's and v's are a quarter of q's on Llama-3-8B)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, fused: bool = False) -> None:
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"dim={dim} must divide by n_heads={n_heads}, "
                f"and n_heads by n_kv_heads={n_kv_heads}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        q, kv = n_heads * self.head_dim, n_kv_heads * self.head_dim
        self.widths = (q, kv, kv)
        if fused:
            self.wqkv = nn.Linear(dim, q + 2 * kv, bias=False)
        else:
            self.wq = nn.Linear(dim, q, bias=False)
            self.wk = nn.Linear(dim, kv, bias=False)
            self.wv = nn.Linear(dim, kv, bias=False)
        self.wo = nn.Linear(q, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, expand=q.is_cuda and q.dtype == torch.float32)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool) -> torch.Tensor:
    """Causal attention with fewer key/value heads than query heads (GQA). `expand`: repeat
    the key/value heads instead of SDPA's enable_gqa. On a GPU in fp32 (precision=fp32, tf32)
    enable_gqa leaves SDPA only its math kernel (flash takes no fp32, memory-efficient no GQA),
    which keeps the T x T attention matrix of every head for the backward: on Llama-3-8B's
    layers at 4,096 tokens, 3.9x bf16's activations instead of 2x (docs/memory.md). Repeated
    heads go to the memory-efficient kernel. bf16 and fp16 keep enable_gqa (flash)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and expand:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    gqa = k.shape[1] != q.shape[1]  # (repeated heads: equal, and no enable_gqa to refuse)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). `fused`: w1 and w3 as one Linear (w13), one GEMM."""

    def __init__(self, dim: int, hidden: int, fused: bool = False) -> None:
        super().__init__()
        if fused:
            self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim, norm_eps, fused=False) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads, fused)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim, ffn_dim, fused)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class Shape:
    """A decoder's size (conf/model/llama_*.yaml: model.kwargs)."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    fused: bool = False  # q, k, v as one Linear, and SwiGLU's w1, w3 as one: fewer, wider GEMMs


class Llama(nn.Module):
    """(batch, seq) token ids -> (batch, seq, vocab) logits."""

    pretrained_cfg = {"classifier": "output"}  # timm's name for the head
    mixprec_head = "output"  # fp8 keeps it in bf16 (models/parts.py)
    mixprec_blocks = "layers.*"  # compile_scope=blocks, checkpointing, FSDP2's units

    def __init__(self, num_classes: int = 256, max_seq_len: int = 256, **shape) -> None:
        """num_classes: the vocabulary (timm's name; the data's size); shape: Shape's fields
        (an unknown one is a TypeError)."""
        super().__init__()
        sh = Shape(**shape)
        self.vocab, self.max_seq_len, self.dim = num_classes, max_seq_len, sh.dim
        self.tok_embeddings = nn.Embedding(num_classes, sh.dim)
        self.layers = nn.ModuleList(
            Block(sh.dim, sh.n_heads, sh.n_kv_heads, sh.ffn_dim, sh.norm_eps, sh.fused)
            for _ in range(sh.n_layers)
        )
        self.norm = nn.RMSNorm(sh.dim, eps=sh.norm_eps)
        self.output = nn.Linear(sh.dim, num_classes, bias=False)
        cos, sin = rope_tables(sh.dim // sh.n_heads, max_seq_len, sh.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.grad_checkpointing = False
        self._init(sh.init_std, sh.n_layers)

    def _init(self, std: float, n_layers: int) -> None:
        """GPT-2's: normal(0, std) weights, the projections into the residual stream scaled by
        1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = (2 * n_layers) ** -0.5 if name.endswith(("wo.weight", "w2.weight")) else 1
                nn.init.normal_(p, std=std * scale)

    def set_grad_checkpointing(self, enable: bool = True) -> None:  # timm's interface
        self.grad_checkpointing = enable

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"a sequence of {tokens.shape[1]} > max_seq_len {self.max_seq_len}")
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, stated: 6 N for the N weights of the matmuls (the
        embedding is a lookup, the output head is a matmul) and 12 L d T for attention's scores
        and weighted values (forward 4 L d T, backward twice that; the full T x T square, as
        PaLM and nanoGPT count it, though causal attention computes about half)."""
        n = sum(p.numel() for n_, p in self.named_parameters() if p.dim() == 2)
        n -= self.tok_embeddings.weight.numel()
        return 6 * n + 12 * len(self.layers) * self.dim * seq_len


@register_model
def mixprec_llama(
    pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kw
) -> Llama:
    """timm's entry point (timm.create_model passes its own arguments; the rest are Llama's, so
    an unknown `+model.kwargs.x` is a TypeError: a config error)."""
    return Llama(**kw)


mixprec_llama.mixprec_task = "lm"  # it takes token ids: the timm adapter gives it token data
