"""A run's checkpoints as a reader sees them: each manifest verified against its files, and the list of
saves with their cost (from the `checkpoint_saved` events) and their state on disk.

The trainer writes the manifests (keel.trainer.checkpoint.checkpointer) and verifies them before loading; the
dashboard lists them. No torch here, and pandas only in the dashboard's table (every trainer process
imports `verify`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from keel.monitor.event_kinds import EventKind
from keel.monitor.hashing import sha256_file
from keel.monitor.run_dir import MANIFEST, checkpoint_name, list_checkpoints

if TYPE_CHECKING:
    import pandas as pd

CHECKPOINT_COLUMNS = ("step", "attempt", "folder", "size_bytes", "blocked_s", "write_s", "state")


def verify(path: Path) -> str | None:
    """None when every file matches the manifest; otherwise what is wrong, in one line."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"{path.name}: unreadable manifest ({e})"
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{path.name}: {name} is missing"
        if sha256_file(file) != expected:
            return f"{path.name}: {name} does not match its sha256 in the manifest"
    return None


def checkpoint_table(run_dir: str | Path, events: pd.DataFrame, verify_one=verify) -> pd.DataFrame:
    """One row per save the run recorded (CHECKPOINT_COLUMNS), oldest first. `state` is "verified",
    "corrupt: <why>" or "removed" (by retention, or by a rollback past it); a finished checkpoint found
    on disk without a save event (a run resumed from elsewhere) is listed too. `verify_one` lets a
    caller cache the hashing of large files."""
    import pandas as pd  # loaded already: `events` is a DataFrame

    saved = events[events.kind == EventKind.CHECKPOINT_SAVED]
    on_disk = dict(list_checkpoints(run_dir))
    rows = {}
    for e in saved.itertuples():  # a step saved again by a later attempt replaces the earlier save
        folder = Path(e.data["path"]).name if "path" in e.data else checkpoint_name(int(e.step))  # a hand-made event
        rows[int(e.step)] = {"step": int(e.step), "attempt": e.attempt, "folder": folder,
                             "blocked_s": e.data.get("blocking_s"), "write_s": e.data.get("total_s")}  # fmt: skip
    for step, path in on_disk.items():
        rows.setdefault(step, {"step": step, "attempt": pd.NA, "folder": path.name, "blocked_s": None, "write_s": None})
    for step, row in rows.items():
        path = on_disk.get(step)
        if path is None:
            row |= {"size_bytes": None, "state": "removed"}
            continue
        problem = verify_one(path)
        row |= {"size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
                "state": "verified" if problem is None else f"corrupt: {problem}"}  # fmt: skip
    return pd.DataFrame([rows[s] for s in sorted(rows)], columns=list(CHECKPOINT_COLUMNS))
