"""Shared helpers: run `keel train` as a user would (a real torchrun with gloo workers) and read its store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.monitor.store import read_steps

REPO = Path(__file__).resolve().parents[1]


def keel(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "keel.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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
