"""Stop signals as real tools send them: to the whole process group (a terminal's Ctrl-C, GNU
`timeout`, SLURM), with DataLoader workers running; and resume bit-exact with workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zygote
from test_data import make_folder
from test_reliability import assert_identical, weights
from torch.utils.data import Dataset

from conftest import ROOT, TORCHRUN, finish, run_train, start_session


class Noisy(Dataset):
    """A sample whose "augmentation" is a draw from torch's RNG, as a random crop's is."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        return torch.rand(3), i


@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_depends_on_the_sample_not_on_the_worker_or_a_resume(workers):
    from mixprec.data import Context, Workers
    from mixprec.data.loaders import EpochLoader

    def epoch(loader, e: int, skip: int = 0) -> list:
        loader.set_epoch(e, skip)
        return [(x.tolist(), y.tolist()) for x, y in loader]

    ctx = Context(8, torch.device("cpu"), seed=5, workers=Workers(num_workers=workers))
    single = EpochLoader(Noisy(), Context(8, torch.device("cpu"), seed=5))
    ours = EpochLoader(Noisy(), ctx)
    whole = epoch(single, 1)
    assert epoch(ours, 1) == whole  # any number of workers: the same draws
    assert epoch(ours, 1, skip=2) == whole[2:]  # a resume part-way: the same draws
    assert epoch(ours, 2) != whole  # another epoch: other draws
    before = torch.get_rng_state()
    epoch(single, 1)
    assert torch.equal(torch.get_rng_state(), before)  # the run's own RNG did not move


class WhoServes(Noisy):
    """Noisy's sample, and the parent of the process that served it."""

    def __getitem__(self, i: int):
        return super().__getitem__(i)[0], torch.tensor([i, os.getppid()])


@pytest.mark.slow
def test_workers_beside_a_process_group_on_an_old_python_start_from_a_forkserver(monkeypatch):
    """CPython before 3.11.10 can hang a child forked while another thread creates a Python
    thread state (gh-112275), which torch.distributed's threads do after every collective.
    In a process group on such a Python, workers start from a forkserver (not forked from the
    trainer), and serve exactly the samples forked workers serve; elsewhere they are forked."""
    import torch.distributed as dist

    from mixprec.data import Context, Workers
    from mixprec.data import workers as start
    from mixprec.data.loaders import EpochLoader

    def served(python: tuple) -> tuple[list, set]:
        monkeypatch.setattr(start, "PYTHON", python)
        ctx = Context(8, torch.device("cpu"), seed=5, workers=Workers(num_workers=2))
        loader = EpochLoader(WhoServes(), ctx)
        loader.set_epoch(1)
        rows = [(x.tolist(), y.tolist()) for x, y in loader]
        loader.close()
        return [(x, [i for i, _ in y]) for x, y in rows], {p for _, y in rows for _, p in y}

    forked, parents = served((3, 11, 7))
    assert parents == {os.getpid()}  # no process group: forked from this process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert served((3, 12, 1)) == (forked, parents)  # a fixed Python: forked as before
        samples, parents = served((3, 11, 7))
        assert samples == forked and os.getpid() not in parents and len(parents) == 1
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"), n=24)


def base(images: Path, workers: int = 2, steps: int = 30) -> list[str]:
    return [
        "data=imagenet",
        f"data.root={images}",
        "data.image_size=32",
        "data.eval_resize=36",
        "model=digits_cnn",
        "hardware=cpu",
        f"hardware.num_workers={workers}",
        "batch=8",
        f"trainer.max_steps={steps}",
        "trainer.log_every=5",
        "ckpt.every_steps=5",
        "logger=none",
    ]


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reference")
    proc = run_train([*base(images), f"hydra.run.dir={d}"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    return d


def start(
    args: list[str],
    prefix: list[str] = (),
    python: list[str] = (sys.executable,),
    threads=None,
    forked: bool = False,
) -> subprocess.Popen:
    """train.py as the leader of a process group of its own (as a terminal or timeout starts
    it), so that the group can be signalled without signalling pytest. (A run compared bit for
    bit with another must use the same number of threads.) Real processes, except `forked`
    (a run no signal is sent to: torchrun's agent and ranks from the zygote, zygote.relay; and
    the runs that test what a signal does once training is under way: the real processes
    here, signalled as a group, by `timeout` or through torchrun, cover the rest)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if forked:
        env.update(zygote.relay_env())
    cmd = [*prefix, *python, str(ROOT / "train.py"), *args]
    return start_session(cmd, ROOT, env, merge=True, forked=forked)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 180
    while time.time() < deadline:
        if list((run_dir / "checkpoints").glob(f"step_{step:08d}.pt")):
            return
        if proc.poll() is not None:
            raise AssertionError(finish(proc, 60)[0][-3000:])  # a worker may hold the pipe
        time.sleep(0.05)
    raise AssertionError("the run never reached that step")


def stopped_at_a_checkpoint(run_dir: Path, proc, sig: int) -> None:
    out = finish(proc, 120)[0]
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "a second signal" not in out and "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert summary["status"] == "preempted" and summary["steps"] == ckpt["state"]["step"]


def finish_and_compare(run_dir: Path, images: Path, reference: Path, proc, sig: int) -> None:
    stopped_at_a_checkpoint(run_dir, proc, sig)
    done = run_train([*base(images), "resume=auto", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stdout[-3000:]
    assert_identical(weights(run_dir), weights(reference))  # bit-exact, workers and all


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_with_workers_stops_once_and_resumes_exactly(
    tmp_path, images, reference, sig
):
    proc = start([*base(images), f"hydra.run.dir={tmp_path}"])
    wait_for_step(tmp_path, proc, 10)
    os.killpg(proc.pid, sig)  # the trainer and its two workers, as a terminal's Ctrl-C does
    finish_and_compare(tmp_path, images, reference, proc, sig)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP])
def test_a_schedulers_signal_to_the_group_checkpoints_once(tmp_path, images, sig):
    """SIGUSR1, SIGUSR2 and SIGHUP stop as SIGINT and SIGTERM do (the real processes above and
    below): here forked from the zygote, the leader of a session of its own all the same."""
    proc = start([*base(images, steps=100000), f"hydra.run.dir={tmp_path}"], forked=True)
    wait_for_step(tmp_path, proc, 10)
    os.killpg(proc.pid, sig)
    stopped_at_a_checkpoint(tmp_path, proc, sig)


@pytest.mark.slow
def test_gnu_timeout_signals_the_group_and_the_run_checkpoints(tmp_path, images):
    """`timeout` without --foreground sends SIGTERM to its whole process group."""
    args = [*base(images, steps=100000), f"hydra.run.dir={tmp_path}"]
    proc = start(args, prefix=["timeout", "--preserve-status", "-s", "TERM", "15"])
    stopped_at_a_checkpoint(tmp_path, proc, signal.SIGTERM)


@pytest.mark.slow
def test_gnu_timeout_foreground_signals_the_trainer_alone(tmp_path, images):
    """`timeout --foreground` (a terminal's job control kept) signals the child only: the
    workers never see it, and the trainer stops them itself."""
    args = [*base(images, steps=100000), f"hydra.run.dir={tmp_path}"]
    proc = start(args, prefix=["timeout", "--foreground", "--preserve-status", "-s", "INT", "15"])
    stopped_at_a_checkpoint(tmp_path, proc, signal.SIGINT)


@pytest.mark.slow
def test_torchrun_with_workers_signalled_as_a_group_stops_every_rank_once(tmp_path, images):
    """SIGTERM to torchrun's process group (a terminal, `timeout`, a scheduler): the agent gets
    it and sends it on to each rank's own process group (torchrun starts every rank in a
    session of its own), so the ranks and their loader workers get it once. The ranks agree on
    one stop step, rank 0 checkpoints it, and the printed torchrun command resumes to the
    weights of an uninterrupted torchrun run, bit for bit; that run has no loader workers (a
    sample's augmentation is its own, whoever serves it), so no forkservers of its own either.
    (torchrun itself then exits 1 with its SignalException: torch's agent, not the run, sets
    that code.)"""
    run_dir, ref = tmp_path / "run", tmp_path / "ref"
    # the uninterrupted run and the resume are signalled by no one: forked (zygote.relay)
    plain = [*base(images, workers=0), f"hydra.run.dir={ref}"]
    done = start(plain, python=TORCHRUN, threads=1, forked=True)
    out = finish(done, 300)[0]
    assert done.returncode == 0, out[-3000:]
    proc = start([*base(images), f"hydra.run.dir={run_dir}"], python=TORCHRUN, threads=1)
    wait_for_step(run_dir, proc, 10)
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc, 120)[0]
    log = run_dir / "train.log"  # rank 0's own lines, which torchrun's output may bury
    said = (out[-3000:], log.read_text()[-3000:] if log.exists() else "no train.log")
    assert out.count("preempted in") == 1 and "a second signal" not in out, said
    assert "continue with: torchrun --nproc_per_node=2 train.py" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (summary["status"], summary["exit_code"]) == ("preempted", 143)
    assert summary["steps"] == ckpt["state"]["step"] < 30
    resume = [*base(images), "resume=auto", f"hydra.run.dir={run_dir}"]
    again = start(resume, python=TORCHRUN, threads=1, forked=True)
    out = finish(again, 300)[0]
    assert again.returncode == 0, out[-3000:]
    assert_identical(weights(run_dir), weights(ref))


@pytest.mark.slow
def test_sigkill_to_torchruns_group_takes_its_ranks_down_with_a_checkpoint(tmp_path, images):
    """`timeout -s KILL torchrun ...` or `kill -9 -PGID`: the SIGKILL reaches the agent alone
    (each rank leads a session of its own); the ranks, told by the kernel that their parent
    died (SIGTERM), stop at one step with a checkpoint instead of training on as orphans."""
    from conftest import _family

    run_dir = tmp_path / "run"
    proc = start(
        [*base(images, steps=100000), f"hydra.run.dir={run_dir}"], python=TORCHRUN, threads=1
    )
    wait_for_step(run_dir, proc, 10)
    os.killpg(proc.pid, signal.SIGKILL)
    out = finish(proc, 120)[0]  # returns once every rank has let go of the output
    assert not _family(proc), out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (summary["status"], summary["exit_code"]) == ("preempted", 143), out[-3000:]
    assert summary["steps"] == ckpt["state"]["step"] >= 10


@pytest.mark.slow
def test_a_signal_to_one_worker_alone_does_not_stop_the_run(tmp_path, images):
    """(Workers end with each epoch and start again: on a loaded machine one look at step 10
    could fall between two epochs' workers, so the test looks until it finds one.)"""
    args = [*base(images, steps=60), "trainer.stop_grace_s=3", f"hydra.run.dir={tmp_path}"]
    proc = start(args, forked=True)
    wait_for_step(tmp_path, proc, 10)
    sent, deadline = False, time.time() + 60
    while not sent and proc.poll() is None and time.time() < deadline:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        for pid in [int(p) for p in workers.stdout.split()][:1]:
            with contextlib.suppress(ProcessLookupError):  # (it ended with its epoch: next)
                os.kill(pid, signal.SIGUSR1)
                sent = True
        time.sleep(0.02)
    assert sent, "no worker process found"
    out = finish(proc, 180)[0]
    assert proc.returncode == 0, out[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_sixteen_workers_and_ctrl_c(tmp_path, images):
    proc = start([*base(images, workers=16), f"hydra.run.dir={tmp_path}"], forked=True)
    wait_for_step(tmp_path, proc, 10)
    os.killpg(proc.pid, signal.SIGINT)
    out = finish(proc, 120)[0]
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["checkpoint"]


@pytest.mark.slow
def test_the_same_signal_twice_at_once_is_one_stop(tmp_path, images):
    """GNU `timeout` signals its child and then the child's whole process group: the trainer
    gets the signal twice within microseconds. That is one stop (a checkpoint), not a second
    Ctrl-C (an exit without one). Seen on the H200 with 16 workers."""
    proc = start([*base(images, steps=100000), f"hydra.run.dir={tmp_path}"], forked=True)
    wait_for_step(tmp_path, proc, 10)
    os.kill(proc.pid, signal.SIGINT)
    # two deliveries, not one coalesced pending signal: a few ms lets the first be delivered;
    # 50 ms let a fast run checkpoint and exit first, and the group was gone for the second
    time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    stopped_at_a_checkpoint(tmp_path, proc, signal.SIGINT)


@pytest.mark.slow
def test_a_run_that_hangs_fails_with_its_stacks_and_leaves_no_process(tmp_path):
    """The harness every test here waits through: a process that exits while its child still
    holds the output (a rank of torchrun, in a session of its own, stuck after its agent)
    fails the test within the time given, shows where each Python process stood, and is killed
    with its child."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        "def the_child_waits_here():\n"
        "    while True: time.sleep(1)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"  # as torchrun starts each rank: in a session of its own
        "    print(os.getpid(), flush=True)\n"
        "    the_child_waits_here()\n"
        "time.sleep(0.5)\n"
    )
    proc = start_session([sys.executable, str(script)], tmp_path, dict(os.environ), merge=True)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        finish(proc, 3)
    assert time.monotonic() - t0 < 30
    message = str(failed.value)
    assert "did not finish within 3 s" in message and "the_child_waits_here" in message
    child = int(message.split("stacks of its Python processes:\n")[1].split()[0])
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{child}").exists()
        or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    )


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_writes_its_report_and_one_printed_command_finishes_it(tmp_path):
    """Issue 93, item 1: Ctrl-C during a plain `-m` sweep stopped the running job, the rest
    never ran, no report.md was written, and the printed command resumed that one job only
    (its report row then labelled `...,resume=auto`). Now the report of what ran is written,
    and the one printed command finishes the sweep: the finished job is read back, the stopped
    one continues, the last one runs, and the rows carry the sweep's own labels."""
    sweep = tmp_path / "sweep"
    args = ["-m", "seed=0,1,2", "hardware=cpu", "logger=none", "trainer.max_steps=300"]
    args += ["ckpt.every_steps=5", "trainer.log_every=50", f"hydra.sweep.dir={sweep}"]
    proc = start(args)
    wait_for_step(sweep / "1_seed=1", proc, 10)  # a job's folder: its number and swept values
    os.killpg(proc.pid, signal.SIGINT)
    out = finish(proc, 120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out
    line = next(x for x in out.splitlines() if "finish the sweep with: " in x)
    command = line.split("finish the sweep with: ", 1)[1].split()
    assert command[:3] == ["python", "train.py", "-m"] and "resume=auto" in command
    report = (sweep / "report.md").read_text()
    assert "preempted" in report and not (sweep / "2_seed=2").exists()
    done = run_train(command[2:])  # (run_train starts python train.py)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        "0_seed=0",
        "1_seed=1",
        "2_seed=2",
    ]
    for job in ("0_seed=0", "1_seed=1", "2_seed=2"):
        assert json.loads((sweep / job / "summary.json").read_text())["status"] == "completed"
    report = (sweep / "report.md").read_text()
    assert "resume=auto" not in report and report.count("| completed |") == 3, report
