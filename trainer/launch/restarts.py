"""Who failed, and whether to restart: what `keel train`'s agent decides each time the worker group fails.

torchrun's `--max-restarts` counts over the agent's whole life, so a job that meets a fault a day ends
at its fourth. Keel's budget follows progress instead: a failure after the run got past the step where
the previous failure happened starts the count again, so only failures in a row without progress
count, and more than `max_in_a_row` of them (a crash loop) stop the run. The coordinated restart that
halves the micro-batch after an out-of-memory error is Keel's own recovery, not a failure: it never counts.

Each failure is attributed to the rank that failed first. torchrun names whichever dead process it finds
first, often a peer that only saw the connection drop, so Keel ranks the exits by cause: a signal
(other than the SIGTERM torchrun sends the survivors), then Keel's own exit codes (hang, OOM), then any
other exit. A fault Keel injected names its rank outright: the injector writes its line in
RUN_DIR/chaos/injected.jsonl before it acts.

Every failure is a line of RUN_DIR/control/failures.jsonl, written before the restart, so the restarted
rank 0 puts it in its `restart` event, and `keel train` reads the last one to report a give-up.
No torch here: the launcher reads these records too.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from keel.chaos.kinds import KINDS
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_HANG, EXIT_MEANINGS, EXIT_OOM, EXIT_OOM_RESTART
from keel.monitor.run_dir import AGENT_LOG, CHAOS_DIR, CONTROL_DIR, FAILURES_FILE, INJECTED_FILE, STORE_FILE, rank_log_name
from keel.monitor.store import last_event, step_bounds

# `keel train` names the run directory to its agent, which then restarts by this budget.
RUN_DIR_ENV = "KEEL_RUN_DIR"
# ... and the C++ log level its workers get (the agent quiets its own: keel.trainer.launch.agent).
WORKERS_CPP_LOG_LEVEL_ENV = "KEEL_WORKERS_CPP_LOG_LEVEL"
# Written by --reset-restarts: the number of failure records that no longer count.
RESET_FILE = Path(CONTROL_DIR) / "restarts-reset"
# torchrun's own count of restarts, over the agent's life: set out of reach when Keel's budget decides.
TORCHRUN_MAX_RESTARTS = 1_000_000

# A rank torchrun stopped because another failed ends by this signal; it is never the cause.
_STOPPED_BY_TORCHRUN = -signal.SIGTERM
# Exits Keel's own handlers choose: the watchdog on a hang, the OOM handler.
_KEEL_EXITS = (EXIT_HANG, EXIT_OOM_RESTART, EXIT_OOM)


@dataclass
class Failure:
    rank: int | None  # the rank that failed first; None when the whole node went (its agent was killed)
    exit_code: int  # the process's exit status; negative: killed by that signal
    step: int  # the furthest step the run had recorded when it failed (0: none)
    time: float
    restart: int  # how many restarts the run had before this failure
    fault: str = ""  # the injected fault that caused it, if Keel injected one ...
    fault_step: int = 0  # ... and the step it was injected at
    in_a_row: int = 1  # failures in a row without progress, this one included
    gave_up: bool = False
    host: str = ""  # the host of the node where it failed ("" in records older than multi-node attribution)
    node: int | None = None  # that node's rank in the job (torchrun's group rank)

    def cause(self) -> str:
        """'SIGSEGV', 'exit code 3 (hang)', ... in a few words."""
        if self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        if self.exit_code in _KEEL_EXITS:
            return f"exit code {self.exit_code} ({EXIT_MEANINGS[self.exit_code]})"
        where = "" if self.rank is None else f": see logs/{rank_log_name(self.rank)} and logs/{AGENT_LOG}"
        return f"exit code {self.exit_code} (an error{where})"

    def describe(self) -> str:
        """What failed, as one clause: 'rank 3 on node-b ended by SIGSEGV after step 37 (injected segfault@step=38,rank=3)'."""
        on = f" on {self.host}" if self.host else ""
        who = f"the node{on} (its agent and every worker)" if self.rank is None else f"rank {self.rank}{on}"
        fault = f" (injected {self.fault})" if self.fault else ""
        return f"{who} ended by {self.cause()} after step {self.step}{fault}"

    def console_line(self, max_in_a_row: int, then: str = "restarting from the newest snapshot or checkpoint") -> str:
        """The one line a failure gets on the console."""
        if self.gave_up:
            return f"keel train: {self.describe()}: {self.in_a_row} failures in a row without progress; giving up"
        budget = "" if self.exit_code == EXIT_OOM_RESTART else f"; {self.in_a_row} of {max_in_a_row} in a row without progress"
        return f"keel train: {self.describe()}; {then} (restart {self.restart + 1}{budget})"


def first_failed(exits: dict[int, int]) -> int:
    """The rank whose exit caused the others', from every rank's exit status (rank -> status)."""

    def blame(item: tuple[int, int]) -> tuple[int, int]:
        rank, code = item
        if code == 0 or code == _STOPPED_BY_TORCHRUN:
            order = 3
        elif code < 0:
            order = 0  # killed by the kernel or a person: nothing else ends a process by a signal here
        elif code in _KEEL_EXITS:
            order = 1  # Keel's watchdog or OOM handler ended it on purpose
        else:
            order = 2  # an exception: most often a peer's death seen as a broken connection
        return order, rank

    return min(exits.items(), key=blame)[0]


@dataclass
class Node:
    """A node of the job as its agent reported it: its host, its workers' global ranks, and whether it
    reported the exit statuses of this failure."""

    host: str
    ranks: list[int]
    reported: bool = True


def attribute(exits: dict[int, int] | None, fault: dict | None, nodes: dict[int, Node]) -> tuple[int | None, int | None]:
    """(the rank that failed first, or None when a whole node went; the node it was on, or None when not
    known). The injected fault's rank comes first, then a node that reported nothing while the others
    only saw their connections drop (it was lost), then the ranks by cause (first_failed)."""
    lost = sorted(n for n, node in nodes.items() if not node.reported)
    on_node = {rank: n for n, node in nodes.items() for rank in node.ranks}
    fault_rank = int(fault["rank"]) if fault else None
    if exits and fault_rank in exits:
        return fault_rank, on_node.get(fault_rank)
    if fault_rank in on_node and on_node[fault_rank] in lost:
        return None, on_node[fault_rank]
    if lost and not any(_killed(code) for code in (exits or {}).values()):
        return None, lost[0]
    if exits:
        rank = first_failed(exits)
        return rank, on_node.get(rank)
    return None, lost[0] if lost else None


def _killed(code: int) -> bool:
    """Ended by a signal that torchrun did not send: the process itself died, not a peer that saw it go."""
    return code < 0 and code != _STOPPED_BY_TORCHRUN


def injected_kill(run_dir: Path, since: float) -> dict | None:
    """The newest process-ending fault Keel injected since `since` (epoch seconds), or None."""
    path = run_dir / CHAOS_DIR / INJECTED_FILE
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill it announced
        kind = KINDS.get(entry.get("kind"))
        if kind is not None and kind.ends_process and entry.get("time", 0) >= since:
            found = entry
    return found


def furthest_step(run_dir: Path) -> int:
    """The furthest step the run store holds, any attempt (0 before the first step or without a store)."""
    if not (run_dir / STORE_FILE).is_file():
        return 0
    try:
        bounds = step_bounds(run_dir)
    except sqlite3.Error:
        return 0
    return 0 if bounds is None else int(bounds[1])


def ended_unrecorded(run_dir: Path) -> bool:
    """Whether the run's last start has neither finished nor stopped on record: its processes vanished
    (a node lost, the job killed from outside; a preemption and a Ctrl-C are on record)."""
    if not (run_dir / STORE_FILE).exists():
        return False
    last = last_event(run_dir, [EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED])
    return last is not None and last[0] == EventKind.RUN_STARTED


def read_failures(run_dir: Path) -> list[Failure]:
    path = run_dir / FAILURES_FILE
    if not path.is_file():
        return []
    return [Failure(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def last_failure(run_dir: Path) -> Failure | None:
    failures = read_failures(run_dir)
    return failures[-1] if failures else None


class RestartBudget:
    """Decides, failure by failure, whether the run restarts; keeps the record in RUN_DIR/control/failures.jsonl."""

    def __init__(self, run_dir: str | Path, max_in_a_row: int):
        self.run_dir, self.max_in_a_row = Path(run_dir), max_in_a_row

    def record(self, exits: dict[int, int] | None, exit_code: int, started: float, nodes: dict[int, Node] | None = None) -> Failure:
        """Attributes the failure of a group started at `started` (epoch seconds) from its ranks' exit
        statuses (None, with the agent's own `exit_code`, when the whole node went), decides, and
        writes the record down before anything restarts. `nodes` (node rank -> Node) are the job's
        nodes, those that reported their workers' exits and those that did not (lost)."""
        previous = read_failures(self.run_dir)
        step = furthest_step(self.run_dir)
        fault = injected_kill(self.run_dir, started)
        counted = [f for f in previous[self._reset_at() :] if f.exit_code != EXIT_OOM_RESTART]
        rank, node = attribute(exits, fault, nodes or {})
        if rank is not None:
            exit_code = exits[rank]
        elif exits and node is not None and not nodes[node].reported:
            exit_code = -signal.SIGKILL  # lost, as the survivors see it: a machine that died says nothing
        if exit_code == EXIT_OOM_RESTART:  # Keel's own recovery: neither progress nor a failure
            in_a_row = counted[-1].in_a_row if counted else 0
        elif counted and step <= counted[-1].step:  # no step past the previous failure's
            in_a_row = counted[-1].in_a_row + 1
        else:
            in_a_row = 1
        failure = Failure(
            rank=rank,
            exit_code=exit_code,
            step=step,
            time=time.time(),
            restart=len(previous),
            fault=fault["fault"] if fault else "",
            fault_step=int(fault["step"]) if fault else 0,
            in_a_row=in_a_row,
            gave_up=in_a_row > self.max_in_a_row,
            host="" if node is None else nodes[node].host,
            node=node,
        )
        self._append(failure)
        return failure

    def reset(self) -> None:
        """A person fixed the cause (`keel train --resume RUN_DIR --reset-restarts`): the failures so far no
        longer count; they stay on record."""
        path = self.run_dir / RESET_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(len(read_failures(self.run_dir))))

    def _reset_at(self) -> int:
        """How many of the records came before the last reset (0: none)."""
        path = self.run_dir / RESET_FILE
        return int(path.read_text()) if path.is_file() else 0

    def _append(self, failure: Failure) -> None:
        path = self.run_dir / FAILURES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(asdict(failure)) + "\n")
            f.flush()
            os.fsync(f.fileno())
