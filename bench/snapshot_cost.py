"""What in-memory snapshots cost the main job: `keel train` (the main job's own settings, cut to a few
steps) with snapshots off, at their measured interval (the default), and at every step, interleaved
(off, default, every, every, default, off, ...) so that a drift of the machine cancels out.

The figure is the median step time of each run (from the run store, past the warm-up steps) against
the run without snapshots of the same round; beside it the interval the default chose and what one
snapshot took (from rank 0's log). Target: the default's cost under 1% of the step.

    python bench/snapshot_cost.py                   # 2 rounds of 3 runs each way, 30 steps per run
    python bench/snapshot_cost.py --args="--config=tiny" --steps 200
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from keel.monitor.store import read_steps

MODES = {"off": ["--checkpoint.snapshot_cost=0"], "default": [], "every step": ["--checkpoint.snapshot_every_steps=1"]}
WARMUP = 5  # steps left out: start-up, the first allocations and profiled steps
TARGET = 0.01


def run(run_dir: Path, steps: int, extra: list[str], mode: str) -> tuple[float, str]:
    """(the median step time past the warm-up, the last snapshot interval rank 0 logged) of one run."""
    command = [sys.executable, "-m", "keel.cli", "train", f"--run-dir={run_dir}", f"--steps={steps}", "--monitor.prometheus=false",
               "--monitor.wandb=false", "--checkpoint.interval_minutes=0", *extra, *MODES[mode]]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    steps_run = read_steps(run_dir, effective=True)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    intervals = re.findall(r"snapshots: (every \d+ steps \(a snapshot takes [\d.]+ ms)", log)
    return float(steps_run[steps_run.step > WARMUP].step_time_s.median()), (intervals[-1] + ")" if intervals else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--args", default="", help="more `keel train` flags (default: the main job's own)")
    args = ap.parse_args()
    extra = shlex.split(args.args)
    cost: dict[str, list[float]] = {"default": [], "every step": []}
    chosen = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            medians = {}
            for mode in order:
                medians[mode], interval = run(Path(tmp) / f"r{r}-{mode.replace(' ', '-')}", args.steps, extra, mode)
                if mode == "default" and interval:
                    chosen.append(interval)
            for mode in cost:
                cost[mode].append(medians[mode] / medians["off"] - 1)
            print(f"round {r + 1}: " + ", ".join(f"{m} {medians[m]:.3f} s/step" for m in order), flush=True)
    print(f"\n{args.steps} steps per run (median step time past step {WARMUP}), {args.rounds} rounds, interleaved:")
    for mode, xs in cost.items():
        verdict = "" if mode != "default" else f"; target < {TARGET:.0%}: {_verdict(xs)}"
        print(f"  snapshots {mode}: {statistics.median(xs):+.1%} of the step (range {min(xs):+.1%} to {max(xs):+.1%}){verdict}")
    print(f"  the default's interval: {'; '.join(chosen) or 'none logged'}")


def _verdict(costs: list[float]) -> str:
    """Holds or missed only when every round says so: a spread across the target is noise, not a figure."""
    if max(costs) < TARGET:
        return "holds"
    if min(costs) >= TARGET:
        return "MISSED"
    return "not resolved (the rounds' spread crosses it: more steps or rounds)"


if __name__ == "__main__":
    main()
