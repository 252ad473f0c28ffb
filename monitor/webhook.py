"""Webhook alert channel: posts each alert as a Slack-compatible JSON message (also accepted by Mattermost,
Rocket.Chat and most incoming-webhook endpoints).

A webhook URL is a secret (whoever has a Slack webhook URL can post to the channel), so errors and logs
name only its host, never the URL.

Time per alert is bounded: each of the `retries` tries waits at most `timeout_s` for the connection and
for each read (name resolution is left to the system resolver's own timeout), and the pauses between
tries double from `backoff_s`. Connection errors, timeouts, 5xx and 429 are retried; other 4xx are not. With the defaults (2 s, 3 tries,
0.5 s) an unreachable endpoint costs at most about 3 * 2 + 0.5 + 1 = 7.5 s per alert, spent on the sink's
own thread: training never waits for it (the Publisher drops and counts what the queue cannot hold).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from keel.monitor.alerts import describe
from keel.monitor.event_kinds import EventKind
from keel.monitor.sinks import Event, SinkError

_COLORS = {"critical": "#d93025", "warning": "#f29900", "info": "#9aa0a6"}  # red, orange, grey


class WebhookSink:
    name = "webhook"
    wants_steps = False  # alerts only: the publisher does not wake this sink for every step

    def __init__(self, url: str, timeout_s: float = 2.0, retries: int = 3, backoff_s: float = 0.5) -> None:
        try:
            parts = urlsplit(url)
            valid = parts.scheme in ("http", "https") and parts.hostname is not None
        except (ValueError, TypeError):  # e.g. an unbalanced "[" in the host, or not a string at all
            valid = False
        if not valid:
            # Not echoing the value: it may be a real webhook URL with a typo.
            raise SinkError(
                "monitor.webhook_url is not an http(s) URL with a host; set it to the full URL your chat tool"
                " gives for an incoming webhook (https://hooks.slack.com/services/...), or leave it empty"
            )
        self._url = url
        self.host = parts.hostname
        self.timeout_s = timeout_s
        self.retries = max(1, retries)
        self.backoff_s = backoff_s

    def on_step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        pass  # the webhook carries alerts only

    def on_event(self, event: Event) -> None:
        if event.get("kind") != EventKind.ALERT:
            return
        body = json.dumps(_message(event), default=str).encode()
        request = urllib.request.Request(
            self._url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "keel"}
        )
        pause = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                return
            except urllib.error.HTTPError as e:
                # A refusal (bad URL, revoked hook, bad payload) stays a refusal; 429 asks us to come back later.
                if e.code < 500 and e.code != 429:
                    raise SinkError(
                        f"webhook at {self.host} rejected the alert with HTTP {e.code}: check monitor.webhook_url"
                        " (a revoked or mistyped webhook answers 403/404)"
                    ) from None
                problem = f"HTTP {e.code}"
            except (OSError, http.client.HTTPException) as e:  # refused, DNS, timeout, connection cut
                problem = str(getattr(e, "reason", e)) or type(e).__name__
            if attempt < self.retries:
                time.sleep(pause)
                pause *= 2
        # `from None`: the chained exception would carry the request, and with it the URL.
        raise SinkError(
            f"webhook at {self.host} failed {self.retries} times ({problem}); alerts are still in the run store"
            " and the log. Check that the host is reachable from the training nodes"
        ) from None

    def close(self) -> None:
        pass


def _message(event: Event) -> dict[str, Any]:
    data = event.get("data") or {}
    alert = {
        "run_id": data.get("run_id"),
        "step": event.get("step"),
        "attempt": event.get("attempt"),
        "rank": event.get("rank"),
        "name": data.get("alert"),
        "severity": event.get("severity"),
        "message": event.get("message"),
        "values": data.get("values", {}),
    }
    fields = [
        {"title": key, "value": str(alert[key]), "short": True} for key in ("run_id", "step", "attempt", "rank") if alert[key] is not None
    ]
    fields += [{"title": key, "value": str(value), "short": True} for key, value in alert["values"].items()]
    return {
        "text": f"[keel] {describe(event)}",
        "attachments": [{"color": _COLORS.get(str(alert["severity"]), _COLORS["info"]), "fields": fields}],
        "keel": alert,
    }
