"""Preemption in a worker: SIGTERM (what SLURM and Kubernetes send before SIGKILL) or SIGUSR1 (SLURM's
`--signal`, and what `keel train` and its agent forward) asks the run to save its current step and end
within `checkpoint.preempt_grace_s`.

A worker also gets SIGTERM when torchrun stops it: a peer failed and the group restarts, or the agent
is going away. That is no preemption (the peer is gone: a save would wait on it forever), so the worker
reads who sent the signal: a dedicated thread takes SIGTERM and SIGUSR1 with sigwaitinfo, which names
the sender's pid. SIGTERM from the agent or the fork server that started this worker ends the process
by SIGTERM at once, as before; any other sender asks for a preemption. Each rank only notes the request:
the ranks agree on it at the end of the step (keel.trainer.step_metrics) and save together
(KeelRun.preempt). If the step or the save cannot finish within the grace, a timer ends the process
with EXIT_PREEMPTED and the newest complete checkpoint stands.

The signals are blocked in every thread, so `watch()` must run before the process starts any thread.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from keel.monitor.exits import EXIT_PREEMPTED
from keel.monitor.run_dir import CONTROL_DIR

log = logging.getLogger("keel.preemption")
# Where `keel train` or its agent notes the signal it got before passing it on (as SIGUSR1), for the record.
SIGNAL_NOTE = Path(CONTROL_DIR) / "preempted-by.json"
PREEMPT_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}
AGENT_PID_ENV = "KEEL_AGENT_PID"  # the agent's pid, exported by keel.trainer.launch.agent


class Preemption:
    """This process's preemption request: the signal and when it came (None until one came)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.time: float | None = None
        self.grace_s = 20.0
        self._stoppers: set[int] = set()

    def watch(self) -> None:
        """Blocks the preemption signals in this (the only) thread and every thread started after it, and
        takes them in a thread of their own."""
        if not sys.platform.startswith("linux") or threading.active_count() > 1:
            return  # another thread could take the signals; then they keep their usual meaning
        if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: its agent (or fork server) stops us
            self._stoppers = {os.getppid(), int(os.environ.get(AGENT_PID_ENV, 0) or 0)} - {0}
        self._stoppers.add(os.getpid())  # lifetime.end_with_parent's own SIGTERM, when the parent is already gone
        for sig in PREEMPT_SIGNALS:  # an ignored signal is dropped, never pending (the fork server ignores them)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
        threading.Thread(target=self._take_signals, name="keel-preemption", daemon=True).start()

    @property
    def requested(self) -> int:
        """The signal that asked for a preemption, or 0."""
        return self.signal or 0

    def _take_signals(self) -> None:
        while True:
            info = signal.sigwaitinfo(PREEMPT_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid in self._stoppers:
                _end_by(signal.SIGTERM)
            if self.signal is None:
                self.signal, self.time = info.si_signo, time.time()
                # In the rank's log only: `keel train` and its agent say it on the console, once.
                log.info("preempted by %s from pid %d: saving at the end of this step", signal.Signals(info.si_signo).name, info.si_pid)
                threading.Timer(self.grace_s, self._expire).start()

    def _expire(self) -> None:
        """The grace is over and the process is still here: the newest complete checkpoint stands."""
        log.error("preemption: the step and its save did not finish within %.0f s; ending now", self.grace_s)
        logging.shutdown()
        os._exit(EXIT_PREEMPTED)


def note_signal(run_dir: str | Path, signum: int) -> None:
    """Notes the preemption signal `keel train` or its agent got, unless a note is there already."""
    path = Path(run_dir) / SIGNAL_NOTE
    note = {"signal": signal.Signals(signum).name, "host": socket.gethostname(), "time": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x") as f:
            json.dump(note, f)
    except FileExistsError:
        pass


def take_signal_note(run_dir: str | Path) -> str | None:
    """'SIGTERM on node-a', from the note (which it removes), or None when there is none. Which process
    noted it is left out: a signal to the process group reaches them all at once."""
    path = Path(run_dir) / SIGNAL_NOTE
    try:
        note = json.loads(path.read_text())
        path.unlink()
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return f"{note['signal']} on {note['host']}"


# The process's one request: signals are the process's, as is this.
notice = Preemption()


def _end_by(sig: int) -> None:
    """Ends the process by `sig`'s default action (watch() set it), as if it had not been caught: the exit
    status torchrun reads. Unblocked in this thread alone, the signal is delivered here."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    time.sleep(60)  # delivered to this thread on the way out of the kill
