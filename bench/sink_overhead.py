"""Step-time overhead of Keel's sinks: the tiny preset on one process with every sink on (run store,
Prometheus exporter, W&B offline, webhook to a local server) against every sink off (the run store
alone, which is always on), runs interleaved in one invocation.

    python bench/sink_overhead.py                # 4 rounds of 300 steps each way
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from keel.monitor.store import read_steps

WARMUP_STEPS = 20


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def sink_flags(sinks: list[str], webhook: str) -> list[str]:
    return [
        f"--monitor.prometheus={'prometheus' in sinks}".lower(), "--monitor.prometheus_port=0",
        f"--monitor.wandb={'wandb' in sinks}".lower(), "--monitor.wandb_mode=offline",
    ] + ([f"--monitor.webhook_url={webhook}"] if "webhook" in sinks else [])


def run(steps: int, run_dir: Path, flags: list[str]) -> float:
    """Median step time (s) after warm-up."""
    cmd = [sys.executable, "-m", "keel.cli", "train", "--config", "tiny", "--pp", "1", "--dp", "1", "--tp", "1", "--steps", str(steps),
           "--run-dir", str(run_dir), "--metrics.log_every=1000000", *flags]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return statistics.median(read_steps(run_dir).step_time_s[WARMUP_STEPS:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sinks", default="prometheus,wandb,webhook", help="the sinks of the 'on' runs (comma-separated)")
    a = p.parse_args()
    sinks = a.sinks.split(",")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    webhook = f"http://127.0.0.1:{server.server_address[1]}/hook"
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            off.append(run(a.steps, Path(tmp) / f"off-{r}", sink_flags([], webhook)))
            on.append(run(a.steps, Path(tmp) / f"on-{r}", sink_flags(sinks, webhook)))
            print(f"round {r + 1}: sinks off {off[-1] * 1e3:.2f} ms/step   {a.sinks} on {on[-1] * 1e3:.2f} ms/step   "
                  f"overhead {on[-1] / off[-1] - 1:+.2%}", flush=True)
    server.shutdown()
    m_off, m_on = statistics.median(off), statistics.median(on)
    ratio = statistics.median(b / a for a, b in zip(off, on))
    print(f"\ntiny, 1 process, {a.steps} steps x {a.rounds} rounds, on = {a.sinks}: off {m_off * 1e3:.2f} ms/step, "
          f"on {m_on * 1e3:.2f} ms/step; overhead of the medians {m_on / m_off - 1:+.2%}, median of round ratios {ratio - 1:+.2%} (target <= 1%)")


if __name__ == "__main__":
    main()
