"""Shared fixtures: compose any config the way train.py does, shrunk to a CPU-sized run."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest


def _session_tmpdir() -> str | None:
    """The test session's own TMPDIR, made by the first pytest process (xdist's workers, the test
    zygotes and every run they start inherit it) and removed at its end: what a killed run or a
    zygote's imports leave in a temporary directory goes with it, not into the machine's /tmp.
    pytest's own tmp_path directories stay where pytest keeps them (its last three sessions)."""
    if os.environ.get("MIXPREC_TEST_TMPDIR"):  # an xdist worker: the controller's
        return None
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix="mixprec-tests-")
    os.environ["TMPDIR"] = os.environ["MIXPREC_TEST_TMPDIR"] = path
    tempfile.tempdir = None  # (gettempdir() reads TMPDIR again)
    return path


SESSION_TMPDIR = _session_tmpdir()  # before the imports below make their temporary directories
# The suite's CPU compiles (in-process, and in every run it starts) emit inductor's scalar C++,
# its own path for CPUs without vector units: the same graphs, kernels and caches, less code for
# g++. What the tests check is mixprec's (a compiled run trains like eager, its cache loads),
# not inductor's vectorizer; the full suite took 629 s and 1,211 CPU-s with it, 650 s and 1,251
# without (2 cores, 2026-12-04). TORCHINDUCTOR_VEC_ISA_OK=1 pytest ... compiles vectorized.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
gc.disable()  # while importing (frozen below, as train.py does)

import torch  # noqa: E402
import zygote  # noqa: E402  # tests/zygote.py: train.py runs forked from the imports' process
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mixprec.run.config import register_configs, validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test runs -n 2 on 2 cores: two workers that
    torch.set_num_threads(1)  # each spin 2 threads on them run several times slower
CONF = ROOT / "conf"
# finish() ends a hung run with SIGABRT (for its stacks): no core files from it
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
register_configs()
# Hydra stays initialised for the whole session, as inside train.py: hardware profiles load
# through it (config.hardware_profiles)
initialize_config_dir(str(CONF), version_base="1.3")

gc.freeze()  # as train.py does: the in-process runs' collections skip what the imports made
gc.enable()

# Small enough for a 2-core CPU: a couple of steps, no W&B unless a test asks for it.
CPU_SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=1", "trainer.perf_warmup_steps=0"]


TINY_BERT = [  # transformers' BERT at a CPU test's size (model=hf; random init, nothing downloaded)
    "model=hf",
    "model.hf.config=bert",
    "++model.hf.overrides={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
    "intermediate_size: 64}",
]


def compose_cfg(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    """compose() as train.py's parser composes, with run_dir set (default "."). The same
    overrides compose to the same config while the ConfigStore holds the same nodes (a test
    that stores a plugin's node changes them), so each composition is made once a process and
    copied after (0.3 s to compose; 0.01 s a copy)."""
    key = (tuple(overrides), _store_nodes(ConfigStore.instance().repo))
    if key not in _COMPOSED:
        _COMPOSED[key] = compose("train", overrides=["run_dir=.", *overrides])
    cfg = copy.deepcopy(_COMPOSED[key])
    if run_dir is not None and not any(o.startswith("run_dir=") for o in overrides):
        cfg.run_dir = str(run_dir)  # (as an override before them would: theirs wins)
    return cfg


_COMPOSED: dict[tuple, DictConfig] = {}


def _store_nodes(repo: dict) -> tuple:
    return tuple(
        (k, _store_nodes(v) if isinstance(v, dict) else id(v)) for k, v in sorted(repo.items())
    )


def group(name: str, option: str | None = None, **keys):
    """One group's validated dataclass, composed from conf/ (the one source of its values)."""
    overrides = [f"{name}={option}"] if option else []
    overrides += [f"{name}.{k}={'null' if v is None else v}" for k, v in keys.items()]
    return getattr(validate(compose_cfg(overrides)), name)


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test's in-process run leaves in os.environ (W&B's WANDB_SERVICE, once wandb.init
    ran in this process) is gone after the test: the zygote refuses a request whose environment
    differs from the one it imported under, and a later test on the same worker would then run
    its ranks as real processes or fail, depending on which tests xdist gave that worker first
    (seen under load: the zygote tests failed after a W&B test on the same worker)."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


@pytest.fixture
def cfg_factory(tmp_path):
    """Composes a config with its own fresh run dir (tmp_path/run, run1, run2, ...), unless the
    overrides give run_dir=."""
    made = []

    def make(*overrides: str, small: bool = True) -> DictConfig:
        made.append(1)
        run_dir = tmp_path / ("run" if len(made) == 1 else f"run{len(made) - 1}")
        return compose_cfg([*(CPU_SMALL if small else []), *overrides], run_dir)

    return make


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A torch.distributed process group of one (gloo), as DDP code needs (a run ends it)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


SHARDED = [
    "hardware=cpu",
    "logger=none",
    "trainer.log_every=2",
    "trainer.perf_warmup_steps=0",
    "model=llama_tiny",
    "data=text",
    "data.seq_len=32",
    "data.max_mb=1",
    "parallel=fsdp",
    "ckpt.sharded=true",
]


@pytest.fixture(scope="session")
def sharded_run(tmp_path_factory) -> Path:
    """A run that kept a sharded (DCP) checkpoint: FSDP2 in a world of one, on the CPU."""
    d = tmp_path_factory.mktemp("sharded") / "run"
    p = run_train([*SHARDED, "trainer.max_steps=2", f"hydra.run.dir={d}"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    return d


@pytest.fixture
def read_only():
    """read_only(path): `path` (a folder, made if missing, or a file) becomes a read-only bind
    mount of itself, as a read-only filesystem is (a file: it cannot be written or replaced);
    undone at the test's end. Skips where mounts are not allowed."""
    mounted = []

    def make(path: Path) -> Path:
        if not path.is_file():
            path.mkdir(parents=True, exist_ok=True)
        for cmd in (["mount", "--bind", path, path], ["mount", "-o", "remount,bind,ro", path]):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                pytest.skip(f"a read-only mount needs root and mount(8): {p.stderr.strip()}")
            if cmd[1] == "--bind":
                mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", path], capture_output=True)


SIZE = 2 * 2**20  # small_disk's tmpfs; a digits checkpoint is about 0.37 MB


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)], capture_output=True
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {p.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def fill(disk: Path, leave: int) -> Path:
    """A file that leaves about `leave` bytes free on `disk`."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (free - leave))
    return filler


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def threads_as_here(env: dict) -> dict:
    """`env` for a process a test starts: under pytest-xdist one CPU thread, as this process
    (see the top; four threads on 2 cores ran the suite 5 min slower), unless `env` says. Runs
    compared bit for bit must use the same number of threads: start them all through here."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_train(
    args: list[str],
    cwd: Path = ROOT,
    env_extra: dict | None = None,
    merge: bool = False,
    forked: bool = True,
) -> subprocess.Popen:
    """`python train.py ARGS` started and not waited for (W&B offline and without credentials,
    forked from the zygote unless `forked` is false): completed() waits for it, as run_train
    does. `merge`: stderr into stdout."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env_extra or {})})
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    return start_session(cmd, cwd, env, merge=merge, forked=forked)


def run_train(
    args: list[str], cwd: Path = ROOT, env_extra: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    return completed(start_train(args, cwd, env_extra), timeout)


def run_train_fresh(
    args: list[str], env_extra: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """train.py in a fresh interpreter, as users start it: what a test of its first lines
    needs (the zygote's process has torch imported already)."""
    return completed(start_train(args, ROOT, env_extra, forked=False), timeout)


FAMILY = "MIXPREC_TEST_RUN"  # start_session's mark: every process a test run started has it


def run_module(
    module: str, args: list, cwd: Path = ROOT, timeout: int = 300, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (mixprec.diagnose, .report, .export, .prepare, .sync) as
    subprocess.run(capture_output=True, text=True) runs it, forked from the zygote."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    return run_session(cmd, cwd, {**os.environ, **(env_extra or {})}, timeout, forked=True)


def start_session(
    cmd: list[str], cwd: Path, env: dict, merge: bool = False, forked: bool = False
) -> subprocess.Popen:
    """`cmd` as the leader of a session of its own (as a terminal or `timeout` starts it): the
    group can be signalled without signalling pytest, and finish() can find every process it
    started. Python's faulthandler is on in all of them, so that a hang can show its stacks.
    `merge`: stderr into stdout, in the order written. `forked` (cmd: python train.py ARGS, or
    python -m MODULE ARGS): forked from tests/zygote.py where the environment allows
    (zygote.eligible)."""
    mark = uuid.uuid4().hex
    env = threads_as_here({**env, "PYTHONFAULTHANDLER": "1", FAMILY: mark})
    if forked and zygote.eligible(env):
        try:
            proc = zygote.Launched(cmd, cwd, env, merge)
            proc.family_mark = mark
            return proc
        except zygote.Refused as e:  # a new process, as below: slower, so it is said
            warnings.warn(str(e), stacklevel=2)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.family_mark = mark
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str | None]:
    """(stdout, stderr) of a process from start_session once it has exited and every process
    it started has let go of its output. One that hangs fails the test with what hung: its
    processes are listed, each Python one prints its threads' stacks (faulthandler, on
    SIGABRT), then all are killed (subprocess.run would kill the child alone and then wait
    forever on a grandchild that holds the pipe)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    family = _family(proc)
    ps = [
        "ps",
        "-o",
        "pid=,ppid=,stat=,etime=,args=",
        "-p",
        ",".join(map(str, family or [proc.pid])),
    ]
    tree = subprocess.run(ps, capture_output=True, text=True).stdout
    out = err = None
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in family:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        try:
            out, err = proc.communicate(timeout=20)
            break
        except subprocess.TimeoutExpired:
            pass
    pytest.fail(
        f"{shlex.join(map(str, proc.args))}\ndid not finish within {timeout} s. Its processes "
        f"(pid, parent, state, age, command):\n{tree}\nThe end of its output, with the stacks of "
        f"its Python processes:\n{(out or '')[-15000:]}\n{(err or '')[-15000:]}",
        pytrace=False,
    )


def _family(proc: subprocess.Popen) -> list[int]:
    """Every process still alive that `proc` started, however far down and wherever it went
    (torchrun starts each rank in a session of its own; a worker whose trainer has exited is
    re-parented): they all carry start_session's mark in their environment."""
    mark = f"{FAMILY}={proc.family_mark}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    if proc.poll() is None and proc.pid not in found:  # forked by tests/zygote.py: its
        found.append(proc.pid)  # environment is the zygote's in /proc
    return sorted(found)


def run_session(
    cmd: list[str], cwd: Path, env: dict, timeout: float, forked: bool = False
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True), through start_session/finish."""
    return completed(start_session(cmd, cwd, env, forked=forked), timeout)


def completed(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """What subprocess.run returns, for a process from start_session once finish() has it."""
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# the Llama on the standard library's text, small enough for 2 processes on a 2-core CPU
LM_CPU = [
    "model=llama_tiny",
    "data=text",
    "data.seq_len=32",
    "data.val_sequences=8",
    "trainer.log_every=1",
    "hardware=cpu",
    "scheduler=constant",
    "logger=none",
]


def run_torchrun(
    args: list[str], env_extra: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 ARGS` (a script and its arguments), one CPU
    thread per process, W&B offline. The agent and its ranks are forked from tests/zygote.py
    where the environment allows (the ranks through torchrun's PYTHON_EXEC, zygote.relay)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env_extra or {})}
    env.update(zygote.relay_env())
    return run_session([*TORCHRUN, *args], ROOT, env, timeout, forked=True)


def train_losses(run_dir: Path) -> list[float]:
    """The train/loss of every logged step in a run dir's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def last_weights(run_dir: Path) -> dict:
    """The model weights of a run dir's last checkpoint."""
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


_MODULES = [0]


def pytest_runtest_logfinish(nodeid, location):
    """Once a test has imported more (timm's models, torchao, transformers: hundreds of
    thousands of objects that live as long as the process), the collector sets them aside as
    conftest did the first imports: each in-process run's full collection (a later job's
    release_earlier_jobs) then walks only what that run made."""
    if len(sys.modules) != _MODULES[0]:
        _MODULES[0] = len(sys.modules)
        gc.collect()  # (what the test left is freed first, not frozen)
        gc.freeze()


def pytest_unconfigure(config):
    if SESSION_TMPDIR is not None:
        shutil.rmtree(SESSION_TMPDIR, ignore_errors=True)


def pytest_configure(config):
    """xdist's load scheduling hands each worker a quarter of the suite at its start (84 tests
    here, the end-to-end runs among them) and never takes them back: one worker ran minute-long
    signal tests to the end while the other had been idle for 78 s. Two at a time instead (a
    given --maxschedchunk wins): a worker asks for more as it finishes, and the two end
    together."""
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 2


def pytest_collection_modifyitems(config, items):
    # the end-to-end runs first (in their own order): xdist then ends on short tests, not with
    # one worker left on a minute-long torchrun test while the other has nothing left to do
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
