"""The hang watchdog: a thread per rank that notices when the training thread stops making progress.

The train loop calls `beat(phase, step)` as it moves through a step, and `step_finished(seconds)`
after it. When no beat comes for longer than the phase allows, the watchdog writes every thread's
stack (faulthandler) and what it knows of the step and phase to RUN_DIR/dumps/, reports it, and ends
the process with EXIT_HANG so that torchrun
restarts the group and the run resumes from its last good checkpoint. A hang in a collective stops
every rank, so every rank's watchdog fires and every rank leaves a dump; the stuck rank is the one
whose stack is not inside a collective.

What a step is allowed comes from the steps this process has measured: `step_factor` times the median
of the last `window` steps, and never less than `floor_s`. The first `warmup_steps` steps of a process
(after every restart or resume too) get `startup_s`: they compile, allocate, and profile for the first
time. A checkpoint save or load gets `checkpoint_s`, and the step after it twice the step allowance:
an async save's copy, its writes and rank 0's seal run beside that step (3.9 times the median step on
the tiny pp2·dp2·tp2 job on two cores; every other step stayed under 2.5 times, profiled steps included).
The allowance is fixed when its phase's beat comes, so the thread and the backstop below judge the
same stall by the same allowance.

The watchdog thread needs the GIL. A rank whose GIL is held (a deadlock in an extension, a C call
that never releases it) stops that thread too, so each beat also arms faulthandler's timer, which
runs without the GIL: a little after the allowance it appends every stack to
dumps/stall-rank<R>-pid<P>.txt and ends the process. The next attempt reports that file as a hang
(`stalled_dumps`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from keel.monitor.exits import EXIT_HANG
from keel.monitor.run_dir import DUMP_DIR
from keel.trainer.config import WatchdogConfig

log = logging.getLogger("keel.watchdog")

_STALL_HEADER = 200  # characters of the JSON line that starts a stall dump

# Phases that may legitimately take long, and which allowance covers them.
_LONG_PHASES = {"startup": "startup_s", "checkpoint_save": "checkpoint_s", "checkpoint_load": "checkpoint_s"}
_CHECKPOINT_PHASES = ("checkpoint_save", "checkpoint_load")
_AFTER_CHECKPOINT = 2.0  # the step after a checkpoint save or load: this many step allowances (see above)


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, run_dir: str | Path, rank: int, on_hang: Callable[[dict], None] | None = None):
        self.cfg, self.rank, self.on_hang = cfg, rank, on_hang
        self.dumps = Path(run_dir) / DUMP_DIR
        self.phase, self.step, self.attempt = "startup", 0, 0
        self.last_beat = time.monotonic()
        self.allowance_s = cfg.startup_s  # what the phase of the last beat allows
        self.steps_timed, self.recent_steps = 0, deque(maxlen=cfg.window)
        self.median_step_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="keel-watchdog", daemon=True)
        self._stall = None
        self._armed_phase, self._armed_at, self._armed_s = "", 0.0, 0.0
        if cfg.enabled:
            self.dumps.mkdir(parents=True, exist_ok=True)
            for old in self.dumps.glob(f"stall-rank{rank}-pid*.txt"):  # left empty by a killed process
                if old.stat().st_size <= _STALL_HEADER + 1:
                    old.unlink(missing_ok=True)
            self._stall = open(self.dumps / f"stall-rank{rank}-pid{os.getpid()}.txt", "w")
            self._thread.start()

    def beat(self, phase: str, step: int, attempt: int | None = None, steps_allowed: float = 1.0) -> None:
        """Progress into `phase` of `step`. A phase that is not one of the long ones may take `steps_allowed`
        times what a step may (an evaluation of N batches, each a forward pass of a global batch: N)."""
        after_checkpoint = phase == "step" and self.phase in _CHECKPOINT_PHASES
        self.phase, self.step, self.last_beat = phase, step, time.monotonic()
        self.allowance_s = self._allowance(after_checkpoint, steps_allowed)
        if attempt is not None:
            self.attempt = attempt
        if self._stall is not None:
            self._arm_stall_timer()

    def _arm_stall_timer(self) -> None:
        """The GIL-free backstop fires two polls after this thread would have: later than the watchdog
        thread when that one can run, so it only acts when the GIL is held. Re-arming starts a thread
        (about 140 us), so it happens at most once a poll, or when the phase changes; the deadline
        then reaches one poll further, so a beat that did not re-arm still gets its full allowance. An
        allowance that grew re-arms at once: the armed deadline must never come before the thread's."""
        allowed = self.allowance_s + 2 * self.cfg.poll_s
        info = {
            "rank": self.rank,
            "step": self.step,
            "attempt": self.attempt,
            "phase": self.phase,
            "stalled_s": round(allowed, 3),
            "timeout_s": round(allowed, 3),
        }
        self._stall.seek(0)
        self._stall.write(json.dumps(info).ljust(_STALL_HEADER) + "\n")  # faulthandler appends the stacks after it
        self._stall.flush()
        stale = self.phase != self._armed_phase or self.last_beat - self._armed_at >= self.cfg.poll_s
        if stale or self.allowance_s > self._armed_s:
            self._armed_phase, self._armed_at, self._armed_s = self.phase, self.last_beat, self.allowance_s
            faulthandler.dump_traceback_later(allowed + self.cfg.poll_s, exit=True, file=self._stall)

    def step_finished(self, step_time_s: float) -> None:
        """Feeds the step allowance, and counts as progress. The first warmup_steps steps of the process do
        not count (they compile and allocate)."""
        self.steps_timed += 1
        if self.steps_timed > self.cfg.warmup_steps:
            self.recent_steps.append(step_time_s)
            self.median_step_s = statistics.median(self.recent_steps)
        self.beat(self.phase, self.step)

    def step_allowance_s(self) -> float:
        """What a step may take once the warm-up is over: step_factor x the median recent step, at least floor_s."""
        return max(self.cfg.floor_s, self.cfg.step_factor * self.median_step_s)

    def _allowance(self, after_checkpoint: bool, steps_allowed: float) -> float:
        if self.phase in _LONG_PHASES:
            return getattr(self.cfg, _LONG_PHASES[self.phase])
        if self.steps_timed <= self.cfg.warmup_steps:
            return self.cfg.startup_s
        return self.step_allowance_s() * steps_allowed * (_AFTER_CHECKPOINT if after_checkpoint else 1.0)

    def collective_timeout_s(self) -> float:
        """The process-group timeout that backs the watchdog up: startup_s during the warm-up, then a minute
        more than twice the longest a step may take (after a checkpoint), rounded up to whole minutes so
        that it seldom changes. Never shorter than what the watchdog allows."""
        if self.steps_timed <= self.cfg.warmup_steps:
            return self.cfg.startup_s
        return 60.0 * math.ceil((2 * _AFTER_CHECKPOINT * self.step_allowance_s() + 60) / 60)

    def stop(self) -> None:
        self._stop.set()
        if self._stall is not None:
            faulthandler.cancel_dump_traceback_later()
            self._stall.close()
            Path(self._stall.name).unlink(missing_ok=True)
            self._stall = None

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            timeout = self.allowance_s  # read before last_beat, which beat() sets first: never a new allowance with an old beat
            stalled = time.monotonic() - self.last_beat
            if stalled > timeout:
                self._fire(stalled, timeout)

    def _fire(self, stalled: float, timeout: float) -> None:
        faulthandler.cancel_dump_traceback_later()  # this thread runs: the exit below is the one that counts
        info = {
            "rank": self.rank,
            "step": self.step,
            "attempt": self.attempt,
            "phase": self.phase,
            "stalled_s": round(stalled, 3),
            "timeout_s": round(timeout, 3),
        }
        self.dumps.mkdir(parents=True, exist_ok=True)
        path = self.dumps / f"hang-attempt{self.attempt}-step{self.step}-rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(
                f"keel hang watchdog: rank {self.rank} made no progress for {stalled:.1f} s "
                f"(allowed {timeout:.1f} s) in phase '{self.phase}' of step {self.step}, attempt {self.attempt}\n"
            )
            f.write(f"pid {os.getpid()}; the last collective this rank entered belongs to that phase\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        info["dump"] = str(path)
        log.error(
            "hang: no progress for %.1f s in %s of step %d; stacks in %s; exiting with code %d",
            stalled,
            self.phase,
            self.step,
            path,
            EXIT_HANG,
        )
        try:
            if self.on_hang is not None:
                self.on_hang(info)
            # The other ranks' watchdogs fire within about a poll of this one; give them time to leave
            # their dumps (the stuck rank's is the one that matters) before torchrun stops the group.
            time.sleep(3 * self.cfg.poll_s)
        finally:
            logging.shutdown()
            os._exit(EXIT_HANG)  # the training thread is stuck: a normal exit would wait for it forever


def stalled_dumps(run_dir: str | Path) -> list[dict]:
    """The stall dumps that faulthandler wrote for processes whose GIL was held, as hang reports (the
    `info` of a hang), each renamed to hang-attempt<A>-step<S>-rank<R>-gil.txt so it is reported once."""
    found = []
    for path in sorted((Path(run_dir) / DUMP_DIR).glob("stall-rank*-pid*.txt")):
        text = path.read_text(errors="replace")
        if len(text) <= _STALL_HEADER + 1:
            continue  # armed, never fired: a process that is running, or one that was killed
        info = json.loads(text[:_STALL_HEADER])
        target = path.with_name(f"hang-attempt{info['attempt']}-step{info['step']}-rank{info['rank']}-gil.txt")
        path.rename(target)
        found.append({**info, "dump": str(target), "detected_at": target.stat().st_mtime, "by": "faulthandler (GIL held)"})
    return found
