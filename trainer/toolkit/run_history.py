"""What a starting process reads from its run's store about the starts before it: the next attempt number,
when the run began, when the failed group
recorded its last step, and the stalls faulthandler ended. Rank 0 reads; collectives share what all need.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from keel.monitor.event_kinds import EventKind
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import read_events, read_steps
from keel.trainer.incidents import Incidents
from keel.trainer.watchdog import stalled_dumps


def report_stalls(run_dir: Path, incidents: Incidents) -> None:
    """Reports the processes that faulthandler ended because their GIL was held, unless the attempt
    already reported its hang (the other ranks' watchdogs see the same stall from inside a collective)."""
    events = read_events(run_dir) if (run_dir / STORE_FILE).exists() else None
    reported = set() if events is None else set(events.loc[events.kind == EventKind.HANG, "attempt"].dropna().astype(int))
    for info in stalled_dumps(run_dir):
        if info["attempt"] not in reported:
            incidents.hang(info)
            reported.add(info["attempt"])


def next_attempt(run_dir: Path, rank: int, world: int) -> int:
    """One more than any attempt in the run store, so a resumed run's rows never replace earlier ones."""
    value = [0]
    if rank == 0 and (run_dir / STORE_FILE).exists():
        steps, events = read_steps(run_dir), read_events(run_dir)
        attempts = [
            int(steps["attempt"].max()) if len(steps) else -1,
            int(events["attempt"].max()) if events["attempt"].notna().any() else -1,
        ]
        value = [max(attempts) + 1]
    if world > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


def run_began(run_dir: Path, process_start: float) -> float:
    """When the run's first process started (the progress line's clock spans restarts and resumes)."""
    if not (run_dir / STORE_FILE).exists():
        return process_start
    events = read_events(run_dir)
    starts = [d.get("process_start") for d in events.loc[events.kind == EventKind.RUN_STARTED, "data"] if isinstance(d, dict)]
    return min([s for s in starts if s] + [process_start])


def last_step_time(run_dir: Path) -> float | None:
    """When the failed group recorded its last step: its down time runs from there to the new processes.
    Not its last event: a watchdog records the hang when it detects it, after the stall, and goodput
    counts the stall as the hang inside this down time (keel.monitor.goodput)."""
    if not (run_dir / STORE_FILE).exists():
        return None
    last = read_steps(run_dir)["time"].max()
    return None if last != last else float(last)
