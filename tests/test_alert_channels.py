"""What users rely on from Keel's alert channels: the router (record, log, publish, throttle), the webhook
(delivery, retries, and never holding up training), W&B offline runs, and secrets kept out of everything."""

from __future__ import annotations

import copy
import http.server
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.monitor.alerts import Alert, AlertRouter
from keel.monitor.redact import redact, redact_argv
from keel.monitor.sinks import Publisher, SinkError
from keel.monitor.store import RunStore, read_events
from keel.monitor.webhook import WebhookSink

SECRET_PATH = "/services/T0123/B0456/s3cr3tW3bh00kT0k3n"
SECRET_URL = "https://hooks.slack.com" + SECRET_PATH


class RecordingSink:
    name = "recorder"

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.events: list[dict] = []

    def on_step(self, row, rank_rows) -> None:
        self.steps.append(row)

    def on_event(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def spike_alert(step: int = 7) -> Alert:
    return Alert(
        "loss_spike",
        "critical",
        "loss jumped 4.5x over its median",
        run_id="run-7",
        step=step,
        attempt=1,
        rank=0,
        values={"loss": 9.5, "median": 2.1, "detector": "mad"},
    )


# --- router ----------------------------------------------------------------------------------------------


def test_router_records_logs_publishes_and_throttles(tmp_path, caplog):
    now = [1000.0]
    recorder = RecordingSink()
    publisher = Publisher([recorder])
    store = RunStore(tmp_path)
    router = AlertRouter("run-7", store, publisher, throttle_s=300, clock=lambda: now[0])

    with caplog.at_level(logging.WARNING, logger="keel.alerts"):
        assert router.raise_alert(spike_alert(step=7))
    events = read_events(tmp_path)
    assert len(events) == 1
    event = events.iloc[0]
    assert (event["kind"], event["severity"], event["step"], event["attempt"], event["rank"]) == ("alert", "critical", 7, 1, 0)
    assert event["data"] == {"alert": "loss_spike", "run_id": "run-7", "values": {"loss": 9.5, "median": 2.1, "detector": "mad"}}
    [record] = caplog.records
    assert record.name == "keel.alerts" and record.levelno == logging.ERROR
    for part in ("loss_spike", "run run-7", "step 7", "rank 0", "loss jumped", "loss=9.5", "median=2.1"):
        assert part in record.getMessage()

    # A repeat within the throttle is held back and counted; another alert name is not held back by it.
    now[0] += 299
    assert not router.raise_alert(spike_alert(step=8))
    assert not router.raise_alert(spike_alert(step=9))
    assert router.suppressed == {"loss_spike": 2}
    straggler = Alert("straggler", "warning", "rank 3 is 2.1x slower", run_id="run-7", step=9, rank=3)
    assert router.raise_alert(straggler)
    assert caplog.records[-1].levelno == logging.WARNING

    # Once the throttle has passed, the same alert goes out again.
    now[0] += 1
    assert router.raise_alert(spike_alert(step=10))

    publisher.close()
    store.close()
    assert list(read_events(tmp_path)["step"]) == [7, 9, 10]
    assert [(e["kind"], e["step"], e["data"]["alert"]) for e in recorder.events] == [
        ("alert", 7, "loss_spike"),
        ("alert", 9, "straggler"),
        ("alert", 10, "loss_spike"),
    ]


# --- webhook ---------------------------------------------------------------------------------------------


class WebhookServer:
    """A local webhook endpoint answering with `statuses` in turn (the last one repeats)."""

    def __init__(self, statuses: list[int], delay_s: float = 0.0) -> None:
        self.received: list[dict] = []
        self.release = threading.Event()  # ends a slow handler's wait at teardown
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.received.append(body)
                server.release.wait(delay_s)
                status = statuses[min(len(server.received), len(statuses)) - 1]
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that timed out cut the connection
        self.url = f"http://127.0.0.1:{self.httpd.server_port}{SECRET_PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator:
    servers: list[WebhookServer] = []

    def start(statuses: list[int], delay_s: float = 0.0) -> WebhookServer:
        servers.append(WebhookServer(statuses, delay_s))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A URL whose port refuses connections: bound (so nothing else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}{SECRET_PATH}"


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_webhook_posts_a_slack_message_with_the_alert(serve):
    server = serve([200])
    WebhookSink(server.url).on_event(spike_alert().to_event())
    [body] = server.received
    assert body["text"] == "[keel] CRITICAL loss_spike · run run-7 · step 7 · rank 0: loss jumped 4.5x over its median"
    [attachment] = body["attachments"]
    assert attachment["color"] == "#d93025"
    assert {"title": "median", "value": "2.1", "short": True} in attachment["fields"]
    assert body["keel"] == {
        "run_id": "run-7",
        "step": 7,
        "attempt": 1,
        "rank": 0,
        "name": "loss_spike",
        "severity": "critical",
        "message": "loss jumped 4.5x over its median",
        "values": {"loss": 9.5, "median": 2.1, "detector": "mad"},
    }


def test_webhook_ignores_steps_and_other_events(serve):
    server = serve([200])
    sink = WebhookSink(server.url)
    sink.on_step({"step": 1, "attempt": 0, "loss": 2.0}, [])
    sink.on_event({**spike_alert().to_event(), "kind": "checkpoint_saved"})
    assert server.received == []


@pytest.mark.parametrize("first_status", [500, 503, 429])
def test_webhook_retries_a_server_error_and_delivers_once(serve, first_status):
    server = serve([first_status, 200])
    WebhookSink(server.url, backoff_s=0.01).on_event(spike_alert().to_event())
    assert len(server.received) == 2 and server.received[0] == server.received[1]


def test_webhook_does_not_retry_a_rejection(serve):
    server = serve([404])
    with pytest.raises(SinkError, match="HTTP 404") as error:
        WebhookSink(server.url, backoff_s=0.01).on_event(spike_alert().to_event())
    assert len(server.received) == 1
    assert "127.0.0.1" in str(error.value) and SECRET_PATH not in str(error.value)


@pytest.mark.slow
def test_webhook_down_never_holds_up_training(dead_url, caplog):
    sink = WebhookSink(dead_url, timeout_s=0.2, retries=2, backoff_s=0.05)
    publisher = Publisher([sink])
    with caplog.at_level(logging.WARNING):
        start = time.perf_counter()
        for step in range(20):
            publisher.publish_event(spike_alert(step).to_event())
        assert time.perf_counter() - start < 0.05

        # A training loop publishing every step and an alert every 5 steps runs at its own pace.
        start = time.perf_counter()
        for step in range(50):
            time.sleep(0.002)  # the "step"
            publisher.publish_step({"step": step, "attempt": 0, "loss": 2.0}, [])
            if step % 5 == 0:
                publisher.publish_event(spike_alert(step).to_event())
        assert time.perf_counter() - start < 50 * 0.002 + 0.5

        assert wait_for(lambda: publisher.stats()["webhook"]["failures"] >= 1)
        start = time.perf_counter()
        publisher.close(timeout=1.0)
        assert time.perf_counter() - start < 2.5  # the STOP put and the join wait 1 s each at most

    # Logged once, naming the host and never the secret URL.
    failures = [r for r in caplog.records if "webhook" in r.getMessage()]
    assert len(failures) == 1 and "127.0.0.1" in failures[0].getMessage()
    assert SECRET_PATH not in caplog.text


@pytest.mark.slow
def test_webhook_slow_server_gives_up_after_the_timeout(serve):
    server = serve([200], delay_s=5.0)
    sink = WebhookSink(server.url, timeout_s=0.3, retries=2, backoff_s=0.05)

    start = time.perf_counter()
    with pytest.raises(SinkError, match="failed 2 times"):
        sink.on_event(spike_alert().to_event())
    elapsed = time.perf_counter() - start
    assert 2 * 0.3 <= elapsed < 2 * 0.3 + 0.05 + 0.5  # two tries of timeout_s and one pause
    assert len(server.received) == 2

    publisher = Publisher([sink])
    start = time.perf_counter()
    for step in range(5):
        publisher.publish_event(spike_alert(step).to_event())
    assert time.perf_counter() - start < 0.05
    publisher.close(timeout=0.5)
    assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize(
    "url",
    [
        "hooks.slack.com" + SECRET_PATH,  # no scheme
        "ftp://hooks.slack.com" + SECRET_PATH,
        "https://" + SECRET_PATH,  # no host
        "https://[hooks.slack.com" + SECRET_PATH,
    ],
)
def test_malformed_webhook_url_is_refused_without_echoing_it(url, caplog):
    with caplog.at_level(logging.DEBUG), pytest.raises(SinkError, match="monitor.webhook_url") as error:
        WebhookSink(url)
    assert "s3cr3t" not in str(error.value) and "s3cr3t" not in caplog.text


# --- redaction -------------------------------------------------------------------------------------------


def test_redact_replaces_secrets_at_any_depth_and_leaves_the_input_alone():
    config = {
        "run_id": "r1",
        "monitor": {"webhook_url": SECRET_URL, "port": 9100, "wandb_mode": "auto", "alerts": {"Slack_Token": "xoxb-1", "throttle_s": 300}},
        "WANDB_API_KEY": "k" * 40,
        "db": {"password": "hunter2", "secret": "", "token": None},
        "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
    }
    before = copy.deepcopy(config)
    out = redact(config)
    assert out == {
        "run_id": "r1",
        "monitor": {
            "webhook_url": "<redacted>",
            "port": 9100,
            "wandb_mode": "auto",
            "alerts": {"Slack_Token": "<redacted>", "throttle_s": 300},
        },
        "WANDB_API_KEY": "<redacted>",
        "db": {"password": "<redacted>", "secret": "", "token": None},  # empty values stay visibly empty
        "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
    }
    assert config == before
    assert out["optim"]["betas"] is not config["optim"]["betas"]


def test_redact_argv_hides_secret_overrides():
    argv = ["keel", "train", f"--monitor.webhook_url={SECRET_URL}", "monitor.wandb_api_key=k", "--optim.lr=3e-4", "--monitor.webhook_url="]
    assert redact_argv(argv) == [
        "keel",
        "train",
        "--monitor.webhook_url=<redacted>",
        "monitor.wandb_api_key=<redacted>",
        "--optim.lr=3e-4",
        "--monitor.webhook_url=",
    ]


# --- W&B -------------------------------------------------------------------------------------------------

# Run in a child process: wandb keeps process-wide state (a service process, settings, environment
# variables) that must not leak into other tests. Host lookups from Python are recorded to show that an
# offline run stays off the network, up to and including interpreter exit.
_WANDB_SCRIPT = """
import atexit, json, os, socket, sys, time
lookups = []
real_getaddrinfo = socket.getaddrinfo
def recording_getaddrinfo(host, *args, **kwargs):
    if host not in ("localhost", "127.0.0.1", "::1"):
        lookups.append(host)
    return real_getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = recording_getaddrinfo
atexit.register(lambda: open(sys.argv[2], "w").write(json.dumps(lookups)))  # first registered, runs last

from keel.monitor.sinks import SinkError
from keel.monitor.wandb_sink import WandbSink
start = time.monotonic()
config = json.loads(open(sys.argv[3]).read())
try:
    sink = WandbSink("run-42", config, mode=sys.argv[4], run_dir=sys.argv[1], min_interval_s=float(os.environ.get("MIN_INTERVAL_S", "0")))
except SinkError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
init_s = time.monotonic() - start
# Steps 1-3, then a rollback to step 1 under attempt 1: step numbers repeat. The user's own metrics on even steps.
for step, attempt in [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (4, 1)]:
    custom = {"custom": {"val_acc": step / 10 + attempt}} if step % 2 == 0 else {}
    sink.on_step({"step": step, "attempt": attempt, "loss": 1.0 / step + attempt, "grad_norm": 0.5, "lr": 1e-3,
                  "comm_share": None, "tokens": 4096, **custom}, [])
sink.on_event({"time": time.time(), "step": 4, "attempt": 1, "rank": 0, "kind": "alert", "severity": "critical",
               "message": "loss is nan", "data": {"alert": "nonfinite_loss", "run_id": "run-42", "values": {}}})
sink.close()
print(json.dumps({"mode": sink.mode, "init_s": init_s}))
"""


def run_wandb_child(tmp_path: Path, config: dict, mode: str = "auto", **env: str) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    home = tmp_path / "home"
    home.mkdir()
    # No API key anywhere: not in the environment, no ~/.netrc, no wandb settings file.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    child_env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        WANDB_CONFIG_DIR=str(home / ".config/wandb"),
        WANDB_CACHE_DIR=str(home / ".cache/wandb"),
        WANDB_DATA_DIR=str(home / ".local/wandb"),
        **env,
    )
    lookups_file, config_file = tmp_path / "lookups.json", tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    # The last argument stands for a user's `keel train --monitor.webhook_url=...`: wandb records argv.
    args = [str(tmp_path / "run"), str(lookups_file), str(config_file), mode, f"--monitor.webhook_url={SECRET_URL}"]
    proc = subprocess.run([sys.executable, "-c", _WANDB_SCRIPT, *args], env=child_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads(lookups_file.read_text()), proc


def wandb_records(path: Path) -> Iterator:
    """The records of an offline run's .wandb file: a leveldb-style log (32 KiB blocks of chunks, each with a
    7-byte header: crc32c, length, type) after a 7-byte W&B header, holding protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@pytest.mark.slow
def test_wandb_without_api_key_logs_offline_into_the_run_dir(tmp_path):
    config = {"model": {"d_model": 64}, "monitor": {"webhook_url": SECRET_URL, "wandb_mode": "auto"}}
    start = time.monotonic()
    result, lookups, proc = run_wandb_child(tmp_path, config, KEEL_WEBHOOK_URL=SECRET_URL)
    assert time.monotonic() - start < 30
    assert result["mode"] == "offline" and result["init_s"] < 15
    assert lookups == []  # never touched the network, not even at exit
    assert "wandb" not in proc.stderr  # quiet

    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*-run-42/run-run-42.wandb")
    records = list(wandb_records(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == ("run-42", "keel", "run-42")
    stored_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert stored_config["monitor"] == {"webhook_url": "<redacted>", "wandb_mode": "auto"}
    assert stored_config["model"] == {"d_model": 64}
    [environment] = [r.environment for r in records if r.WhichOneof("record_type") == "environment" and r.environment.args]
    assert environment.args[-1] == "--monitor.webhook_url=<redacted>"

    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    # Every row arrives, rollback included: train/step repeats while wandb's own step keeps counting.
    assert [row["train/step"] for row in history] == [1, 2, 3, 2, 3, 4]
    assert [row["_step"] for row in history] == [0, 1, 2, 3, 4, 5]
    assert history[-1]["train/loss"] == pytest.approx(1.25) and history[-1]["train/attempt"] == 1
    assert "train/comm_share" not in history[-1] and "train/tokens" not in history[-1]
    # Alerts are not queued for a later sync, when they would arrive stale.
    assert not any(r.WhichOneof("record_type") == "alert" for r in records)

    for path in tmp_path.rglob("*"):  # the run, wandb's logs and caches in the fake home
        if path.name == "config.json":  # the test's own input
            continue
        assert not path.is_file() or SECRET_PATH.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_wandb_rate_bound_keeps_rollbacks_and_the_last_step(tmp_path):
    """With steps faster than min_interval_s, W&B gets the first step, the last step of the abandoned
    attempt and the first of the new one around a rollback, and the last step at close."""
    _, _, _ = run_wandb_child(tmp_path, {"model": {}}, mode="offline", MIN_INTERVAL_S="3600")
    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*-run-42/run-run-42.wandb")
    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(run_file)
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(row["train/step"], row["train/attempt"]) for row in history] == [(1, 0), (3, 0), (2, 1), (4, 1)]


@pytest.mark.slow
def test_wandb_bad_api_key_fails_with_the_fix(tmp_path):
    result, _, _ = run_wandb_child(tmp_path, {}, mode="online", WANDB_API_KEY="not-a-key")
    assert "set WANDB_API_KEY or run `wandb login`" in result["error"]
    assert "monitor.wandb_mode=offline" in result["error"] and "wandb sync" in result["error"]
