"""The restart budget of a long job and the attribution of each failure (keel.trainer.launch.restarts), unit by
unit and on real runs: a crash loop stops with its record and a resume command, a failure names the rank
that failed first, a node loss is resumed and recorded, and the console, ETA and MFU hold across restarts."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import NO_WANDB, keel, train

from keel.monitor.exits import EXIT_HANG, EXIT_OOM_RESTART, EXIT_RESTART_CAP
from keel.monitor.run_dir import CHAOS_DIR, INJECTED_FILE
from keel.monitor.store import RunStore, read_events, read_meta, read_steps
from keel.trainer.launch.restarts import RestartBudget, first_failed, furthest_step, read_failures
from keel.trainer.progress import ProgressLine

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY_DP2 = ("--config=tiny", "--dp=2", "--steps=16", "--checkpoint.interval_steps=4", "--monitor.prometheus=false")
SIGKILL, SIGSEGV, SIGTERM = -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGTERM


# -- attribution ---------------------------------------------------------------------------------


def test_a_rank_killed_by_a_signal_failed_before_the_peers_that_saw_its_connection_drop():
    # Rank 0 raised "connection reset by peer" (exit 1), torchrun stopped ranks 1 and 2 (SIGTERM): rank 3 segfaulted.
    assert first_failed({0: 1, 1: SIGTERM, 2: SIGTERM, 3: SIGSEGV}) == 3


def test_keel_s_own_exit_codes_come_before_an_exception():
    assert first_failed({0: 1, 1: EXIT_HANG, 2: SIGTERM}) == 1
    assert first_failed({0: 1, 1: SIGTERM}) == 0


def _store_with_steps(run_dir, last_step: int) -> None:
    with RunStore(run_dir) as store:
        for step in range(1, last_step + 1):
            store.write_step({"step": step, "attempt": 0, "time": float(step), "loss": 1.0})


def test_an_injected_fault_names_its_rank_and_spec(tmp_path):
    _store_with_steps(tmp_path, 7)
    (tmp_path / CHAOS_DIR).mkdir()
    line = {"fault": "crash@step=8,rank=2", "kind": "crash", "rank": 2, "step": 8, "time": 100.0, "detail": ""}
    (tmp_path / CHAOS_DIR / INJECTED_FILE).write_text(json.dumps(line) + "\n")
    failure = RestartBudget(tmp_path, 3).record({0: 1, 1: SIGTERM, 2: SIGKILL}, 0, started=50.0)
    assert (failure.rank, failure.exit_code, failure.fault, failure.fault_step, failure.step) == (2, SIGKILL, "crash@step=8,rank=2", 8, 7)
    assert failure.describe() == "rank 2 ended by SIGKILL after step 7 (injected crash@step=8,rank=2)"
    # A fault injected before this group started is not this failure's cause.
    assert RestartBudget(tmp_path, 3).record({0: SIGSEGV, 1: SIGTERM}, 0, started=200.0).fault == ""


# -- the budget ----------------------------------------------------------------------------------


def test_the_budget_counts_failures_in_a_row_without_progress_and_refills_with_progress(tmp_path):
    budget, crash = RestartBudget(tmp_path, 2), {0: SIGKILL, 1: SIGTERM}
    _store_with_steps(tmp_path, 10)
    assert [budget.record(crash, 0, 0.0).in_a_row for _ in range(2)] == [1, 2]
    _store_with_steps(tmp_path, 25)  # the run got past the step of the last failure
    assert budget.record(crash, 0, 0.0).in_a_row == 1
    # A coordinated OOM restart is Keel's recovery: it neither counts nor refills.
    assert budget.record({0: EXIT_OOM_RESTART, 1: SIGTERM}, 0, 0.0).in_a_row == 1
    second, third = budget.record(crash, 0, 0.0), budget.record(crash, 0, 0.0)
    assert (second.in_a_row, second.gave_up, third.in_a_row, third.gave_up) == (2, False, 3, True)
    assert [f.restart for f in read_failures(tmp_path)] == [0, 1, 2, 3, 4, 5]


def test_a_budget_of_zero_gives_up_at_the_first_failure(tmp_path):
    assert RestartBudget(tmp_path, 0).record({0: SIGKILL}, 0, 0.0).gave_up


# -- the console line ----------------------------------------------------------------------------


def test_eta_follows_the_pace_of_this_process_not_the_run_s_step(monkeypatch):
    """A restart at step 200 of 300: the ETA is 100 steps at this process's pace (1 s), not the time
    since the process started divided by 200; `done` counts the run's wall time from its first start."""
    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr("keel.trainer.progress.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("keel.trainer.progress.time.time", lambda: 5000.0)
    out = io.StringIO()
    line = ProgressLine(300, stream=out, run_began=5000.0 - 3725)
    for step in (201, 202, 203):
        line.update(step, 1.0, 100.0, 0.1, None, 1.0)
    line.finish()
    etas = re.findall(r"ETA (\S+)", out.getvalue())
    assert etas == ["1m39s", "1m38s", "1m37s"]
    assert out.getvalue().endswith("done: 300 steps in 1h02m\n")


# -- real runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crash_loop(tmp_path_factory):
    """Rank 1 dies at step 10 on every attempt (four specs, one fired per attempt), with a budget of 2."""
    run_dir = tmp_path_factory.mktemp("crash_loop") / "run"
    crashes = [f"--fault=crash@step=10,rank=1,steps={k}" for k in (1, 2, 3, 4)]
    proc = keel("train", f"--run-dir={run_dir}", *TINY_DP2, *crashes, "--max-restarts=2")
    return run_dir, proc


def test_a_crash_loop_stops_with_its_event_alert_and_resume_command(crash_loop):
    run_dir, proc = crash_loop
    assert proc.returncode == EXIT_RESTART_CAP, proc.stderr[-3000:]
    events = read_events(run_dir)
    [stopped] = events[events.kind == "run_stopped"].itertuples()
    assert stopped.data["exit_code"] == EXIT_RESTART_CAP and "3 failures in a row without progress" in stopped.message
    assert "run_stopped" in set(events[events.kind == "alert"].data.map(lambda d: d.get("alert")))
    assert f"then resume: keel train --resume {run_dir}" in proc.stderr
    assert len(read_failures(run_dir)) == 3 and read_failures(run_dir)[-1].gave_up


def test_each_failure_gets_one_console_line_naming_the_rank_and_none_of_torchrun_s_traceback(crash_loop):
    run_dir, proc = crash_loop
    lines = [line for line in proc.stderr.splitlines() if "ended by" in line and line.startswith("keel train: rank")]
    host = socket.gethostname()
    assert len(lines) == 3 and all(line.startswith(f"keel train: rank 1 on {host} ended by SIGKILL after step 9") for line in lines), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and "torch/distributed" not in proc.stderr
    # Kept, in the logs: torchrun's traceback of each failure. Which rank's exception it names is a race: the
    # killed rank's exit (ProcessExitedException), or its peer's "connection closed" in a collective
    # (ProcessRaisedException), whichever the fork server's wait returns first.
    agent_log = (run_dir / "logs" / "agent.log").read_text()
    assert agent_log.count("Traceback") >= 3 and "ChildFailedError" in agent_log
    assert "ProcessExitedException" in agent_log or "ProcessRaisedException" in agent_log


def test_a_requeue_of_a_run_that_gave_up_counts_on_and_stops_at_its_next_failure(crash_loop):
    """A scheduler requeues the job that gave up (SLURM_RESTART_COUNT set, the same resume command): the
    budget counts on from where it stood, so the crash loop stops at the next failure without progress, with
    the event, the alert and the console line, instead of looping through requeues."""
    run_dir, _ = crash_loop
    before = len(read_failures(run_dir))
    proc = keel("train", "--resume", str(run_dir), env={"SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == EXIT_RESTART_CAP, proc.stderr[-3000:]
    failures = read_failures(run_dir)
    assert len(failures) == before + 1 and failures[-1].gave_up and failures[-1].in_a_row == 4
    events = read_events(run_dir)
    assert len(events.query("kind == 'run_stopped'")) == 2
    assert sum(d.get("alert") == "run_stopped" for d in events.query("kind == 'alert'").data) == 2
    assert "4 failures in a row without progress; giving up" in proc.stderr and f"resume: keel train --resume {run_dir}" in proc.stderr


def test_a_resume_after_a_start_that_vanished_counts_in_the_budget(tmp_path):
    """A start that ended with no record (its node killed, the job requeued) is a failure of the budget: a
    loop of such starts stops, and --reset-restarts gives a person who fixed the cause a fresh budget."""
    from keel.trainer.launch.launcher import count_vanished_start, parse_train_args

    _store_with_steps(tmp_path, 10)
    with RunStore(tmp_path) as store:
        store.write_event("run_started", "2 processes", step=0)
    cfg, _ = parse_train_args(["--config=tiny", f"--run-dir={tmp_path}", NO_WANDB, "--monitor.prometheus=false"])
    budget = RestartBudget(tmp_path, 2)
    assert [count_vanished_start(cfg, budget) for _ in range(3)] == [False, False, True]
    assert [f.in_a_row for f in read_failures(tmp_path)] == [1, 2, 3]
    assert read_events(tmp_path).query("kind == 'run_stopped'").data.iloc[0]["exit_code"] == EXIT_RESTART_CAP
    budget.reset()
    assert not count_vanished_start(cfg, budget) and read_failures(tmp_path)[-1].in_a_row == 1


def test_a_restart_event_names_the_failed_rank_its_signal_and_the_injected_fault(crash_loop):
    run_dir, _ = crash_loop
    events = read_events(run_dir)
    restarts = events[events.kind == "restart"]
    assert len(restarts) == 2 and list(restarts["rank"]) == [1, 1]
    assert [d["exit_code"] for d in restarts.data] == [SIGKILL, SIGKILL]
    assert [d["fault"] for d in restarts.data] == ["crash@step=10,rank=1", "crash@step=10,rank=1,steps=2"]
    injected = events[(events.kind == "fault_injected") & events.message.str.contains("ended the process")]
    assert list(injected.step) == [10, 10] and list(injected["rank"]) == [1, 1]


@pytest.fixture(scope="module")
def node_loss(tmp_path_factory):
    """The node dies at step 7 (agent and workers SIGKILLed); `keel train` resumes the run. Saves are
    synchronous: the save of step 4 is surely on disk when the node dies (a save in flight dies with it)."""
    run_dir = tmp_path_factory.mktemp("node_loss") / "run"
    proc = keel("train", f"--run-dir={run_dir}", *TINY_DP2, "--checkpoint.async_save=false", "--fault=node_loss@step=7,rank=1")
    return run_dir, proc


def test_a_node_loss_is_resumed_recorded_with_its_gap_and_counted_as_lost_time(node_loss):
    run_dir, proc = node_loss
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the node on {socket.gethostname()} (its agent and every worker) ended by SIGKILL after step 6" in proc.stderr
    events = read_events(run_dir)
    [loss] = events[events.kind == "node_loss"].itertuples()
    assert loss.step == 4 and loss.data["last_step"] == 6 and loss.data["down_s"] > 0
    assert read_meta(run_dir)["goodput"]["lost_s"]["node_loss"] == pytest.approx(loss.data["down_s"])
    assert list(read_steps(run_dir, effective=True).step) == list(range(1, 17))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the resumed ones must follow: TINY_DP2 with no fault."""
    return train(tmp_path_factory.mktemp("uninterrupted") / "run", *TINY_DP2)


def test_the_resumed_run_follows_the_uninterrupted_one_bit_for_bit(node_loss, uninterrupted):
    run_dir, _ = node_loss
    np.testing.assert_array_equal(read_steps(run_dir, effective=True).loss.to_numpy(), uninterrupted.loss.to_numpy())


def test_an_agent_that_crashes_is_resumed_as_a_lost_node(tmp_path, uninterrupted):
    """torchrun's agent dies of a segfault of its own at step 6 or later: its stacks reach the console, its
    workers end with it, and `keel train` resumes the run, which still follows the uninterrupted one."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "keel.cli", "train", f"--run-dir={run_dir}", *TINY_DP2, "--checkpoint.async_save=false", NO_WANDB]
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONWARNINGS": "ignore"}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            deadline = time.monotonic() + 120
            while furthest_step(run_dir) < 6:
                assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 6"
                time.sleep(0.05)
            [agent] = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
            os.kill(agent, signal.SIGSEGV)
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:  # a failed wait: stop the run with its torchrun and workers
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in stderr  # the agent's stacks
    assert re.search(r"the node on \S+ \(its agent and every worker\) ended by SIGSEGV after step \d+; resuming the run", stderr), stderr[
        -3000:
    ]
    assert len(read_events(run_dir).query("kind == 'node_loss'")) == 1
    np.testing.assert_array_equal(read_steps(run_dir, effective=True).loss.to_numpy(), uninterrupted.loss.to_numpy())


def test_mfu_s_peak_is_measured_once_per_run(node_loss):
    """MFU = tokens/s x flops per token / peak: the same peak on every attempt."""
    run_dir, _ = node_loss
    steps, meta = read_steps(run_dir), read_meta(run_dir)
    peaks = steps.tokens_per_s * meta["flops_per_token"] / steps.mfu
    assert steps.attempt.nunique() == 2
    np.testing.assert_allclose(peaks, meta["peak_flops_total"], rtol=1e-6)


def test_done_gives_the_run_s_own_wall_time(node_loss):
    run_dir, proc = node_loss
    minutes, seconds = map(int, re.search(r"done: 16 steps in (\d+)m(\d+)s", proc.stdout).groups())
    events = read_events(run_dir)
    began = min(d["process_start"] for d in events[events.kind == "run_started"].data)
    assert 60 * minutes + seconds >= int(read_steps(run_dir).time.max() - began)
