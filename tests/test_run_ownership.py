"""A run directory has one live trainer, and a trainer never outlives its launcher.

Before these guarantees, a `keel train` killed with its process group left its workers training (torchrun
starts each in a session of its own), and a `keel train --resume` then trained beside them on the same
store and checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NO_WANDB, keel

from keel.monitor.run_dir import CHECKPOINT_DIR, LOCK_FILE
from keel.monitor.run_lock import RunDirBusy, check_free, own
from keel.monitor.store import read_steps

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


def _processes_writing(run_dir: Path) -> list[int]:
    """Pids of live processes that name the run directory on their command line (the launcher, torchrun)
    or hold a file in it open (the workers: their logs, the store, rank 0 the lock)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "stat").read_text().split(") ")[1][0] == "Z":  # a zombie has ended
                continue
            if str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace") or _holds_a_file_in(proc, run_dir):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _holds_a_file_in(proc: Path, run_dir: Path) -> bool:
    for fd in (proc / "fd").iterdir():
        try:
            if os.readlink(fd).startswith(f"{run_dir}/"):
                return True
        except OSError:
            continue
    return False


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_a_killed_launcher_ends_its_workers_and_a_resume_beside_a_live_run_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "keel.cli", "train", "--config", "tiny", "--dp", "2", "--steps", "100000",
           "--checkpoint.interval_steps=5", "--run-dir", str(run_dir), NO_WANDB]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _wait(lambda: (run_dir / CHECKPOINT_DIR).is_dir() and any((run_dir / CHECKPOINT_DIR).glob("step-*")), 120)
        # A second trainer on the live run is refused before it starts a worker, naming the holder.
        second = keel("train", "--resume", str(run_dir), timeout=120)
        assert second.returncode == 2, second.stderr
        [line] = second.stderr.strip().splitlines()
        holder = int(line.split("in use by pid ")[1].split()[0])
        assert f"on host {os.uname().nodename}" in line and holder in _processes_writing(run_dir), line
        # The launcher and torchrun die at once (SIGKILL, neither can stop the workers; a SIGKILL to the
        # group would reach the workers themselves); the workers follow within seconds.
        for pid in [*_children(job.pid), job.pid]:
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout=30)
        assert _wait(lambda: not _processes_writing(run_dir), 15), f"workers still running: {_processes_writing(run_dir)}"
    finally:
        for pid in _processes_writing(run_dir):
            os.kill(pid, signal.SIGKILL)
    stopped_at = int(read_steps(run_dir).step.max())  # the store is readable after the kill
    time.sleep(2)
    assert int(read_steps(run_dir).step.max()) == stopped_at  # and nothing writes it any more
    check_free(run_dir)  # the dead owner left no lock behind: the resume that follows is let in
    resumed = keel("train", "--resume", str(run_dir), "--steps", str(stopped_at + 3), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert int(read_steps(run_dir, effective=True).step.max()) == stopped_at + 3
    assert not list(run_dir.glob("run.sqlite-*")), "a finished run leaves its store as one file"


def test_the_lock_names_its_holder_and_ends_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"from keel.monitor.run_lock import own; h = own({str(tmp_path)!r}); "
                               "print('held', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"in use by pid {holder.pid} on host {os.uname().nodename} \(since"):
            check_free(tmp_path)
        with pytest.raises(RunDirBusy):
            own(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    check_free(tmp_path)
    with own(tmp_path):
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
