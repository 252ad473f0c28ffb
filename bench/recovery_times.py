"""How long recovery takes, from the run store of real `keel train` runs:

- in-process rollback: from the end of the step that confirmed a loss spike to the start of the first
  step after the rollback, against the median step time and the checkpoint load (target: under two
  step times plus the load);
- faults that end a process (hang, deadlock, crash, segfault, and an out-of-memory with collectives in
  flight), one run each, at dp2 unless told otherwise: detection (from the fault to the failure being known: the watchdog's
  kill, the process's death, the out-of-memory handler), restart (from there to the new workers'
  start: the watchdog's grace for the other ranks' dumps, torchrun stopping and starting the group,
  imports) and resume (from the new workers' start to their first step: process group, model build,
  checkpoint load), each next to its target; and the steps recomputed: those done since the state the
  restart restored (an in-memory snapshot, or a checkpoint: `--checkpoint.snapshot_cost=0` for the latter).

Targets. Detection: a hang within the watchdog's step allowance, max(floor_s, step_factor x the median
step), plus one poll; a deadlock (the GIL held) the same, since the waiting ranks' watchdogs see it too
(the stuck rank's own faulthandler backstop comes two polls later); a crash, segfault or out-of-memory
within a second. Restart: the watchdog's grace of three polls (hang, deadlock) plus 10 s for torchrun
and the imports on two cores. Resume: 10 s plus the checkpoint load.

    python bench/recovery_times.py                                 # every kind, tiny preset
    python bench/recovery_times.py --only hang --preset small --pp=2 --dp=2 --tp=2 --training.microbatches=4   # the main job
    python bench/recovery_times.py --only hang --watchdog.floor_s=60   # the old floor, for comparison
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from keel.monitor.event_kinds import EventKind
from keel.monitor.run_dir import CHAOS_DIR, INJECTED_FILE, MICROBATCH_FILE
from keel.monitor.store import read_events, read_steps
from keel.trainer.config import WatchdogConfig, load_config

KINDS = ("hang", "deadlock", "crash", "segfault", "oom")
FAULT_STEP = 20
SETUP = ["--dp=2", "--pp=1", "--tp=1", "--steps=30", "--checkpoint.interval_steps=10", "--training.microbatches=1"]
RESTART_TARGET_S, RESUME_TARGET_S, PROCESS_DEATH_TARGET_S = 10.0, 10.0, 1.0


def keel_train(run_dir: Path, *args: str) -> None:
    no_sinks = ["--monitor.prometheus=false", "--monitor.wandb=false"]
    cmd = [sys.executable, "-m", "keel.cli", "train", "--run-dir", str(run_dir), *no_sinks, *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def first_step_start(steps, attempt: int) -> float:
    row = steps[steps.attempt == attempt].sort_values("time").iloc[0]
    return row.time - row.step_time_s


def verdict(value: float, target: float) -> str:
    return f"{value:6.2f} s (target < {target:5.2f} s: {'holds' if value < target else 'MISSED'})"


def rollback(tmp: Path, preset: str, extra: list[str]) -> None:
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
        *extra,
    )
    steps, events = read_steps(run_dir), read_events(run_dir)
    rb = events[events.kind == EventKind.ROLLBACK].iloc[0]
    confirm = steps[(steps.step == rb.data["from_step"]) & (steps.attempt == rb.attempt - 1)].iloc[0]
    took = first_step_start(steps, rb.attempt) - confirm.time
    step_s = statistics.median(steps[steps.attempt == 0].step_time_s.iloc[10:])
    load = rb.data["load_s"]
    print(
        f"rollback ({preset}, 1 process): {took:.3f} s from the confirming step to the next step; "
        f"checkpoint load {load:.3f} s, median step {step_s:.3f} s"
    )
    steps_taken = (took - load) / step_s
    print(f"  rollback - load = {took - load:.3f} s = {steps_taken:.2f} step times; target < 2: {'holds' if steps_taken < 2 else 'MISSED'}")
    print(f"  recomputed {rb.data['from_step'] - rb.data['to_step']} steps (to {rb.data['checkpoint']})")


def fault(tmp: Path, preset: str, kind: str, watchdog: WatchdogConfig, extra: list[str]) -> None:
    """One run with `kind` on rank 1 at FAULT_STEP; prints its detection, restart and resume."""
    run_dir = tmp / kind
    spec = f"{kind}@step={FAULT_STEP},rank=1" + (",rows=2" if kind == "oom" else "")
    keel_train(run_dir, f"--config={preset}", *SETUP, f"--fault={spec}", *extra)
    steps, events = read_steps(run_dir), read_events(run_dir)
    fired = min(json.loads(line)["time"] for line in (run_dir / CHAOS_DIR / INJECTED_FILE).read_text().splitlines())
    median = statistics.median(steps[steps.attempt == 0].step_time_s.iloc[watchdog.warmup_steps :])
    allowance = max(watchdog.floor_s, watchdog.step_factor * median)
    detected, target = _detection(run_dir, events, kind, fired, allowance + watchdog.poll_s)
    started = events[(events.kind == EventKind.RUN_STARTED) & (events.attempt > 0)].iloc[0]
    restart_s = started.data["process_start"] - detected
    resume_s = first_step_start(steps, started.attempt) - started.data["process_start"]
    loaded = events[(events.kind == EventKind.CHECKPOINT_LOADED) & (events.attempt == started.attempt)]
    load_s = loaded.iloc[0].data["load_s"] if len(loaded) else 0.0
    grace = 3 * watchdog.poll_s if kind in ("hang", "deadlock") else 0.0
    layout = events[events.kind == EventKind.RUN_STARTED].iloc[0].message
    print(f"{kind} ({preset}, {layout}; median step {median:.3f} s, step allowance {allowance:.2f} s):")
    print(f"  detect  {verdict(detected - fired, target)}")
    print(f"  restart {verdict(restart_s, grace + RESTART_TARGET_S)}")
    print(f"  resume  {verdict(resume_s, RESUME_TARGET_S + load_s)} (checkpoint load {load_s:.2f} s)")
    print(f"  total   {started.data['process_start'] - fired + resume_s:6.2f} s from the fault to the next step")
    if len(loaded):
        recomputed = FAULT_STEP - 1 - int(loaded.iloc[0].step)
        print(f"  recomputed {recomputed} steps ({loaded.iloc[0].message})")


def _detection(run_dir: Path, events, kind: str, fired: float, hang_target: float) -> tuple[float, float]:
    """When the failure was known, and the detection target: the hang event for hangs and deadlocks, the
    out-of-memory handler's record, or the agent's record of the dead process."""
    if kind in ("hang", "deadlock"):
        hang = events[events.kind == EventKind.HANG].iloc[0]
        return hang.data.get("detected_at", hang.time), hang_target
    if kind == "oom":
        return json.loads((run_dir / MICROBATCH_FILE).read_text())["time"], PROCESS_DEATH_TARGET_S
    # The agent's record of the failure when it keeps one; else the fault itself, which killed the process.
    return events[events.kind == EventKind.RESTART].iloc[0].data.get("time", fired), PROCESS_DEATH_TARGET_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--only", help=f"comma-separated: rollback and any of {', '.join(KINDS)}")
    args, extra = ap.parse_known_args()  # the rest goes to every fault run (after SETUP, so it wins), e.g. --watchdog.floor_s=60
    chosen = args.only.split(",") if args.only else ["rollback", *KINDS]
    watchdog = load_config(None, [a for a in extra if a.lstrip("-").startswith("watchdog.")]).watchdog
    with tempfile.TemporaryDirectory() as tmp:
        if "rollback" in chosen:
            rollback(Path(tmp), args.preset, extra)
        for kind in KINDS:
            if kind in chosen:
                fault(Path(tmp), args.preset, kind, watchdog, extra)


if __name__ == "__main__":
    main()
