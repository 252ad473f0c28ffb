"""Keel's metric vocabulary: every exported metric's name, type, unit and help text, in one place.

Names follow the Prometheus naming guide: a `keel_` prefix, base units (seconds, bytes, ratios
0..1), `_total` on counters. Every series carries the `run_id` label; per-rank series add `rank` (and
`stage`, the pipeline stage, where ranks are compared with their peers). The run store's columns map
onto these names; events of some kinds count into the counters. The alerting rules
(`keel.monitor.alert_rules`) query these names and no others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # gauge | counter | histogram
    unit: str
    help: str
    source: str = ""  # the step-row or rank-row column a gauge reads, or the event kind a counter counts
    labels: tuple[str, ...] = ("run_id",)


GAUGES = (
    MetricSpec("keel_loss", "gauge", "", "Training loss of the last step (mean over the global batch).", "loss"),
    MetricSpec("keel_grad_norm", "gauge", "", "Global gradient L2 norm of the last step, before clipping.", "grad_norm"),
    MetricSpec("keel_learning_rate", "gauge", "", "Learning rate used by the last step.", "lr"),
    MetricSpec("keel_tokens_per_second", "gauge", "tokens/s", "Global training throughput of the last step.", "tokens_per_s"),
    MetricSpec("keel_mfu_ratio", "gauge", "ratio", "Model FLOPs utilization of the last step (0..1).", "mfu"),
    MetricSpec(
        "keel_comm_share_ratio",
        "gauge",
        "ratio",
        "Exposed communication time / step time, the ranks' mean, last sampled step (0..1).",
        "comm_share",
    ),
    MetricSpec(
        "keel_comm_share_max_ratio",
        "gauge",
        "ratio",
        "Exposed communication time / step time of the rank that waited longest, last sampled step (0..1).",
        "comm_share_max",
    ),
    MetricSpec("keel_last_step_duration_seconds", "gauge", "seconds", "Duration of the last step (slowest rank).", "step_time_s"),
    MetricSpec("keel_step", "gauge", "", "Last completed training step.", "step"),
    MetricSpec("keel_attempt", "gauge", "", "Attempt of the last step (raised by each rollback or restart).", "attempt"),
    MetricSpec("keel_last_step_timestamp_seconds", "gauge", "seconds", "Unix time at which the last step completed.", "time"),
    MetricSpec("keel_memory_peak_bytes", "gauge", "bytes", "Peak memory of the busiest rank.", "mem_peak_bytes"),
)

# Per-rank gauges, from the rank rows (sampled steps: see keel.trainer.step_metrics). In synchronous training every rank's step takes the same wall time
# (the fast ranks wait for the slow one inside the collectives), so only busy time names a straggler.
RANK_STEP_DURATION = MetricSpec(
    "keel_rank_step_duration_seconds",
    "gauge",
    "seconds",
    "Duration of the last sampled step on each rank.",
    "step_time_s",
    ("run_id", "rank"),
)
RANK_BUSY = MetricSpec(
    "keel_rank_busy_seconds",
    "gauge",
    "seconds",
    "Busy time of each rank in the last step whose communication was measured: step time minus exposed "
    "communication (the time it waited on other ranks). Compare ranks of the same pipeline stage.",
    "busy_s",
    ("run_id", "rank", "stage"),
)
RANK_GAUGES = (RANK_STEP_DURATION, RANK_BUSY)

# 1 once the run has ended on purpose (finished, or stopped by the rollback cap), while its exporter
# lingers: a run that ended is not stalled.
RUN_ENDED = MetricSpec(
    "keel_run_ended", "gauge", "", "1 once the run has finished or stopped (its exporter may linger), 0 while it trains."
)
RUN_ENDED_EVENTS = ("run_finished", "run_stopped")  # the event kinds that set it

STEP_DURATION = MetricSpec(
    "keel_step_duration_seconds", "histogram", "seconds", "Duration of training steps (slowest rank).", "step_time_s"
)
STEP_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Counters, each counting run-store events of one kind.
COUNTERS = (
    MetricSpec(
        "keel_nonfinite_steps_total", "counter", "", "Steps skipped (no update) because a loss or gradient was NaN or Inf.", "nonfinite"
    ),
    MetricSpec("keel_loss_spikes_total", "counter", "", "Loss spikes confirmed by the spike detector.", "spike"),
    MetricSpec("keel_rollbacks_total", "counter", "", "Rollbacks to an earlier checkpoint.", "rollback"),
    MetricSpec("keel_data_skips_total", "counter", "", "Windows of bad batches skipped after a rollback.", "skip_data"),
    MetricSpec("keel_checkpoints_total", "counter", "", "Checkpoints saved.", "checkpoint_saved"),
    MetricSpec("keel_checkpoints_corrupt_total", "counter", "", "Checkpoints that failed verification on load.", "checkpoint_corrupt"),
    MetricSpec("keel_hangs_total", "counter", "", "Hangs the watchdog detected.", "hang"),
    MetricSpec("keel_oom_total", "counter", "", "Out-of-memory errors recovered by halving the micro-batch.", "oom"),
    MetricSpec("keel_oom_retries_total", "counter", "", "Retries of the larger micro-batch after an out-of-memory.", "oom_retry"),
    MetricSpec("keel_restarts_total", "counter", "", "Restarts of the worker group.", "restart"),
    MetricSpec("keel_node_losses_total", "counter", "", "Resumes after the run's processes vanished with no record.", "node_loss"),
    MetricSpec("keel_faults_injected_total", "counter", "", "Faults injected by chaos hooks or drills.", "fault_injected"),
    MetricSpec("keel_alerts_total", "counter", "", "Alerts raised by Keel, by kind and severity.", "alert"),
)

ALL = GAUGES + RANK_GAUGES + (RUN_ENDED, STEP_DURATION) + COUNTERS
