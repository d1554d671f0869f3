"""precision=fp8_auto (precision/fp8_layers.py): the per-layer choice on a fake timer, the shapes
read from a forward, the timing cache and its key, the conversion that follows the plan, and a
resumed run that keeps its plan. Timing on the GPU is test_gpu.py's (float8 needs one)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mixprec.core.errors import MixprecError
from mixprec.precision import base as precision
from mixprec.precision import fp8_early, fp8_layers, fp8_timing
from mixprec.precision.fp8_layers import BF16, Gemm, choose
from mixprec.run import build, rundir
from mixprec.run.config import validate

from conftest import compose_cfg, group

pytest.importorskip("torchao.float8")


def test_a_layer_goes_float8_only_where_it_beats_bf16_by_the_margin():
    cands = ["tensorwise", "rowwise"]
    assert choose({BF16: 100.0, "tensorwise": 80.0, "rowwise": 90.0}, cands, 0.05) == "tensorwise"
    assert choose({BF16: 100.0, "tensorwise": 120.0, "rowwise": 110.0}, cands, 0.05) == BF16
    assert choose({BF16: 100.0, "tensorwise": 96.0, "rowwise": 99.0}, cands, 0.05) == BF16  # tie
    assert choose({BF16: 100.0, "tensorwise": 96.0, "rowwise": 90.0}, cands, 0.0) == "rowwise"
    assert choose({BF16: 100.0, "tensorwise": 1.0}, [], 0.05) == BF16  # no candidate


class Net(nn.Module):
    """Two wide layers (float8 pays on the fake timer), a narrow one (it does not), the head."""

    mixprec_head = "head"

    def __init__(self):
        super().__init__()
        self.wide1, self.wide2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.narrow, self.head = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.narrow(self.wide2(torch.relu(self.wide1(x)))))


def fake_timer(calls: list):
    """µs that favour float8 for K*N >= 64*256 (tensorwise most), bf16 for smaller layers."""

    def one(g: Gemm, recipe: str) -> float:
        calls.append((g, recipe))
        big = g.k * g.n >= 64 * 256
        return {
            BF16: 100.0,
            "tensorwise": 60.0 if big else 130.0,
            "rowwise": 70.0 if big else 140.0,
        }[recipe]

    return lambda todo: [sum(one(g, recipe) for g in shapes) for shapes, recipe in todo]


def test_shapes_come_from_a_forward_and_the_cache_spares_a_second_measurement(tmp_path):
    model = Net()
    x = torch.randn(2, 8, 64)  # 16 rows per layer: M = batch x tokens
    names = ["wide1", "wide2", "narrow"]
    gemms = fp8_layers.layer_gemms(model, x, lambda: torch.autocast("cpu", enabled=False), names)
    assert gemms == {
        "wide1": (Gemm(16, 64, 256, True), 1),
        "wide2": (Gemm(16, 256, 64, True), 1),
        "narrow": (Gemm(16, 64, 16, True), 1),
    }
    calls: list = []
    cache = fp8_layers.TimingCache(str(tmp_path / "plan.json"))
    key = lambda shapes, r: f"gpu|{'&'.join(g.key() for g in shapes)}|{r}"  # noqa: E731
    plan = fp8_layers.measure(gemms, ["tensorwise", "rowwise"], 0.05, fake_timer(calls), key, cache)
    assert {n: c.choice for n, c in plan.items()} == {
        "wide1": "tensorwise",
        "wide2": "tensorwise",
        "narrow": BF16,
    }
    assert plan["wide1"].saving_us == 40.0 and plan["narrow"].saving_us == 0.0
    assert len(calls) == 3 * 3
    assert all(c.group is None for c in plan.values())  # no groups given: each layer alone
    again: list = []
    cached = fp8_layers.TimingCache(str(tmp_path / "plan.json"))  # a new process, the same file
    same = fp8_layers.measure(
        gemms, ["tensorwise", "rowwise"], 0.05, fake_timer(again), key, cached
    )
    assert again == [] and {n: c.choice for n, c in same.items()} == {
        n: c.choice for n, c in plan.items()
    }
    (tmp_path / "plan.json").write_text("{not json")  # a broken cache is measured again
    assert fp8_layers.TimingCache(str(tmp_path / "plan.json")).data == {}


class Attention(nn.Module):
    """q, k and v read one input (and o reads theirs): a group of three, and one alone."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 256), nn.Linear(64, 32), nn.Linear(64, 32)
        self.o = nn.Linear(256, 64)

    def forward(self, x):
        q = self.q(x)
        return self.o(q * (self.k(x) + self.v(x)).repeat(1, 8))


def shared_cast_timer(todo):
    """Float8 pays for q alone (60 against 100 µs) and not for k or v alone (40 against 30: the
    cast of the input is most of their time); read together, the input is cast once (-15 µs
    for each extra layer)."""
    us = {(256, BF16): 100.0, (256, "tensorwise"): 60.0, (32, BF16): 30.0, (32, "tensorwise"): 40.0}
    us[(64, BF16)], us[(64, "tensorwise")] = 50.0, 80.0  # o: 256 -> 64
    out = []
    for shapes, recipe in todo:
        t = sum(us[(g.n, recipe)] for g in shapes)
        out.append(t - (15.0 * (len(shapes) - 1) if recipe != BF16 else 0.0))
    return out


def test_layers_that_read_one_input_are_timed_and_chosen_together(tmp_path):
    """q, k and v read the same tensor: one group, timed together. Alone, k and v would stay in
    bf16 (40 against 30 µs) while q goes float8; together the three take 60+40+40-30 = 110 µs
    in float8 against 160 in bf16, so all three go float8, each carrying a third of the group's
    times. o reads another tensor: alone, and bf16."""
    model = Attention()
    groups: list = []
    gemms = fp8_layers.layer_gemms(
        model,
        torch.randn(16, 64),
        lambda: torch.autocast("cpu", enabled=False),
        list("qkvo"),
        groups,
    )
    assert groups == [["q", "k", "v"]]
    cache = fp8_layers.TimingCache(str(tmp_path / "plan.json"))
    key = lambda shapes, r: f"gpu|{'&'.join(g.key() for g in shapes)}|{r}"  # noqa: E731
    plan = fp8_layers.measure(gemms, ["tensorwise"], 0.05, shared_cast_timer, key, cache, groups)
    assert {n: c.choice for n, c in plan.items()} == {
        "q": "tensorwise",
        "k": "tensorwise",
        "v": "tensorwise",
        "o": BF16,
    }
    assert plan["k"].group == "q+k+v" and plan["o"].group is None
    assert plan["k"].us == {BF16: pytest.approx(160 / 3), "tensorwise": pytest.approx(110 / 3)}
    assert sum(c.saving_us for c in plan.values()) == pytest.approx(50.0)
    assert "with q+k+v" in fp8_layers.table(plan, ["tensorwise"])
    # each layer alone (an eager run: no shared cast to count), k and v stay in bf16
    alone = fp8_layers.measure(gemms, ["tensorwise"], 0.05, shared_cast_timer, key, cache)
    assert [n for n, c in alone.items() if c.choice != BF16] == ["q"]
    # through the plugin: a compiled run times the group, an eager one each layer alone
    for compiled, in_fp8 in ((True, ["q", "k", "v"]), (False, ["q"])):
        prec = auto_plugin(shared_cast_timer)
        prec.prepare(precision.Context(example=lambda: torch.randn(16, 64), compiled=compiled))
        prec.convert(Attention())
        assert prec.converted == in_fp8
    # a plan saved before groups existed reads back
    old = {k: v for k, v in plan["o"].as_dict().items() if k != "group"}
    assert fp8_layers.Choice.from_dict(old).group is None


def test_the_cache_key_changes_with_each_input(monkeypatch):
    import torchao

    cpu = torch.device("cpu")
    g = Gemm(16, 64, 256, True)
    base = fp8_layers.cache_key(g, "tensorwise", True, cpu)
    others = {
        fp8_layers.cache_key(Gemm(32, 64, 256, True), "tensorwise", True, cpu),  # shape
        fp8_layers.cache_key(Gemm(16, 64, 256, False), "tensorwise", True, cpu),  # bias
        fp8_layers.cache_key(g, "rowwise", True, cpu),  # recipe
        fp8_layers.cache_key(g, "tensorwise", False, cpu),  # compiled or eager
        fp8_layers.cache_key((g, Gemm(16, 64, 32, True)), "tensorwise", True, cpu),  # a group
    }
    assert fp8_layers.cache_key((g,), "tensorwise", True, cpu) == base  # one layer: as before
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.add(fp8_layers.cache_key(g, "tensorwise", True, cpu))  # torch
    monkeypatch.undo()
    monkeypatch.setattr(torchao, "__version__", "0.0.1")
    others.add(fp8_layers.cache_key(g, "tensorwise", True, cpu))  # torchao
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Another GPU")
    others.add(fp8_layers.cache_key(g, "tensorwise", True, torch.device("cuda")))  # the GPU
    assert base not in others and len(others) == 8


class FakeChild:
    """Child's protocol in-process: a share sent, compiled ("ready"), then timed on "go"; it
    records the order of events across children in `events`."""

    started: list = []
    events: list = []

    def __init__(self, proc=None, t0=0.0):
        self.closed, self.share, self.proc, self.t0 = False, None, proc, t0
        FakeChild.started.append(self)

    def send(self, todo, compiled):
        self.share = todo
        FakeChild.events.append(("send", self))

    def ready(self):
        FakeChild.events.append(("ready", self))

    def results(self):
        FakeChild.events.append(("go", self))
        self.closed = True
        return fake_timer([])(self.share)

    def close(self):
        self.closed = True


def test_the_children_compile_their_shares_at_once_and_time_them_one_after_another():
    """time_in_child deals the float8 timings (each a compile) round the children first, sends
    every share before any is timed, times one child at a time only after all are ready, and
    gives the answers back in the order asked; a child with nothing to do is ended unused."""
    wide, narrow = Gemm(16, 64, 256, True), Gemm(16, 64, 16, True)
    todo = [((g,), r) for g in (wide, narrow) for r in (BF16, "tensorwise", "rowwise")]
    assert sorted(i for share in fp8_timing.deal(todo, 4) for i in share) == list(range(6))
    float8_per_child = [
        len([i for i in share if todo[i][1] != BF16]) for share in fp8_timing.deal(todo, 4)
    ]
    assert float8_per_child == [1, 1, 1, 1]  # the compiles dealt first, one each
    FakeChild.started, FakeChild.events = [], []
    kids = [FakeChild() for _ in range(8)]  # more children than timings
    us = fp8_timing.time_in_child(todo, True, torch.device("cuda"), kids)
    assert us == fake_timer([])(todo)  # each answer in its place
    kinds = [kind for kind, _ in FakeChild.events]
    assert kinds == ["send"] * 6 + ["ready"] * 6 + ["go"] * 6  # no timing before all compiled
    idle = kids[6:]
    assert all(c.share is None for c in idle) and all(c.closed for c in FakeChild.started)


def test_the_timing_process_starts_early_only_where_the_cache_lacks_this_gpu(tmp_path):
    """warm_up (before the data and the model) starts the timing child for fp8_layers=auto on a
    GPU whose timings the cache has none of; convert() uses it and ends it, or ends it unused
    (a resumed plan). A cache with this GPU's timings, fp8_layers=all or the CPU: no child."""
    cuda = torch.device("cuda", 0)
    cache = tmp_path / "plan.json"
    FakeChild.started = []
    prec = auto_plugin(fp8_plan_cache=str(cache))
    prec.warm_up(cuda, True)
    assert len(FakeChild.started) == 2 and not any(c.closed for c in FakeChild.started)
    prec.prepare(precision.Context(example=lambda: torch.randn(4, 64)))
    prec.convert(Net())
    assert all(c.closed for c in FakeChild.started) and prec.children == [] and prec.timed > 0
    assert all(c.share for c in FakeChild.started)  # both took a share
    assert json.loads(cache.read_text())  # its timings kept
    cache.write_text(json.dumps({"H200|torch 2.11|torchao 0.18|16x64x256|bf16|x": 1.0}))
    for prec, device in (
        (auto_plugin(fp8_plan_cache=str(cache)), cuda),  # this GPU's timings cached
        (auto_plugin(fp8_plan_cache=None), torch.device("cpu")),
        (auto_plugin(fp8_plan_cache=None, fp8_layers="all"), cuda),
    ):
        prec.warm_up(device, True)
    assert len(FakeChild.started) == 2
    # started, then not needed: a resume brings its plan
    prec = auto_plugin(fp8_plan_cache=None)
    prec.warm_up(cuda, True)
    prec.prepare(precision.Context(saved_plan={}, example=lambda: torch.randn(4, 64)))
    prec.convert(Net())
    assert len(FakeChild.started) == 4 and all(c.closed for c in FakeChild.started[2:])


def test_a_timing_child_that_is_not_needed_ends_with_its_process_group():
    """close() ends a child still importing or waiting for its share on its stdin, and its
    process group with it; so does the parent dropping it."""
    child = fp8_timing.Child(*fp8_early.spawn("cpu", 1))
    pid = child.proc.pid
    child.close()
    assert child.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    other = fp8_timing.Child(*fp8_early.spawn("cpu", 1))
    proc = other.proc
    del other
    gc.collect()
    assert proc.returncode is not None


def test_train_py_starts_timing_processes_only_where_a_plan_will_time_layers(tmp_path):
    """fp8_early.wanted, on train.py's command line before anything is imported: fp8_auto (or
    fp8_layers=auto) with no timings in the named plan cache, a GPU node, not a sweep, a help or
    a config print, and the switch not off."""
    gpu = tmp_path / "nvidiactl"
    gpu.touch()
    cached, empty = tmp_path / "plan.json", f"precision.fp8_plan_cache={tmp_path / 'none.json'}"
    cached.write_text(json.dumps({"H200|x|16x64x256|bf16|x": 1.0}))

    def wanted(*argv, **environ):
        return fp8_early.wanted(list(argv), environ, nodes=(gpu,))

    assert wanted("precision=fp8_auto", empty) and wanted("precision.fp8_layers=auto", empty)
    assert wanted("+precision.fp8_layers=auto", empty, "model=vit_base")
    assert wanted("precision=fp8_auto", "precision.fp8_plan_cache=null")  # nothing kept
    assert not wanted("precision=fp8_auto", f"precision.fp8_plan_cache={cached}")  # cached
    assert not wanted("precision=fp8", empty) and not wanted("precision=bf16", empty)
    assert not wanted("-m", "precision=fp8_auto", empty)  # a sweep: each job plans its own
    assert not wanted("precision=fp8_auto", empty, "--cfg", "job")
    assert not wanted("precision=fp8_auto", empty, MIXPREC_FP8_EARLY="0")
    assert not wanted("precision=fp8_auto", empty, CUDA_VISIBLE_DEVICES="")
    gpu.unlink()
    assert not wanted("precision=fp8_auto", empty)  # no GPU driver here


def test_the_plan_claims_the_early_processes_of_its_gpu_and_the_builder_ends_the_rest(
    monkeypatch, tmp_path, cfg_factory
):
    """Started by train.py (core/early.py: fp8.yaml's early module, fp8_early), the timing
    processes are the ones the plan's warm_up uses, with their start time; a dead one (no such
    GPU) or one for another GPU is ended and new ones start; a run that needs none (another
    precision) ends them at build."""
    from mixprec.core import early
    from mixprec.run import session

    gpu = tmp_path / "nvidiactl"
    gpu.touch()
    spawned: list = []
    ended: list = []

    class Proc:
        def __init__(self, device):
            self.device, self.code = device, None

        def poll(self):
            return self.code

    def spawn(device, n, early=False):
        spawned.append(Proc(device))
        return spawned[-1], 100.0 + len(spawned)

    monkeypatch.setattr(fp8_early, "GPU_NODES", (gpu,))
    monkeypatch.setattr(fp8_early, "spawn", spawn)
    monkeypatch.setattr(fp8_early, "end", ended.append)
    monkeypatch.setattr(fp8_early, "processes", lambda: 2)
    monkeypatch.setattr(fp8_early, "_early", [])  # none left to the process's end
    monkeypatch.setattr(fp8_timing, "Child", FakeChild)
    argv = ["precision=fp8_auto", "precision.fp8_plan_cache=null"]
    fp8_early.start(argv)
    assert [p.device for p in spawned] == ["cuda:0", "cuda:0"]
    prec = auto_plugin(timing=NamedGPU())
    prec.warm_up(torch.device("cuda", 0), True)
    assert [c.proc for c in prec.children] == spawned and prec.children_t0 == 101.0
    assert len(spawned) == 2 and not ended
    fp8_early.start(argv)  # 3, 4: one found no GPU and ended
    spawned[2].code = 0
    prec = auto_plugin(timing=NamedGPU())
    prec.warm_up(torch.device("cuda", 0), True)
    assert [c.proc for c in prec.children] == [spawned[3]] and ended == [spawned[2]]
    monkeypatch.setenv("LOCAL_RANK", "1")
    fp8_early.start(argv)  # 5, 6 for GPU 1; the plan is on GPU 0: ended, 7 and 8 started
    prec = auto_plugin(timing=NamedGPU())
    prec.warm_up(torch.device("cuda", 0), True)
    assert ended[1:] == spawned[4:6] and [c.proc for c in prec.children] == spawned[6:]
    assert [p.device for p in spawned[4:]] == ["cuda:1", "cuda:1", "cuda:0", "cuda:0"]
    monkeypatch.delenv("LOCAL_RANK")
    spawned.clear(), ended.clear()
    monkeypatch.setattr(early, "_started", [])
    early.start(argv)  # as train.py starts them (fp8.yaml's `early:`), then the run's config
    session.run(cfg_factory("precision=bf16", "trainer.max_steps=1"))  # is another precision:
    assert ended == spawned and len(spawned) == 2  # the build ends them


def test_a_timing_process_started_early_on_a_machine_without_that_gpu_ends_quietly():
    """The command line's word was wrong (no CUDA here): the early child exits 0 and prints
    nothing, so a CPU run refused for fp8 says only why; warm_up's own children say theirs."""
    setup = json.dumps({"device": "cuda:0", "t0": 0.0, "early": True})
    out = subprocess.run(
        [sys.executable, "-m", "mixprec.precision.fp8_timing", setup],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


class FakeGPU(fp8_timing.Timing):
    """The plugin's timing source (Plugin.timing) as a GPU that is not here: a machine name,
    FakeChild processes that follow Child's protocol in-process, and `timer` (microseconds for
    each (shapes, recipe)) in place of the child processes' timings, where one is given."""

    def __init__(self, timer=None, name: str = "H200|torch 2.11|torchao 0.18") -> None:
        self.timer, self.name = timer, name

    def machine(self, device) -> str:
        return self.name

    def start(self, device) -> list:
        return [FakeChild(), FakeChild()]

    def time(self, todo, compiled, device, children) -> list:
        if self.timer is None:  # the children's protocol: shares dealt, compiled, then timed
            return super().time(todo, compiled, device, children)
        return self.timer(todo)


def auto_plugin(timer=None, timing=None, **keys):
    prec = precision.build(
        group("precision", "fp8_auto", **{"fp8_plan_cache": None, **keys}),
        group("scaler"),
        torch.device("cpu"),
        check_device=False,
    )
    prec.timing = timing or FakeGPU(timer)
    return prec


class NamedGPU(fp8_timing.Timing):
    """The real timing source (its processes: train.py's early ones, claimed), on a GPU named
    as the tests' caches name it."""

    def machine(self, device) -> str:
        return "H200|torch 2.11|torchao 0.18"


def test_the_plan_converts_each_layer_to_its_recipe_and_a_resume_keeps_it():
    calls: list = []
    prec = auto_plugin(fake_timer(calls))
    prec.prepare(precision.Context(example=lambda: torch.randn(4, 64)))
    model = prec.convert(Net())
    assert type(model.wide1).__name__.endswith("Float8Linear") and type(model.narrow) is nn.Linear
    assert prec.converted == ["wide1", "wide2"] and prec.owned() == dict.fromkeys(
        prec.converted, "float8"
    )
    assert "head" not in prec.plan()  # the head is not eligible (fp8_head=false)
    saved = json.loads(json.dumps(prec.plan()))  # as precision_plan.json holds it
    summary = prec.plan_summary()
    assert (summary["float8_layers"], summary["layers"]) == (2, 3)
    # a resume: the saved plan, nothing timed
    calls.clear()
    resumed = auto_plugin(fake_timer(calls))
    resumed.prepare(precision.Context(example=lambda: torch.randn(4, 64), saved_plan=saved))
    model = resumed.convert(Net())
    assert calls == [] and resumed.converted == ["wide1", "wide2"] and resumed.plan() == saved
    # rowwise as the only candidate: the chosen layers get torchao's rowwise config
    rowwise = auto_plugin(fake_timer(calls), fp8_candidates="[rowwise]")
    rowwise.prepare(precision.Context(example=lambda: torch.randn(4, 64)))
    model = rowwise.convert(Net())
    cfg = model.wide1.config
    assert (
        cfg.round_scales_to_power_of_2
        and cfg.cast_config_input.scaling_granularity.name == "AXISWISE"
    )


def test_a_plan_that_keeps_every_layer_in_bf16_trains_bf16s_model():
    """Where float8 pays on no layer (ConvNeXt-T, the ViTs at batch 128), fp8_auto must cost
    nothing: the same module objects and types, no hook left behind by the shape forward, the
    same weights and the same outputs and gradients as the model it was given."""
    bf16_wins = lambda todo: [  # noqa: E731
        sum(100.0 if recipe == BF16 else 150.0 for _ in shapes) for shapes, recipe in todo
    ]
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 64)
    before = {n: (type(m), m) for n, m in net.named_modules()}
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    reference = Net()
    reference.load_state_dict(weights)
    prec = auto_plugin(bf16_wins)
    prec.prepare(precision.Context(example=lambda: x))
    model = prec.convert(net)
    assert model is net and prec.converted == [] and prec.owned() == {}
    assert set(prec.plan()) == {"wide1", "wide2", "narrow"}  # measured, and bf16 chosen
    assert {n: (type(m), m) for n, m in model.named_modules()} == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    out, ref = model(x), reference(x)
    out.sum().backward(), ref.sum().backward()
    assert torch.equal(out, ref)
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters())
    )


def test_without_a_micro_batch_every_eligible_layer_is_float8():
    """batch=auto's probes and the dtype audit give no micro-batch: nothing is timed, and every
    eligible layer takes fp8_recipe (the upper bound of float8's share)."""
    never = lambda *a: pytest.fail("timed without a batch")  # noqa: E731
    prec = auto_plugin(never)
    prec.prepare(precision.Context())
    prec.convert(Net())
    assert prec.converted == ["wide1", "wide2", "narrow"] and prec.plan() is None


def test_a_timing_that_fails_in_its_child_process_is_an_error_and_the_parent_goes_on():
    """The timings run in a child process (what they leave allocated leaves with it); one that
    fails there (here: no GPU to time on) is a MixprecError in the training process, which is
    itself unharmed."""
    with pytest.raises(MixprecError, match="timing the layers failed in its child process"):
        fp8_timing.time_in_child([((Gemm(16, 64, 256, True),), BF16)], True, torch.device("cpu"))
    assert torch.ones(2).sum().item() == 2.0


def test_a_run_dir_plan_is_found_for_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"x")
    (run_dir / rundir.PLAN_FILE).write_text(json.dumps({"wide1": {"choice": "tensorwise"}}))
    c = validate(compose_cfg(["precision=fp8_auto", "resume=auto"], run_dir))
    assert build.saved_plan(c) == {"wide1": {"choice": "tensorwise"}}
    fresh = validate(compose_cfg(["precision=fp8_auto"], run_dir))
    assert build.saved_plan(fresh) is None  # not a resume: plan again


def test_bad_plan_settings_name_the_key():
    from mixprec.core.errors import ConfigError

    for keys, needle in [
        (["precision.fp8_layers=some"], "precision.fp8_layers"),
        (["precision.fp8_candidates=[blockwise]"], "precision.fp8_candidates"),
        (["precision.fp8_margin=1.5"], "precision.fp8_margin"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            validate(compose_cfg(["precision=fp8_auto", *keys]))
