"""A disk that fails or stalls does not stop training: `keel train` at dp2 with its checkpoints on a real
tmpfs that the test fills, and with its run store's write lock held by another connection (a backup, a
slow network file system).

A checkpoint save that fails is survivable. A disk full for a while costs the saves made meanwhile (one event and one alert
each, the cause in one line) and nothing else: the saves after the space returns succeed, no worker
restarts, and the losses are those of a run that never saw a full disk. A disk that stays full stops the
run after three failed saves in a row, with the cause on the console and its own exit code. A store
locked for longer than the watchdog's floor is neither a hang nor a restart: the steps go on meanwhile,
their rows wait in memory, and the stall is one event.

Mounting a tmpfs needs root (CI runs as root, as the namespace hosts of tests/hosts.py do)."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from keel.monitor.exits import EXIT_OK, EXIT_SAVES_FAILING
from keel.monitor.store import read_events, read_steps

pytestmark = pytest.mark.slow

STEPS, EVERY = 40, 5
# The tiny job's checkpoint is about 4 MiB; room for the three kept and one being written, and some to spare.
TMPFS = "24m"
LOCKED_S = 12.0


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Writes a file into `folder` until its file system is full; returns the file."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def start_training(run_dir: Path, *args: str) -> subprocess.Popen:
    """`keel train` at dp2 for STEPS steps, saving every EVERY steps, each step made 200 ms slower (a
    straggler fault: it changes no number) so the test can act between saves."""
    command = [sys.executable, "-m", "keel.cli", "train", f"--run-dir={run_dir}", "--config=tiny", "--dp=2", f"--steps={STEPS}",
               "--monitor.prometheus=false", "--monitor.wandb=false", f"--checkpoint.interval_steps={EVERY}",
               f"--fault=straggler@step=1,steps={STEPS},ms=200", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # as conftest's keel(): the references' setting
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_event(run_dir: Path, kind: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the run's store holds an event of `kind` (read with sqlite3 itself, every 20 ms: quick)."""
    deadline = time.monotonic() + timeout
    query = "SELECT COUNT(*) FROM events WHERE kind = ?"
    while True:
        with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True)) as conn:
            if conn.execute(query, (kind,)).fetchone()[0]:
                return
        assert proc.poll() is None and time.monotonic() < deadline, f"no {kind} event"
        time.sleep(0.02)


class Console:
    """The run's console, read line by line as it comes (a thread), so the test acts at once on what it shows."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self._reader.start()

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in list(self.lines)):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {pattern!r} on the console:\n{self.text()[-4000:]}"
            time.sleep(0.02)

    def finish(self, timeout: float = 300) -> str:
        self.proc.wait(timeout=timeout)
        self._reader.join()
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


def test_a_disk_full_for_a_while_costs_its_saves_and_nothing_else(tmp_path, tiny_dp2_40):
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "checkpoints", TMPFS) as checkpoints:
        console = Console(start_training(run_dir))
        console.wait_for(r"step\s+3/")
        filler = fill(checkpoints)  # the save of step EVERY finds the disk full
        wait_for_event(run_dir, "checkpoint_failed", console.proc)
        filler.unlink()
        output = console.finish()
        assert console.proc.returncode == EXIT_OK, output[-4000:]
        events = read_events(run_dir)
    failed = events[events.kind == "checkpoint_failed"]
    # Each failed save: one event, its cause in one line naming the disk and the space left.
    for message in failed.message:
        assert "\n" not in message and message.count("disk full: ") == 1 and "MiB free on" in message, message
    assert failed.step.iloc[0] == EVERY and len(failed) <= 2  # the space came back before a third save
    saved = events[events.kind == "checkpoint_saved"]
    assert saved.step.max() == STEPS and (saved.step > failed.step.max()).any()
    assert not set(events.kind) & {"restart", "rollback", "run_stopped"}, set(events.kind)
    assert "run_finished" in set(events.kind) and "Logging error" not in output
    # The disk changed nothing the run computed: the losses of the same run that never saw it, bit for bit.
    run = read_steps(run_dir, effective=True)
    np.testing.assert_array_equal(run.loss.to_numpy(), tiny_dp2_40.loss.to_numpy())


def test_a_disk_that_stays_full_stops_the_run_with_its_cause(tmp_path):
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "checkpoints", TMPFS) as checkpoints:
        fill(checkpoints)
        console = Console(start_training(run_dir))
        output = console.finish()
        events = read_events(run_dir)
    assert console.proc.returncode == EXIT_SAVES_FAILING, output[-4000:]
    assert list(events[events.kind == "checkpoint_failed"].step) == [EVERY, 2 * EVERY, 3 * EVERY]
    [stopped] = events[events.kind == "run_stopped"].itertuples()
    # Stopped once the third failure was known: its save runs in the background, so a step or two later.
    assert 3 * EVERY <= stopped.step < 4 * EVERY and stopped.data["exit_code"] == EXIT_SAVES_FAILING
    assert "3 checkpoints in a row failed, the last: disk full: " in stopped.message
    # On the console: that cause, not a worker's "exit code 1" nor a flood of logging errors.
    assert f"run stopped at step {stopped.step}: 3 checkpoints in a row failed, the last: disk full" in output
    assert "exit code 1" not in output and "Logging error" not in output
    assert len(output.splitlines()) < 60, output


def test_a_store_locked_past_the_watchdogs_floor_is_one_event_not_a_hang(tmp_path, tiny_dp2_40):
    run_dir = tmp_path / "run"
    console = Console(start_training(run_dir))
    console.wait_for(r"step\s+2/")
    lock = sqlite3.connect(run_dir / "run.sqlite", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the write lock: held past the watchdog's 10 s floor and SQLite's 10 s busy timeout
    locked_at = time.time()
    time.sleep(LOCKED_S)
    lock.execute("COMMIT")
    unlocked_at = time.time()
    lock.close()
    output = console.finish()
    assert console.proc.returncode == EXIT_OK, output[-4000:]
    events = read_events(run_dir)
    assert not set(events.kind) & {"hang", "restart", "run_stopped"}, set(events.kind)
    [stall] = events[events.kind == "store_stalled"].itertuples()
    assert stall.data["stalled_s"] >= LOCKED_S - 2 and stall.data["dropped"] == 0 and stall.data["queued"] > 0
    # Training went on while the store was locked: steps ran in that window, recorded once it opened.
    run = read_steps(run_dir, effective=True)
    during = run[(run.time > locked_at + 1) & (run.time < unlocked_at - 1)]
    assert len(during) >= 5, run[["step", "time"]]
    np.testing.assert_array_equal(run.loss.to_numpy(), tiny_dp2_40.loss.to_numpy())
