"""Real servers for tests: Prometheus, Alertmanager, a Pushgateway, a webhook receiver and a static metrics
target, each on a free loopback port, each stopped by its own PID (never by name).

Not a test module (nothing here is named test_*): import it from tests, e.g.

    from servers import WebhookReceiver, start_alertmanager, start_prometheus

    with WebhookReceiver() as hook, start_alertmanager(tmp_path, hook.url) as am, \\
            start_prometheus(tmp_path, [target], [rules], am.url) as prom:
        prom.query("up")
"""

from __future__ import annotations

import atexit
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 30.0

_live: set[Server] = set()  # servers not stopped yet: stopped at interpreter exit at the latest


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, explain: Callable[[], str] = lambda: "") -> Any:
    """Polls `predicate` until it returns something true, and returns that; raises AssertionError
    naming `what` (and `explain()`, e.g. a log tail) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{explain()}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        f"none of {', '.join(names)} is on PATH (on Debian: apt-get install prometheus prometheus-alertmanager prometheus-pushgateway)"
    )


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """A server process started by this module: `.url`, `.port`, `.proc`, `.stop()`, and for
    Prometheus `.query(promql)` and `.api(path, **params)`."""

    def __init__(self, name: str, proc: subprocess.Popen, port: int, log_path: Path, workdir: Path):
        self.name = name
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.workdir = workdir
        _live.add(self)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready; log tail:\n{self.log_tail()}"
                )
            try:
                status, body = _get(self.url + "/-/ready", timeout=1.0)
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} on {self.url} not ready after {timeout:.0f} s (last: {last}); log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminates the process by its own PID, waits, kills it if it does not exit in time."""
        _live.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GETs a Prometheus HTTP API path (e.g. "/api/v1/rules"); returns `data`, raises on error."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        status, body = _get(url)
        try:
            doc = json.loads(body)
        except ValueError:
            raise RuntimeError(f"{self.name} {path}: HTTP {status}, not JSON: {body[:300]!r}") from None
        if status != 200 or doc.get("status") != "success":
            raise RuntimeError(f"{self.name} {path} {params}: HTTP {status}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def reload(self) -> None:
        """Makes Prometheus re-read its configuration and rule files (POST /-/reload; needs --web.enable-lifecycle)."""
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.name} /-/reload: HTTP {r.status}")

    def query(self, promql: str) -> list:
        """An instant query (/api/v1/query); returns the result list ([{metric, value}, ...] for a vector)."""
        return self.api("/api/v1/query", query=promql)["result"]


def _start(name: str, argv: list[str], port: int, workdir: Path) -> Server:
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    finally:
        log.close()  # the child holds its own descriptor
    server = Server(name, proc, port, log_path, workdir)
    server.wait_ready()
    return server


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def start_prometheus(
    tmp_path: Path,
    scrape_targets: list[str],
    rule_files: list[str],
    alertmanager_url: str | None,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
) -> Server:
    """Starts Prometheus scraping `scrape_targets` ("host:port", job `keel`), loading `rule_files`,
    sending alerts to `alertmanager_url` (when given); returns once /-/ready answers."""
    binary = _binary("prometheus")
    workdir = Path(tmp_path) / f"prometheus-{free_port()}"
    workdir.mkdir(parents=True)
    lines = [
        "global:",
        f"  scrape_interval: {scrape_interval}",
        f"  evaluation_interval: {evaluation_interval}",
        "rule_files: [" + ", ".join(_yaml_str(str(Path(f).resolve())) for f in rule_files) + "]",
        "scrape_configs:",
        "  - job_name: keel",
        "    static_configs:",
        "      - targets: [" + ", ".join(_yaml_str(t) for t in scrape_targets) + "]",
    ]
    if alertmanager_url:
        am = urllib.parse.urlsplit(alertmanager_url)
        lines += [
            "alerting:",
            "  alertmanagers:",
            f"    - scheme: {am.scheme or 'http'}",
            f"      path_prefix: {_yaml_str(am.path or '/')}",
            "      static_configs:",
            f"        - targets: [{_yaml_str(am.netloc)}]",
        ]
    config = workdir / "prometheus.yml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--rules.alert.resend-delay=1s",  # resend firing alerts every second, not every minute
        "--web.enable-lifecycle",
        "--log.level=info",
    ]
    return _start("prometheus", argv, port, workdir)


def start_alertmanager(tmp_path: Path, webhook_url: str) -> Server:
    """Starts a single (non-clustered) Alertmanager that routes every alert to `webhook_url`
    (group_wait and group_interval 1s); returns once /-/ready answers."""
    binary = _binary("prometheus-alertmanager", "alertmanager")
    workdir = Path(tmp_path) / f"alertmanager-{free_port()}"
    workdir.mkdir(parents=True)
    config = workdir / "alertmanager.yml"
    config.write_text(
        "route:\n"
        "  receiver: webhook\n"
        "  group_by: [alertname, run_id]\n"
        "  group_wait: 1s\n"
        "  group_interval: 1s\n"
        "  repeat_interval: 1h\n"
        "receivers:\n"
        "  - name: webhook\n"
        "    webhook_configs:\n"
        f"      - url: {_yaml_str(webhook_url)}\n"
        "        send_resolved: true\n"
    )
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # no clustering: no gossip port, no peer settle wait
        "--log.level=info",
    ]
    return _start("alertmanager", argv, port, workdir)


def start_pushgateway(tmp_path: Path) -> Server:
    """Starts a Pushgateway (nothing persisted: it forgets every push when stopped); returns once /-/ready
    answers. Its /metrics serves what was pushed, each series with the push's grouping labels."""
    binary = _binary("prometheus-pushgateway", "pushgateway")
    workdir = Path(tmp_path) / f"pushgateway-{free_port()}"
    workdir.mkdir(parents=True)
    port = free_port()
    argv = [
        binary,
        f"--web.listen-address=127.0.0.1:{port}",
        # Debian's build persists to /var/lib/prometheus/pushgateway.data by default: one gateway's pushes
        # would show up in the next one, and the machine's file would hold the tests' metrics.
        "--persistence.file=",
        "--log.level=info",
    ]
    return _start("pushgateway", argv, port, workdir)


def wait_for_dashboard(url: str, server: subprocess.Popen, timeout: float = 90.0) -> None:
    """Waits until the `keel dashboard` process `server` answers its health check at `url`, or has ended, or
    `timeout` seconds have passed (a Streamlit server takes seconds to start); the caller checks which."""
    deadline = time.time() + timeout
    while time.time() < deadline and server.poll() is None:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            time.sleep(0.5)


class _HookServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class WebhookReceiver:
    """An HTTP server on a free loopback port that records every POSTed JSON body.

    `delay` (seconds) and `status` (HTTP status) set how it answers, and may be changed while it
    runs: e.g. `hook.status = 500` to make senders retry, `hook.delay = 5` to make them time out.
    Bodies are recorded whatever the answer. A body that is not JSON is recorded as its text.
    """

    def __init__(self, delay: float = 0.0, status: int = 200, path: str = "/hook"):
        self.delay = delay
        self.status = status
        self._received: list[Any] = []
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                with receiver._lock:
                    receiver._received.append(body)
                    receiver._lock.notify_all()
                if receiver.delay:
                    time.sleep(receiver.delay)
                status = receiver.status
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except OSError:
                    pass  # the sender gave up (timed out) while we were slow

            def log_message(self, *args):  # keep test output quiet
                pass

        self._server = _HookServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}{path}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="webhook-receiver", daemon=True
        )
        self._thread.start()

    @property
    def received(self) -> list[Any]:
        """A copy of the bodies received so far, in arrival order."""
        with self._lock:
            return list(self._received)

    def wait_for(self, predicate: Callable[[list[Any]], Any], timeout: float = 10.0) -> list[Any]:
        """Waits until `predicate(received)` is true; returns the bodies received, or raises
        TimeoutError showing them."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                bodies = list(self._received)
                if predicate(bodies):
                    return bodies
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"webhook {self.url}: condition not met in {timeout} s; received {len(bodies)} bodies: {json.dumps(bodies)[-3000:]}"
                    )
                self._lock.wait(min(left, 0.2))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class MetricsTarget:
    """A scrape target on a free loopback port serving `.text` (Prometheus text format) at
    /metrics; `.target` is the "host:port" to give start_prometheus. Change `.text` at any time."""

    def __init__(self, text: str = ""):
        self.text = text
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = target.text.encode()
                self.send_response(200 if self.path.startswith("/metrics") else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = _HookServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.target = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.target}/metrics"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics-target", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop()
