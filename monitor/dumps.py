"""A hang's stack dumps as a reader sees them: each rank's dump of the hang's attempt, read from RUN_DIR/dumps/
only, size-capped, and the ranks that were stuck picked out.

The watchdog (keel.trainer.watchdog) makes every rank write dumps/hang-attempt<A>-step<S>-rank<R>.txt when
a step stops; faulthandler's timer, for a rank whose GIL was held, leaves ...-rank<R>-gil.txt. Rank 0
records a hang its watchdog saw, so that event's `data` names rank 0 and rank 0's dump, not the rank that
stopped: that one is told apart by its stack, the only one not waiting inside a collective (a -gil dump's
rank stopped by definition). The dashboard shows these; no Streamlit here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath

from keel.monitor.run_dir import DUMP_DIR

DUMP_TAIL_BYTES = 64 * 1024  # a dump is a few KiB; only a runaway thread count makes more
HANG_DUMP = re.compile(r"^hang-attempt(\d+)-step(\d+)-rank(\d+)(-gil)?\.txt$")
_THREAD_START = "(most recent call first):\n"
_FRAME = re.compile(r'^\s+File "(.+)", line \d+ in ')
_COLLECTIVE_FILES = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")  # c10d, functional collectives, pipelining, DDP


@dataclass(frozen=True)
class RankDump:
    rank: int | None
    name: str  # the file's name in RUN_DIR/dumps (the recorded path itself when it was refused)
    text: str  # the whole dump, or its last DUMP_TAIL_BYTES; "" when it could not be read
    note: str  # one line when the text is not the whole dump, or there is none; "" otherwise
    stuck: bool  # its GIL was held, or its training thread stopped outside any collective


def hang_dumps(run_dir: str | Path, event: Mapping) -> list[RankDump]:
    """The dumps of a `hang` event's attempt (a row of read_events), stuck ranks first, then by rank. The
    dump the event names is one of them: a note says when it is gone, or when its path is not in the run's
    dumps folder (refused, never read)."""
    dumps, data = Path(run_dir) / DUMP_DIR, event.get("data") or {}
    attempt = _whole(data.get("attempt", event.get("attempt")))
    names = {p.name for p in _listing(dumps) if (m := HANG_DUMP.match(p.name)) and int(m.group(1)) == attempt}
    found = []
    if data.get("dump"):
        name = recorded_name(data["dump"])
        if name is None:
            note = f"refused: {data['dump']} is not a hang dump in this run's {DUMP_DIR} folder"
            found.append(RankDump(data.get("rank"), str(data["dump"]), "", note, False))
        else:
            names.add(name)
    found += [read_dump(dumps, name) for name in names]
    return sorted(found, key=lambda d: (not d.stuck, -1 if d.rank is None else d.rank, d.name))


def _whole(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):  # None, or pandas' NA from a store's empty cell
        return None


def _listing(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def recorded_name(recorded: str) -> str | None:
    """The file name of a dump path recorded in an event, when it names a watchdog dump in a folder named
    dumps; None otherwise. Only the name is kept: the run directory may have moved since it was recorded,
    and it is looked up in this run's dumps folder alone."""
    path = PurePath(recorded)
    return path.name if HANG_DUMP.match(path.name) and path.parent.name == DUMP_DIR else None


def read_dump(dumps: Path, name: str) -> RankDump:
    """One dump, its last DUMP_TAIL_BYTES at most. A name that leads out of `dumps` once resolved (a link)
    is refused, and a missing file gets a note, never an exception."""
    match = HANG_DUMP.match(name)
    rank = int(match.group(3)) if match else None
    path = (dumps / name).resolve()
    if not path.is_relative_to(dumps.resolve()):
        return RankDump(rank, name, "", f"refused: {DUMP_DIR}/{name} leads out of the run's {DUMP_DIR} folder", False)
    try:
        text, note = _tail(path)
    except FileNotFoundError:
        return RankDump(rank, name, "", f"{DUMP_DIR}/{name} is not there: removed, or the run was copied without it", False)
    except OSError as e:
        return RankDump(rank, name, "", f"{DUMP_DIR}/{name} cannot be read ({type(e).__name__}: {e})", False)
    return RankDump(rank, name, text, note, bool(match and match.group(4)) or stopped_outside_collectives(text))


def _tail(path: Path) -> tuple[str, str]:
    """The file's text, or its last DUMP_TAIL_BYTES from a line start with a note saying so."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - DUMP_TAIL_BYTES))
        raw = f.read(DUMP_TAIL_BYTES)
    if size <= DUMP_TAIL_BYTES:
        return raw.decode(errors="replace"), ""
    raw = raw[raw.find(b"\n") + 1 :]  # the innermost frames are at the end: cut the partial line at the start
    return raw.decode(errors="replace"), f"the last {len(raw) // 1024} KiB of {size // 1024} KiB"


def stopped_outside_collectives(stacks: str) -> bool:
    """Whether a faulthandler dump's training thread (the main one, which faulthandler lists last) stopped
    outside torch.distributed: its innermost frames leave torch's own code before reaching a collective, a
    pipeline send or receive, or DDP's broadcast. False for a dump with no stack in it."""
    _, found, thread = stacks.rpartition(_THREAD_START)
    frames = [m.group(1).replace("\\", "/") for line in thread.splitlines() if (m := _FRAME.match(line))] if found else []
    for where in frames:
        if any(part in where for part in _COLLECTIVE_FILES):
            return False
        if "/torch/" not in where:
            return True
    return False
