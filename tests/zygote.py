"""train.py runs for the tests, each in a fork of a process that has already imported what
train.py imports (a "zygote", as Android starts its apps): the same code from train.py's first
line on, without the 4-6 s that every new Python process spends importing torch, timm, Hydra
and scikit-learn on a 2-core CPU (most of a test run's time: the full suite went from 28 min).

The server (`python tests/zygote.py`) imports, prints the path of its Unix socket, and forks one
child per request. A child leaves the server's loop entirely (serve() returns in it), becomes
the leader of a session of its own (as start_session's processes are), takes the request's
working directory, environment, argv and output pipes, and runs train.py as `__main__` through
runpy: SystemExit, an uncaught exception or Ctrl-C end it through the interpreter's own exit,
as they end `python train.py`. The server reports each child's pid, then its exit status.

Launched is the client: a subprocess.Popen for conftest.finish() (pid, communicate, poll, wait,
returncode). conftest.run_train uses it (start_session's `forked`) unless the run needs an
environment read at import time (only the keys in SAFE_ENV may differ) or
MIXPREC_TEST_ZYGOTE=0; tests about how a process
starts and the runs a test signals start real processes. torchrun's agent and ranks come
through tests/zygote_python (relay(), torchrun's PYTHON_EXEC), which stands in for the forked
child. The zygote refuses a request whose environment differs where its imports may read it
(unsafe()): the caller then starts a real process. tests/test_zygote.py checks that a run
through it and a real process write the same things, torchrun's included.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the environment as this module was imported: in pytest, what each zygote is started with; in
# a zygote, the environment its imports saw
START_ENV = dict(os.environ)
TRAIN = ROOT / "train.py"
# what train.py and a default or LM run import (the rest is imported in the child, as usual)
PRELOAD = (
    "torch",
    "timm",
    "sklearn.datasets",
    "hydra",
    "omegaconf",
    "wandb",
    "mixprec.internals.quick_exit",
    "mixprec.core.launch",
    "mixprec.run.config",
    "mixprec.run.session",
    "mixprec.data.digits",
    "sklearn.model_selection",  # (the digits' split)
    "mixprec.data.text",
    "mixprec.data.imagenet",  # every run lists the datasets (data.names()): it imports them all
    "mixprec.data.cifar10",
    "mixprec.data.custom",
    "mixprec.data.synthetic",
    "mixprec.data.tokens",
    # the sweeper and launcher plugins Hydra imports as it starts (hydra_plugins is a namespace
    # package: a child's own PYTHONPATH still adds its plugins)
    "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
    "hydra_plugins.mixprec_sweepers",
    "wandb.sdk.launch.inputs.internal",  # what wandb.init imports (0.5 s a W&B run)
    "matplotlib.pyplot",  # the report's plots
)
# environment keys a child may set that nothing reads while importing PRELOAD: ours, and what
# torchrun gives a rank (read by torch.distributed, NCCL and mixprec when the run starts)
SAFE_ENV = {"PYTHONPATH", "OMP_NUM_THREADS", "WANDB_MODE", "WANDB_SILENT", "PYTHONFAULTHANDLER"}
SAFE_ENV |= {"PYTEST_CURRENT_TEST"}  # (pytest's, set anew for each test)
SAFE_ENV |= {"PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES"}  # a shell's (zygote_python's sh)
SAFE_ENV |= {"PYTHON_EXEC", "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
SAFE_ENV |= {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "MASTER_ADDR"}
SAFE_ENV |= {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_PORT"}
SAFE_ENV |= {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "OUT", "PYTHON"}  # (and two_gpu.sh's own)
# (and "_TORCHINDUCTOR_": what inductor sets in a process that compiled, e.g. the pytest process
# after an in-process compiled run, for its own C++ wrapper, which it sets again before use)
SAFE_PREFIXES = ("MIXPREC_TEST_", "TORCHELASTIC_", "NCCL_", "_TORCHINDUCTOR_")
# the relay (tests/zygote_python): the interpreter it stands in for, and the zygote's socket
PYTHON_ENV, SOCKET_ENV = "MIXPREC_TEST_PYTHON", "MIXPREC_TEST_ZYGOTE_SOCKET"
LOG_ENV = "MIXPREC_TEST_ZYGOTE_LOG"  # a file each child names itself in
DELAY_ENV = "MIXPREC_TEST_ZYGOTE_REPLY_DELAY"  # seconds the server waits between fork and reply
SETSID_DELAY_ENV = "MIXPREC_TEST_ZYGOTE_SETSID_DELAY"  # seconds a child waits before its setsid
RELAY = Path(__file__).resolve().parent / "zygote_python"
# the zygote's own PYTHONPATH entries: a child's come from its request's environment instead
BASE_PYTHONPATH = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


def eligible(env: dict) -> bool:
    """Whether a run with environment `env` can start from the zygote: every key it adds to or
    changes from this process's environment is one that is read after the imports. (The
    zygote checks again against its own, and refuses a run that differs where it matters.)"""
    if os.environ.get("MIXPREC_TEST_ZYGOTE", "1") == "0":
        return False
    return not unsafe(env, os.environ, os.environ)


def unsafe(env: dict, before: dict, after: dict) -> list[str]:
    """The keys of `env` that may be read while PRELOAD is imported and differ from what those
    imports saw (`before`) and from what they left (`after`: torch, sklearn and inductor set
    some, e.g. KMP_DUPLICATE_LIB_OK, TORCHINDUCTOR_CACHE_DIR)."""
    keys = set(env) | set(before) | set(after)
    changed = {k for k in keys if env.get(k) != before.get(k) and env.get(k) != after.get(k)}
    return sorted(k for k in changed if k not in SAFE_ENV and not k.startswith(SAFE_PREFIXES))


def relay_env() -> dict:
    """The environment under which torchrun (PYTHON_EXEC) or a script (benchmarks/two_gpu.sh's
    PYTHON) starts its Python processes through tests/zygote_python: forked from this process's
    zygote where they can be. Empty under MIXPREC_TEST_ZYGOTE=0."""
    if os.environ.get("MIXPREC_TEST_ZYGOTE", "1") == "0":
        return {}
    return {"PYTHON_EXEC": str(RELAY), PYTHON_ENV: sys.executable, SOCKET_ENV: _address()}


# ---------------------------------------------------------------------------------- the server


def serve(path: str) -> dict:
    """Accept requests on `path` until this process's stdin closes (its pytest has ended).
    Returns only in a forked child: the request it is to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    print(f"ready {path}", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection to report its end to
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():  # its own files go with it
                    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                    for module, attr, _ in WANDB_TMP:
                        if (tmp := _wandb_tmp(module, attr)) is not None:
                            tmp.cleanup()
                    os._exit(0)
            elif key.fileobj is listener:
                request = _accept(listener, sel, waiting)
                if request is not None:
                    return request
            else:  # a client hung up before its child ended (killed): the child goes with it
                _client_gone(key, sel, waiting)
        _reap(waiting, sel)


def _accept(listener: socket.socket, sel: selectors.BaseSelector, waiting: dict) -> dict | None:
    """Forks the child of one request: returns the request in the child, None in the server
    (or where the request is refused: an environment read at import differs)."""
    conn, _ = listener.accept()
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    request = json.loads(msg)
    refused = unsafe(request["env"], START_ENV, os.environ)
    if refused:
        _send(conn, {"refused": refused})
    else:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            sel.close()
            listener.close()
            conn.close()
            for other in waiting.values():
                other.close()
            return {**request, "fds": fds}
        time.sleep(float(request["env"].get(DELAY_ENV, 0)))  # (a loaded machine, in tests)
        if _send(conn, {"pid": pid}):
            waiting[pid] = conn
            sel.register(conn, selectors.EVENT_READ, pid)
        else:  # the client died as it asked (killed): no one waits for the child, so it goes
            _kill_child(pid)
            os.waitpid(pid, 0)
            refused = True  # (closed below)
    for fd in fds:
        os.close(fd)
    if refused:
        conn.close()
    return None


def _send(conn: socket.socket, reply: dict) -> bool:
    """One reply line to a client; False where the client is gone (a broken pipe must not end
    the server, which every later test run needs)."""
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        return False
    return True


def _client_gone(key: selectors.SelectorKey, sel: selectors.BaseSelector, waiting: dict) -> None:
    with contextlib.suppress(OSError):
        if key.fileobj.recv(1):
            return  # (clients send nothing after their request)
    sel.unregister(key.fileobj)
    if key.data in waiting:
        _kill_child(key.data)


def _kill_child(pid: int) -> None:
    """SIGKILL a child and its session: the group, and the pid itself, since a child not yet
    past its setsid leads no group (a loaded machine)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _reap(waiting: dict, sel: selectors.BaseSelector) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def become(request: dict, home: str) -> None:
    """In the child: take the request's session, output, directory, environment and argv as a
    new `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS` process would have them."""
    time.sleep(float(request["env"].get(SETSID_DELAY_ENV, 0)))  # (a loaded machine, in tests)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out, err = request["fds"]
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    # python -u (torchrun starts its ranks so) or PYTHONUNBUFFERED, as CPython makes it
    if request.get("unbuffered") or request["env"].get("PYTHONUNBUFFERED"):
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            raw = io.FileIO(fd, "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True))
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in BASE_PYTHONPATH]
    module = _module(request["argv"])
    first = request["cwd"] if module else os.path.dirname(_script(request))  # as python does
    sys.path[:] = [first, *extra, *base]
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    _own_wandb_tmp_dirs(home)
    if env.get(LOG_ENV):  # (the tests that check what was forked)
        with open(env[LOG_ENV], "a") as f:
            f.write(json.dumps({"argv": request["argv"], "rank": env.get("RANK")}) + "\n")
    sys.argv = [module, *request["argv"][2:]] if module else request["argv"]  # -m: run_module
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _module(argv: list[str]) -> str:
    """The module of `python -m MODULE ARGS` (argv: what follows the interpreter), else ""."""
    return argv[1] if argv[0] == "-m" else ""


def _script(request: dict) -> str:
    return os.path.realpath(os.path.join(request["cwd"], request["argv"][0]))


# wandb's temporary directories, made when it is imported and deleted when that process exits
WANDB_TMP = (
    ("wandb.sdk.data_types._private", "MEDIA_TMP", "wandb-media"),  # media (tables, images)
    ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR", "wandb-artifacts"),
)


def _own_wandb_tmp_dirs(home: str) -> None:
    """wandb makes its temporary directories when it is imported and deletes them when that
    process exits: the forks shared the zygote's, and the first child to exit deleted them under
    the others ("W&B table failed (FileNotFoundError: ...wandb-media/..." in a sweep that ran
    beside it). Each child gets its own, in the zygote's home, deleted at the child's exit (or
    with that home: train.py ends through os._exit)."""
    for module, attr, suffix in WANDB_TMP:
        tmp = _wandb_tmp(module, attr)
        if tmp is None:
            continue
        tmp._finalizer.detach()  # the zygote's directory stays the zygote's
        tmp.name = tempfile.mkdtemp(suffix, dir=home)  # (its atexit cleanup reads the name)
        tmp._finalizer = weakref.finalize(tmp, shutil.rmtree, tmp.name, ignore_errors=True)


def _wandb_tmp(module: str, attr: str) -> tempfile.TemporaryDirectory | None:
    obj = sys.modules.get(module)
    for name in attr.split(".") if obj is not None else ():
        obj = getattr(obj, name, None)
    return obj


def main() -> None:
    import gc
    import importlib

    gc.disable()  # while importing, then frozen, as train.py does (1.3 s less of 7 CPU-s)
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()
    request = serve(sys.argv[1])
    become(request, home=os.path.dirname(sys.argv[1]))
    import runpy

    if _module(request["argv"]):  # python -m mixprec.diagnose ARGS, and the like
        runpy.run_module(_module(request["argv"]), run_name="__main__", alter_sys=True)
    else:  # train.py, or a script torchrun starts; its exit is the interpreter's own
        runpy.run_path(_script(request), run_name="__main__")


# ---------------------------------------------------------------------------------- the client

_server: dict = {}


def _address() -> str:
    """The path of this process's zygote's socket, the zygote started first if need be."""
    proc = _server.get("proc")
    if proc is None or proc.poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="mixprec-zygote-"), "socket")
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), path],
            env=START_ENV,  # pytest's own, not a test's (monkeypatch.setenv) that started it
            stdin=subprocess.PIPE,  # its lifeline: it ends when this process does
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        line = proc.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise RuntimeError(f"the test zygote did not start (exit {proc.wait()})")
        _server.update(proc=proc, path=line[1])
    return _server["path"]


def _connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(_address())
    return sock


class Refused(RuntimeError):
    """The zygote would not fork this run (its environment differs where imports read it)."""


class Launched:
    """`python train.py ARGS` or `python -m MODULE ARGS` (`cmd`) forked from the zygote, for
    conftest.finish(): what it reads of a Popen."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict, merge: bool = False) -> None:
        if _module(cmd[1:]) == "" and Path(cmd[1]).resolve() != TRAIN:
            raise ValueError(f"the zygote runs train.py or python -m MODULE, not {cmd[1]}")
        self.args = list(map(str, cmd))
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = (out_r, out_w) if merge else os.pipe()
        sock = _connect()
        request = {"argv": self.args[1:], "cwd": str(cwd), "env": env}
        socket.send_fds(sock, [json.dumps(request).encode()], [out_w, err_w])
        for fd in {out_w, err_w}:
            os.close(fd)
        self._sock = sock.makefile("r")
        reply = json.loads(self._sock.readline() or "{}")
        if "pid" not in reply:
            for fd in {out_r, err_r}:
                os.close(fd)
            raise Refused(f"the test zygote refused {self.args}: {reply}")
        self.pid = reply["pid"]
        self._ended = threading.Event()
        self._parts = {"out": [], "err": []}
        self._readers = [self._read(out_r, "out")]
        if not merge:
            self._readers.append(self._read(err_r, "err"))
        threading.Thread(target=self._wait_status, daemon=True).start()

    def _read(self, fd: int, key: str) -> threading.Thread:
        def pump():
            with open(fd, encoding="utf-8", errors="replace") as f:
                for chunk in iter(lambda: f.read(4096), ""):
                    self._parts[key].append(chunk)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        return t

    def _wait_status(self) -> None:
        line = self._sock.readline()
        self.returncode = json.loads(line)["code"] if line else -signal.SIGKILL
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        err = "".join(self._parts["err"]) if len(self._readers) > 1 else None
        return "".join(self._parts["out"]), err

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)


# ----------------------------------------------------------------------------------- the relay

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGABRT", "SIGALRM")


def relay(argv: list[str]) -> None:
    """tests/zygote_python, the `python` that torchrun (PYTHON_EXEC) and two_gpu.sh (PYTHON)
    start in the tests: `python ARGS` (argv), forked from the zygote at SOCKET_ENV when ARGS is
    `[-u] SCRIPT.py ...` or `[-u] -m MODULE ...` and the zygote takes the environment; anything
    else execs the real interpreter. This process then stands in for the child to whoever
    started it: a signal it gets goes on to the child's process group (where a real rank's
    loader workers are), its exit is the child's (a signal too), and if it is killed, the zygote
    kills the child. Like a real rank, it is sent SIGTERM when torchrun's agent dies (the
    same prctl as mixprec.parallel.distributed.die_with_agent, which cannot be imported here:
    this process runs without site-packages, to start in milliseconds)."""
    unbuffered = argv[:1] == ["-u"]
    rest = argv[1:] if unbuffered else argv
    script = rest[:1] != ["-m"] and rest[:1] and rest[0].endswith(".py") and Path(rest[0]).is_file()
    reply, answers = {}, None
    # a signal from now until the child's pid is known is held, then forwarded: before, one
    # that came between the fork and the reply killed this process and left the child running
    forwarded = {getattr(signal, name) for name in FORWARDED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    if script or (rest[:1] == ["-m"] and len(rest) > 1):
        request = {
            "argv": rest,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "unbuffered": unbuffered,
        }
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.environ[SOCKET_ENV])
            socket.send_fds(sock, [json.dumps(request).encode()], [1, 2])
            answers = sock.makefile("r")
            reply = json.loads(answers.readline() or "{}")
        except (OSError, KeyError, ValueError):
            reply = {}
    if "pid" not in reply:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the real interpreter's, as given
        python = os.environ[PYTHON_ENV]
        os.execv(python, [python, *argv])
    pid = reply["pid"]

    def forward(sig: int, _frame) -> None:
        for kill in (os.killpg, os.kill):  # (the child may not lead its own group yet)
            with contextlib.suppress(OSError):
                return kill(pid, sig)

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what came meanwhile is forwarded now
    if "TORCHELASTIC_RUN_ID" in os.environ:  # as parallel.distributed.die_with_agent
        import ctypes

        agent = os.getppid()
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != agent:
            forward(signal.SIGTERM, None)
    line = answers.readline()
    code = json.loads(line)["code"] if line else -signal.SIGKILL
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--relay"]:
        relay(sys.argv[2:])
    else:
        main()
