"""The run directory's layout: the name of everything a run leaves in RUN_DIR, defined once for every component.

    RUN_DIR/
        run.sqlite                   the run store (keel.monitor.store)
        owner.lock                   held by the live trainer's rank 0 (keel.monitor.run_lock)
        config.toml                  the resolved config, secrets redacted; `keel train --resume` reads it
        logs/rank-<R>.log            each rank's log
        dumps/                       hang and stall dumps (keel.trainer.watchdog), NCCL flight-recorder traces
        checkpoints/step-XXXXXXXX/   finished checkpoints, each with its manifest.json (keel.trainer.checkpoint.checkpointer)
        chaos/injected.jsonl         one line per injected fault, beside the faults' fire-once markers
        control/faults/              live fault requests left by `keel inject`
        control/microbatches.json    the micro-batch after an out-of-memory error, and when to retry the job's own (keel.trainer.oom)
        control/failures.jsonl       each failure of the worker group: who, why, restarted or not (keel.trainer.launch.restarts)
        drills/drill-<time>/         `keel drill`'s runs and reports
        wandb/offline-run-*/         W&B's offline runs, for `wandb sync` (keel.monitor.wandb_sink)

Only names and path arithmetic live here (no torch, no I/O beyond listing a folder), so any
component may import it at no cost.
"""

from __future__ import annotations

import re
from pathlib import Path

STORE_FILE = "run.sqlite"
LOCK_FILE = "owner.lock"
CONFIG_FILE = "config.toml"
LOG_DIR = "logs"
DUMP_DIR = "dumps"
CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
CHAOS_DIR = "chaos"
INJECTED_FILE = "injected.jsonl"
CONTROL_DIR = "control"
FAULT_REQUEST_DIR = Path(CONTROL_DIR) / "faults"
MICROBATCH_FILE = Path(CONTROL_DIR) / "microbatches.json"
FAILURES_FILE = Path(CONTROL_DIR) / "failures.jsonl"
AGENT_LOG = "agent.log"  # in LOG_DIR: torchrun's own log lines and tracebacks, kept off the console
DRILL_DIR = "drills"
WANDB_DIR = "wandb"  # wandb.init(dir=RUN_DIR) names it

# A finished checkpoint's folder; a save in flight or one found corrupt has another name and never matches.
CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")


def rank_log_name(rank: int) -> str:
    return f"rank-{rank}.log"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints of a run, oldest first (unverified)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step-*") if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()]
    return sorted(found)


def wandb_offline_runs(run_dir: str | Path) -> list[Path]:
    """The run's offline W&B runs (one per worker start: a restart or resume adds one), oldest first."""
    return sorted(p for p in (Path(run_dir) / WANDB_DIR).glob("offline-run-*") if p.is_dir())
