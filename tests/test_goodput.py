"""What the end-of-run summary and drills rely on from keel.monitor.goodput: productive time over wall
time, and the lost time split by cause (recomputed, skipped, restart, node loss, preemption, hang, checkpoint,
start-up, other)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from keel.monitor.goodput import CAUSES, Goodput, compute_goodput, goodput_of_run
from keel.monitor.store import RunStore, read_steps

T0 = 1_700_000_000.0  # a whole number of seconds: every time and duration below is exact in binary


def steps_frame(rows: list[tuple]) -> pd.DataFrame:
    """Rows of (step, attempt, time since T0, step_time_s, skipped)."""
    df = pd.DataFrame(rows, columns=["step", "attempt", "time", "step_time_s", "skipped"])
    df["time"] += T0
    return df


def events_frame(rows: list[tuple]) -> pd.DataFrame:
    """Rows of (time since T0, kind, data)."""
    return pd.DataFrame(
        [
            {"time": T0 + t, "step": None, "attempt": None, "rank": 0, "kind": kind, "severity": "info", "message": kind, "data": data}
            for t, kind, data in rows
        ],
        columns=["time", "step", "attempt", "rank", "kind", "severity", "message", "data"],
    )


def lost(**causes: float) -> dict[str, float]:
    return {c: causes.get(c, 0.0) for c in CAUSES}


def rollback_run() -> tuple[list[tuple], list[tuple]]:
    """1 s start-up, steps 1-15 of attempt 0 (1 s each, a 0.5 s checkpoint save after step 10), a rollback
    to step 10's checkpoint (2 s load), steps 11-20 again as attempt 1."""
    steps = [(s, 0, s + (0.5 if s > 10 else 0), 1.0, 0) for s in range(1, 16)]
    steps += [(s, 1, 17.5 + s - 10, 1.0, 0) for s in range(11, 21)]
    events = [
        (0, "run_started", {"process_start": T0 - 1}),
        (10.5, "checkpoint_saved", {"blocking_s": 0.5, "step": 10}),
        (15.5, "rollback", {"load_s": 2.0, "to_step": 10}),
        (17.5, "checkpoint_loaded", {"load_s": 2.0, "step": 10}),
        (27.5, "run_finished", {}),
    ]
    return steps, events


def test_rollback_counts_abandoned_steps_as_recomputed_and_the_load_once():
    steps, events = rollback_run()
    g = compute_goodput(steps_frame(steps), events_frame(events))
    # 20 effective steps, steps 11-15 of attempt 0 done twice, 0.5 s save + 2 s load (the rollback's own
    # load_s is the same load, not counted again), and the start-up.
    assert g == Goodput(wall_s=28.5, productive_s=20.0, lost_s=lost(recomputed=5.0, checkpoint=2.5, startup=1.0))
    assert g.goodput == 20.0 / 28.5


def test_restart_counts_down_time_and_takes_the_first_process_start():
    # 1 s start-up, steps 1-4, a 0.5 s checkpoint save, steps 5-6, a crash
    steps = [(s, 0, 1 + s + (0.5 if s > 4 else 0), 1.0, 0) for s in range(1, 7)]
    # new workers start 3 s after the last step recorded; 1 s start-up, 0.5 s load of step 4's checkpoint
    steps += [(s, 1, 12 + s - 4, 1.0, 0) for s in range(5, 9)]
    events = [
        (1, "run_started", {"process_start": T0}),
        (5.5, "checkpoint_saved", {"blocking_s": 0.5}),
        (11.5, "run_started", {"process_start": T0 + 10.5}),
        (11.5, "restart", {"down_s": 3.0}),
        (12, "checkpoint_loaded", {"load_s": 0.5}),
    ]
    g = compute_goodput(steps_frame(steps), events_frame(events))
    # Each start of the workers up to its first step is start-up: 1 s, then 1.5 s less the 0.5 s load inside it.
    assert g == Goodput(wall_s=16.0, productive_s=8.0, lost_s=lost(recomputed=2.0, restart=3.0, checkpoint=1.0, startup=2.0))
    assert g.summary() == "goodput 50.0% of 16.0 s wall: lost restart 3.0 s, recomputed 2.0 s, startup 2.0 s, checkpoint 1.0 s"
    assert json.loads(json.dumps(g.to_dict())) == {
        "wall_s": 16.0,
        "productive_s": 8.0,
        "goodput": 0.5,
        "lost_s": {
            "recomputed": 2.0,
            "skipped": 0.0,
            "restart": 3.0,
            "node_loss": 0.0,
            "preempted": 0.0,
            "hang": 0.0,
            "oom": 0.0,
            "checkpoint": 1.0,
            "startup": 2.0,
            "evaluation": 0.0,
            "other": 0.0,
        },
    }


def test_skipped_steps_are_lost_unless_a_later_attempt_abandoned_them():
    steps = [
        (1, 0, 1, 0.5, 0),
        (2, 0, 1.5, 0.5, 1),  # skipped by the NaN guard, and kept: skipped
        (3, 0, 2, 0.5, 1),  # skipped, then rolled back: recomputed, not skipped
        (3, 1, 2.5, 0.5, 0),
        (4, 1, 3, 0.5, 0),
    ]
    g = compute_goodput(steps_frame(steps), events_frame([(0, "run_started", {"process_start": T0})]))
    assert g == Goodput(wall_s=3.0, productive_s=1.5, lost_s=lost(recomputed=0.5, skipped=0.5, startup=0.5))


def test_a_stall_inside_a_step_is_the_hang_not_productive_time():
    steps = [(1, 0, 1, 1.0, 0), (2, 0, 7, 6.0, 0)]  # step 2 hung for 5 s, then went on
    events = [(0, "run_started", {"process_start": T0}), (6.5, "hang", {"stalled_s": 5.0, "rank": 1})]
    g = compute_goodput(steps_frame(steps), events_frame(events))
    assert g == Goodput(wall_s=7.0, productive_s=2.0, lost_s=lost(hang=5.0))
    assert g.productive_s + sum(g.lost_s.values()) == g.wall_s
    assert g.summary() == "goodput 28.6% of 7.0 s wall: lost hang 5.0 s"  # before: 100.0%, and 12 s of 7


def test_a_hang_that_led_to_a_restart_is_counted_once():
    # Step 2 stalled; the watchdog killed the workers after 5 s; the new ones ran step 2 again 8 s after step 1.
    steps = [(1, 0, 1, 1.0, 0), (2, 1, 10, 1.0, 0)]
    events = [(0, "run_started", {"process_start": T0}), (6, "hang", {"stalled_s": 5.0, "rank": 1}),
              (9, "restart", {"down_s": 8.0})]  # fmt: skip
    g = compute_goodput(steps_frame(steps), events_frame(events))
    assert g == Goodput(wall_s=10.0, productive_s=2.0, lost_s=lost(hang=5.0, restart=3.0))
    assert g.productive_s + sum(g.lost_s.values()) == g.wall_s


def test_abandoned_rows_past_the_rerun_so_far_are_recomputed_like_the_store_says():
    steps = [(s, 0, s, 1.0, 0) for s in range(1, 16)] + [(11, 1, 17, 1.0, 0), (12, 1, 18, 1.0, 0)]
    g = compute_goodput(steps_frame(steps), events_frame([(0, "run_started", {"process_start": T0})]))
    # Steps 13-15 of attempt 0 do not count either: attempt 1 will run them again.
    assert g == Goodput(wall_s=18.0, productive_s=12.0, lost_s=lost(recomputed=5.0, other=1.0))


def test_without_run_started_the_run_starts_when_its_first_step_or_event_did():
    steps = [(1, 0, 3, 2.0, 0), (2, 0, 4, 1.0, 0)]
    assert compute_goodput(steps_frame(steps), events_frame([(2, "note", None)])).wall_s == 3.0  # step 1 began at 1 s
    assert compute_goodput(steps_frame(steps), events_frame([(0.5, "note", None)])).wall_s == 3.5
    assert compute_goodput(steps_frame(steps), events_frame([])).wall_s == 3.0


def test_end_time_overrides_the_last_record():
    steps = [(1, 0, 1, 1.0, 0)]
    g = compute_goodput(steps_frame(steps), events_frame([(0, "run_started", {"process_start": T0})]), end_time=T0 + 4)
    assert g == Goodput(wall_s=4.0, productive_s=1.0, lost_s=lost(other=3.0))
    assert g.goodput == 0.25


def test_data_as_json_text_missing_columns_and_bad_values():
    steps = pd.DataFrame({"step": [1, 2], "time": [T0 + 1, T0 + 2], "step_time_s": [1.0, None]})  # no attempt, no skipped
    events = events_frame(
        [
            (0, "run_started", json.dumps({"process_start": T0})),
            (1, "checkpoint_saved", json.dumps({"blocking_s": 0.25})),
            (1, "checkpoint_saved", "not json"),
            (1, "checkpoint_saved", {"blocking_s": "0.5"}),  # not a number: ignored
            (1, "checkpoint_loaded", {"load_s": float("nan")}),
            (1, "hang", None),
            (1, "restart", {"down_s": -1.0}),  # clocks disagreeing: no down time
        ]
    )
    g = compute_goodput(steps, events)
    assert g == Goodput(wall_s=2.0, productive_s=1.0, lost_s=lost(checkpoint=0.25, other=0.75))


@pytest.mark.parametrize(
    "steps, events",
    [
        (pd.DataFrame(), pd.DataFrame()),
        (steps_frame([]), events_frame([])),
        (steps_frame([]), events_frame([(0, "run_started", {"process_start": T0})])),
    ],
)
def test_a_run_without_steps_or_records_is_all_zeros(steps, events):
    g = compute_goodput(steps, events)
    assert g == Goodput(wall_s=0.0, productive_s=0.0, lost_s=lost())
    assert g.goodput == 0.0
    assert g.summary() == "goodput 0.0% of 0.0 s wall"


def test_long_runs_print_whole_seconds():
    g = Goodput(wall_s=612.4, productive_s=558.5, lost_s=lost(recomputed=20.1, restart=18.0, other=15.8))
    assert g.summary() == "goodput 91.2% of 612 s wall: lost recomputed 20.1 s, restart 18.0 s, other 15.8 s"


def test_round_trip_through_the_run_store(tmp_path):
    steps, events = rollback_run()
    with RunStore(tmp_path) as store:
        for step, attempt, t, step_time, skipped in steps:
            store.write_step({"step": step, "attempt": attempt, "time": T0 + t, "step_time_s": step_time, "skipped": skipped})
        for t, kind, data in events:
            store.write_event(kind, kind, time=T0 + t, data=data)
    g = goodput_of_run(tmp_path)
    assert g == Goodput(wall_s=28.5, productive_s=20.0, lost_s=lost(recomputed=5.0, checkpoint=2.5, startup=1.0))
    assert g.productive_s == read_steps(tmp_path, effective=True)["step_time_s"].sum()


def test_a_fresh_store_is_all_zeros(tmp_path):
    RunStore(tmp_path).close()
    assert goodput_of_run(tmp_path) == Goodput(wall_s=0.0, productive_s=0.0, lost_s=lost())


def test_productive_time_never_exceeds_the_wall_clock():
    """Step times are the slowest rank's; when ranks take turns being slowest, their sum overshoots the
    clock between step ends. Each step counts at most the wall time since the previous one ended."""
    started = events_frame([(0, "run_started", {"process_start": T0})])
    steps = steps_frame([(1, 0, 2.0, 2.0, 0), (2, 0, 4.0, 2.5, 0), (3, 0, 6.0, 2.5, 0)])
    g = compute_goodput(steps, started)
    assert g.productive_s == 6.0 and g.wall_s == 6.0 and g.goodput == 1.0


def test_the_time_from_a_preemption_to_the_next_start_is_lost_to_preemption():
    """Steps 1-10 (1 s each after 1 s of start-up), preempted after step 10; the scheduler starts the job
    again 20 s later (the queue), whose start-up takes 1 s before steps 11-20 run."""
    steps = [(s, 0, float(s), 1.0, 0) for s in range(1, 11)] + [(s, 1, 21.0 + s, 1.0, 0) for s in range(11, 21)]
    events = [
        (-1, "run_started", {"process_start": T0 - 1}),
        (10, "preempted", {"saved_step": 10, "lost_steps": 0}),
        (10, "run_stopped", {"exit_code": 143}),
        (31, "run_started", {"process_start": T0 + 30}),
        (41, "run_finished", {}),
    ]
    g = compute_goodput(steps_frame(steps), events_frame(events))
    assert g == Goodput(wall_s=42.0, productive_s=20.0, lost_s=lost(preempted=20.0, startup=2.0))
