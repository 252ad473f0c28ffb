"""Step-time overhead of Keel's sinks: the tiny preset on one process with every sink on (run store,
Prometheus exporter, W&B offline, webhook to a local server) against every sink off (the run store
alone, which is always on).

Both run in this one process, alternately (off, on, on, off, ...), through the real train loop:
separate processes on a small shared machine differ by more than the 1% being measured.

    python bench/sink_overhead.py                      # 12 rounds of 300 steps each way
    python bench/sink_overhead.py --sinks wandb        # one sink at a time
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import os
import statistics
import tempfile
import threading
from pathlib import Path

import torch

from keel.monitor.store import read_events, read_steps
from keel.trainer.launch import parse_train_args
from keel.trainer.train import Trainer

WARMUP_STEPS = 50  # also lets the sinks' own start-up (wandb's service process) settle


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def sink_flags(sinks: list[str], webhook: str) -> list[str]:
    return [
        f"--monitor.prometheus={'prometheus' in sinks}".lower(),
        "--monitor.prometheus_port=0",
        f"--monitor.wandb={'wandb' in sinks}".lower(),
        "--monitor.wandb_mode=offline",
    ] + ([f"--monitor.webhook_url={webhook}"] if "webhook" in sinks else [])


def run(steps: int, run_dir: Path, flags: list[str]) -> tuple[float, float]:
    """(median step time after warm-up, CPU seconds the sink threads used per step) of one run of
    the real train loop in this process."""
    cfg, _ = parse_train_args(
        [
            "--config=tiny",
            "--pp=1",
            "--dp=1",
            "--tp=1",
            f"--steps={steps}",
            f"--run-dir={run_dir}",
            f"--run.run_id={run_dir.name}",
            "--metrics.log_every=1000000",
            *flags,
        ],
        world_size=1,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(cfg, torch.device("cpu"), rank=0, world=1).train()
    closed = read_events(run_dir).query("kind == 'sinks_closed'")
    sink_cpu = sum(s["cpu_s"] for s in closed.iloc[0].data.values()) if len(closed) else 0.0
    return statistics.median(read_steps(run_dir).step_time_s[WARMUP_STEPS:]), sink_cpu / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--sinks", default="prometheus,wandb,webhook", help="the sinks of the 'on' runs (comma-separated)")
    a = p.parse_args()
    sinks = a.sinks.split(",")
    os.environ.pop("WANDB_API_KEY", None)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    webhook = f"http://127.0.0.1:{server.server_address[1]}/hook"
    off, on, sink_cpu = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        run(a.steps, Path(tmp) / "warmup", sink_flags(sinks, webhook))  # first-call costs (imports, wandb setup)
        for r in range(a.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")  # ABBA: a slow drift cancels out
            for mode in order:
                flags = sink_flags(sinks if mode == "on" else [], webhook)
                step_time, cpu = run(a.steps, Path(tmp) / f"{mode}-{r}", flags)
                (on if mode == "on" else off).append(step_time)
                if mode == "on":
                    sink_cpu.append(cpu)
            print(
                f"round {r + 1}: sinks off {off[-1] * 1e3:.2f} ms/step   {a.sinks} on {on[-1] * 1e3:.2f} ms/step   "
                f"overhead {on[-1] / off[-1] - 1:+.2%}",
                flush=True,
            )
    server.shutdown()
    m_off, m_on = statistics.median(off), statistics.median(on)
    ratios = sorted(b / a for a, b in zip(off, on))
    ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"\ntiny, 1 process, torch threads {torch.get_num_threads()}, {a.steps} steps x {a.rounds} rounds, on = {a.sinks}: "
        f"off {m_off * 1e3:.2f} ms/step, on {m_on * 1e3:.2f} ms/step; overhead of the medians {m_on / m_off - 1:+.2%}, "
        f"median of round ratios {ratio - 1:+.2%} (quartiles {q1 - 1:+.2%} .. {q3 - 1:+.2%}; target <= 1%)"
    )
    cpu = statistics.median(sink_cpu)
    print(f"CPU of the sink threads: {cpu * 1e6:.0f} us per step = {cpu / m_off:.2%} of a step (W&B's own service process not included)")


if __name__ == "__main__":
    main()
