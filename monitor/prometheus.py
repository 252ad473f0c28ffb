"""Prometheus exporter: serves Keel's metric vocabulary on /metrics (127.0.0.1 by default), and
optionally pushes the final state to a Pushgateway, for jobs shorter than a scrape interval."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, push_to_gateway, start_http_server
from prometheus_client.metrics_core import Metric

from keel.monitor import metrics
from keel.monitor.custom_metrics import CUSTOM_KEY
from keel.monitor.event_kinds import EventKind
from keel.monitor.sinks import Event, SinkError

log = logging.getLogger("keel.monitor")

PORT_SEARCH = 20  # a busy port moves the exporter up to this many ports higher


class KeelRegistry(CollectorRegistry):
    """Keel's own registry, whose output (served and pushed) leaves out the *_created series that
    prometheus_client adds to each counter and histogram: they would double the series count, and no
    rule or dashboard uses them. prometheus_client's disable_created_metrics() would drop them from
    every registry in the process, the host program's too."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            # Each collect() builds new Metric objects: filtering them changes no state of the metrics.
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family


def start_exporter(registry: CollectorRegistry, host: str, port: int):
    """Starts /metrics on host:port, or the next free port when that one is busy. Returns (server, port)."""
    for candidate in range(port, port + PORT_SEARCH) if port else [0]:
        try:
            server, _ = start_http_server(candidate, addr=host, registry=registry)
        except OSError:
            continue
        bound = server.server_address[1]
        if port and bound != port:
            log.warning("port %d is in use: Prometheus exporter on %s:%d instead (set monitor.prometheus_port)", port, host, bound)
        return server, bound
    raise SinkError(f"monitor.prometheus_port={port}: ports {port}-{port + PORT_SEARCH - 1} on {host} are all in use; choose another port")


class PrometheusSink:
    name = "prometheus"

    def __init__(self, run_id: str, host: str = "127.0.0.1", port: int = 9400, pushgateway_url: str = "", pipeline_stages: int = 1):
        self.run_id, self.pushgateway_url, self.pipeline_stages = run_id, pushgateway_url, pipeline_stages
        self.registry = KeelRegistry()
        self.gauge_families = {m.source: Gauge(m.name, m.help, m.labels, registry=self.registry) for m in metrics.step_gauges()}
        # Each labelled child is looked up once (.labels() takes a lock and a dict lookup per call), at the
        # first step that has its column's value. Not before: a gauge would read 0 until then, and a loss of
        # 0 is a lie (a run that never evaluates would report a validation loss of 0).
        self.gauges: dict[str, Any] = {}
        self.rank_families = {m.source: (m.labels, Gauge(m.name, m.help, m.labels, registry=self.registry)) for m in metrics.RANK_GAUGES}
        self.rank_children: dict[tuple[str, int], Any] = {}
        custom = metrics.CUSTOM_METRIC
        self.custom_family = Gauge(custom.name, custom.help, custom.labels, registry=self.registry)
        self.custom_children: dict[str, Any] = {}  # by name, each made at the first step that reports it
        # Present at 0 from the start: the stall rule matches on it with `unless`.
        ended = metrics.RUN_ENDED
        self.run_ended = Gauge(ended.name, ended.help, ended.labels, registry=self.registry).labels(run_id)
        self.run_ended.set(0)
        self.step_duration = Histogram(
            metrics.STEP_DURATION.name,
            metrics.STEP_DURATION.help,
            metrics.STEP_DURATION.labels,
            buckets=metrics.STEP_DURATION_BUCKETS,
            registry=self.registry,
        ).labels(run_id)
        self.counters = {}
        for m in metrics.COUNTERS:
            labels = (*m.labels, "kind", "severity") if m.source == EventKind.ALERT else m.labels
            # prometheus_client adds _total itself; the vocabulary spells the exported name.
            self.counters[m.source] = Counter(m.name.removesuffix("_total"), m.help, labels, registry=self.registry)
            if m.source != EventKind.ALERT:
                self.counters[m.source].labels(run_id).inc(0)  # present from the start, so increase() sees the first event
        self.server, self.port = start_exporter(self.registry, host, port)
        log.info("Prometheus exporter on http://%s:%d/metrics", host, self.port)

    def on_step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        for column, family in self.gauge_families.items():
            value = row.get(column)
            if value is not None:
                gauge = self.gauges.get(column)
                if gauge is None:
                    gauge = self.gauges[column] = family.labels(self.run_id)
                gauge.set(value)
        self.step_duration.observe(row["step_time_s"])
        for name, value in (row.get(CUSTOM_KEY) or {}).items():  # names checked before the run (keel.monitor.custom_metrics)
            if value is not None:
                self._custom_gauge(name).set(value)
        ranks_per_stage = max(1, len(rank_rows) // self.pipeline_stages)  # ranks are laid out stage by stage
        for r in rank_rows:
            self._rank_gauge("step_time_s", r["rank"], ranks_per_stage).set(r["step_time_s"])
            busy = None if r.get("comm_time_s") is None else r["step_time_s"] - r["comm_time_s"]  # sampled steps only
            if busy is not None and busy > 0:  # communication that took the whole step says nothing about speed
                self._rank_gauge("busy_s", r["rank"], ranks_per_stage).set(busy)

    def _rank_gauge(self, source: str, rank: int, ranks_per_stage: int):
        child = self.rank_children.get((source, rank))
        if child is None:
            labels, family = self.rank_families[source]
            extra = (str(rank // ranks_per_stage),) if "stage" in labels else ()
            child = self.rank_children[(source, rank)] = family.labels(self.run_id, str(rank), *extra)
        return child

    def _custom_gauge(self, name: str):
        child = self.custom_children.get(name)
        if child is None:
            child = self.custom_children[name] = self.custom_family.labels(self.run_id, name)
        return child

    def on_event(self, event: Event) -> None:
        kind = event["kind"]
        if kind == EventKind.ALERT:
            self.counters[EventKind.ALERT].labels(self.run_id, event["data"].get("alert", ""), event["severity"]).inc()
        elif kind in self.counters:
            self.counters[kind].labels(self.run_id).inc()
        elif kind in metrics.RUN_ENDED_EVENTS:
            self.run_ended.set(1)

    def close(self) -> None:
        try:
            if self.pushgateway_url:
                push_to_gateway(self.pushgateway_url, job="keel", registry=self.registry, grouping_key={"run_id": self.run_id}, timeout=5)
        except Exception as e:
            log.warning("push to the Pushgateway failed (%s); check monitor.pushgateway_url", e)
        finally:
            self.server.shutdown()
            self.server.server_close()
