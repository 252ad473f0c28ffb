"""Keel's Prometheus vocabulary: every exported metric's name, type, unit and help text. The gauges of
the step row's columns are declared once with the other step metrics, in keel.monitor.metric_registry,
and derived here; the per-rank gauges, the user's own metrics' gauge, the step histogram and the
counters are declared here.

Names follow the Prometheus naming guide: a `keel_` prefix, base units (seconds, bytes, ratios
0..1), `_total` on counters. Every series carries the `run_id` label; per-rank series add `rank` (and
`stage`, the pipeline stage, where ranks are compared with their peers), the user's own metrics the
`name` the user gave them. Events of some kinds count into the counters. The alerting rules
(`keel.monitor.alert_rules`) query these names and no others.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.monitor import metric_registry
from keel.monitor.custom_metrics import CUSTOM_KEY
from keel.monitor.event_kinds import EventKind


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # gauge | counter | histogram
    unit: str
    help: str
    source: str = ""  # the step-row or rank-row column a gauge reads, or the event kind a counter counts
    labels: tuple[str, ...] = ("run_id",)


def step_gauges() -> tuple[MetricSpec, ...]:
    """A gauge per step metric with a Prometheus name, from keel.monitor.metric_registry (read at each
    call, never at import: see there)."""
    return tuple(MetricSpec(m.prometheus, "gauge", m.unit, m.help, m.column) for m in metric_registry.STEP_METRICS if m.prometheus)


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

# The user's own metrics (keel.monitor.custom_metrics), a series per name. Their units are the user's
# to know, so the name carries none; a name the user stops reporting keeps its last value.
CUSTOM_METRIC = MetricSpec(
    "keel_custom_metric",
    "gauge",
    "",
    "A metric your training code reports under its own name (label name), at the last step that reported it.",
    CUSTOM_KEY,
    ("run_id", "name"),
)

# 1 once the run has ended on purpose (finished, or stopped by the rollback cap), while its exporter
# lingers: a run that ended is not stalled.
RUN_ENDED = MetricSpec(
    "keel_run_ended", "gauge", "", "1 once the run has finished or stopped (its exporter may linger), 0 while it trains."
)
RUN_ENDED_EVENTS = (EventKind.RUN_FINISHED, EventKind.RUN_STOPPED)  # the event kinds that set it

STEP_DURATION = MetricSpec(
    "keel_step_duration_seconds", "histogram", "seconds", "Duration of training steps (slowest rank).", "step_time_s"
)
STEP_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Counters, each counting run-store events of one kind.
COUNTERS = (
    MetricSpec(
        "keel_nonfinite_steps_total",
        "counter",
        "",
        "Steps skipped (no update) because a loss or gradient was NaN or Inf.",
        EventKind.NONFINITE,
    ),
    MetricSpec("keel_loss_spikes_total", "counter", "", "Loss spikes confirmed by the spike detector.", EventKind.SPIKE),
    MetricSpec("keel_rollbacks_total", "counter", "", "Rollbacks to an earlier checkpoint.", EventKind.ROLLBACK),
    MetricSpec("keel_data_skips_total", "counter", "", "Windows of bad batches skipped after a rollback.", EventKind.SKIP_DATA),
    MetricSpec("keel_checkpoints_total", "counter", "", "Checkpoints saved.", EventKind.CHECKPOINT_SAVED),
    MetricSpec(
        "keel_checkpoints_corrupt_total", "counter", "", "Checkpoints that failed verification on load.", EventKind.CHECKPOINT_CORRUPT
    ),
    MetricSpec("keel_hangs_total", "counter", "", "Hangs the watchdog detected.", EventKind.HANG),
    MetricSpec("keel_oom_total", "counter", "", "Out-of-memory errors recovered by halving the micro-batch.", EventKind.OOM),
    MetricSpec("keel_oom_retries_total", "counter", "", "Retries of the larger micro-batch after an out-of-memory.", EventKind.OOM_RETRY),
    MetricSpec("keel_restarts_total", "counter", "", "Restarts of the worker group.", EventKind.RESTART),
    MetricSpec(
        "keel_node_losses_total",
        "counter",
        "",
        "Nodes lost: one gone while the job's others lived on, or the run's processes vanished with no record.",
        EventKind.NODE_LOSS,
    ),
    MetricSpec("keel_faults_injected_total", "counter", "", "Faults injected by chaos hooks or drills.", EventKind.FAULT_INJECTED),
    MetricSpec("keel_alerts_total", "counter", "", "Alerts raised by Keel, by kind and severity.", EventKind.ALERT),
)


def exported() -> tuple[MetricSpec, ...]:
    """Every metric the exporter serves."""
    return step_gauges() + RANK_GAUGES + (CUSTOM_METRIC, RUN_ENDED, STEP_DURATION) + COUNTERS
