"""Alerts: what went wrong in a run, recorded once and sent to every channel.

A detector (non-finite loss, loss spike, straggler, hang) builds an `Alert` and hands it to the run's
`AlertRouter`, which writes it to the run store, logs it and publishes it to the sinks (webhook, W&B,
Prometheus) without waiting for them. A detector firing on every step would flood a chat channel, so the
router sends each alert name at most once per `throttle_s` and counts the repeats it holds back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from keel.monitor.event_kinds import EventKind
from keel.monitor.sinks import Event, Publisher
from keel.monitor.store import RunStore

log = logging.getLogger("keel.alerts")


@dataclass
class Alert:
    name: str  # e.g. "nonfinite_loss", "loss_spike", "straggler"
    severity: str  # "critical" | "warning" | "info"
    message: str
    run_id: str
    step: int | None = None
    attempt: int | None = None
    rank: int | None = None
    values: dict[str, float | int | str] = field(default_factory=dict)  # the values that triggered it

    def to_event(self) -> Event:
        return {
            "time": time.time(),
            "step": self.step,
            "attempt": self.attempt,
            "rank": self.rank,
            "kind": EventKind.ALERT,
            "severity": self.severity,
            "message": self.message,
            "data": {"alert": self.name, "run_id": self.run_id, "values": dict(self.values)},
        }


def describe(event: Event) -> str:
    """One line for people: `CRITICAL nonfinite_loss · run R · step S · rank r: message`."""
    data = event.get("data") or {}
    parts = [f"{str(event.get('severity', 'info')).upper()} {data.get('alert', event.get('kind'))}"]
    if data.get("run_id") is not None:
        parts.append(f"run {data['run_id']}")
    for key in ("step", "rank"):
        if event.get(key) is not None:
            parts.append(f"{key} {event[key]}")
    return f"{' · '.join(parts)}: {event.get('message', '')}"


class AlertRouter:
    """Records, logs and publishes alerts; safe to call from the training and watchdog threads alike."""

    def __init__(
        self,
        run_id: str,
        store: RunStore | None,
        publisher: Publisher | None,
        throttle_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id = run_id  # detectors build their alerts with it
        self.store = store
        self.publisher = publisher
        self.throttle_s = throttle_s
        self.clock = clock
        self.suppressed: dict[str, int] = {}  # alert name -> repeats held back by the throttle
        self._last_sent: dict[str, float] = {}
        self._lock = threading.Lock()

    def raise_alert(self, alert: Alert) -> bool:
        """Sends `alert` unless the same name went out less than `throttle_s` ago; True when sent."""
        now = self.clock()
        with self._lock:
            last = self._last_sent.get(alert.name)
            if last is not None and now - last < self.throttle_s:
                self.suppressed[alert.name] = self.suppressed.get(alert.name, 0) + 1
                return False
            self._last_sent[alert.name] = now
        event = alert.to_event()
        if self.store is not None:
            self.store.write_event(
                EventKind.ALERT,
                alert.message,
                severity=alert.severity,
                step=alert.step,
                attempt=alert.attempt,
                rank=alert.rank,
                data=event["data"],
                time=event["time"],
            )
        level = logging.ERROR if alert.severity == "critical" else logging.WARNING
        values = " ".join(f"{k}={v}" for k, v in alert.values.items())
        log.log(level, "alert %s (%s)", describe(event), values)
        if self.publisher is not None:
            self.publisher.publish_event(event)
        return True
