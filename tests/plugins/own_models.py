"""Models defined outside mixprec, as a user writes them (tests/test_own_model.py trains them
through train.py with `model.target=own_models:TinyConvNet` and tests/plugins on PYTHONPATH).
Each declares its head and its repeated blocks (docs/own-model.md); nothing else is asked."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class TinyConvNet(nn.Module):
    """(B, C, H, W) images -> (B, classes): a stem, `depth` identical blocks, a linear head."""

    mixprec_head = "head"
    mixprec_blocks = "blocks.*"

    def __init__(self, num_classes: int, in_chans: int, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_chans, width, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(width) for _ in range(depth))
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(F.adaptive_avg_pool2d(x, 2))


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """(B, T) token ids -> (B, T, vocab) logits."""

    mixprec_head = "lm_head"
    mixprec_blocks = "layers.*"

    def __init__(self, vocab_size: int, max_seq_len: int, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_seq_len, dim))
        self.layers = nn.ModuleList(Block(dim, heads=2) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def plain_mlp(num_classes: int, input_shape: tuple, hidden: int = 32) -> nn.Module:
    """A builder function rather than a class, declaring nothing."""
    n = 1
    for s in input_shape:
        n *= s
    return nn.Sequential(
        nn.Flatten(), nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def not_a_module(num_classes: int):
    return {"classes": num_classes}


class FixedChannels(TinyConvNet):
    """Takes 3-channel images whatever the data is."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes, in_chans=3)


class FiveWay(TinyConvNet):
    """Returns five logits whatever the data's classes."""

    def __init__(self, in_chans: int) -> None:
        super().__init__(5, in_chans)


class MaskedLM(TinyLM):
    """TinyLM whose attention adds a registered causal mask (-inf above the diagonal), as many
    GPT implementations do: a float buffer that is non-finite by design."""

    def __init__(self, vocab_size: int, max_seq_len: int, dim: int = 32, depth: int = 1) -> None:
        super().__init__(vocab_size, max_seq_len, dim, depth)
        mask = torch.full((max_seq_len, max_seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        for layer in self.layers:
            b, _, d = x.shape
            qkv = layer.qkv(layer.norm1(x)).view(b, t, 3, layer.heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
            x = x + layer.proj(att.transpose(1, 2).reshape(b, t, d))
            x = x + layer.mlp(layer.norm2(x))
        return self.lm_head(self.norm(x))


class CrashingLM(TinyLM):
    """TinyLM that raises at its third training forward when built under seed 1: a bug in
    one job of a sweep (the others, the study and the report must still come)."""

    def __init__(self, vocab_size: int, max_seq_len: int) -> None:
        super().__init__(vocab_size, max_seq_len, dim=16, depth=1)
        self.crash, self.calls = torch.initial_seed() == 1, 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.crash and self.calls == 3:
            raise RuntimeError("a bug in the user's model")
        return super().forward(tokens)


def gpt2_output(vocab_size: int, max_seq_len: int) -> nn.Module:
    """transformers' GPT-2 as it is: its forward returns CausalLMOutputWithCrossAttentions (the
    logits are its .logits), through model.target rather than model=hf."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=max_seq_len, n_embd=32, n_layer=1, n_head=2
    )
    config.bos_token_id = config.eos_token_id = vocab_size - 1  # the data's vocabulary
    return GPT2LMHeadModel(config)


class DictLogits(TinyConvNet):
    """A model that returns a dict of its outputs, the logits among them."""

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": super().forward(x), "features": x.mean()}


def half_frozen(num_classes: int, input_shape: tuple) -> nn.Module:
    """plain_mlp with its first Linear frozen (a fine-tune of the head alone)."""
    model = plain_mlp(num_classes, input_shape)
    model[1].requires_grad_(False)
    return model


class AuxLossNet(nn.Module):
    """A model that computes its own loss when given labels, as research code often does: the
    cross-entropy plus a fixed auxiliary term (10.0, no gradient), returned as a dict with the
    logits; without labels, the logits alone. `with_loss=False`: it never returns a loss."""

    def __init__(self, num_classes: int, input_shape: tuple, with_loss: bool = True) -> None:
        super().__init__()
        self.net = plain_mlp(num_classes, input_shape)
        self.with_loss = with_loss

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(x)
        if labels is None or not self.with_loss:
            return logits if labels is None else {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits.float(), labels) + 10.0}


class KeywordNet(nn.Module):
    """Sequence classification from keyword arguments, as a Hugging Face-style forward takes
    them: token ids and the attention mask, both required (mean of the unmasked tokens'
    embeddings, then a linear layer)."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)


class TinyTagger(nn.Module):
    """Token classification: a label per token from the token and its neighbours."""

    mixprec_head = "head"

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Conv1d(dim, dim, 3, padding=1)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + torch.relu(self.mix(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h)
