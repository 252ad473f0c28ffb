"""Shared helpers: run `keel train` as a user would (a real torchrun with gloo workers) and read its store."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from keel.monitor.store import read_events, read_steps

REPO = Path(__file__).resolve().parents[1]
# W&B is on by default and adds about a second to every run, a fifth of a tiny one (its import and offline
# start-up on rank 0), so the runs these helpers start leave it off unless the test sets a monitor.wandb field.
NO_WANDB = "--monitor.wandb=false"


# The suite runs on two pytest-xdist workers (-n 2 in pyproject.toml): a tiny training run leaves a third of
# two cores idle (launcher, agent and workers start one after another), and a second test fills it. Each test
# module runs whole on one worker (its module fixtures are made once), and the modules that read the costly
# drill below run on the same worker (a session fixture is made once per worker that needs it; cheaper ones,
# a tiny reference run, are made on each). xdist's own loadgroup marks do not take under pytest 9 (they
# rename `_nodeid`, which pytest 9 no longer reads), so the grouping is a scheduler of Keel's.
SHARED_ON_ONE_WORKER = ("collective_drill", "drill_runs")  # a pp2 dp2 tp2 drill (141 s) and its runs
READ_THE_DRILL = ("tests/test_dashboard.py", "tests/test_dashboard_browser.py", "tests/test_dashboard_events.py", "tests/test_drill.py")


class ModulesOnOneWorker(LoadScopeScheduling):
    """xdist's module-at-a-time scheduling, with the modules that read the drill as one module."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "the collective drill" if module in READ_THE_DRILL else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return ModulesOnOneWorker(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `exclusive` runs (its fixtures too) while no other test does: it holds the suite's lock
    alone, every other test holds it shared. Only under xdist: the lock is in the folder its workers'
    temporary folders share (pytest-N/, which pytest's retention cleans up)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with open(item.config._tmp_path_factory.getbasetemp().parent / "exclusive.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("exclusive") else fcntl.LOCK_SH)
        yield


@pytest.fixture(scope="session", autouse=True)
def no_wandb_api_key(tmp_path_factory):
    """No API key reaches a run (WANDB_API_KEY, a `wandb login` entry): W&B runs in tests log offline and
    never go to the network, even on a developer's machine."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("WANDB_API_KEY", raising=False)
        env.setenv("NETRC", str(tmp_path_factory.mktemp("netrc") / "missing"))  # where wandb looks first
        yield


def _without_wandb(args: tuple[str, ...]) -> list[str]:
    return list(args) if any(arg.lstrip("-").startswith("monitor.wandb") for arg in args) else [*args, NO_WANDB]


def keel(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # One thread per worker: with two OpenMP threads per process, anything else on the machine makes
    # their spin-waits collide and a 20 ms step takes seconds. Every run in a test (references too)
    # gets the same setting, so the comparisons stay exact.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    cmd = [sys.executable, "-m", "keel.cli", *(_without_wandb(args) if args[0] == "train" else args)]
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
    module = ["-m", "keel.trainer.train", *_without_wandb(args)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}", *module]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def train(run_dir: Path, *args: str, timeout: float = 300):
    """Runs `keel train --run-dir run_dir ARGS`; returns the effective step metrics."""
    proc = keel("train", "--run-dir", str(run_dir), *args, timeout=timeout)
    assert proc.returncode == 0, f"keel train {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_steps(run_dir, effective=True)


def drill(run_dir: Path, *args: str, timeout: float = 900) -> tuple[int, dict, Path, str]:
    """Runs `keel drill --run-dir run_dir ARGS`; returns its exit code, report.json, report folder and output."""
    proc = keel("drill", "--run-dir", str(run_dir), *args, timeout=timeout)
    reports = sorted((run_dir / "drills").glob("drill-*/report.json"))
    assert reports, f"no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(reports[-1].read_text()), reports[-1].parent, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def collective_drill(tmp_path_factory) -> tuple[int, dict, Path, str]:
    """A drill of a 3D-parallel job (pp2 dp2 tp2): a hang, a crash and slow communication on rank 7. Its
    runs hold what a user sees after such faults (a watchdog kill and torchrun's restart, a straggler);
    the drill and dashboard tests share it."""
    args = ("--config", "tiny", "--pp=2", "--dp=2", "--tp=2", "--faults=hang;crash;late_collective", "--drill-steps=16", "--fault-step=9",
            "--checkpoint-every=4")  # fmt: skip
    return drill(tmp_path_factory.mktemp("drill") / "job", *args)


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory) -> Path:
    """The single-process tiny run that every parallel layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(run_dir, "--config", "tiny", "--pp", "1", "--dp", "1", "--tp", "1")
    return run_dir


@pytest.fixture(scope="session")
def tiny_dp2_40(tmp_path_factory):
    """The uninterrupted tiny dp2 run of 40 steps that the cluster tests' interrupted runs (preempted, requeued by
    SLURM, a node replaced) must follow bit for bit: checkpoints and nodes do not change a trajectory."""
    return train(tmp_path_factory.mktemp("tiny_dp2_40") / "run", "--config=tiny", "--dp=2", "--steps=40", "--monitor.prometheus=false")


@pytest.fixture(scope="session")
def reference_run(reference_dir):
    return read_steps(reference_dir, effective=True)


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory) -> Path:
    """A real run with checkpoints, a loss spike from bad data, the rollback and the data skip. Snapshots at a
    fixed interval, not a measured one: the rollback's target (step 25, after both checkpoints) is the same
    however loaded the machine is, and so is what the dashboard tests draw."""
    run_dir = tmp_path_factory.mktemp("dashboard") / "spike"
    train(run_dir, "--config=tiny", "--pp=1", "--dp=1", "--tp=1", "--steps=60", "--checkpoint.interval_steps=10",
          "--checkpoint.snapshot_every_steps=5", "--spike.warmup_steps=12", "--spike.min_baseline=8",
          "--fault=spike@step=30,steps=3")  # fmt: skip
    assert (read_events(run_dir).kind == "rollback").sum() == 1
    return run_dir


@pytest.fixture(scope="session")
def drill_runs(collective_drill, tmp_path_factory) -> Path:
    """The runs of a pp2 dp2 tp2 drill (hang, crash, slow communication) in a folder, as a user who keeps
    them would link them; the drill's report stays where the drill wrote it."""
    folder = tmp_path_factory.mktemp("drill-runs")
    for run in (collective_drill[2] / "runs").iterdir():
        (folder / run.name).symlink_to(run, target_is_directory=True)
    return folder
