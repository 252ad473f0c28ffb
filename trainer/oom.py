"""Out-of-memory recovery: halve the micro-batch (twice as many micro-batches, the same global batch,
so the same arithmetic up to summation order), and later try the larger micro-batch again.

On a single process nothing else is waiting, so the step simply runs again with the new setting. With
several processes the other ranks are already inside the step's collectives, so the rank that ran out
of memory writes the new setting to RUN_DIR/control/microbatches.json and exits with EXIT_OOM_RESTART;
torchrun restarts the group, every worker reads the setting, and the run resumes from its last good
checkpoint.

Many out-of-memory errors are transient (fragmentation, a long batch, another process on the device),
and a halved micro-batch costs every later step (35% on the main job). So a halving also plans a retry:
`recovery.oom_retry_steps` steps later every rank, at the same step and from the same state, goes back
to twice the micro-batch (one halving undone; several halvings are undone one retry at a time). A retry
that runs out of memory again before it has held for oom_retry_steps is halved again like any other,
and the next wait is `oom_retry_backoff` times longer: a memory that stays short costs a few failed
retries, each further apart, not one every few steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from keel.monitor.exits import EXIT_OOM, EXIT_OOM_RESTART
from keel.monitor.run_dir import MICROBATCH_FILE
from keel.trainer.config import JobConfig

log = logging.getLogger("keel.oom")


@dataclass
class MicrobatchState:
    """What control/microbatches.json holds. Every rank keeps the same copy, so every rank makes the same
    retry at the same step; only an out-of-memory writes the file (the rank that ran out, which is then
    the only writer)."""

    microbatches: int  # the setting now
    configured: int  # the job's own setting: retries stop there
    retry_step: int = 0  # from this step on, try twice the micro-batch again (0: none planned)
    wait_steps: int = 0  # from the last out-of-memory to retry_step; multiplied by the backoff after a failed retry
    retried_step: int = 0  # the step of the last retry (0: none since the last out-of-memory)
    # The last out-of-memory, which rank 0 records as an event when it was not yet (after a restart).
    step: int = 0
    rank: int = 0
    previous: int = 0
    time: float = 0.0
    reported: bool = True

    def note(self) -> dict | None:
        """The out-of-memory the previous attempt asked a restart for, until it is recorded; else None."""
        return None if self.reported else dataclasses.asdict(self)


def load_state(cfg: JobConfig, run_dir: Path, resuming: bool) -> MicrobatchState:
    """At start-up: the state a previous attempt left (when resuming), applied to cfg; a fresh one otherwise."""
    path = run_dir / MICROBATCH_FILE
    if not (resuming and path.exists()):
        return MicrobatchState(cfg.training.microbatches, cfg.training.microbatches)
    saved = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(MicrobatchState)}
    # A file from before retries existed has no `configured`: the config's setting is the job's own.
    state = MicrobatchState(**{"configured": cfg.training.microbatches, **{k: v for k, v in saved.items() if k in known}})
    cfg.training.microbatches = state.microbatches
    return state


def halve_microbatch(cfg: JobConfig, state: MicrobatchState, world: int, run_dir: Path, rank: int, step: int) -> int:
    """Doubles cfg.training.microbatches, plans the retry, and returns the new count, or ends the process
    (restart or give up)."""
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
    _plan_retry(cfg, state, step)
    cfg.training.microbatches = new
    state.microbatches, state.previous, state.step, state.rank, state.time = new, old, step, rank, time.time()
    state.reported = world == 1  # in process, the trainer records it now; after a restart, rank 0 does
    _write(run_dir, state)
    if world == 1:
        log.warning("out of memory at step %d: micro-batches %d -> %d, running the step again", step, old, new)
        return new
    log.critical("out of memory at step %d: micro-batches %d -> %d through a restart (exit code %d)", step, old, new, EXIT_OOM_RESTART)
    logging.shutdown()
    os._exit(EXIT_OOM_RESTART)  # collectives of this step are pending on the other ranks: no clean way out


def _plan_retry(cfg: JobConfig, state: MicrobatchState, step: int) -> None:
    """The retry after an out-of-memory at `step`: oom_retry_steps later, or the backoff times the last
    wait when a retry ran out of memory before it held for oom_retry_steps."""
    rec = cfg.recovery
    failed_retry = state.retried_step > 0 and step < state.retried_step + rec.oom_retry_steps
    state.wait_steps = state.wait_steps * rec.oom_retry_backoff if failed_retry else rec.oom_retry_steps
    state.retry_step = step + state.wait_steps if rec.oom_retry_steps > 0 else 0
    state.retried_step = 0


def retry_due(state: MicrobatchState, step: int) -> bool:
    return 0 < state.retry_step <= step and state.microbatches > state.configured


def retry_larger_microbatch(cfg: JobConfig, state: MicrobatchState, step: int) -> int:
    """Undoes one halving at `step` (half the micro-batches) and plans the next retry while the job's own
    setting is not reached; returns the new count. Not written to the file: a failed retry's
    out-of-memory writes the state it leaves."""
    new = max(state.configured, state.microbatches // 2)
    log.warning("step %d: micro-batches %d -> %d, trying the larger micro-batch again", step, state.microbatches, new)
    state.microbatches, state.retried_step = new, step
    state.retry_step = step + state.wait_steps if new > state.configured else 0
    cfg.training.microbatches = new
    return new


def mark_reported(run_dir: Path) -> None:
    path = run_dir / MICROBATCH_FILE
    note = json.loads(path.read_text())
    note["reported"] = True
    _replace(path, note)


def _write(run_dir: Path, state: MicrobatchState) -> None:
    path = run_dir / MICROBATCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, dataclasses.asdict(state))


def _replace(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
