"""The hang watchdog: a thread per rank that notices when the training thread stops making progress.

The train loop calls `beat(phase, step)` as it moves through a step. When no beat comes for longer
than the phase allows, the watchdog writes every thread's stack (faulthandler) and what it knows of
the step and phase to RUN_DIR/dumps/, reports it, and ends the process with EXIT_HANG so that torchrun
restarts the group and the run resumes from its last good checkpoint. A hang in a collective stops
every rank, so every rank's watchdog fires and every rank leaves a dump; the stuck rank is the one
whose stack is not inside a collective.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from keel.trainer.config import WatchdogConfig
from keel.trainer.exits import EXIT_HANG

log = logging.getLogger("keel.watchdog")

# Phases that may legitimately take long, and which allowance covers them.
_LONG_PHASES = {"startup": "startup_s", "checkpoint_save": "checkpoint_s", "checkpoint_load": "checkpoint_s"}


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, run_dir: str | Path, rank: int, on_hang: Callable[[dict], None] | None = None):
        self.cfg, self.rank, self.on_hang = cfg, rank, on_hang
        self.dumps = Path(run_dir) / "dumps"
        self.phase, self.step, self.attempt = "startup", 0, 0
        self.last_beat = time.monotonic()
        self.steps_timed, self.longest_step_s = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="keel-watchdog", daemon=True)
        if cfg.enabled:
            self._thread.start()

    def beat(self, phase: str, step: int, attempt: int | None = None) -> None:
        self.phase, self.step, self.last_beat = phase, step, time.monotonic()
        if attempt is not None:
            self.attempt = attempt

    def step_finished(self, step_time_s: float) -> None:
        """Feeds the step-time allowance; the first warmup_steps steps do not count (they compile and allocate)."""
        self.steps_timed += 1
        if self.steps_timed > self.cfg.warmup_steps:
            self.longest_step_s = max(self.longest_step_s, step_time_s)

    def timeout_s(self) -> float:
        if self.phase in _LONG_PHASES:
            return getattr(self.cfg, _LONG_PHASES[self.phase])
        if self.steps_timed <= self.cfg.warmup_steps:
            return self.cfg.startup_s
        return max(self.cfg.floor_s, self.cfg.step_factor * self.longest_step_s)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            stalled = time.monotonic() - self.last_beat
            timeout = self.timeout_s()
            if stalled > timeout:
                self._fire(stalled, timeout)

    def _fire(self, stalled: float, timeout: float) -> None:
        info = {"rank": self.rank, "step": self.step, "attempt": self.attempt, "phase": self.phase,
                "stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3)}
        self.dumps.mkdir(parents=True, exist_ok=True)
        path = self.dumps / f"hang-attempt{self.attempt}-step{self.step}-rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"keel hang watchdog: rank {self.rank} made no progress for {stalled:.1f} s "
                    f"(allowed {timeout:.1f} s) in phase '{self.phase}' of step {self.step}, attempt {self.attempt}\n")
            f.write(f"pid {os.getpid()}; the last collective this rank entered belongs to that phase\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        info["dump"] = str(path)
        log.error("hang: no progress for %.1f s in %s of step %d; stacks in %s; exiting with code %d",
                  stalled, self.phase, self.step, path, EXIT_HANG)
        try:
            if self.on_hang is not None:
                self.on_hang(info)
            # The other ranks' watchdogs fire within about a poll of this one; give them time to leave
            # their dumps (the stuck rank's is the one that matters) before torchrun stops the group.
            time.sleep(3 * self.cfg.poll_s)
        finally:
            logging.shutdown()
            os._exit(EXIT_HANG)  # the training thread is stuck: a normal exit would wait for it forever
