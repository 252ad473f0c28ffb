"""Run-store writes off the training thread: a stalled store (another process holding its write lock, a
backup, a slow network file system, a full disk) must cost the run its record of a few steps at most,
never a step's time, and never look like a hang to the watchdog.

`BackgroundStore` has RunStore's write methods and runs them, in order, on a thread of its own. While the
store keeps up, the caller waits for each write (a few milliseconds), so that every step and event is
committed when its call returns, as with RunStore itself: a run killed just after still has them. A write
that takes longer than `wait_s` leaves the caller waiting no more: from then on writes queue in memory
(at most `queue_size`; beyond that they are dropped and counted) until the store has caught up, and the
stall is then recorded as one `store_stalled` event with how long it lasted, what waited and what was lost.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from keel.monitor.event_kinds import EventKind
from keel.monitor.free_space import free_space
from keel.monitor.store import RunStore

log = logging.getLogger("keel.store")

WAIT_S = 1.0  # the longest a caller waits for one write before writes go on in the background
CLOSE_WAIT_S = 60.0  # at close, how long the queued writes may take before they are given up
_RETRY_S = 0.5  # between tries of a write the store's lock refused


class BackgroundStore:
    """RunStore's writers (write_step, write_event, write_data_tokens, set_meta), run by a thread of their own."""

    def __init__(self, store: RunStore, wait_s: float = WAIT_S, queue_size: int = 10_000):
        self.store, self.path, self.wait_s = store, store.path, wait_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stall: dict | None = None  # since when the store has been behind, and what queued or dropped meanwhile
        self._stall_lock = threading.Lock()  # the callers' thread and the writer's both change it
        self._closing = False
        self._failed_kinds: set[str] = set()  # failures already logged (one line each, not one per write)
        self._thread = threading.Thread(target=self._run, name="keel-store", daemon=True)
        self._thread.start()

    # -- the writers: RunStore's, in the background --------------------------------------------------

    def write_step(self, step: dict, rank_rows: list = ()) -> None:
        self._submit(self.store.write_step, step, list(rank_rows))

    def write_event(self, kind: str, message: str, **fields: Any) -> None:
        fields.setdefault("time", time.time())  # when it happened, not when the store took it
        self._submit(self.store.write_event, kind, message, **fields)

    def write_data_tokens(self, step: int, attempt: int, tokens: list[int]) -> None:
        self._submit(self.store.write_data_tokens, step, attempt, list(tokens))

    def set_meta(self, key: str, value: Any) -> None:
        self._submit(self.store.set_meta, key, value)

    def _submit(self, write: Callable, *args: Any, **kwargs: Any) -> None:
        done: Future = Future()
        try:
            self._queue.put_nowait((write, args, kwargs, done))
        except queue.Full:
            self._stall_note("dropped")
            return
        if self._stall is not None:
            self._stall_note("queued")
            return
        try:
            done.result(timeout=self.wait_s)  # a write that raised (a row the store refuses) raises here
        except FutureTimeout:
            self._stall_note("queued")
            log.warning("run store %s: a write has taken over %.1f s; writes go on in the background", self.path, self.wait_s)

    def _stall_note(self, what: str) -> None:
        with self._stall_lock:
            if self._stall is None:
                self._stall = {"since": time.time(), "queued": 0, "dropped": 0}
            self._stall[what] += 1

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            write, args, kwargs, done = item
            try:
                self._write(write, args, kwargs)
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 (handed to the caller, who waits for it while the store keeps up)
                done.set_exception(e)
            if self._stall is not None and self._queue.empty():
                self._record_stall()

    def _write(self, write: Callable, args: tuple, kwargs: dict) -> None:
        """One write, tried again while another process holds the store's lock; a full disk or another
        failure of the file loses the write, logged once per kind of failure."""
        while True:
            try:
                write(*args, **kwargs)
                return
            except sqlite3.OperationalError as e:
                if "locked" in str(e) and not self._closing:
                    time.sleep(_RETRY_S)
                    continue
                self._lost(e)
                return

    def _lost(self, error: Exception) -> None:
        self._stall_note("dropped")
        kind = str(error)
        if kind not in self._failed_kinds:
            self._failed_kinds.add(kind)
            log.error("run store %s: %s (%s); the run's record misses what it could not write", self.path, error, free_space(self.path))

    def _record_stall(self) -> None:
        with self._stall_lock:
            stall, self._stall = self._stall, None
        seconds = time.time() - stall["since"]
        message = (
            f"the run store was blocked for {seconds:.1f} s (another process held its lock, or its disk was slow or full); "
            f"{stall['queued']} writes waited in memory, {stall['dropped']} were lost"
        )
        data = {"stalled_s": seconds, "queued": stall["queued"], "dropped": stall["dropped"]}
        try:
            self.store.write_event(EventKind.STORE_STALLED, message, severity="warning", data=data)
        except sqlite3.Error as e:
            self._lost(e)
        log.warning("%s", message)

    # -- the end ---------------------------------------------------------------------------------

    def flush(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Waits until every write so far is in the store (at most `timeout` seconds); returns whether they are."""
        done: Future = Future()
        try:
            self._queue.put((lambda: None, (), {}, done), timeout=timeout)
            done.result(timeout=timeout)
            return True
        except (queue.Full, FutureTimeout):
            return False

    def close(self) -> None:
        """Writes what is queued, then closes the store. A store still blocked after CLOSE_WAIT_S is left to
        the process's exit, and what waited is lost, saying so: the run's end must not wait on it."""
        if not self.flush():
            self._closing = True
            log.error("run store %s: writes still waiting after %.0f s at close are lost", self.path, CLOSE_WAIT_S)
            return
        self._queue.put(None)
        self._thread.join()
        self.store.close()
