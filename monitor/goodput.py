"""Goodput: the share of a run's wall time spent on steps that count, and where the rest went.

Productive time is the step time of the effective trajectory (the rows `read_steps(effective=True)`
keeps) minus the steps the NaN guard skipped. The lost time is kept by cause: steps recomputed after a
rollback or restart, skipped steps, time down between a failure and the restart, time between a
preemption and the next start (a scheduler's queue), hangs, the slower steps of a micro-batch halved after
an out-of-memory, checkpoint saves and loads, each start of the workers up to their first step (imports,
rendezvous, the model's build, the data; its checkpoint load counted as a load), evaluations, and "other"
(the last save, whatever the records do not explain).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

import pandas as pd

from keel.monitor.event_kinds import EventKind
from keel.monitor.store import abandoned_mask, read_events, read_steps

CAUSES = ("recomputed", "skipped", "restart", "node_loss", "preempted", "hang", "oom", "checkpoint", "startup", "evaluation", "other")


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    lost_s: dict[str, float]  # seconds per cause, keys exactly CAUSES

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.goodput, "lost_s": dict(self.lost_s)}

    def summary(self) -> str:
        """One line for the end-of-run console summary; causes with no lost time are left out, largest first."""
        line = f"goodput {self.goodput:.1%} of {_seconds(self.wall_s)} wall"
        lost = sorted(((c, s) for c, s in self.lost_s.items() if s > 0), key=lambda cause: -cause[1])
        if lost:
            line += ": lost " + ", ".join(f"{c} {_seconds(s)}" for c, s in lost)
        return line


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 100 else f"{s:.1f} s"


def _column(df: pd.DataFrame, name: str, default: float) -> pd.Series:
    """A column as float64 with missing values (NULL in the store) replaced by `default`."""
    if name not in df:
        return pd.Series(default, index=df.index, dtype="float64")
    return pd.to_numeric(df[name], errors="coerce").astype("float64").fillna(default)


def _data(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _event_values(events: pd.DataFrame, kind: EventKind, key: str) -> list[float]:
    """The finite numbers events of `kind` carry under data[key]; events without one are left out."""
    if "kind" not in events or "data" not in events:
        return []
    values = []
    for data in events.loc[events["kind"] == kind, "data"]:
        value = _data(data).get(key)
        if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
            values.append(float(value))
    return values


def _duration_sum(events: pd.DataFrame, kind: EventKind, key: str) -> float:
    # A negative duration can only come from clocks disagreeing between processes or hosts; it counts as none.
    return sum(max(v, 0.0) for v in _event_values(events, kind, key))


def _run_start(steps: pd.DataFrame, events: pd.DataFrame) -> float:
    process_starts = _event_values(events, EventKind.RUN_STARTED, "process_start")
    if process_starts:
        return min(process_starts)
    # Without a recorded process start, the run began no later than its first step started or first event.
    candidates = []
    if "time" in steps:
        candidates.append((_column(steps, "time", math.nan) - _column(steps, "step_time_s", 0.0)).min())
    if "time" in events:
        candidates.append(_column(events, "time", math.nan).min())
    return min((t for t in candidates if not math.isnan(t)), default=math.nan)


def _run_end(steps: pd.DataFrame, events: pd.DataFrame) -> float:
    latest = [_column(df, "time", math.nan).max() for df in (steps, events) if "time" in df]
    return max((t for t in latest if not math.isnan(t)), default=math.nan)


def _preempted_s(events: pd.DataFrame) -> float:
    """From each preemption to the start of the next process (the scheduler's queue, the requeue)."""
    if "kind" not in events or "time" not in events:
        return 0.0
    starts = sorted(_event_values(events, EventKind.RUN_STARTED, "process_start"))
    total = 0.0
    for stopped in events.loc[events["kind"] == EventKind.PREEMPTED, "time"]:
        later = [s for s in starts if s > stopped]
        total += (later[0] - stopped) if later else 0.0
    return total


def compute_goodput(steps: pd.DataFrame, events: pd.DataFrame, end_time: float | None = None) -> Goodput:
    """Goodput of a run from its step rows (all attempts, as `read_steps(run_dir)`) and its events.

    The run starts at the earliest worker process start a `run_started` event records and ends at
    `end_time`, by default the latest step or event. Missing columns and empty frames count as nothing.
    """
    start = _run_start(steps, events)
    end = _run_end(steps, events) if end_time is None else float(end_time)
    wall = max(end - start, 0.0) if math.isfinite(start) and math.isfinite(end) else 0.0

    step_time = _wall_bounded(steps, _column(steps, "step_time_s", 0.0))
    abandoned = abandoned_mask(steps)
    skipped = _column(steps, "skipped", 0.0) == 1
    counted = ~abandoned & ~skipped
    productive = float(step_time[counted].sum())
    # A hang's stall lies inside another measured span, and is counted once, as the hang: in a restart's
    # down time when the watchdog's kill led to the restart (down time runs from the last step recorded
    # to the new process), otherwise in the step that stalled and then went on.
    hang = _duration_sum(events, EventKind.HANG, "stalled_s")
    down = _duration_sum(events, EventKind.RESTART, "down_s")
    productive -= min(productive, hang - min(hang, down))
    oom = min(productive, _halved_microbatch_excess(steps, step_time, counted, events))
    productive -= oom
    lost = {
        "recomputed": float(step_time[abandoned].sum()),
        "skipped": float(step_time[~abandoned & skipped].sum()),
        "restart": down - min(hang, down),
        # From the last step a vanished group recorded to the resumed one's start (node_loss.down_s).
        "node_loss": _duration_sum(events, EventKind.NODE_LOSS, "down_s"),
        "preempted": _preempted_s(events),
        "hang": hang,
        "oom": oom,
        # A rollback's checkpoint load is also recorded by its checkpoint_loaded event, so rollback.load_s
        # is not added here.
        "checkpoint": _duration_sum(events, EventKind.CHECKPOINT_SAVED, "blocking_s")
        + _duration_sum(events, EventKind.CHECKPOINT_LOADED, "load_s"),
        "startup": _startup_s(steps, events),
        "evaluation": float(_column(steps, "eval_time_s", 0.0).sum()),
    }
    # What no cause accounts for (start-up, logging, the last save). Clipped at 0 against rounding: the
    # spans above are disjoint, so productive + lost = wall.
    lost["other"] = max(wall - productive - sum(lost.values()), 0.0)
    return Goodput(wall_s=wall, productive_s=productive, lost_s={c: lost[c] for c in CAUSES})


def _startup_s(steps: pd.DataFrame, events: pd.DataFrame) -> float:
    """From each start of the workers (`run_started`'s process_start) to the start of the first step they ran,
    less the checkpoint loads recorded meanwhile (counted as checkpoint): imports, the process group's
    rendezvous, the model's build, the data. A start that ran no step counts nothing here."""
    starts = sorted(_event_values(events, EventKind.RUN_STARTED, "process_start"))
    if not starts or not {"time", "step_time_s"} <= set(steps) or steps.empty:
        return 0.0
    step_starts = (_column(steps, "time", math.nan) - _column(steps, "step_time_s", 0.0)).dropna().sort_values().to_numpy()
    loads = events[events["kind"] == EventKind.CHECKPOINT_LOADED] if "kind" in events else events.iloc[0:0]
    total = 0.0
    for start, next_start in zip(starts, [*starts[1:], math.inf]):
        first = step_starts[(step_starts >= start) & (step_starts < next_start)]
        if not len(first):
            continue
        inside = loads[(_column(loads, "time", math.nan) >= start) & (_column(loads, "time", math.nan) <= first[0])]
        load = _duration_sum(inside, EventKind.CHECKPOINT_LOADED, "load_s")
        total += max(float(first[0]) - start - load, 0.0)
    return total


def _halved_microbatch_excess(steps: pd.DataFrame, step_time: pd.Series, counted: pd.Series, events: pd.DataFrame) -> float:
    """Time lost to a micro-batch halved after an out-of-memory: for each counted step that ran with more
    micro-batches than the job's own setting, the median such step's time beyond the median counted step
    at the job's setting. Medians on both sides: the first steps after a restart are slow whatever the
    micro-batch, and would count as lost to it. A step's setting is the one the last `oom` or `oom_retry`
    event before its end set (the job's own before the first). With no step at the job's own setting
    there is nothing to compare with: none."""
    if not {"kind", "data", "time"} <= set(events) or "time" not in steps or steps.empty:
        return 0.0
    changes = events[events["kind"].isin([EventKind.OOM, EventKind.OOM_RETRY])].sort_values("time")
    data = [_data(d) for d in changes["data"]]
    known = [isinstance(d.get("microbatches"), int) for d in data]
    changes, data = changes[known], [d for d, ok in zip(data, known) if ok]
    if not data:
        return 0.0
    # Halvings double the job's own setting and retries stop at it: the least setting named is the job's own.
    own = min(v for d in data for v in (d.get("microbatches"), d.get("previous"), d.get("configured")) if isinstance(v, int))
    settings = pd.Series([own] + [d["microbatches"] for d in data]).to_numpy()
    at = settings[_column(changes, "time", math.nan).searchsorted(_column(steps, "time", math.nan))]
    halved = counted & (at > own)
    reference = step_time[counted & (at == own)]
    if reference.empty or not halved.any():
        return 0.0
    return float(halved.sum() * max(step_time[halved].median() - reference.median(), 0.0))


def _wall_bounded(steps: pd.DataFrame, step_time: pd.Series) -> pd.Series:
    """Each step's time, at most the wall time since the previous step of the same attempt ended.
    A row's step time is its slowest rank's; when different ranks are slowest on different steps,
    the sum of those maxima exceeds the wall clock (by 2% on a busy 8-process run), and goodput
    came out above 100%."""
    if "time" not in steps or "attempt" not in steps or steps.empty:
        return step_time
    order = steps.sort_values(["attempt", "step"])
    gap = order.groupby("attempt")["time"].diff()
    bounded = step_time.loc[order.index].where(gap.isna() | (step_time.loc[order.index] <= gap), gap)
    return bounded.reindex(step_time.index)


def run_goodput(meta: dict, steps: pd.DataFrame, events: pd.DataFrame) -> Goodput:
    """The run's goodput as every view shows it. Once the run ended: the figure it recorded then (meta
    `goodput`, what its last console line printed); computing it again would move it, since the records
    written after it (the goodput event, the sinks closing) lengthen the wall time. Before that, or once a
    resume started the run again, computed from `steps` (every attempt's, as read_steps(run_dir)) and
    `events` so far."""
    recorded = _recorded(meta.get("goodput"))
    return recorded if recorded is not None and _ended(events) else compute_goodput(steps, events)


def _recorded(value: Any) -> Goodput | None:
    """The Goodput a run's meta recorded (Goodput.to_dict()), or None when it holds none it can be rebuilt from.
    A cause an older record lacks lost nothing."""
    try:
        lost = {cause: float(value["lost_s"].get(cause, 0.0)) for cause in CAUSES}
        return Goodput(wall_s=float(value["wall_s"]), productive_s=float(value["productive_s"]), lost_s=lost)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _ended(events: pd.DataFrame) -> bool:
    """Whether the run's goodput event is newer than its last start: a run that ended and was not resumed."""
    marks = [kind for kind in events["kind"] if kind in (EventKind.RUN_STARTED, EventKind.GOODPUT)] if "kind" in events else []
    return bool(marks) and marks[-1] == EventKind.GOODPUT


def goodput_of_run(run_dir: str | Path) -> Goodput:
    """Goodput of the run in `run_dir`, from its store; also while the trainer is still writing."""
    return compute_goodput(read_steps(run_dir), read_events(run_dir))
