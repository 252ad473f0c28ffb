"""How long recovery takes, from the run store of real `keel train` runs:

- in-process rollback: from the end of the step that confirmed a loss spike to the start of the first
  step after the rollback, against the median step time and the checkpoint load (target: under two
  step times plus the load);
- hang recovery: detection (watchdog), restart (torchrun stops and starts the group), and resume
  (process group, model build, checkpoint load) until the first step after the hang starts.

    python bench/recovery_times.py                     # both, small preset
    python bench/recovery_times.py --only rollback
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from keel.monitor.store import read_events, read_steps


def keel_train(run_dir: Path, *args: str) -> None:
    no_sinks = ["--monitor.prometheus=false", "--monitor.wandb=false"]
    cmd = [sys.executable, "-m", "keel.cli", "train", "--run-dir", str(run_dir), *no_sinks, *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def first_step_start(steps, attempt: int) -> float:
    row = steps[steps.attempt == attempt].sort_values("time").iloc[0]
    return row.time - row.step_time_s


def rollback(tmp: Path, preset: str) -> None:
    run_dir = tmp / "rollback"
    keel_train(
        run_dir,
        f"--config={preset}",
        "--pp=1",
        "--dp=1",
        "--tp=1",
        "--steps=120",
        "--checkpoint.interval_steps=20",
        "--spike.warmup_steps=30",
        "--fault=spike@step=90,steps=5",
    )
    steps, events = read_steps(run_dir), read_events(run_dir)
    rb = events[events.kind == "rollback"].iloc[0]
    confirm = steps[(steps.step == rb.data["from_step"]) & (steps.attempt == rb.attempt - 1)].iloc[0]
    took = first_step_start(steps, rb.attempt) - confirm.time
    step_s = statistics.median(steps[steps.attempt == 0].step_time_s.iloc[10:])
    load = rb.data["load_s"]
    print(
        f"rollback ({preset}, 1 process): {took:.3f} s from the confirming step to the next step; "
        f"checkpoint load {load:.3f} s, median step {step_s:.3f} s"
    )
    steps_taken = (took - load) / step_s
    verdict = "holds" if steps_taken < 2 else "MISSED"
    print(f"  rollback - load = {took - load:.3f} s = {steps_taken:.2f} step times; target < 2: {verdict}")


def hang(tmp: Path, preset: str) -> None:
    run_dir = tmp / "hang"
    keel_train(
        run_dir,
        f"--config={preset}",
        "--dp=2",
        "--pp=1",
        "--tp=1",
        "--steps=30",
        "--checkpoint.interval_steps=10",
        "--fault=hang@step=20,rank=1",
        "--watchdog.floor_s=5",
        "--watchdog.warmup_steps=3",
    )
    steps, events = read_steps(run_dir), read_events(run_dir)
    h = events[events.kind == "hang"].iloc[0]
    started = events[(events.kind == "run_started") & (events.attempt == h.attempt + 1)].iloc[0]
    restart_s = started.data["process_start"] - h.time
    resume_s = first_step_start(steps, h.attempt + 1) - started.data["process_start"]
    load = events[(events.kind == "checkpoint_loaded") & (events.attempt == h.attempt + 1)].iloc[0].data["load_s"]
    print(f"hang recovery ({preset}, dp2, watchdog floor 5 s):")
    print(f"  detection {h.data['stalled_s']:.1f} s (timeout {h.data['timeout_s']:.1f} s)")
    print(f"  restart   {restart_s:.1f} s (dumps, 3 s grace for the other ranks' dumps, torchrun stop and start, imports)")
    print(f"  resume    {resume_s:.1f} s (process group, model build, checkpoint load {load:.2f} s) until the first step")
    print(f"  total     {h.data['stalled_s'] + restart_s + resume_s:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--only", choices=["rollback", "hang"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "rollback"):
            rollback(Path(tmp), args.preset)
        if args.only in (None, "hang"):
            hang(Path(tmp), args.preset)


if __name__ == "__main__":
    main()
