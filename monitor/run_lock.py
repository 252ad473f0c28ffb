"""One live trainer per run directory. The trainer's rank 0 holds an exclusive lock on RUN_DIR/owner.lock
for as long as it trains; a second trainer on the same run (a `keel train --resume` while the first
still runs) is refused, with the holder's host and pid, before it writes anything.

The lock is the kernel's (flock), so it ends with the process that holds it however that process ends
(SIGKILL, the OOM killer, a crashed node's NFS lease running out): a dead owner never leaves the run
locked. The file itself stays, with the last holder's host, pid and start time, which only the
message reads.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from keel.monitor.run_dir import LOCK_FILE


class RunDirBusy(RuntimeError):
    """Another live process owns the run directory."""


def own(run_dir: str | Path) -> IO[str]:
    """Takes the run's lock and writes this process as its holder. Keep the returned file open for as long
    as the run is owned (closing it, or the process ending, releases the lock). RunDirBusy if held."""
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        text = handle.read()
        handle.close()
        raise RunDirBusy(_busy_message(run_dir, text)) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}))
    handle.flush()
    return handle


def check_free(run_dir: str | Path) -> None:
    """RunDirBusy if a live process owns the run directory; otherwise nothing (and nothing is left held)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return
    with path.open() as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(_busy_message(run_dir, handle.read())) from None


def _busy_message(run_dir: str | Path, holder: str) -> str:
    try:
        who = json.loads(holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"]))
        name = f"pid {who['pid']} on host {who['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        name = "another process (its holder record is unreadable)"
    return f"run dir {run_dir} is in use by {name}: stop that trainer first, or wait for it to end"
