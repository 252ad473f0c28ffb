"""A monitoring problem never stops training or loses data: a busy port, a Pushgateway that is down,
a malformed webhook URL. And no secret (W&B key, webhook URL) reaches the run directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import WebhookReceiver, free_port

from keel.monitor.store import read_meta, read_steps

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

WEBHOOK_TOKEN = "T0KEN-abc123-do-not-leak"
WANDB_KEY = "f" * 32 + "-fake-wandb-key"


def train(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keel.cli", "train", "--config", "tiny", "--pp", "1", "--steps", "8", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


def all_bytes(run_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())


def test_busy_port_and_dead_pushgateway_do_not_stop_training(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        proc = train(tmp_path / "run", f"--monitor.prometheus_port={port}", f"--monitor.pushgateway_url=http://127.0.0.1:{free_port()}")
    finally:
        busy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(read_steps(tmp_path / "run").step) == list(range(1, 9))
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert f"port {port} is in use: Prometheus exporter on 127.0.0.1:" in log
    assert log.count("push to the Pushgateway failed") == 1 and "monitor.pushgateway_url" in log


def test_malformed_webhook_url_is_logged_once_and_training_goes_on(tmp_path):
    proc = train(tmp_path / "run", "--monitor.webhook_url=hooks.example.com/no-scheme", "--fault", "nan@step=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(read_steps(tmp_path / "run").step) == list(range(1, 9))
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert log.count("monitor.webhook_url") == 1


def test_no_secret_reaches_the_run_directory_logs_or_wandb(tmp_path):
    with WebhookReceiver() as hook:
        secret_url = f"{hook.url}/{WEBHOOK_TOKEN}"
        proc = train(
            tmp_path / "run",
            f"--monitor.webhook_url={secret_url}",
            "--monitor.wandb=true",
            "--monitor.wandb_mode=offline",
            "--fault=nan@step=3",
            env={"WANDB_API_KEY": WANDB_KEY, "HOME": str(tmp_path / "home")},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # The secret URL worked: the NaN alert was delivered to it.
        hook.wait_for(lambda bodies: any("nonfinite_loss" in b.get("text", "") for b in bodies), timeout=10)
    run_dir = tmp_path / "run"
    assert list(run_dir.rglob("*.wandb")), "W&B wrote its offline run into the run directory"
    everything = all_bytes(run_dir) + proc.stdout.encode() + proc.stderr.encode()
    assert WEBHOOK_TOKEN.encode() not in everything
    assert WANDB_KEY.encode() not in everything
    assert 'webhook_url = "<redacted>"' in (run_dir / "config.toml").read_text()
    assert read_meta(run_dir)["config"]["monitor"]["webhook_url"] == "<redacted>"
