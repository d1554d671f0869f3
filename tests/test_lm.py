"""Language models: the Llama-style decoder (causal, RoPE, grouped-query attention), its FLOP
count, the text corpus and token files, the task's metrics, and training it through train.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixprec.core.errors import ConfigError
from mixprec.data import Context, text, tokens
from mixprec.data.sequences import unigram_nats
from mixprec.models import llama
from mixprec.run import session as run

from conftest import group

TINY = dict(num_classes=64, max_seq_len=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def tiny(**kw) -> llama.Llama:
    torch.manual_seed(0)
    return llama.Llama(**{**TINY, **kw}).eval()


def test_logits_at_a_position_do_not_depend_on_later_tokens():
    model = tiny()
    x = torch.randint(0, 64, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 32, 64)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_rope_makes_attention_scores_depend_on_relative_position_only():
    cos, sin = llama.rope_tables(8, 64, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> torch.Tensor:
        at = lambda v, p: llama.apply_rope(v.expand(1, 1, p + 1, 8), cos, sin)[0, 0, p]  # noqa: E731
        return at(q, i) @ at(k, j)

    torch.testing.assert_close(score(5, 2), score(40, 37))
    assert not torch.allclose(score(5, 2), score(5, 4))
    v = torch.randn(1, 1, 10, 8)  # a rotation: lengths are kept
    torch.testing.assert_close(llama.apply_rope(v, cos, sin).norm(dim=-1), v.norm(dim=-1))


def test_grouped_query_attention_equals_repeated_kv_heads():
    model = tiny()
    att = model.layers[0].attention
    x = torch.randn(2, 16, 32)
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        ours = att(x, cos, sin)
        b, t = 2, 16
        q = att.wq(x).view(b, t, 4, 8).transpose(1, 2)
        k = att.wk(x).view(b, t, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = att.wv(x).view(b, t, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        plain = att.wo(out.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(ours, plain)


def test_repeated_kv_heads_give_enable_gqas_values_and_gradients():
    """attend(expand=True) (what fp32 on a GPU takes, for the memory-efficient kernel) is
    enable_gqa's attention: the same outputs and the same gradients of q, k and v."""
    torch.manual_seed(0)
    leaves = [torch.randn(2, h, 16, 8, requires_grad=True) for h in (8, 2, 2)]
    outs, grads = [], []
    for expand in (False, True):
        q, k, v = (x.detach().clone().requires_grad_() for x in leaves)
        out = llama.attend(q, k, v, expand=expand)
        out.square().sum().backward()
        outs.append(out)
        grads.append((q.grad, k.grad, v.grad))
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert grads[1][1].shape == (2, 2, 16, 8)  # the gradient comes back to the 2 kv heads


def test_fused_projections_compute_the_unfused_decoder_with_its_weights_concatenated():
    """model.kwargs.fused=true: wqkv = [wq; wk; wv] and w13 = [w1; w3] give the same logits and
    the same gradients (split back), and the same FLOP count."""
    plain, fused = tiny(), tiny(fused=True)
    state = plain.state_dict()
    for i in range(len(plain.layers)):
        a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        state[a + "wqkv.weight"] = torch.cat(
            [state.pop(a + w + ".weight") for w in ("wq", "wk", "wv")]
        )
        state[f + "w13.weight"] = torch.cat([state.pop(f + w + ".weight") for w in ("w1", "w3")])
    fused.load_state_dict(state)
    x = torch.randint(0, 64, (2, 32))
    for m in (plain, fused):
        F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    torch.testing.assert_close(fused(x), plain(x))
    att_p, att_f = plain.layers[0].attention, fused.layers[0].attention
    grads = torch.cat([att_p.wq.weight.grad, att_p.wk.weight.grad, att_p.wv.weight.grad])
    torch.testing.assert_close(att_f.wqkv.weight.grad, grads)
    ff_p, ff_f = plain.layers[1].feed_forward, fused.layers[1].feed_forward
    torch.testing.assert_close(
        ff_f.w13.weight.grad, torch.cat([ff_p.w1.weight.grad, ff_p.w3.weight.grad])
    )
    assert fused.flops_per_token(32) == plain.flops_per_token(32)
    assert len(list(fused.parameters())) < len(list(plain.parameters()))


def test_the_stated_flop_count_is_6n_plus_attention():
    """flops_per_token = 6 N (what torch's counter counts for the matmuls of a real training
    step: it does not count the CPU's attention kernel) + 12 L d T for attention."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny().train()
    x = torch.randint(0, 64, (1, 32))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    per_token_attention = 12 * 2 * 32 * 32  # L=2, d=32, T=32
    assert model.flops_per_token(32) == counter.get_total_flops() // 32 + per_token_attention


def test_the_text_corpus_is_split_by_file_and_the_same_every_time():
    train, val, name = text.corpus(2.0, 0.2)
    again = text.corpus.__wrapped__(2.0, 0.2)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert 1.2e6 < len(train) + len(val) <= 2e6 and 0.05 < len(val) / (len(train) + len(val)) < 0.4
    assert "standard library" in name and "sha256" in name
    assert 2.5 < unigram_nats(val, 256) < 4.5  # Python source: ~3.3 nats per byte


def write_bin(root: Path, train: np.ndarray, val: np.ndarray) -> Path:
    root.mkdir(exist_ok=True)
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    return root


def test_token_files_are_read_as_nanogpt_writes_them(tmp_path):
    rng = np.random.default_rng(0)
    root = write_bin(
        tmp_path / "d",
        rng.integers(0, 1000, 5000, dtype=np.uint16),
        np.arange(700, dtype=np.uint16),
    )
    cfg = group("data", "tokens", root=str(root), vocab_size=1000, seq_len=16, val_sequences=4)
    data = tokens.build(cfg, Context(4, torch.device("cpu"), 0))
    x, y = next(iter(data.val))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[0], torch.arange(1, 17))
    assert (data.num_classes, data.input_shape, data.task.name) == (1000, (16,), "lm")
    with pytest.raises(ConfigError, match="token id 999, outside data.vocab_size=500"):
        tokens.read(group("data", "tokens", root=str(root), vocab_size=500), "train")
    with pytest.raises(ConfigError, match="val.bin not found"):
        (root / "val.bin").unlink()
        tokens.read(cfg, "val")


def test_a_validation_split_smaller_than_asked_is_evaluated_whole_and_the_log_says_so(
    tmp_path, caplog
):
    rng = np.random.default_rng(0)
    root = write_bin(
        tmp_path / "d",
        rng.integers(0, 1000, 5000, dtype=np.uint16),
        np.arange(700, dtype=np.uint16),
    )  # (700 - 1) // 16 = 43 windows

    def ask(n: int):
        return group("data", "tokens", root=str(root), vocab_size=1000, seq_len=16, val_sequences=n)

    def evaluated(data) -> int:
        return sum(len(x) for x, _ in data.val)

    with caplog.at_level("WARNING", logger="mixprec.data"):
        assert evaluated(tokens.build(ask(40), Context(8, torch.device("cpu"), 0))) == 40
        assert not caplog.records
        assert evaluated(tokens.build(ask(128), Context(8, torch.device("cpu"), 0))) == 43
    (record,) = caplog.records
    assert "data.val_sequences=128" in record.message and "has 43 windows" in record.message


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model=llama_tiny"], "a language model and this data is images"),
        (["data=text", "model=digits_cnn"], "an image model and this data is token sequences"),
        (["model=llama_tiny", "data=text", "+model.kwargs.n_head=3"], "unexpected keyword"),
        (["model=llama_tiny", "data=text", "data.seq_len=1"], "data.seq_len=1 is not allowed"),
        (["model=llama_tiny", "data=tokens"], "data.root=None is not allowed"),
    ],
)
def test_a_model_that_cannot_take_the_data_is_a_config_error(cfg_factory, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        run.run(cfg_factory(*overrides))


def test_a_timm_entry_point_that_says_it_takes_token_ids_is_a_language_model():
    """The timm adapter asks the entry point (fn.mixprec_task = "lm"), not a list of names: a
    user's own registered LM gets token data and is refused images, as mixprec_llama is."""
    from timm.models import register_model

    from mixprec.core import tasks
    from mixprec.models import llama, sources

    def _test_registered_lm(pretrained=False, **kw):  # a user's entry point
        return llama.Llama(**kw)

    _test_registered_lm.mixprec_task = "lm"
    register_model(_test_registered_lm)
    with pytest.raises(ConfigError, match="a language model and this data is images"):
        sources.check_fits("_test_registered_lm", tasks.CLASSIFY)
    with pytest.raises(ConfigError, match="an image model and this data is token sequences"):
        sources.check_fits("resnet18", tasks.LanguageModel())
    sources.check_fits("_test_registered_lm", tasks.LanguageModel())  # token data: it fits


LM = ["model=llama_tiny", "data=text", "data.max_mb=4", "trainer.log_every=10"]
SMALL = [*LM, "data.seq_len=64", "batch=16", "data.val_sequences=32"]


@pytest.mark.slow
def test_llama_tiny_learns_real_text_below_the_unigram_baseline(cfg_factory):
    # 60 steps of 16 sequences at lr 0.006 end 0.53 nats below the unigram (batch 32 at lr
    # 0.003: 0.47, in twice the time)
    cfg = cfg_factory(*LM, "batch=16", "trainer.max_steps=60", "optimizer.lr=0.006")
    s = run.run(cfg)
    train, val, _ = text.corpus(4.0, 0.05)
    assert s["task"] == "lm" and s["val_acc1"] is None
    assert s["val_loss"] < unigram_nats(val, 256) - 0.4
    assert s["val_bpb"] == pytest.approx(s["val_loss"] / math.log(2))
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 128)
    rows = [json.loads(r) for r in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert any("perf/tokens_per_s" in r for r in rows) and any("val/bpb" in r for r in rows)


@pytest.mark.slow
def test_amp_bf16_and_fp32_reach_the_same_loss(cfg_factory):
    """On the CPU (autocast to fp16 or bf16): after 15 steps every precision has learned (from
    ln 256 = 5.55 nats, a uniform guess over bytes, to below 4.5) and the val losses agree within
    0.05 nats (the same seed and data; the low-precision matmuls round differently). A small
    shape: this CPU multiplies bf16 and fp16 12x slower than fp32 (no units for them)."""
    losses = {}
    for p in ("fp32", "amp", "bf16"):
        cfg = cfg_factory(
            *LM,
            "data.seq_len=32",
            "batch=8",
            "data.val_sequences=16",
            f"precision={p}",
            "trainer.max_steps=15",
            "optimizer.lr=0.006",
        )
        losses[p] = run.run(cfg)["val_loss"]
    assert max(losses.values()) < 4.5, losses
    assert max(losses.values()) - min(losses.values()) < 0.05, losses


@pytest.mark.slow
def test_resume_is_bit_exact(cfg_factory, tmp_path):
    base = [
        *SMALL,
        "trainer.max_steps=12",
        "ckpt.every_steps=6",
        "ckpt.keep=3",
        "model.grad_checkpointing=true",
    ]
    ref = cfg_factory(*base, f"run_dir={tmp_path / 'ref'}")
    run.run(ref)
    half = tmp_path / "ref" / "checkpoints" / "step_00000006.pt"
    assert (
        run.run(cfg_factory(*base, f"resume={half}", f"run_dir={tmp_path / 'again'}"))["steps"]
        == 12
    )
    a = torch.load(tmp_path / "ref" / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "again" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_fp8_share_of_an_lm_is_its_owned_linears():
    """MFU's blended peak needs the float8 share: 6 in x out per token for each owned Linear,
    over the model's stated count (torch's counter cannot count grouped-query attention)."""
    from mixprec.core.tasks import LanguageModel
    from mixprec.models import flops

    model = tiny()
    owned = {f"layers.{i}.feed_forward.{w}" for i in range(2) for w in ("w1", "w2", "w3")}
    total, fp8 = flops.train_flops(
        model, (32,), 64, torch.device("cpu"), None, owned, LanguageModel()
    )
    assert total == 32 * model.flops_per_token(32)
    assert fp8 == 32 * 6 * 2 * 3 * 32 * 64  # 2 layers x 3 matrices of 32 x 64


@pytest.mark.slow
def test_a_sweeps_later_job_times_its_own_start_and_compile(cfg_factory):
    """In an in-process sweep, first_step_s and compile_s are the job's own, not the
    process's running totals. (The first job is the LM with its blocks compiled one by one.)"""
    one = [*SMALL, "model.kwargs.n_layers=1", "trainer.max_steps=2"]
    blocks = ["model.compile=true", "model.compile_scope=blocks"]
    first = run.run(cfg_factory(*one, *blocks))
    second = run.run(cfg_factory(*one))  # not compiled
    assert first["status"] == second["status"] == "completed"
    assert first["compile_s"] > 0 and second["compile_s"] == 0
    assert second["first_step_s"] < first["first_step_s"]
