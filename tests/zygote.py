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
starts, signals and torchrun start real processes. tests/test_zygote.py checks that a run
through it and a real process write the same things.
"""

from __future__ import annotations

import contextlib
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
    "mixprec.data.text",
)
# environment keys a child may set that nothing reads while importing PRELOAD
SAFE_ENV = {"PYTHONPATH", "OMP_NUM_THREADS", "WANDB_MODE", "WANDB_SILENT", "PYTHONFAULTHANDLER"}
SAFE_PREFIXES = ("MIXPREC_TEST_",)
# the zygote's own PYTHONPATH entries: a child's come from its request's environment instead
BASE_PYTHONPATH = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


def eligible(env: dict) -> bool:
    """Whether a run with environment `env` can start from the zygote: every key it adds to or
    changes from this process's environment is one that is read after the imports."""
    if os.environ.get("MIXPREC_TEST_ZYGOTE", "1") == "0":
        return False
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
    return all(k in SAFE_ENV or k.startswith(SAFE_PREFIXES) for k in changed)


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
                    media = sys.modules.get("wandb.sdk.data_types._private")
                    if media is not None:
                        media.MEDIA_TMP.cleanup()
                    os._exit(0)
                continue
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                conn.close()
                return {**json.loads(msg), "fds": fds}
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        _reap(waiting)


def _reap(waiting: dict) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def become(request: dict, home: str) -> None:
    """In the child: take the request's session, output, directory, environment and argv as a
    new `python train.py ARGS` process would have them."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out, err = request["fds"]
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in BASE_PYTHONPATH]
    module = _module(request["argv"])
    first = request["cwd"] if module else str(TRAIN.parent)  # -m: the working directory
    sys.path[:] = [first, *extra, *base]
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    _own_wandb_media_dir(home)
    sys.argv = [module, *request["argv"][2:]] if module else request["argv"]  # -m: run_module
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _module(argv: list[str]) -> str:
    """The module of `python -m MODULE ARGS` (argv: what follows the interpreter), else ""."""
    return argv[1] if argv[0] == "-m" else ""


def _own_wandb_media_dir(home: str) -> None:
    """wandb makes one temporary directory for media (tables, images) when it is imported and
    deletes it when that process exits: the forks shared the zygote's, and the first child to
    exit deleted it under the others ("W&B table failed (FileNotFoundError: ...wandb-media/..."
    in a sweep that ran beside it). Each child gets one of its own, deleted at its own exit."""
    private = sys.modules.get("wandb.sdk.data_types._private")
    if private is None:
        return
    tmp = private.MEDIA_TMP  # one object, imported by name into wandb's media modules
    tmp._finalizer.detach()  # the zygote's directory stays the zygote's
    # in the zygote's own directory, which the zygote deletes (train.py ends through os._exit)
    tmp.name = tempfile.mkdtemp("wandb-media", dir=home)
    tmp._finalizer = weakref.finalize(tmp, shutil.rmtree, tmp.name, ignore_errors=True)


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    request = serve(sys.argv[1])
    become(request, home=os.path.dirname(sys.argv[1]))
    import runpy

    if _module(request["argv"]):  # python -m mixprec.diagnose ARGS, and the like
        runpy.run_module(_module(request["argv"]), run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(str(TRAIN), run_name="__main__")  # its exit is the interpreter's own


# ---------------------------------------------------------------------------------- the client

_server: dict = {}


def _connect() -> socket.socket:
    proc = _server.get("proc")
    if proc is None or proc.poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="mixprec-zygote-"), "socket")
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), path],
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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(_server["path"])
    return sock


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
        self.pid = json.loads(self._sock.readline())["pid"]
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


if __name__ == "__main__":
    main()
