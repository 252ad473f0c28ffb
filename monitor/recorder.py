"""What the trainer talks to: the run store (a RunStore, or in a worker a BackgroundStore: each write
committed when its call returns while the store keeps up, so a killed run keeps every step, and queued
when it does not), the sinks (fed off the training thread), and the alert router."""

from __future__ import annotations

import time
from typing import Any

from keel.monitor.alerts import Alert, AlertRouter
from keel.monitor.event_kinds import EventKind
from keel.monitor.sinks import Publisher, Sink
from keel.monitor.store import RunStore
from keel.monitor.store_writer import BackgroundStore


class RunRecorder:
    def __init__(
        self, run_id: str, store: RunStore | BackgroundStore, sinks: list[Sink], alert_throttle_s: float = 300.0, queue_size: int = 1000
    ):
        self.store = store
        self.publisher = Publisher(sinks, queue_size)
        self.alerts = AlertRouter(run_id, store, self.publisher, throttle_s=alert_throttle_s)

    def step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        self.store.write_step(row, rank_rows)
        self.publisher.publish_step(row, rank_rows)

    def event(
        self,
        kind: EventKind,
        message: str,
        *,
        severity: str = "info",
        step: int | None = None,
        attempt: int | None = None,
        rank: int | None = None,
        data: dict | None = None,
    ) -> None:
        now = time.time()
        self.store.write_event(kind, message, severity=severity, step=step, attempt=attempt, rank=rank, data=data, time=now)
        self.publisher.publish_event(
            {
                "time": now,
                "step": step,
                "attempt": attempt,
                "rank": rank,
                "kind": kind,
                "severity": severity,
                "message": message,
                "data": data or {},
            }
        )

    def flush(self) -> bool:
        """Waits until every step and event so far is in the store; False when it is still blocked."""
        return self.store.flush()

    def alert(self, alert: Alert) -> bool:
        return self.alerts.raise_alert(alert)

    def close(self) -> None:
        """Drains and closes the sinks, then records what each cost and lost (event `sinks_closed`)."""
        self.publisher.close()
        stats = self.publisher.stats()
        if stats:
            summary = ", ".join(
                f"{name}: {s['cpu_s']:.3f} s CPU, {s['dropped']} dropped, {s['failures']} failed" for name, s in stats.items()
            )
            self.store.write_event(EventKind.SINKS_CLOSED, summary, data=stats)
        self.store.close()
