"""Hang detection from measured step times, and the micro-batch retried after an out-of-memory.

The watchdog's allowance (keel.trainer.watchdog) on its own, then a real hang in a dp2 run caught within
the 10 s floor with the default settings (the old fixed floor took 60 s). The out-of-memory retries
(keel.trainer.oom) in one process and through coordinated restarts, with the chaos `oom` fault: a retry
while the fault's memory is still short runs out again and backs off; after the fault's span it holds.
Goodput counts the slower steps of a halved micro-batch as time lost to the out-of-memory."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import train
from test_goodput import T0, events_frame, steps_frame

from keel.monitor.goodput import compute_goodput
from keel.monitor.run_dir import MICROBATCH_FILE
from keel.monitor.store import read_events, read_meta
from keel.trainer.config import ConfigError, RecoveryConfig, WatchdogConfig, load_config, validate
from keel.trainer.watchdog import Watchdog

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY = ["--config", "tiny", "--monitor.prometheus=false"]


def events_of(run_dir, *kinds: str) -> list[tuple]:
    """(kind, step, attempt, micro-batches before, after) of the run's oom and oom_retry events, in order."""
    events = read_events(run_dir)
    chosen = events[events.kind.isin(kinds)]
    return [(e.kind, e.step, e.attempt, e.data["previous"], e.data["microbatches"]) for e in chosen.itertuples()]


def test_a_step_is_allowed_a_multiple_of_the_median_step_never_less_than_the_floor(tmp_path):
    dog = Watchdog(WatchdogConfig(poll_s=0.5, floor_s=5.0), tmp_path, rank=0)
    try:
        allowed = []
        for step, seconds in enumerate([9.0, 5.0, 4.0, 2.0, 1.5, 1.4, 1.6, 6.0, 1.5], start=1):
            dog.beat("step", step)
            allowed.append(dog.allowance_s)
            dog.step_finished(seconds)
        # Warm-up (3 steps, and the first timed one): startup_s; then 5 x the median since. The 6 s step (a
        # profiled one, a busy machine) moves the median a little; the old rule took 5 x the longest: 30 s.
        assert allowed == [600.0, 600.0, 600.0, 600.0, 10.0, 8.75, 7.5, 7.75, 8.0]
        assert dog.median_step_s == 1.55 and dog.step_allowance_s() == pytest.approx(7.75)
        dog.beat("checkpoint_save", 9)
        assert dog.allowance_s == 600.0
        dog.beat("step", 10)
        assert dog.allowance_s == pytest.approx(15.5)  # the step beside the save's copy, writes and seal
        [stall_file] = (tmp_path / "dumps").glob("stall-rank0-pid*.txt")
        stall = json.loads(stall_file.read_text()[:200])
        assert stall["timeout_s"] == pytest.approx(15.5 + 2 * 0.5)  # the GIL-free backstop: the same allowance
        dog.step_finished(1.5)
        dog.beat("step", 11)
        assert dog.allowance_s == pytest.approx(7.5)
        for step in range(12, 40):  # quick steps: the floor holds
            dog.beat("step", step)
            dog.step_finished(0.1)
        assert dog.step_allowance_s() == 5.0 and dog.collective_timeout_s() == 120.0
    finally:
        dog.stop()


@pytest.mark.parametrize(
    "override, message",
    [
        ("watchdog.window=0", "watchdog.window=0: must be at least 1"),
        ("recovery.oom_retry_steps=-1", "recovery.oom_retry_steps=-1: must be at least 0; 0 keeps the halved micro-batch"),
        ("recovery.oom_retry_backoff=0", "recovery.oom_retry_backoff=0: must be at least 1"),
    ],
)
def test_new_settings_are_checked_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny", [override]))
    assert RecoveryConfig().oom_retry_steps == 20 and WatchdogConfig().floor_s == 10.0


def test_a_hang_is_caught_within_the_floor_by_default(tmp_path):
    """dp2, rank 1 stuck at step 12; checkpoints every 5 steps and profiled steps trip nothing before it."""
    run_dir = tmp_path / "run"
    run = train(run_dir, *TINY, "--dp", "2", "--steps=16", "--checkpoint.interval_steps=5", "--fault", "hang@step=12,rank=1")
    events = read_events(run_dir)
    [hang] = events[events.kind == "hang"].data
    assert hang["step"] == 12 and hang["timeout_s"] == 10.0 and hang["stalled_s"] < 12.0  # the old floor: 60 s
    assert list(run.step) == list(range(1, 17))


def test_one_process_retries_the_larger_micro_batch_backs_off_while_memory_is_short_then_holds(tmp_path):
    ref = train(tmp_path / "ref", *TINY, "--training.microbatches=4", "--steps=16")
    run_dir = tmp_path / "run"
    # 8 sequences per micro-batch; the fault's memory holds 2 during steps 6-9.
    args = ["--training.microbatches=1", "--steps=16", "--recovery.oom_retry_steps=2", "--fault", "oom@step=6,rows=2,steps=4"]
    run = train(run_dir, *TINY, *args)
    assert events_of(run_dir, "oom", "oom_retry") == [
        ("oom", 6, 0, 1, 2),
        ("oom", 6, 0, 2, 4),
        ("oom_retry", 8, 0, 4, 2),  # 2 steps later; the memory is still short ...
        ("oom", 8, 0, 2, 4),
        ("oom_retry", 12, 0, 4, 2),  # ... so the next retry waits twice as long: past the fault, it holds
        ("oom_retry", 16, 0, 2, 1),  # and the job's own micro-batch comes back
    ]
    assert list(run.step) == list(range(1, 17)) and list(run.tokens) == list(ref.tokens)  # global batch unchanged
    np.testing.assert_allclose(run.loss, ref.loss, rtol=1e-5)
    assert read_meta(run_dir)["goodput"]["lost_s"]["oom"] >= 0


def test_several_ranks_retry_at_the_same_step_and_a_failed_retry_backs_off_through_the_restart(tmp_path):
    run_dir = tmp_path / "run"
    # 4 sequences per dp rank; rank 1's memory holds 2 during steps 6-9. Checkpoints every 4 steps.
    args = ["--dp", "2", "--training.microbatches=1", "--steps=14", "--checkpoint.interval_steps=4", "--recovery.oom_retry_steps=2"]
    run = train(run_dir, *TINY, *args, "--fault", "oom@step=6,rank=1,rows=2,steps=4")
    assert events_of(run_dir, "oom", "oom_retry") == [
        ("oom", 6, 1, 1, 2),  # recorded by the restarted group, which resumed from step 4
        ("oom_retry", 8, 1, 2, 1),  # every rank, in process; rank 1 runs out again ...
        ("oom", 8, 2, 1, 2),  # ... and the group restarts from step 4 again, with a wait of 4
        ("oom_retry", 12, 2, 2, 1),  # past the fault: it holds to the end
    ]
    assert list(run.step) == list(range(1, 15))
    state = json.loads((run_dir / MICROBATCH_FILE).read_text())
    assert (state["configured"], state["wait_steps"], state["retry_step"]) == (1, 4, 12)


def test_goodput_counts_the_slower_steps_of_a_halved_micro_batch_as_lost_to_oom():
    # Steps 1-4 and 9-10 at the job's own micro-batch (1 s), steps 5-8 halved (1.5 s each) after an OOM.
    times = [1, 2, 3, 4, 5.5, 7, 8.5, 10, 11, 12]
    steps = [(s, 0, t, 1.5 if 5 <= s <= 8 else 1.0, 0) for s, t in enumerate(times, start=1)]
    events = [
        (0, "run_started", {"process_start": T0}),
        (4.1, "oom", {"microbatches": 2, "previous": 1, "how": "in process"}),
        (10.05, "oom_retry", {"microbatches": 1, "previous": 2, "configured": 1}),
    ]
    g = compute_goodput(steps_frame(steps), events_frame(events))
    assert g.lost_s["oom"] == pytest.approx(4 * 0.5) and g.productive_s == pytest.approx(12.0 - 2.0)
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)
    # Without a step at the job's own micro-batch there is nothing to compare with.
    assert compute_goodput(steps_frame(steps[4:8]), events_frame(events[:2])).lost_s["oom"] == 0.0
    assert compute_goodput(steps_frame(steps), pd.DataFrame()).lost_s["oom"] == 0.0
