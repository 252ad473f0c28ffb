"""End to end against the real servers: a training run exports its metrics, Prometheus scrapes them,
the PromQL API returns what the run store holds, and a NaN injected into the run (skipped by the NaN
guard) makes the shipped rule fire and Alertmanager deliver it to a webhook."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from servers import WebhookReceiver, free_port, start_alertmanager, start_prometheus, wait_until

from keel.monitor.store import read_events, read_steps

RULES = Path(__file__).resolve().parents[1] / "monitor" / "alerting" / "keel-rules.yml"
STEPS, NAN_STEP = 60, 45


def scalar(prometheus, promql: str) -> float | None:
    result = prometheus.query(promql)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_the_run_and_alertmanager_delivers_the_nan_alert(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    with (
        WebhookReceiver() as hook,
        start_alertmanager(tmp_path / "am", hook.url) as am,
        start_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], [str(RULES)], am.url) as prom,
    ):
        train = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "keel.cli",
                "train",
                "--config=tiny",
                "--pp=1",
                f"--steps={STEPS}",
                f"--run-dir={run_dir}",
                "--run.run_id=e2e",
                f"--monitor.prometheus_port={port}",
                "--monitor.prometheus_linger_s=120",
                "--fault",
                f"nan@step={NAN_STEP},rank=0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "train.stderr").open("w"),
            start_new_session=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        try:
            # Scrapes arrive while the run trains, and the final state stays up while the run lingers.
            wait_until(
                lambda: scalar(prom, 'keel_step{run_id="e2e"}') == STEPS or train.poll() is not None, 180, "the last step in Prometheus"
            )
            assert train.poll() is None, (tmp_path / "train.stderr").read_text()[-3000:]
            steps = read_steps(run_dir, effective=True)
            last = steps.iloc[-1]
            assert scalar(prom, 'keel_tokens_per_second{run_id="e2e"}') == last.tokens_per_s
            assert scalar(prom, 'keel_learning_rate{run_id="e2e"}') == last.lr
            assert scalar(prom, 'keel_last_step_timestamp_seconds{run_id="e2e"}') == last.time
            # The NaN guard skipped the poisoned step, so the run went on with finite losses.
            assert scalar(prom, 'keel_loss{run_id="e2e"}') == last.loss and math.isfinite(last.loss)
            # Every scraped finite loss is the stored loss of some step.
            history = prom.query('keel_loss{run_id="e2e"}[5m]')[0]["values"]
            finite = [float(v) for _, v in history if not math.isnan(float(v))]
            assert finite and set(finite) <= set(steps.loss.dropna())
            nonfinite = read_events(run_dir).query("kind == 'nonfinite'")
            assert list(nonfinite.step) == [NAN_STEP]
            assert list(steps[steps.skipped == 1].step) == [NAN_STEP]
            assert scalar(prom, 'keel_nonfinite_steps_total{run_id="e2e"}') == 1
            assert scalar(prom, 'keel_faults_injected_total{run_id="e2e"}') == 1
            assert scalar(prom, 'keel_step_duration_seconds_count{run_id="e2e"}') == STEPS

            alert = wait_until(
                lambda: next(
                    (a for body in hook.received for a in body.get("alerts", []) if a["labels"].get("alertname") == "KeelNonFiniteLoss"),
                    None,
                ),
                60,
                "Alertmanager to deliver KeelNonFiniteLoss",
            )
            assert alert["status"] == "firing"
            assert alert["labels"]["run_id"] == "e2e" and alert["labels"]["severity"] == "critical"
            # Keel's own channel recorded the same problem as an alert event in the run store.
            alerts = read_events(run_dir).query("kind == 'alert'")
            assert alerts.iloc[0].data["alert"] == "nonfinite_loss" and alerts.iloc[0].step == NAN_STEP
        finally:
            os.killpg(train.pid, signal.SIGTERM)  # the run we started, lingering on purpose
            train.wait(30)
