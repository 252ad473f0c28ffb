"""The sink interface and the publisher that fans step metrics and events out to sinks off the
training thread.

Every sink gets its own bounded queue and thread: a slow webhook never delays the Prometheus
exporter, and no sink ever blocks a training step. When a queue is full the item is dropped and
counted. A sink that raises is logged once (with the fix, when the sink says it) and then counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

log = logging.getLogger("keel.monitor")

Step = tuple[dict[str, Any], list[dict[str, Any]]]  # (step row, per-rank rows), as in the run store
Event = dict[str, Any]  # time, step, attempt, rank, kind, severity, message, data


class Sink(Protocol):
    name: str
    # A sink may set `wants_steps = False` to receive events only.

    def on_step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None: ...

    def on_event(self, event: Event) -> None: ...

    def close(self) -> None: ...


class SinkError(RuntimeError):
    """A sink's failure with a message a user can act on (what failed and the fix)."""


_STOP = object()
BATCH_INTERVAL_S = 0.05


class _Worker:
    def __init__(self, sink: Sink, maxsize: int):
        self.sink = sink
        self.queue: queue.Queue = queue.Queue(maxsize)
        self.dropped = 0
        self.failures = 0
        self.cpu_s = 0.0  # CPU time this sink's thread used, known once it stops
        self.thread = threading.Thread(target=self._run, name=f"keel-sink-{sink.name}", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("sink %s is falling behind: dropping metrics (counted, training is not slowed)", self.sink.name)

    def _run(self) -> None:
        # Wake at most every BATCH_INTERVAL_S and handle everything queued meanwhile: a thread switch
        # per item costs the training thread more than the items themselves.
        while True:
            items = [self.queue.get()]
            while True:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _STOP:
                    self.cpu_s = time.thread_time()
                    return
                self._handle(*item)
            time.sleep(BATCH_INTERVAL_S)

    def _handle(self, kind: str, payload) -> None:
        try:
            if kind == "step":
                self.sink.on_step(*payload)
            else:
                self.sink.on_event(payload)
        except Exception as e:  # a sink must never take training down
            self.failures += 1
            if self.failures == 1:
                log.warning("sink %s failed, training continues: %s", self.sink.name, e)


class Publisher:
    """Publishes each step and each event once; every sink receives them in order on its own thread."""

    def __init__(self, sinks: list[Sink], maxsize: int = 1000):
        self.workers = [_Worker(s, maxsize) for s in sinks]
        self.step_workers = [w for w in self.workers if getattr(w.sink, "wants_steps", True)]

    def publish_step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        for w in self.step_workers:
            w.put(("step", (row, rank_rows)))

    def publish_event(self, event: Event) -> None:
        for w in self.workers:
            w.put(("event", event))

    def stats(self) -> dict[str, dict[str, float]]:
        """Per sink: items dropped (queue full), failed calls, and CPU seconds (after close)."""
        return {w.sink.name: {"dropped": w.dropped, "failures": w.failures, "cpu_s": w.cpu_s} for w in self.workers}

    def close(self, timeout: float = 10.0) -> None:
        """Lets every sink drain its queue (within `timeout` seconds in all), then closes it."""
        for w in self.workers:
            try:
                w.queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
        for w in self.workers:
            w.thread.join(timeout)
            try:
                w.sink.close()
            except Exception as e:
                log.warning("sink %s failed to close: %s", w.sink.name, e)
