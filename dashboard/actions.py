"""The dashboard's only writes: start `keel drill`, and ask a running job for a fault with `keel inject`.

Both run the `keel` command as a child process with an argument list, never a shell string, so nothing
a user types is interpreted. Both refuse unless `keel dashboard` turned the actions on (ACTIONS_ENV, set
by keel.dashboard.launch: off with --read-only, and off on a non-loopback bind without --allow-actions);
an app started some other way has them off.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ACTIONS_ENV = "KEEL_DASHBOARD_ACTIONS"
DRILL_LOG = "drill-console.log"  # what the started drill prints, in the run directory it drills into
# A run directory's name as the drill form takes it: one plain folder name, so it cannot leave the folder.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ActionRefused(Exception):
    """An action that is off, or whose input is not acceptable; the message says why in one line."""


def actions_enabled() -> bool:
    return os.environ.get(ACTIONS_ENV) == "1"


def _require_actions() -> None:
    if not actions_enabled():
        raise ActionRefused("actions are off on this dashboard (--read-only, or a non-loopback bind without --allow-actions)")


def _keel(*args: str) -> list[str]:
    return [sys.executable, "-m", "keel.cli", *args]


@dataclass
class StartedDrill:
    run_dir: Path
    log: Path
    proc: subprocess.Popen
    started: float


def start_drill(runs_folder: Path, name: str, config: str, layout: tuple[int, int, int], faults: str) -> StartedDrill:
    """Starts `keel drill` on RUNS_FOLDER/NAME for a preset or TOML config at pp, dp, tp; `faults` empty
    runs the standard suite. Its output goes to RUN_DIR/drill-console.log. `keel drill` checks the
    job itself and exits at once with a one-line error on bad input."""
    _require_actions()
    if not _NAME.match(name):
        raise ActionRefused(f"run name {name!r}: use letters, digits, '.', '_' and '-' (one folder name)")
    if not (_NAME.match(config) or (config.endswith(".toml") and Path(config).is_file())):
        raise ActionRefused(f"config {config!r}: give a preset name (e.g. tiny) or the path of a TOML file")
    if not all(isinstance(n, int) and n >= 1 for n in layout):
        raise ActionRefused(f"layout {layout}: pp, dp and tp are whole numbers of at least 1")
    run_dir = runs_folder / name
    run_dir.mkdir(parents=True, exist_ok=True)
    pp, dp, tp = layout
    args = ["drill", f"--run-dir={run_dir}", f"--config={config}", f"--pp={pp}", f"--dp={dp}", f"--tp={tp}"]
    args += [f"--faults={faults}"] if faults.strip() else ["--suite=standard"]
    log = run_dir / DRILL_LOG
    with open(log, "w") as out:  # the child holds its own descriptor
        # A session of its own: the drill outlives a closed browser tab, and a server restart does not kill it.
        proc = subprocess.Popen(_keel(*args), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return StartedDrill(run_dir, log, proc, time.time())


def inject_fault(run_dir: Path, fault: str, rank: int | None) -> tuple[bool, str]:
    """Runs `keel inject RUN_DIR FAULT [--rank R]`; returns whether it was accepted and what it said."""
    _require_actions()
    # Options first, then "--": a fault typed as "--help" is a fault name to reject, not an option.
    args = ["inject", *([f"--rank={rank}"] if rank is not None else []), "--", str(run_dir), fault]
    proc = subprocess.run(_keel(*args), capture_output=True, text=True, timeout=60)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()
