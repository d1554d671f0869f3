"""batch=auto's search (with a simulated memory limit), its cache, the effective-batch arithmetic,
and activation checkpointing."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from torch import nn

from mixprec import models
from mixprec.core.errors import ConfigError
from mixprec.run import session as run
from mixprec.training import batch_size
from mixprec.training.batch_size import search, split_effective, with_margin

from conftest import group


def SearchSettings(**keys):
    """batch_search.* as conf/train.yaml sets them, with `keys` overridden."""
    return group("batch_search", **keys)


def fake_memory(limit: int, calls: list):
    """A probe that runs out of memory above `limit` samples, like a real GPU would."""

    def probe(b: int) -> None:
        calls.append(b)
        if b > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} MiB")

    return probe


@pytest.mark.parametrize("limit", [1, 7, 16, 100, 288, 560, 1000, 4097])
def test_search_lands_within_the_resolution_below_the_limit(limit):
    calls: list[int] = []
    found, probes = search(
        fake_memory(limit, calls), SearchSettings(start=16, resolution=8), free=lambda: None
    )
    assert limit - 8 <= found <= limit
    assert [p["batch"] for p in probes] == calls
    assert all(p["fits"] == (p["batch"] <= limit) for p in probes)
    assert len(calls) <= 30


def test_search_grows_by_half_then_bisects():
    calls: list[int] = []
    search(
        fake_memory(560, calls),
        SearchSettings(start=16, growth=1.5, resolution=8),
        free=lambda: None,
    )
    assert calls[:10] == [16, 24, 36, 54, 81, 121, 181, 271, 406, 609]  # the seeds' +50 %
    assert calls[10] == (406 + 609) // 2  # then bisection inside [406, 609)


def fake_gpu(fixed: float, per_sample: float, limit: float, calls: list, curve: float = 0.0):
    """A probe on a simulated GPU: peak memory fixed + per_sample * b (+ curve * b^2, so that a
    straight-line prediction overshoots); out of memory when the peak passes `limit`."""

    def probe(b: int) -> int:
        calls.append(b)
        peak = fixed + per_sample * b + curve * b * b
        if peak > limit:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return int(peak)

    return probe


@pytest.mark.parametrize("bend", [0.0, 0.15, -0.15])
@pytest.mark.parametrize("true_max", [100, 288, 560, 3000])
def test_guided_search_is_exact_and_needs_few_probes(true_max, bend):
    """Peak memory predicts the largest batch: the search jumps there instead of growing x1.5
    a dozen times, and still lands within the resolution when memory is not quite linear
    (`bend`: the quadratic term's share at the true maximum)."""
    fixed, per_sample = 3e9, 70e6
    curve = bend * per_sample / true_max
    limit = fixed + per_sample * true_max + curve * true_max**2
    guided: list[int] = []
    found, probes = search(
        fake_gpu(fixed, per_sample, limit, guided, curve),
        SearchSettings(start=16, resolution=8),
        free=lambda: None,
        limit=limit,
    )
    assert true_max - 8 <= found <= true_max
    assert all(p["fits"] == (p["batch"] <= true_max) for p in probes)
    assert all(p["peak_gib"] for p in probes if p["fits"])
    plain: list[int] = []
    assert (
        true_max - 8
        <= search(
            fake_gpu(fixed, per_sample, limit, plain, curve),
            SearchSettings(start=16, resolution=8),
            free=lambda: None,
        )[0]
    )
    assert len(guided) < 0.75 * len(plain)
    assert true_max > 600 or len(guided) <= 9


def test_search_propagates_errors_that_are_not_oom():
    def probe(b):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        search(probe, SearchSettings())


def test_search_agrees_across_ranks():
    """If any rank runs out of memory, every rank must treat the batch as not fitting."""
    other_rank_limit = 100
    seen: list[int] = []

    def probe(b):
        seen.append(b)
        if b > 300:
            raise torch.OutOfMemoryError("oom")

    def agree(ok: int) -> int:  # min over ranks: the other rank fits only up to 100
        return min(ok, int(seen[-1] <= other_rank_limit))

    found, _ = search(probe, SearchSettings(), agree=agree, free=lambda: None)
    assert 92 <= found <= 100


def test_margin_and_tensor_core_rounding():
    assert with_margin(560, 0.05) == 528  # 532 rounded down to a multiple of 8
    assert with_margin(288, 0.0) == 288
    assert with_margin(5, 0.05) == 4


def test_cache_hit_skips_the_search(tmp_path):
    cache = tmp_path / "cache.json"
    key = {"model": "resnet50", "gpu": "H200"}
    calls = []
    compute = lambda: (calls.append(1) or 296, [{"batch": 296, "fits": True}])  # noqa: E731
    assert batch_size.cached(key, cache, compute) == (296, False)
    assert batch_size.cached(key, cache, compute) == (296, True)
    assert batch_size.cached({**key, "gpu": "A100"}, cache, compute) == (296, False)
    assert len(calls) == 2
    cache.write_text("{not json")
    assert batch_size.cached(key, cache, compute) == (296, False)  # unreadable cache: search again
    assert json.loads(cache.read_text())  # and rewritten
    for junk in (b"\xff\xfe binary", b'{"k": "not a table entry"}'):
        cache.write_bytes(junk)
        assert batch_size.cached(key, cache, compute) == (296, False)


def test_an_unwritable_cache_costs_the_cache_not_the_run(tmp_path, caplog):
    """batch=auto's answer is used even where ~/.cache cannot be written (a read-only home)."""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's folder should be")
    calls = []
    compute = lambda: (calls.append(1) or 296, [])  # noqa: E731
    assert batch_size.cached({"k": 1}, blocked / "sub" / "c.json", compute) == (296, False)
    assert "could not write the cache" in caplog.text and calls == [1]


@pytest.mark.parametrize(
    "target,max_micro,world,micro,accum",
    [
        (768, 300, 1, 256, 3),
        (1000, 300, 1, 250, 4),
        (64, 16, 2, 16, 2),
        (256, 512, 1, 256, 1),
        (3072, 528, 1, 512, 6),
    ],
)
def test_effective_batch_split_is_exact(target, max_micro, world, micro, accum):
    assert split_effective(target, max_micro, world) == (micro, accum, None)


def test_effective_batch_that_cannot_be_split_says_so():
    micro, accum, note = split_effective(97, 40, 2)
    assert note and "97" in note and micro <= 40
    assert abs(micro * accum * 2 - 97) <= 2 * accum


@pytest.mark.slow
def test_effective_batch_with_an_int_batch_derives_accum(cfg_factory):
    cfg = cfg_factory("batch=32", "effective_batch=128", "trainer.max_steps=2")
    run.run(cfg)
    s = json.loads(open(f"{cfg.run_dir}/summary.json").read())
    assert (s["batch"], s["accum"], s["effective_batch"]) == (32, 4, 128)
    with pytest.raises(ConfigError, match="effective_batch=100 is not a multiple of batch=32"):
        run.run(cfg_factory("batch=32", "effective_batch=100", "trainer.max_steps=2"))


def test_batch_auto_needs_a_gpu(cfg_factory):
    with pytest.raises(ConfigError, match="batch=auto .* CUDA"):
        run.run(cfg_factory("batch=auto"))


def _grads(model, x, y):
    torch.manual_seed(1)  # the same dropout masks for both models
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["mixprec_digits_cnn", "resnet18"])
def test_grad_checkpointing_keeps_the_gradients(name):
    torch.manual_seed(0)
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    plain = timm.create_model(name, num_classes=10, in_chans=1)
    plain(x)
    ckpt = timm.create_model(name, num_classes=10, in_chans=1)
    ckpt(x)
    ckpt.load_state_dict(plain.state_dict())
    ckpt = models.enable_grad_checkpointing(ckpt, name)
    plain.train(), ckpt.train()  # checkpointing acts in training mode
    forwards = {id(plain): 0, id(ckpt): 0}
    for m in (plain, ckpt):  # the last conv: inside a checkpointed block, it runs again in backward
        last = [c for c in m.modules() if isinstance(c, nn.Conv2d)][-1]
        last.register_forward_hook(
            lambda mod, a, out, key=id(m): forwards.update({key: forwards[key] + 1})
        )
    for a, b in zip(_grads(plain, x, y), _grads(ckpt, x, y)):
        torch.testing.assert_close(a, b)
    assert (forwards[id(plain)], forwards[id(ckpt)]) == (1, 2)  # activations were recomputed


def test_grad_checkpointing_fallback_and_error():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = models.enable_grad_checkpointing(seq, "seq")
    x = torch.randn(3, 4, requires_grad=True)
    wrapped.train()
    wrapped(x).sum().backward()
    assert x.grad is not None

    class Odd(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="model.grad_checkpointing=true: odd does not support"):
        models.enable_grad_checkpointing(Odd(), "odd")


def test_batch_auto_larger_than_the_data_becomes_the_datas_samples(tmp_path):
    """A user's small model on a small dataset: memory takes 62,256 per micro-batch (seen on an
    H200), the data holds fewer samples per process; the batch becomes them (a multiple of 8) and
    the data is loaded again at it. Not for a batch the user gave."""
    from mixprec.data import Context, Workers
    from mixprec.data import build as load_data
    from mixprec.run.build import fit_auto_batch_to_data
    from mixprec.run.config import validate
    from mixprec.run.layout import Layout

    from conftest import compose_cfg

    data_cfg = validate(compose_cfg(["data=digits", "hardware=cpu"])).data
    ctx = lambda b: Context(b, torch.device("cpu"), 0, False, 0, 1, Workers(0, False, False))  # noqa: E731
    loads = []

    def load(batch):
        loads.append(batch)
        return load_data(data_cfg, ctx(batch))

    layout = Layout(62256, 1, 1)
    layout.max_batch = 64000
    data = fit_auto_batch_to_data(layout, load(62256), load)
    samples = data.train.samples
    assert 0 < samples < 62256 and layout.batch == samples - samples % 8
    assert loads == [62256, layout.batch] and len(data.train) == 1
    given = Layout(62256, 1, 1)  # batch=62256 typed: left to plan() to refuse, naming it
    assert fit_auto_batch_to_data(given, load(62256), load).train.samples == samples
    assert given.batch == 62256 and loads[-1] == 62256


def test_batch_auto_explains_what_grows_per_sample_and_what_is_fixed(tmp_path):
    """find() says why: a line through the two largest probes that trained gives the memory
    each sample adds and the part that does not grow; a cached answer explains the same from
    the probes the cache kept."""
    fixed, per_sample = 3 * 1024**3, 70 * 1024**2  # 3 GiB fixed, 70 MiB per sample
    limit = fixed + per_sample * 300
    settings = SearchSettings(start=16, resolution=8, cache=str(tmp_path / "c.json"))
    calls: list[int] = []
    probe = fake_gpu(fixed, per_sample, limit, calls, 0.0)
    batch, found, why = batch_size.find(probe, settings, {"k": 1}, limit)
    assert why["per_sample_mib"] == pytest.approx(70, rel=0.01)
    assert why["fixed_gib"] == pytest.approx(3, rel=0.01)
    assert why["peak_at_batch_gib"] == pytest.approx(
        (fixed + per_sample * batch) / 1024**3, rel=0.01
    )
    assert why["limit_gib"] == pytest.approx(limit / 1024**3)
    calls.clear()
    again = batch_size.find(probe, settings, {"k": 1}, limit)
    assert calls == [] and again == (batch, found, why)  # from the cache: no probe, same why
    assert batch_size.explain([{"batch": 16, "fits": True, "peak_gib": 1.0}], 16, None) is None
