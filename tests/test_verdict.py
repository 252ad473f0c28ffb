"""The drill verdict: its loss comparison, and its detection's step and latency: what passes and what must not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from keel.chaos.kinds import Expectation
from keel.chaos.verdict import compare_losses, judge
from keel.monitor.event_kinds import EventKind
from keel.monitor.run_dir import CHAOS_DIR, INJECTED_FILE
from keel.monitor.store import RunStore


def _losses(*values: float) -> pd.DataFrame:
    return pd.DataFrame({"step": range(1, len(values) + 1), "loss": values})


def test_a_run_that_follows_the_reference_passes_with_its_difference():
    worst, reason = compare_losses(_losses(5.0, 4.0), _losses(5.0, 4.0 * (1 + 1e-7)), rtol=1e-5)
    assert reason is None and 0 < worst < 1e-6


def test_a_reference_that_is_not_finite_fails_the_comparison():
    for broken in (math.nan, math.inf):
        worst, reason = compare_losses(_losses(5.0, 4.0, 3.0), _losses(5.0, broken, 3.0), rtol=1e-5)
        assert worst == math.inf and reason == "the reference's loss is not finite at step 2"


def test_a_run_that_differs_or_kept_other_steps_fails():
    assert "from step 2 on" in compare_losses(_losses(5.0, 4.1), _losses(5.0, 4.0), rtol=1e-5)[1]
    assert "kept steps 1..1 (1)" in compare_losses(_losses(5.0), _losses(5.0, 4.0), rtol=1e-5)[1]
    assert "non-finite loss kept at step 1" in compare_losses(_losses(math.nan), _losses(5.0), rtol=1e-5)[1]


# A drill run as its store holds it: steps 1..12 a second apart, a fault fired at step FAULT_STEP.
FAULT_STEP, START = 10, 1_000_000.0
NAN_DRILL = Expectation(detect=(EventKind.NONFINITE,), compare="none")
CRASH_DRILL = Expectation(detect=(EventKind.RESTART,), compare="none")


def _drill_run(run_dir: Path, kind: str, detections: list[dict]) -> Path:
    """`detections`: the detector's events, each a kind, a step and a time."""
    with RunStore(run_dir) as store:
        store.write_event(EventKind.RUN_STARTED, "1 process", step=0, attempt=0, time=START)
        for step in range(1, 13):
            store.write_step({"step": step, "attempt": 0, "time": START + step, "loss": 4.0})
        for event in detections:
            store.write_event(event["kind"], "detected", step=event["step"], attempt=0, time=event["time"])
        store.write_event(EventKind.RUN_FINISHED, "12 steps", step=12, attempt=0, time=START + 13)
    (run_dir / CHAOS_DIR).mkdir()
    fired = {"fault": f"{kind}@step={FAULT_STEP}", "kind": kind, "rank": 0, "step": FAULT_STEP, "time": START + FAULT_STEP - 0.5}
    (run_dir / CHAOS_DIR / INJECTED_FILE).write_text(json.dumps(fired) + "\n")
    return run_dir


def _judge(run_dir: Path, kind: str, expect: Expectation):
    return judge(kind, [f"{kind}@step={FAULT_STEP}"], expect, run_dir, 0, None, FAULT_STEP)


def test_a_detection_in_the_faults_step_passes_with_no_latency(tmp_path):
    run = _drill_run(tmp_path / "run", "nan", [{"kind": EventKind.NONFINITE, "step": FAULT_STEP, "time": START + FAULT_STEP}])
    r = _judge(run, "nan", NAN_DRILL)
    assert r.status == "pass" and r.detected and r.detection_latency_steps == 0 and r.detection_latency_s == 0.5, r


def test_a_detection_before_the_fault_is_a_false_alarm_that_fails_the_drill(tmp_path):
    """The detector fired two steps before the fault (and again at it): its first alarm is the detection, with
    a negative latency, and the drill fails however the fault itself was caught."""
    early, on_time = (FAULT_STEP - 2, START + FAULT_STEP - 2), (FAULT_STEP, START + FAULT_STEP)
    run = _drill_run(tmp_path / "run", "nan", [{"kind": EventKind.NONFINITE, "step": s, "time": t} for s, t in (early, on_time)])
    r = _judge(run, "nan", NAN_DRILL)
    assert r.status == "fail" and r.detection_step == FAULT_STEP - 2, r
    assert r.detection_latency_steps == -2 and r.detection_latency_s == -1.5, r
    assert r.reasons == [
        f"false alarm: nonfinite at step {FAULT_STEP - 2} (-1.50 s from the fault), before the fault hit step {FAULT_STEP}"
    ]


def test_a_detection_written_after_the_fault_but_naming_an_earlier_step_fails(tmp_path):
    """Attributed to the step before the fault: not clamped to the fault's step."""
    run = _drill_run(tmp_path / "run", "nan", [{"kind": EventKind.NONFINITE, "step": FAULT_STEP - 1, "time": START + FAULT_STEP}])
    r = _judge(run, "nan", NAN_DRILL)
    assert r.status == "fail" and r.detection_latency_steps == -1 and r.detection_latency_s > 0, r
    assert "false alarm" in r.reasons[0]


def test_a_restart_counts_at_the_step_its_processes_ended_in_not_the_one_it_resumed_from(tmp_path):
    """A restart after the fault names the checkpoint's step it resumed from (8): the crash was found in the
    fault's own step. One before the fault is a false alarm, at the step after the last one recorded before it."""
    after = {"kind": EventKind.RESTART, "step": 8, "time": START + FAULT_STEP + 0.2}
    r = _judge(_drill_run(tmp_path / "after", "crash", [after]), "crash", CRASH_DRILL)
    assert r.status == "pass" and r.detection_step == FAULT_STEP and r.detection_latency_steps == 0, r
    before = {"kind": EventKind.RESTART, "step": 4, "time": START + 6.5}
    r = _judge(_drill_run(tmp_path / "before", "crash", [before, after]), "crash", CRASH_DRILL)
    assert r.status == "fail" and r.detection_step == 7 and r.detection_latency_steps == -3, r
    assert "false alarm: restart at step 7" in r.reasons[0]
