"""Run summaries (the dashboard's Runs page): status, layout, progress and counts from the run store alone."""

from __future__ import annotations

import time
from pathlib import Path

from keel.monitor.goodput import CAUSES, Goodput
from keel.monitor.runs import MIN_STALE_S, find_runs, summarize_run, summarize_runs
from keel.monitor.store import RunStore

CONFIG = {"parallel": {"pp": 2, "dp": 2, "tp": 2}, "training": {"steps": 300}}


def write_run(run_dir: Path, steps: int, endings: tuple[str, ...] = (), step_time: float = 1.0) -> float:
    """A run store as the trainer leaves it: meta, `steps` step rows `step_time` apart ending now, then
    the ending events. Returns the time of the last record."""
    start = time.time() - steps * step_time
    with RunStore(run_dir) as store:
        store.set_meta("run_id", run_dir.name)
        store.set_meta("config", CONFIG)
        store.write_event("run_started", "8 processes", step=0, attempt=0, rank=0)
        for s in range(1, steps + 1):
            store.write_step({"step": s, "attempt": 0, "time": start + s * step_time, "loss": 5.0 - s / 100, "tokens_per_s": 1000.0,
                              "mfu": 0.1, "comm_share": 0.3 if s % 10 == 2 else None, "step_time_s": step_time})  # fmt: skip
        for kind in endings:
            store.write_event(kind, kind, step=steps, attempt=0, rank=0)
    return time.time()


def test_status_from_the_record(tmp_path):
    for name, endings in {"finished": ("run_finished",), "stopped": ("run_stopped",), "hung": ("hang",), "silent": ()}.items():
        last = write_run(tmp_path / name, 50, endings)
    soon, later = last + MIN_STALE_S / 2, last + MIN_STALE_S + 1
    assert summarize_run(tmp_path / "finished", later)["status"] == "finished"
    assert summarize_run(tmp_path / "stopped", later)["status"] == "stopped"
    assert summarize_run(tmp_path / "silent", soon)["status"] == "running"
    assert summarize_run(tmp_path / "silent", later)["status"] == "failed"
    assert summarize_run(tmp_path / "hung", soon)["status"] == "running"  # torchrun may still restart it
    assert summarize_run(tmp_path / "hung", later)["status"] == "hung"


def test_slow_steps_are_not_mistaken_for_a_dead_run(tmp_path):
    last = write_run(tmp_path / "slow", 5, step_time=60.0)  # a minute per step: ten minutes of silence is normal
    assert summarize_run(tmp_path / "slow", last + 500)["status"] == "running"
    assert summarize_run(tmp_path / "slow", last + 700)["status"] == "failed"


def test_summary_row_holds_the_run(tmp_path):
    write_run(tmp_path / "r", 40, ("run_finished",))
    with RunStore(tmp_path / "r") as store:
        for kind in ("rollback", "alert", "alert", "restart"):
            store.write_event(kind, kind, step=20, attempt=1, rank=0)
        recorded = Goodput(wall_s=100.0, productive_s=93.0, lost_s=dict.fromkeys(CAUSES, 0.0) | {"other": 7.0}).to_dict()
        store.set_meta("goodput", recorded)  # as the trainer records it at the end: the meta key and the event
        store.write_event("goodput", "goodput 93.0%", step=40, attempt=1, rank=0, data=recorded)
    row = summarize_run(tmp_path / "r")
    assert row["layout"] == "pp2 dp2 tp2" and row["step"] == 40 and row["total_steps"] == 300
    assert row["loss"] == 5.0 - 40 / 100 and row["comm_share"] == 0.3 and row["goodput"] == 0.93
    assert (row["rollbacks"], row["alerts"], row["restarts"]) == (1, 2, 1)


def test_damaged_runs_are_reported_and_the_rest_still_listed(tmp_path):
    write_run(tmp_path / "good", 10, ("run_finished",))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "run.sqlite").write_bytes(b"this is not a database" * 100)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.sqlite").write_bytes(b"")
    frame = summarize_runs([tmp_path]).set_index("run_id")
    assert frame.loc["good", "status"] == "finished"
    assert frame.loc["garbage", "status"] == "unreadable" and "DatabaseError" in frame.loc["garbage", "problem"]
    assert frame.loc["empty", "status"] == "unreadable"


def test_runs_found_below_folders_but_not_inside_drills_or_checkpoints(tmp_path):
    for name in ("a", "nested/b", "a/drills/drill-1/runs/nan", "a/checkpoints/step-00000010"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "run.sqlite").write_bytes(b"")
    assert find_runs([tmp_path]) == [tmp_path / "a", tmp_path / "nested" / "b"]
    assert find_runs([tmp_path / "nested" / "b"]) == [tmp_path / "nested" / "b"]
    (tmp_path / "linked").symlink_to(tmp_path / "nested", target_is_directory=True)  # followed, once
    (tmp_path / "nested" / "loop").symlink_to(tmp_path, target_is_directory=True)
    runs = find_runs([tmp_path])  # b is reached through nested/ and linked/: listed once, and the loop ends
    assert len(runs) == 2 and runs[0] == tmp_path / "a" and runs[1].resolve() == (tmp_path / "nested" / "b").resolve()


def test_a_running_run_has_its_goodput_so_far(tmp_path):
    write_run(tmp_path / "live", 30, step_time=2.0)  # no goodput in its meta until it ends
    row = summarize_run(tmp_path / "live")
    # 30 steps of 2 s since its first step's start: all of it productive but the time before step 1
    assert 0.9 < row["goodput"] <= 1.0
