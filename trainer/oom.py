"""Out-of-memory recovery: halve the micro-batch (twice as many micro-batches, the same global batch,
so the same arithmetic up to summation order).

On a single process nothing else is waiting, so the step simply runs again with the new setting. With
several processes the other ranks are already inside the step's collectives, so the rank that ran out
of memory writes the new setting to RUN_DIR/control/microbatches.json and exits with EXIT_OOM_RESTART;
torchrun restarts the group, every worker reads the setting, and the run resumes from its last good
checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from keel.monitor.exits import EXIT_OOM, EXIT_OOM_RESTART
from keel.monitor.run_dir import MICROBATCH_FILE
from keel.trainer.config import JobConfig

log = logging.getLogger("keel.oom")


def halve_microbatch(cfg: JobConfig, world: int, run_dir: Path, rank: int, step: int) -> int:
    """Doubles cfg.training.microbatches and returns it, or ends the process (restart or give up)."""
    old = cfg.training.microbatches
    new = old * 2
    per_rank = cfg.training.global_batch_size // cfg.parallel.dp
    if not cfg.recovery.oom_halve_microbatch or per_rank % new:
        why = (
            "recovery.oom_halve_microbatch is off"
            if not cfg.recovery.oom_halve_microbatch
            else f"{per_rank} sequences per dp rank do not split into {new} micro-batches"
        )
        log.critical(
            "out of memory at step %d with %d micro-batches; cannot halve the micro-batch (%s): exiting with code %d",
            step,
            old,
            why,
            EXIT_OOM,
        )
        logging.shutdown()
        os._exit(EXIT_OOM)
    if world == 1:
        log.warning("out of memory at step %d: micro-batches %d -> %d, running the step again", step, old, new)
        cfg.training.microbatches = new
        return new
    path = run_dir / MICROBATCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"microbatches": new, "previous": old, "rank": rank, "step": step, "time": time.time(), "reported": False}))
    os.replace(tmp, path)
    log.critical("out of memory at step %d: micro-batches %d -> %d through a restart (exit code %d)", step, old, new, EXIT_OOM_RESTART)
    logging.shutdown()
    os._exit(EXIT_OOM_RESTART)  # collectives of this step are pending on the other ranks: no clean way out


def apply_saved_microbatches(cfg: JobConfig, run_dir: Path) -> dict | None:
    """At start-up: takes the micro-batch setting a previous out-of-memory left behind. Returns the
    note once (to be recorded as an event by rank 0), None when there is nothing new to report."""
    path = run_dir / MICROBATCH_FILE
    if not path.exists():
        return None
    note = json.loads(path.read_text())
    cfg.training.microbatches = int(note["microbatches"])
    return None if note["reported"] else note


def mark_reported(run_dir: Path) -> None:
    path = run_dir / MICROBATCH_FILE
    note = json.loads(path.read_text())
    note["reported"] = True
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(note))
    os.replace(tmp, path)
