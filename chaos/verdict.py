"""Judging one drill from the run stores: was the fault detected, did the run recover, was anything lost.

A drill passes only when all three hold: the expected detection event came after the fault fired (one
before it is a false alarm: the drill fails, with a negative latency),
the run finished (exit 0, `run_finished`) through the expected recovery action, and the loss of the
trajectory that counts equals the reference's (the fault-free run, or the fault-free run that
skipped the same batches when the recovery skipped data). Reads the run directory only: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from keel.chaos.kinds import Expectation
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_MEANINGS
from keel.monitor.run_dir import CHAOS_DIR, INJECTED_FILE, STORE_FILE
from keel.monitor.store import read_events, read_meta, read_steps


@dataclass
class DrillResult:
    name: str
    faults: list[str]
    status: str  # pass | fail | n/a
    reasons: list[str] = field(default_factory=list)
    fault_step: int | None = None
    fault_time: float | None = None
    detected: bool = False
    detected_by: str | None = None
    detection_step: int | None = None
    detection_latency_steps: int | None = None
    detection_latency_s: float | None = None
    recovered: bool = False
    recovered_step: int | None = None  # the first step of the kept trajectory after the fault
    time_to_recover_s: float | None = None
    steps_lost: int | None = None  # steps computed and thrown away, plus steps skipped without an update
    batches_skipped: list[list[int]] = field(default_factory=list)  # [first, end) ranges of batches never trained on
    goodput: float | None = None
    loss_compared_with: str | None = None
    loss_max_rel_diff: float | None = None
    final_loss: float | None = None
    reference_final_loss: float | None = None
    exit_code: int | None = None
    wall_s: float | None = None
    run_dir: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def injections(run_dir: Path) -> list[dict]:
    path = run_dir / CHAOS_DIR / INJECTED_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def skipped_batches(events: pd.DataFrame) -> list[tuple[int, int]]:
    """The batch ranges the run's recoveries skipped: rollbacks' skip_data and passed-over bad batches."""
    ranges = {(int(d["first_batch"]), int(d["end_batch"])) for d in events.loc[events.kind == EventKind.SKIP_DATA, "data"]}
    ranges |= {(b, b + 1) for d in events.loc[events.kind == EventKind.BAD_BATCH, "data"] for b in d["batches"]}
    return sorted(ranges)


# How far before the fault's own record a detection may be timed and still count as after it: the fault's
# record and the detection event may be written by different processes.
_CLOCK_TOLERANCE_S = 1e-3
# Events written when the run comes back after its processes ended name the step it resumed from, not the one
# the fault was found in (a checkpoint found corrupt on that load names none).
_NAME_THE_RESUMED_STEP = (EventKind.RESTART, EventKind.NODE_LOSS)


def _detection(
    events: pd.DataFrame, kinds: tuple[str, ...], since: float = -math.inf, rank: int | None = None
) -> tuple[float, pd.Series] | None:
    """The first event of these kinds after `since` (by default the first of the run), with the moment it was
    detected (a hang found by the GIL-free timer is written down only after the restart; its data holds when
    it fired). An event that names a rank (a straggler) counts only when it names the faulty one."""
    found = []
    for _, e in events[events.kind.isin(kinds)].iterrows():
        if rank is not None and e.kind == EventKind.STRAGGLER and e["rank"] != rank:
            continue
        at = float(e.data.get("detected_at", e.time)) if isinstance(e.data, dict) else float(e.time)
        if at >= since:
            found.append((at, e))
    return min(found, key=lambda x: x[0]) if found else None


def compare_losses(run: pd.DataFrame, reference: pd.DataFrame, rtol: float) -> tuple[float, str | None]:
    """Max relative loss difference over the steps, and a reason when it is beyond rtol or the steps differ."""
    if list(run.step) != list(reference.step):
        return math.inf, f"the run kept steps {_span(run.step)}, the reference {_span(reference.step)}"
    a, b = run.loss.to_numpy(float), reference.loss.to_numpy(float)
    if not np.isfinite(a).all():
        return math.inf, f"non-finite loss kept at step {int(run.step[~np.isfinite(a)].iloc[0])}"
    if not np.isfinite(b).all():  # NaN > rtol is False: a broken reference would pass every comparison
        return math.inf, f"the reference's loss is not finite at step {int(reference.step[~np.isfinite(b)].iloc[0])}"
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    worst = float(rel.max()) if len(rel) else 0.0
    if worst > rtol:
        first = int(run.step.iloc[int(np.argmax(rel > rtol))])
        return worst, f"loss differs from the reference from step {first} on (max relative difference {worst:.2e}, allowed {rtol:g})"
    return worst, None


def _span(steps: pd.Series) -> str:
    return f"{int(steps.min())}..{int(steps.max())} ({len(steps)})" if len(steps) else "none"


def judge(
    name: str,
    faults: list[str],
    expect: Expectation,
    run_dir: Path,
    exit_code: int,
    reference_dir: Path | None,
    fault_step: int,
    fault_rank: int | None = None,
    hint: str = "",
) -> DrillResult:
    """The verdict on one drill run. `reference_dir` is the fault-free run to compare with (for
    compare="skip", the one that skipped the same batches; None if that could not be made)."""
    r = DrillResult(name, faults, "fail", fault_step=fault_step, exit_code=exit_code, run_dir=str(run_dir))
    if not (run_dir / STORE_FILE).exists():
        r.reasons.append(f"the run left no run store (exit code {exit_code}: {EXIT_MEANINGS.get(exit_code, 'unknown')})")
        return r
    events, all_steps, kept = read_events(run_dir), read_steps(run_dir), read_steps(run_dir, effective=True)
    primary = faults[0].split("@")[0]
    fired = [i for i in injections(run_dir) if i["kind"] == primary]
    if not fired:
        r.reasons.append(f"the fault never fired (step {fault_step} not reached, or no such rank)")
        return r
    r.fault_time = min(i["time"] for i in fired)
    r.batches_skipped = [list(x) for x in skipped_batches(events)]
    r.steps_lost = int(len(all_steps) - len(kept) + kept.skipped.sum())
    starts = events[events.kind == EventKind.RUN_STARTED]
    if len(starts) and len(events):
        r.wall_s = float(events.time.max() - starts.time.min())
    goodput = read_meta(run_dir).get("goodput")
    r.goodput = goodput["goodput"] if goodput else None
    r.final_loss = float(kept.loss.iloc[-1]) if len(kept) else None

    _judge_detection(r, events, all_steps, expect, fault_step, fault_rank)
    _judge_recovery(r, events, kept, expect, exit_code, hint)
    _judge_loss(r, kept, expect, reference_dir)
    if expect.compare == "skip" and not r.batches_skipped:
        r.reasons.append("the recovery skipped no data")
    r.status = "pass" if not r.reasons else "fail"
    return r


def _judge_detection(
    r: DrillResult, events: pd.DataFrame, steps: pd.DataFrame, expect: Expectation, fault_step: int, fault_rank: int | None
) -> None:
    """Whether, by what and how fast the fault was detected. The detector's first alarm of the run is its
    detection: one before the fault (in steps or in time) is a false alarm, shown with its negative latency,
    and the drill fails."""
    found = _detection(events, expect.detect, rank=fault_rank)
    if found is None:
        r.reasons.append(f"not detected: no {' or '.join(expect.detect)} event")
        return
    at, event = found
    r.detected, r.detected_by = True, str(event.kind)
    r.detection_step = _detection_step(event, at, r.fault_time, fault_step, steps)
    r.detection_latency_steps = r.detection_step - fault_step
    r.detection_latency_s = at - r.fault_time
    if r.detection_latency_steps < 0 or r.detection_latency_s < -_CLOCK_TOLERANCE_S:
        r.reasons.append(
            f"false alarm: {event.kind} at step {r.detection_step} ({r.detection_latency_s:+.2f} s from the fault), "
            f"before the fault hit step {fault_step}"
        )


def _detection_step(event: pd.Series, at: float, fault_time: float, fault_step: int, steps: pd.DataFrame) -> int:
    """The step the fault was detected in: the one the event names. An event written on resuming (a restart, a
    node loss, a checkpoint found corrupt on the load) found what ended the processes, in the step they ended
    in: the fault's own when it came after the fault (a crash ends its process in its own step; the step the
    store holds last can lag a rank that died at a step's start), else the step after the last one the run
    recorded before it."""
    if event.kind not in _NAME_THE_RESUMED_STEP and pd.notna(event.step):
        return int(event.step)
    if at >= fault_time - _CLOCK_TOLERANCE_S:
        return fault_step
    recorded = steps.step[steps.time <= at]
    return int(recorded.max()) + 1 if len(recorded) else 1


def _judge_recovery(r: DrillResult, events: pd.DataFrame, kept: pd.DataFrame, expect: Expectation, exit_code: int, hint: str) -> None:
    """Whether the run went on to finish after the fault, and when it was back to training."""
    finished = exit_code == 0 and (events.kind == EventKind.RUN_FINISHED).any()
    action = _detection(events, expect.recover, r.fault_time - _CLOCK_TOLERANCE_S) if expect.recover else None
    if not finished:
        stopped = events[events.kind == EventKind.RUN_STOPPED]
        why = stopped.iloc[-1].message if len(stopped) else EXIT_MEANINGS.get(exit_code, "unknown")
        r.reasons.append(f"not recovered: the run ended with exit code {exit_code} ({why})")
    elif expect.recover and action is None:
        r.reasons.append(f"not recovered: no {' or '.join(expect.recover)} after the fault{hint}")
    elif expect.degraded:
        r.recovered = True  # it kept going; there is no recovery step or time to report
    else:
        since = action[0] if action else r.fault_time
        after = kept[kept.time > since]
        if len(after):
            r.recovered = True
            r.recovered_step = int(after.step.iloc[0])
            r.time_to_recover_s = float(after.time.iloc[0] - r.fault_time)
        else:
            r.reasons.append("not recovered: no step ran after the recovery")


def _judge_loss(r: DrillResult, kept: pd.DataFrame, expect: Expectation, reference_dir: Path | None) -> None:
    """The loss after recovery against the fault-free reference's."""
    if expect.compare == "none":
        r.loss_compared_with = "not compared (the fault legitimately changes the trajectory)"
    elif reference_dir is None:
        r.reasons.append("no reference run to compare the loss with")
    else:
        reference = read_steps(reference_dir, effective=True)
        r.loss_compared_with = reference_dir.name
        r.reference_final_loss = float(reference.loss.iloc[-1]) if len(reference) else None
        worst, problem = compare_losses(
            kept[["step", "loss"]].reset_index(drop=True), reference[["step", "loss"]].reset_index(drop=True), expect.rtol
        )
        r.loss_max_rel_diff = worst
        if problem:
            r.reasons.append(problem)
