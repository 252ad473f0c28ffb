"""Event kinds: the `kind` column of the run store's events, one enumeration for every writer and reader.

A `StrEnum`: each member is the very string stored (`EventKind.ROLLBACK == "rollback"`, hashed alike), so
run stores written before it read the same, and pandas, SQLite and JSON take a member as its string.
Adding a kind is one member here; docs/design.md ("Adding an event kind") lists who else may want it.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    # The run's life (rank 0).
    RUN_STARTED = "run_started"  # a worker group started: layout, process start, restart count
    RUN_FINISHED = "run_finished"  # the last step ran
    RUN_STOPPED = "run_stopped"  # ended on purpose (the rollback cap, a refused resume, Ctrl-C, a preemption), with its exit code
    PREEMPTED = "preempted"  # SIGTERM or SIGUSR1 from a scheduler: the step saved, the job ended inside the grace
    GOODPUT = "goodput"  # the run's goodput at its end
    SINKS_CLOSED = "sinks_closed"  # what each sink cost and lost, at close
    STORE_STALLED = "store_stalled"  # the run store fell behind (locked, slow or full): how long, what waited, what was lost
    ALERT = "alert"  # an alert sent (keel.monitor.alerts)
    # Faults and what detects them.
    FAULT_INJECTED = "fault_injected"  # a chaos fault acted on a rank
    NONFINITE = "nonfinite"  # a step skipped: its loss or grad norm was NaN or Inf
    LOSS_OUTLIER = "loss_outlier"  # the spike detector's first outlier (reported, not acted on)
    SPIKE = "spike"  # a loss spike confirmed (acted on: rollback)
    SPIKE_HEALED = "spike_healed"  # outliers that ended before the spike was confirmed
    GRAD_NORM_SPIKE = "grad_norm_spike"  # the grad norm jumped (an early warning)
    BAD_BATCH = "bad_batch"  # batches passed over: token ids outside the vocabulary
    HANG = "hang"  # the watchdog (or faulthandler's timer) found no progress
    OOM = "oom"  # out of memory: the micro-batch halved
    OOM_RETRY = "oom_retry"  # the larger micro-batch tried again after an out-of-memory
    STRAGGLER = "straggler"  # a rank slower than its stage's peers
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # a checkpoint failed verification on load
    # Recoveries.
    ROLLBACK = "rollback"  # back to an earlier checkpoint
    ROLLBACK_FAILED = "rollback_failed"  # no good checkpoint to roll back to
    SKIP_DATA = "skip_data"  # the batches a rollback skips
    RESTART = "restart"  # torchrun restarted the worker group, with the failure that caused it
    NODE_LOSS = "node_loss"  # the run's processes vanished unrecorded; `keel train` resumed it
    # Checkpoints.
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_MISSING = "checkpoint_missing"  # nothing good to resume from: step 1
    LAYOUT_CHANGED = "layout_changed"  # resumed at another parallel layout
    # Written by a user's loop (keel.trainer.toolkit: LoopRun.note).
    NOTE = "note"  # something the loop itself wants on the record: an evaluation, a data change, a manual fix
