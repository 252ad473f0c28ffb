"""Shared helpers: run `keel train` as a user would (a real torchrun with gloo workers) and read its store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from keel.monitor.store import read_steps

REPO = Path(__file__).resolve().parents[1]


def keel(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    # One thread per worker: with two OpenMP threads per process, anything else on the machine makes
    # their spin-waits collide and a 20 ms step takes seconds. Every run in a test (references too)
    # gets the same setting, so the comparisons stay exact.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "keel.cli", *args]
    # A session of its own, so that a run that times out is stopped with its torchrun and workers.
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def plain_torchrun(workers: int, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The worker module started by torchrun directly, without `keel train` (as a cluster script does)."""
    module = ["-m", "keel.trainer.train", *args]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}", *module]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def train(run_dir: Path, *args: str, timeout: float = 300):
    """Runs `keel train --run-dir run_dir ARGS`; returns the effective step metrics."""
    proc = keel("train", "--run-dir", str(run_dir), *args, timeout=timeout)
    assert proc.returncode == 0, f"keel train {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_steps(run_dir, effective=True)


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory) -> Path:
    """The single-process tiny run that every parallel layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(run_dir, "--config", "tiny", "--pp", "1", "--dp", "1", "--tp", "1")
    return run_dir


@pytest.fixture(scope="session")
def reference_run(reference_dir):
    return read_steps(reference_dir, effective=True)
