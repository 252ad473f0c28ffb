"""The runs under some folders, each summed up in one row: what a person scanning many runs wants first
(the dashboard's Runs page). Reads run stores only, so it works on runs still being written.

A run's status comes from its own record:
- finished / stopped: its last ending event is `run_finished` / `run_stopped` (the rollback cap);
- hung: the watchdog's `hang` event is its last word and nothing ran after it;
- running: it wrote a step or an event within `stale_after_s` (ten of its median step times, at least
  two minutes: a checkpoint or a restart is a long silence, not a death);
- failed: silent for longer than that, with no ending event;
- unreadable: the run store cannot be read (the message says why); the other runs are unaffected.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from keel.monitor.event_kinds import EventKind
from keel.monitor.goodput import compute_goodput
from keel.monitor.run_dir import CHECKPOINT_DIR, DRILL_DIR, STORE_FILE
from keel.monitor.store import read_events, read_meta, read_steps

MIN_STALE_S = 120.0
_ENDINGS = (EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED, EventKind.HANG)
SUMMARY_COLUMNS = (
    "run_id", "run_dir", "status", "problem", "layout", "step", "total_steps", "loss", "tokens_per_s", "mfu",
    "comm_share", "goodput", "rollbacks", "restarts", "alerts", "last_seen",
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
    run_dir = Path(run_dir)
    row: dict[str, Any] = dict.fromkeys(SUMMARY_COLUMNS) | {"run_id": run_dir.name, "run_dir": str(run_dir)}
    try:
        steps, events, meta = read_steps(run_dir, effective=True), read_events(run_dir), read_meta(run_dir)
    except (sqlite3.Error, FileNotFoundError, ValueError) as e:
        return row | {"status": "unreadable", "problem": f"{type(e).__name__}: {e}"}
    config = meta.get("config", {})
    parallel = config.get("parallel", {})
    row |= {
        "run_id": meta.get("run_id", run_dir.name),
        "layout": f"pp{parallel['pp']} dp{parallel['dp']} tp{parallel['tp']}" if parallel else None,
        "total_steps": config.get("training", {}).get("steps"),
        # The run's own figure once it ended; until then the same computation on what it wrote so far.
        "goodput": (meta.get("goodput") or {}).get("goodput") or compute_goodput(read_steps(run_dir), events).goodput,
        "rollbacks": int((events.kind == EventKind.ROLLBACK).sum()),
        "restarts": int((events.kind == EventKind.RESTART).sum()),
        "alerts": int((events.kind == EventKind.ALERT).sum()),
    }
    if len(steps):
        last = steps.iloc[-1]
        row |= {"step": int(last.step), "loss": float(last.loss), "tokens_per_s": float(last.tokens_per_s), "mfu": float(last.mfu)}
        row["comm_share"] = _last_value(steps.comm_share)
    times = pd.concat([steps.time, events.time]).dropna()
    row["last_seen"] = float(times.max()) if len(times) else None
    row["status"] = _status(steps, events, row["last_seen"], time.time() if now is None else now)
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


def _status(steps: pd.DataFrame, events: pd.DataFrame, last_seen: float | None, now: float) -> str:
    endings = events[events.kind.isin(_ENDINGS)]
    last = endings.kind.iloc[-1] if len(endings) else None
    if last == EventKind.RUN_FINISHED:
        return "finished"
    if last == EventKind.RUN_STOPPED:
        return "stopped"
    quiet = last_seen is None or now - last_seen > stale_after_s(steps)
    if last == EventKind.HANG and (not len(steps) or steps.time.max() <= endings.time.iloc[-1]):
        return "hung" if quiet else "running"  # a hang is followed by torchrun's restart, unless it gave up
    return "failed" if quiet else "running"


def _last_value(series: pd.Series) -> float | None:
    values = series.dropna()
    return float(values.iloc[-1]) if len(values) else None
