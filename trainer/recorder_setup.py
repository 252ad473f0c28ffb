"""Builds the run recorder of rank 0 from the config: the run store always, then each sink the
config turns on. A sink that cannot start is logged once with its fix; training goes on without it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from keel.monitor.recorder import RunRecorder
from keel.monitor.redact import redact
from keel.monitor.sinks import Sink, SinkError
from keel.monitor.store import RunStore
from keel.monitor.store_writer import BackgroundStore
from keel.trainer.config import JobConfig

log = logging.getLogger("keel.train")


def build_sinks(cfg: JobConfig, run_dir: Path, prometheus: bool = True) -> list[Sink]:
    """The sinks the config turns on; `prometheus=False` leaves the exporter out (a record made after the
    run, which nothing would scrape)."""
    m = cfg.monitor
    makers = []
    if m.prometheus and prometheus:
        from keel.monitor.prometheus import PrometheusSink

        makers.append(lambda: PrometheusSink(cfg.run.run_id, m.prometheus_host, m.prometheus_port, m.pushgateway_url, cfg.parallel.pp))
    if m.wandb and m.wandb_mode != "disabled":
        from keel.monitor.wandb_sink import WandbSink

        makers.append(
            lambda: WandbSink(
                cfg.run.run_id,
                redact(cfg.to_dict()),
                project=m.wandb_project,
                mode=m.wandb_mode,
                run_dir=run_dir,
                alert_throttle_s=m.alert_throttle_s,
                min_interval_s=m.wandb_min_interval_s,
            )
        )
    webhook_url = m.webhook_url or os.environ.get("KEEL_WEBHOOK_URL", "")
    if webhook_url:
        from keel.monitor.webhook import WebhookSink

        makers.append(lambda: WebhookSink(webhook_url))
    sinks = []
    for make in makers:
        try:
            sinks.append(make())
        except SinkError as e:
            log.warning("%s; training continues without it", e)
    return sinks


def build_recorder(cfg: JobConfig, run_dir: Path) -> RunRecorder:
    store = BackgroundStore(RunStore(run_dir))  # a stalled store must not stall the step (keel.monitor.store_writer)
    return RunRecorder(cfg.run.run_id, store, build_sinks(cfg, run_dir), cfg.monitor.alert_throttle_s, cfg.monitor.sink_queue_size)
