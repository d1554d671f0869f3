"""The tests' train.py runs and torchrun's processes start from tests/zygote.py (a fork of a
process that has imported what train.py imports): they must write what `python train.py` and
torchrun's real processes write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import zygote

from conftest import (
    LM_CPU,
    ROOT,
    last_weights,
    run_module,
    run_torchrun,
    run_train,
    train_losses,
)

QUICK = ["hardware=cpu", "logger=none", "trainer.max_steps=4", "trainer.log_every=1"]


@pytest.mark.slow  # (train.py runs: the full suite's)
def test_a_run_from_the_zygote_writes_what_a_new_process_writes(tmp_path, monkeypatch):
    runs = {}
    for how in ("zygote", "process"):
        monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1" if how == "zygote" else "0")
        d = tmp_path / how
        proc = run_train([*QUICK, f"hydra.run.dir={d}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads((d / "summary.json").read_text())
        runs[how] = (train_losses(d), summary["val_loss"], summary["status"], proc.stdout)
    assert runs["zygote"][:3] == runs["process"][:3]
    for how in runs:  # the same log lines (less their times)
        assert "completed in" in runs[how][3] and "first step took" in runs[how][3]


@pytest.mark.slow
def test_a_config_error_from_the_zygote_exits_2_with_the_same_message(tmp_path, monkeypatch):
    got = {}
    for how in ("zygote", "process"):
        monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1" if how == "zygote" else "0")
        proc = run_train([*QUICK, "optimizer.lr=-1", f"hydra.run.dir={tmp_path / how}"])
        said = (proc.stdout + proc.stderr).strip().splitlines()[-1]
        got[how] = (proc.returncode, re.sub(r"^\[[\d:]+\] ", "", said))  # (less its time)
    assert got["zygote"] == got["process"]
    assert got["zygote"][0] == 2 and "optimizer.lr" in got["zygote"][1]


def test_a_run_that_needs_an_import_time_variable_starts_a_new_process(monkeypatch):
    monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1")
    assert zygote.eligible({**zygote.os.environ, "OMP_NUM_THREADS": "1"})
    assert not zygote.eligible({**zygote.os.environ, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})
    monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "0")
    assert not zygote.eligible(dict(zygote.os.environ))


@pytest.mark.slow
def test_a_fork_that_exits_leaves_the_next_its_wandb_media_directory(tmp_path):
    """wandb's media directory (where a W&B table is written before it is logged) is made when
    wandb is imported, in the zygote; a child that ends through the interpreter's exit (a
    `python -m mixprec.diagnose`; train.py ends through os._exit) deleted it under the next
    child, which logged "W&B table failed (FileNotFoundError ...)" and dropped W&B."""
    assert run_module("mixprec.diagnose", ["--help"]).returncode == 0
    proc = run_train(["trainer.max_steps=2", "logger=wandb", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B table failed" not in proc.stderr, proc.stderr[-3000:]
    assert list((tmp_path / "wandb").rglob("*.table.json")), "the run logged no W&B table"


# ------------------------------------------------- torchrun's processes through tests/zygote_python

PROBE = """import json, os, signal, sys, time
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda s, f: (print("got", s, flush=True), sys.exit(7)))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
    "preloaded": "timm" in sys.modules, "pid": os.getpid()}), flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _holders(path: Path) -> list[int]:
    """The pids of the processes that hold `path` open (this test's own excepted)."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [p for p in found if p != os.getpid()]


def relayed(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    """`python -u probe.py ARGS` as torchrun starts a rank: its PYTHON_EXEC, in a session."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    full = {**os.environ, **zygote.relay_env(), "RANK": "1", **env}
    return subprocess.Popen(
        [full["PYTHON_EXEC"], "-u", str(script), *args],
        cwd=tmp_path,
        env=full,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_relayed_rank_is_forked_with_its_argv_directory_environment_and_exit_code(tmp_path):
    proc = relayed(tmp_path, "3")
    said = json.loads(proc.stdout.readline())
    assert proc.wait(60) == 3
    assert said["preloaded"]  # forked from the zygote: timm was there before the script ran
    assert said["argv"] == [str(tmp_path / "probe.py"), "3"]
    assert (said["cwd"], said["rank"]) == (str(tmp_path), "1")
    assert said["pid"] != proc.pid


def test_a_rank_whose_environment_the_zygote_cannot_take_starts_as_a_real_process(tmp_path):
    proc = relayed(tmp_path, "0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    said = json.loads(proc.stdout.readline())
    assert proc.wait(60) == 0
    assert not said["preloaded"] and said["pid"] == proc.pid  # exec'd: torch's own interpreter


def test_a_signal_to_a_relayed_rank_reaches_the_child_and_its_exit_is_the_childs(tmp_path):
    proc = relayed(tmp_path, "wait")
    child = json.loads(proc.stdout.readline())["pid"]
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's agent stops a rank
    assert proc.stdout.readline().strip() == f"got {int(signal.SIGTERM)}"
    assert proc.wait(60) == 7
    assert not Path(f"/proc/{child}").exists()


def test_a_relayed_rank_killed_takes_its_child_down(tmp_path):
    proc = relayed(tmp_path, "wait")
    child = json.loads(proc.stdout.readline())["pid"]
    os.killpg(proc.pid, signal.SIGKILL)  # nothing can forward a SIGKILL: the zygote sees it
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


@pytest.mark.slow
def test_torchrun_with_relayed_ranks_trains_what_real_ranks_train(tmp_path, monkeypatch):
    """The torchrun tests' agent and ranks are forked from the zygote: the same run with real
    processes logs the same losses and ends with the same weights, bit for bit."""
    got, forks = {}, {}
    for how in ("zygote", "process"):
        monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1" if how == "zygote" else "0")
        d, log = tmp_path / how, tmp_path / f"{how}.forks"
        args = [str(ROOT / "train.py"), *LM_CPU, "trainer.max_steps=3", f"hydra.run.dir={d}"]
        p = run_torchrun(args, {zygote.LOG_ENV: str(log)})
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        got[how] = (train_losses(d), last_weights(d), json.loads((d / "summary.json").read_text()))
        forks[how] = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    assert [f["argv"][:2] for f in forks["zygote"]][:1] == [["-m", "torch.distributed.run"]]
    assert sorted(f["rank"] for f in forks["zygote"][1:]) == ["0", "1"]  # the agent's ranks
    assert {f["argv"][0] for f in forks["zygote"][1:]} == {str(ROOT / "train.py")}
    assert forks["process"] == []
    assert got["zygote"][0] == got["process"][0]
    for k, w in got["process"][1].items():
        assert torch.equal(got["zygote"][1][k], w), k
    for key in ("status", "steps", "world_size", "val_loss"):
        assert got["zygote"][2][key] == got["process"][2][key], key


def test_a_signal_before_the_relay_knows_its_child_is_held_and_forwarded(tmp_path):
    """The zygote replies with the child's pid a second after forking it (a loaded machine): a
    SIGTERM in between killed the relay, which had no forwarding yet, and left the child
    running; now it is held until the pid is known, then forwarded."""
    proc = relayed(tmp_path, "wait", **{zygote.DELAY_ENV: "1"})
    child = json.loads(proc.stdout.readline())["pid"]  # the child runs: its first line is out
    os.killpg(proc.pid, signal.SIGTERM)  # before the relay has heard of it
    assert proc.wait(60) == 7, "the relay died of the signal instead of forwarding it"
    assert proc.stdout.readline().strip() == f"got {int(signal.SIGTERM)}"
    assert not Path(f"/proc/{child}").exists()


def _ask_zygote(tmp_path, **env: str):
    """A client's own request for `probe.py wait` (stdout to tmp_path/out), sent straight to
    the zygote's socket: the connection, for the test to read from or hang up."""
    import socket

    (tmp_path / "probe.py").write_text(PROBE)
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    request = {"argv": [str(tmp_path / "probe.py"), "wait"], "cwd": str(tmp_path)}
    request |= {"env": {**os.environ, "RANK": "1", **env}, "unbuffered": True}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(zygote.relay_env()[zygote.SOCKET_ENV])
    socket.send_fds(sock, [json.dumps(request).encode()], [out.fileno(), err.fileno()])
    out.close(), err.close()
    return sock


def test_a_client_gone_before_its_child_leads_a_session_takes_the_child_with_it(tmp_path):
    """The client hung up after the pid's reply but before its child's setsid (a loaded
    machine, where the suite's full run failed once): the server killed the child's group, which
    did not exist yet, and the child ran on. Now the child itself goes too."""
    sock = _ask_zygote(tmp_path, **{zygote.SETSID_DELAY_ENV: "3"})
    child = json.loads(sock.makefile().readline())["pid"]  # the reply came: the server waits on it
    sock.close()  # gone while the child has not yet left the server's process group
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}/fd").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _holders(tmp_path / "out"), "the child of a client that died runs on"
    assert relayed(tmp_path, "0").wait(60) == 0, "the server stopped serving"


def test_a_client_gone_before_its_reply_leaves_the_zygote_serving_and_no_child(tmp_path):
    """The server wrote the child's pid to a client that had died (killed as it asked): the
    broken pipe ended the server, and every later run of the session failed. Now the child
    goes (no one would wait for it) and the server goes on."""
    _ask_zygote(tmp_path, **{zygote.DELAY_ENV: "1"}).close()  # gone before the reply
    # The server takes its requests in turn, so once the next one is served this one has been
    # dealt with: until the server receives them, the stdout and stderr it was sent are held by
    # no process (in flight in the socket), and a look for their holders saw none too early.
    proc = relayed(tmp_path, "3")  # the server still serves
    assert json.loads(proc.stdout.readline())["preloaded"] and proc.wait(60) == 3
    # The child may be ended before it prints (a loaded machine can leave it unscheduled for
    # the whole reply delay), so it is found by what it holds: the stdout the request sent.
    deadline = time.monotonic() + 30
    while _holders(tmp_path / "out") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _holders(tmp_path / "out"), "the child of a client that died runs on"
    printed = (tmp_path / "out").read_text().splitlines()
    if printed:  # it started in time: that pid is gone too
        assert not Path(f"/proc/{json.loads(printed[0])['pid']}").exists()
