"""One live trainer per run directory. The trainer's rank 0 holds an exclusive lock on RUN_DIR/owner.lock
for as long as it trains; a second trainer on the same run (a `keel train --resume` while the first
still runs) is refused, with the holder's host and pid, before it writes anything.

The lock is the kernel's (flock), so it ends with the process that holds it however that process ends
(SIGKILL, the OOM killer, a crashed node's NFS lease running out): a dead owner never leaves the run
locked. The file itself stays, with the last holder's host, pid and start time, which the message
reads, and lock_held when the kernel's table of locks cannot be read.

Readers that only want to know whether the trainer is alive (the Runs page's status) ask lock_held, which
never takes the lock, not even shared for an instant: a trainer starting at that instant would be refused.
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

PROC_LOCKS = "/proc/locks"


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


def lock_held(run_dir: str | Path) -> bool | None:
    """Whether a live process holds the run's lock (True), nothing does (False), or this process cannot
    tell (None: no lock file, a holder on another host, or a filesystem whose locks it cannot match).
    Read-only: the lock is never taken, so a trainer starting meanwhile is never refused."""
    path = Path(run_dir) / LOCK_FILE
    try:
        stat, record = path.stat(), path.read_text()
    except OSError:  # no lock file: a run written before the lock existed, or not by Keel's trainer
        return None
    holder = _holder(record)
    try:
        held = _listed(os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino)
    except OSError:  # no /proc/locks (not Linux, or hidden): the holder's record is all there is
        return _pid_alive(holder["pid"]) if holder and holder["host"] == socket.gethostname() else None
    if held is False and (holder is None or holder["host"] != socket.gethostname()):
        return None  # a lock taken on another host (a shared filesystem) is not in this kernel's table
    return held


def _listed(major: int, minor: int, inode: int) -> bool | None:
    """Whether the kernel's table of locks lists a flock held on the file (waiters, `->`, hold nothing);
    None when only another device's file of that inode is: the device stat gives can differ from the one
    the table prints (btrfs subvolumes, overlayfs), and a wrong False would call a live run dead."""
    found = False
    with open(PROC_LOCKS) as table:
        for line in table:  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146470 0 EOF"
            fields = line.split()
            if len(fields) < 6 or fields[1] != "FLOCK":
                continue
            dev_major, dev_minor, dev_inode = fields[5].split(":")
            if int(dev_inode) == inode:
                if (int(dev_major, 16), int(dev_minor, 16)) == (major, minor):
                    return True
                found = None
    return found


def _holder(record: str) -> dict | None:
    """The holder record own() wrote (host, pid, since), or None when it is unreadable."""
    try:
        who = json.loads(record)
        return who if isinstance(who.get("host"), str) and isinstance(who.get("pid"), int) else None
    except (ValueError, AttributeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _busy_message(run_dir: str | Path, holder: str) -> str:
    try:
        who = json.loads(holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"]))
        name = f"pid {who['pid']} on host {who['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        name = "another process (its holder record is unreadable)"
    return f"run dir {run_dir} is in use by {name}: stop that trainer first, or wait for it to end"
