"""Promises the monitoring docs make about the channels a run feeds, each held by a test that fails when the
mechanism behind it is taken away:

- a sink slower than training fills its queue, and then what does not fit is dropped and counted (logged once,
  and in the run store's `sinks_closed` event), while training never waits (docs/config.md, sink_queue_size);
- a webhook that takes its time never delays the Prometheus exporter (docs/design.md, "One publish, many sinks");
- a short job's final state reaches a Pushgateway under the run's grouping labels (monitor.pushgateway_url);
- W&B without an API key logs offline and never touches the network (monitor.wandb), watched at the socket
  level with strace in every process W&B runs in or starts (wandb-core is a Go program of its own: watching
  Python's host lookups alone cannot see it).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import WebhookReceiver, start_pushgateway, wait_until

from keel.monitor.alerts import Alert
from keel.monitor.prometheus import PrometheusSink
from keel.monitor.recorder import RunRecorder
from keel.monitor.store import RunStore, read_events, read_steps
from keel.monitor.webhook import WebhookSink

# Real servers, threads that sleep, multi-process training runs: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

STRACE = shutil.which("strace")
RUN_ID = "promised"
STEPS = 8


def step_row(step: int) -> dict:
    return {"step": step, "attempt": 0, "loss": 1.0 / step, "step_time_s": 0.01}


def samples(text: str) -> dict[str, list]:
    """Metric sample name -> its samples, from Prometheus text."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return samples(response.read().decode())


# --- a full sink queue -------------------------------------------------------------------------------------


class GatedSink:
    """A sink slower than any trainer: it takes no step until the test opens its gate."""

    name = "slow"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.steps: list[int] = []

    def on_step(self, row: dict, rank_rows: list) -> None:
        self.gate.wait(60)
        self.steps.append(row["step"])

    def on_event(self, event: dict) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_full_sink_queue_drops_and_counts_and_training_never_waits(tmp_path, caplog):
    queue_size, published = 10, 200
    sink = GatedSink()
    recorder = RunRecorder(RUN_ID, RunStore(tmp_path), [sink], queue_size=queue_size)
    trainer = threading.Thread(target=lambda: [recorder.step(step_row(s), []) for s in range(1, published + 1)], name="trainer")
    try:
        with caplog.at_level(logging.WARNING, logger="keel.monitor"):
            trainer.start()
            # The sink has taken no step yet: a trainer that waited for room in its queue would still be waiting.
            trainer.join(20)
            assert not trainer.is_alive(), f"the trainer waited for a slow sink: {len(read_steps(tmp_path))} of {published} steps written"
    finally:
        sink.gate.set()
        trainer.join(60)
        recorder.close()
    assert list(read_steps(tmp_path).step) == list(range(1, published + 1))  # the run store has every step

    # The sink got steps in order from the first, at most two queues' worth: its thread takes everything queued
    # when it wakes (a batch: from 1 to all of the queue) and is stuck on the batch's first step, while the queue
    # fills again. The rest were dropped. Which steps it got depends on when its thread woke.
    delivered = len(sink.steps)
    assert sink.steps[0] == 1 and sink.steps == sorted(sink.steps), sink.steps
    assert queue_size <= delivered <= 2 * queue_size, sink.steps
    [closed] = read_events(tmp_path).query("kind == 'sinks_closed'").itertuples()
    assert closed.data["slow"]["dropped"] == published - delivered, closed.data
    assert f"{published - delivered} dropped" in closed.message
    falling_behind = [r for r in caplog.records if "sink slow is falling behind" in r.getMessage()]
    assert len(falling_behind) == 1, [r.getMessage() for r in caplog.records]  # once, not per dropped step


# --- a slow webhook and the exporter -----------------------------------------------------------------------

WEBHOOK_DELAY_S = 6.0  # how long the webhook takes to answer the alert
FRESH_WITHIN_S = 2.0  # the exporter serves a new step within this long, well inside that delay


def test_a_slow_webhook_never_delays_the_prometheus_exporter(tmp_path):
    def served_step() -> float | None:
        step = scrape(exporter.port).get("keel_step")
        return step[0].value if step else None

    with WebhookReceiver(delay=WEBHOOK_DELAY_S) as hook:
        exporter = PrometheusSink(RUN_ID, port=0)
        # Waits for the answer as long as the webhook takes, so that the webhook's thread is busy all that time.
        webhook = WebhookSink(hook.url, timeout_s=2 * WEBHOOK_DELAY_S, retries=1)
        recorder = RunRecorder(RUN_ID, RunStore(tmp_path), [exporter, webhook])
        try:
            recorder.step(step_row(1), [])
            wait_until(lambda: served_step() == 1, 10, "step 1 on /metrics")
            recorder.alert(Alert("nonfinite_loss", "critical", "loss is nan", RUN_ID, step=1))
            [body] = hook.wait_for(lambda bodies: len(bodies) == 1)  # the webhook has the alert and sits on it
            assert body["keel"]["name"] == "nonfinite_loss"
            published = time.monotonic()
            recorder.step(step_row(2), [])
            wait_until(lambda: served_step() == 2, FRESH_WITHIN_S, f"step 2 on /metrics while the webhook sleeps {WEBHOOK_DELAY_S} s")
            assert time.monotonic() - published < FRESH_WITHIN_S
        finally:
            recorder.close()


# --- one short job: the Pushgateway and W&B offline ---------------------------------------------------------


@dataclass
class MonitoredRun:
    run_dir: Path
    pushed: str  # the Pushgateway's /metrics after the run
    trace: list[str]  # strace's lines, one whole call each


def whole_calls(lines: list[str]) -> list[str]:
    """strace -f's lines with each call interrupted by another process's ("<unfinished ...>" and
    "<... connect resumed>") joined into one line again."""
    pending: dict[str, str] = {}
    calls = []
    for line in lines:
        pid, rest = line.split(None, 1)  # strace pads a short pid with spaces to the width of a long one
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest.removesuffix("<unfinished ...>")
        elif rest.startswith("<..."):
            calls.append(f"{pid} {pending.pop(pid, '')}{rest.split('>', 1)[1]}")
        else:
            calls.append(line)
    return calls


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory) -> MonitoredRun:
    """A short `keel train` (tiny, 8 steps) as a user runs one: its final state pushed to a real Pushgateway,
    and W&B on with no API key anywhere (no WANDB_API_KEY, no netrc, a fresh home), so offline. The run and
    every process it starts run under strace, which records each connect() and each addressed send."""
    assert STRACE, "strace is not on PATH: apt-get install strace (.ci/run does)"
    tmp = tmp_path_factory.mktemp("monitored")
    run_dir, trace, home = tmp / "run", tmp / "network.strace", tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env |= {"HOME": str(home), "NETRC": str(home / "no-netrc"), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with start_pushgateway(tmp) as gateway:
        cmd = [STRACE, "-f", "-qq", "--seccomp-bpf", "-e", "signal=none", "-e", "trace=connect,sendto,sendmsg,%process", "-o", str(trace),
               sys.executable, "-m", "keel.cli", "train", "--config=tiny", "--pp=1", f"--steps={STEPS}", f"--run-dir={run_dir}",
               f"--run.run_id={RUN_ID}", "--monitor.wandb=true", f"--monitor.pushgateway_url={gateway.url}"]  # fmt: skip
        # A session of its own: a run that times out is stopped with everything it started.
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
            try:
                output, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
        assert proc.returncode == 0, output[-4000:]
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as response:
            pushed = response.read().decode()
    return MonitoredRun(run_dir, pushed, whole_calls(trace.read_text().splitlines()))


def test_the_final_state_reaches_the_pushgateway_with_the_runs_labels(monitored_run):
    pushed = samples(monitored_run.pushed)
    last = read_steps(monitored_run.run_dir).iloc[-1]
    assert last.step == STEPS
    grouping = {"job": "keel", "run_id": RUN_ID, "instance": ""}  # instance: the Pushgateway's own, empty when not pushed
    for name in ("keel_step", "keel_loss", "keel_run_ended", "keel_step_duration_seconds_count"):
        assert [s.labels for s in pushed.get(name, [])] == [grouping], f"{name}: {pushed.get(name)}\n{monitored_run.pushed[-3000:]}"
    assert pushed["keel_step"][0].value == STEPS
    assert pushed["keel_loss"][0].value == last.loss  # the last step's value, as the run store has it
    assert pushed["keel_step_duration_seconds_count"][0].value == STEPS
    assert pushed["keel_run_ended"][0].value == 1  # pushed after the run ended, not a state from before


_CLONE = re.compile(r"^(\d+)\s+(?:clone3?|fork|vfork)\((.*)\)\s+= (\d+)$")
_EXEC = re.compile(r'^(\d+)\s+execve\("([^"]+)".*\)\s+= 0$')
_ADDRESS = re.compile(r"\{sa_family=(AF_\w+), ([^}]*)\}")
_IP = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')


def off_machine(family: str, fields: str) -> bool:
    """Whether a socket address leads off this machine: anything but a Unix socket, the kernel (netlink: wandb's
    system monitor lists the network interfaces) or a loopback address."""
    if family in ("AF_UNIX", "AF_NETLINK"):
        return False
    ip = _IP.search(fields)
    if family not in ("AF_INET", "AF_INET6") or not ip:
        return True
    address = ipaddress.ip_address(ip.group(1) or ip.group(2))
    return not (address.is_loopback or (address.version == 6 and address.ipv4_mapped and address.ipv4_mapped.is_loopback))


def test_wandb_offline_never_touches_the_network_in_any_process(monitored_run):
    parent: dict[str, tuple[str, bool]] = {}  # process or thread -> (who started it, whether as a thread)
    program: dict[str, str] = {}
    for call in monitored_run.trace:
        if clone := _CLONE.match(call):
            parent[clone.group(3)] = (clone.group(1), "CLONE_THREAD" in clone.group(2))
        elif execve := _EXEC.match(call):
            program[execve.group(1)] = Path(execve.group(2)).name
    cores = [pid for pid, name in program.items() if name == "wandb-core"]
    assert cores, "wandb-core never started: W&B was not on, and this test would show nothing"

    def process_of(pid: str) -> str:  # the thread group a thread belongs to
        while pid in parent and parent[pid][1]:
            pid = parent[pid][0]
        return pid

    def ancestors(pid: str):
        while pid in parent:
            yield pid
            pid = parent[pid][0]
        yield pid

    # W&B runs in the rank-0 worker, the process that started wandb-core: every thread of it and every
    # process it started (wandb-core, its system monitor, git) is watched. The launcher's processes are
    # torch's, which W&B never enters; they do go to the network: torch's rendezvous store looks up the name
    # of each peer's address (127.0.0.1) at the system's DNS server.
    [host] = {process_of(parent[core][0]) for core in cores}
    watched = {pid for pid in {call.split(" ", 1)[0] for call in monitored_run.trace} if host in ancestors(pid)}
    addressed = [(pid, call) for call in monitored_run.trace if (pid := call.split(" ", 1)[0]) in watched and "sa_family=" in call]
    assert any(process_of(pid) in cores for pid, call in addressed if "connect(" in call), (
        "no connect() of wandb-core was recorded: the trace does not follow it"
    )
    leaving = [call for _, call in addressed if any(off_machine(*address) for address in _ADDRESS.findall(call))]
    assert not leaving, "W&B offline reached off this machine:\n" + "\n".join(leaving[:20])
