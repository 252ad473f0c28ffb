"""The runs under some folders, each summed up in one row: what a person scanning many runs wants first
(the dashboard's Runs page). Reads run stores only, so it works on runs still being written.

A run's status comes from its own record and from its trainer's run lock (rank 0 holds it for as long as
it trains; keel.monitor.run_lock.lock_held, which cannot tell for a run written before the lock existed or
by a trainer on another host):
- finished / stopped: its last ending event is `run_finished` / `run_stopped` (the rollback cap, Ctrl-C);
- running: its trainer holds the lock and wrote a step or an event within `stuck_after_s`; or nothing holds
  the lock but it wrote within KILLED_AFTER_S (torchrun's restart of a worker group leaves the lock free
  for a few seconds); or the lock cannot be checked and it wrote within `stale_after_s` (ten of its median
  step times, at least two minutes: a checkpoint or a restart is a long silence, not a death);
- killed: nothing holds the lock, it has been silent for KILLED_AFTER_S and has no ending event: its
  trainer ended without a word (kill -9, the OOM killer, a lost node, a crash torchrun gave up on);
- hung: the watchdog's `hang` event is its last word, nothing ran after it, and it is as silent as a
  killed (or, lock unknown, a failed) run: nothing restarted it; or its trainer holds the lock but has been
  silent beyond `stuck_after_s`, longer than its watchdog allows any phase, so the watchdog could not
  end it (a process stuck in the kernel, or the watchdog off);
- failed: the lock cannot be checked, and it has been silent beyond `stale_after_s` with no ending event;
- unreadable: the run store cannot be read (the message says why); the other runs are unaffected.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from keel.monitor.event_kinds import EventKind
from keel.monitor.goodput import Goodput, run_goodput
from keel.monitor.run_dir import CHECKPOINT_DIR, DRILL_DIR, STORE_FILE
from keel.monitor.run_lock import lock_held
from keel.monitor.store import abandoned_mask, read_events, read_meta, read_steps

MIN_STALE_S = 120.0
# How long a run whose lock nothing holds may be silent before it counts as killed. The lock is free between
# the death of a worker group's rank 0 and its successor taking it: 0.7-4 s in the restarts measured in
# docs/stability.md (its recovery table's restart column). 30 s is several times that, yet a quarter of the
# two minutes a dead run showed as running before; a restart slower still (a large job's slow rendezvous)
# shows as killed for a moment, until its new rank 0 takes the lock.
KILLED_AFTER_S = 30.0
ETA_WINDOW = 50  # the last effective steps whose median step time sets the ETA
_ENDINGS = (EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED, EventKind.HANG)
SUMMARY_COLUMNS = (
    "run_id", "run_dir", "status", "problem", "layout", "step", "total_steps", "loss", "tokens_per_s", "mfu",
    "comm_share", "goodput", "rollbacks", "restarts", "alerts", "last_alert", "last_alert_time", "started", "last_seen", "eta_s",
)  # fmt: skip


def _folders_below(folders: Iterable[str | Path]) -> Iterator[tuple[Path, list[str], list[str]]]:
    """(folder, its subfolder names, its file names) at or below each folder. Symlinked folders are
    followed, once each; the insides of drills and checkpoints are not searched."""
    seen = set()
    for folder in map(Path, folders):
        for root, dirs, files in os.walk(folder, followlinks=True):
            real = os.path.realpath(root)
            if real in seen:  # a link back up the tree
                dirs.clear()
                continue
            seen.add(real)
            yield Path(root), list(dirs), files
            dirs[:] = [d for d in dirs if d not in (DRILL_DIR, CHECKPOINT_DIR)]


def find_runs(folders: Iterable[str | Path]) -> list[Path]:
    """Run directories (those holding a run store) at or below each folder, sorted. The runs a drill made
    stay inside its report (see find_drills)."""
    return sorted({root for root, _, files in _folders_below(folders) if STORE_FILE in files})


def find_drills(folders: Iterable[str | Path]) -> list[Path]:
    """The folders `keel drill` made (RUN_DIR/drills/drill-<time>/) at or below each folder, sorted;
    one still running has no report.json yet."""
    found = set()
    for root, dirs, _ in _folders_below(folders):
        if DRILL_DIR in dirs:
            found.update(p for p in (root / DRILL_DIR).glob("drill-*") if p.is_dir())
    return sorted(found)


def summarize_run(run_dir: str | Path, now: float | None = None) -> dict[str, Any]:
    """One run's row (SUMMARY_COLUMNS). Never raises for a damaged store: its status is `unreadable`."""
    try:
        every, events, meta = read_steps(run_dir), read_events(run_dir), read_meta(run_dir)
    except (sqlite3.Error, FileNotFoundError, ValueError) as e:
        row = dict.fromkeys(SUMMARY_COLUMNS) | {"run_id": Path(run_dir).name, "run_dir": str(run_dir)}
        return row | {"status": "unreadable", "problem": f"{type(e).__name__}: {e}"}
    return summarize(run_dir, every, events, meta, now)


def summarize(run_dir: str | Path, every: pd.DataFrame, events: pd.DataFrame, meta: dict, now: float | None = None,
              goodput: Goodput | None = None) -> dict[str, Any]:  # fmt: skip
    """One run's row (SUMMARY_COLUMNS) from what was read of it: every attempt's step rows (as read_steps
    reads them), its events and its meta, and its goodput (run_goodput) when already worked out. The
    Run page sums up the run it has read this way, without reading it again."""
    run_dir = Path(run_dir)
    row: dict[str, Any] = dict.fromkeys(SUMMARY_COLUMNS) | {"run_id": run_dir.name, "run_dir": str(run_dir)}
    steps = every[~abandoned_mask(every)]  # the effective trajectory: read_steps(effective=True)
    goodput = goodput or run_goodput(meta, every, events)
    config = meta.get("config", {})
    parallel = config.get("parallel", {})
    alerts = events[events.kind == EventKind.ALERT]
    row |= {
        "run_id": meta.get("run_id", run_dir.name),
        "layout": f"pp{parallel['pp']} dp{parallel['dp']} tp{parallel['tp']}" if parallel else None,
        "total_steps": config.get("training", {}).get("steps"),
        "goodput": float(goodput.goodput),  # as the Run page shows it
        "rollbacks": int((events.kind == EventKind.ROLLBACK).sum()),
        "restarts": int((events.kind == EventKind.RESTART).sum()),
        "alerts": len(alerts),
        "last_alert": alerts.message.iloc[-1] if len(alerts) else None,
        "last_alert_time": float(alerts.time.iloc[-1]) if len(alerts) else None,
    }
    if len(steps):
        last = steps.iloc[-1]
        row |= {"step": int(last.step), "loss": float(last.loss), "tokens_per_s": float(last.tokens_per_s), "mfu": float(last.mfu)}
        row["comm_share"] = _last_value(steps.comm_share)
    times = pd.concat([steps.time, events.time]).dropna()
    if len(times):
        row |= {"started": float(times.min()), "last_seen": float(times.max())}
    silent = math.inf if row["last_seen"] is None else (time.time() if now is None else now) - row["last_seen"]
    row["status"] = _status(steps, events, silent, lock_held(run_dir), config)
    row["eta_s"] = _eta_s(steps, row["total_steps"]) if row["status"] == "running" else None
    return row


def summarize_runs(folders: Iterable[str | Path], now: float | None = None) -> pd.DataFrame:
    """One row per run found under the folders (see summarize_run), newest activity first."""
    rows = [summarize_run(run_dir, now) for run_dir in find_runs(folders)]
    frame = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    return frame.sort_values("last_seen", ascending=False, na_position="last", ignore_index=True)


def stale_after_s(steps: pd.DataFrame) -> float:
    """How long a run may be silent and still count as running."""
    median = steps.step_time_s.median() if len(steps) else float("nan")
    return max(MIN_STALE_S, 10 * median) if median == median else MIN_STALE_S


def stuck_after_s(steps: pd.DataFrame, config: dict) -> float:
    """How long a live trainer (one holding the run lock) may be silent and still count as running: the
    longest its watchdog allows a start-up or a checkpoint (watchdog.startup_s, checkpoint_s in the run's
    config), or stale_after_s if longer. Beyond that the watchdog, which ends a stalled process, could not."""
    watchdog = config.get("watchdog", {})
    return max([stale_after_s(steps)] + [float(watchdog.get(phase, 0.0)) for phase in ("startup_s", "checkpoint_s")])


def _status(steps: pd.DataFrame, events: pd.DataFrame, silent_s: float, held: bool | None, config: dict) -> str:
    """The run's status by the rules in the module's docstring; `held` is lock_held's answer."""
    endings = events[events.kind.isin(_ENDINGS)]
    last = endings.kind.iloc[-1] if len(endings) else None
    if last == EventKind.RUN_FINISHED:
        return "finished"
    if last == EventKind.RUN_STOPPED:
        return "stopped"
    # A hang is followed by torchrun's restart, unless it gave up.
    hang = last == EventKind.HANG and (not len(steps) or steps.time.max() <= endings.time.iloc[-1])
    if held is False:
        return "running" if silent_s < KILLED_AFTER_S else "hung" if hang else "killed"
    if silent_s <= (stuck_after_s(steps, config) if held else stale_after_s(steps)):
        return "running"
    return "hung" if hang or held else "failed"


def _eta_s(steps: pd.DataFrame, total_steps: int | None) -> float | None:
    """Seconds left: the steps to go times the median time of the last ETA_WINDOW steps."""
    if not total_steps or not len(steps):
        return None
    median = steps.step_time_s.tail(ETA_WINDOW).median()
    return max(total_steps - int(steps.step.iloc[-1]), 0) * float(median) if median == median else None


def _last_value(series: pd.Series) -> float | None:
    values = series.dropna()
    return float(values.iloc[-1]) if len(values) else None
