"""The step metrics, each declared once: the columns of the step row the trainer builds every step
(keel.trainer.step_metrics), with what every consumer needs to know of them. The run store's `steps`
table, the Prometheus gauges (keel.monitor.metrics), the keys logged to W&B, the `keel metrics` table
and the dashboard's charts are all derived from STEP_METRICS; no other list of step metrics exists.
Adding one: docs/design.md, "Adding a metric".

Consumers read STEP_METRICS when they are built or called, never at import, so that a registry
extended before a run (as tests/test_metric_registry.py does) reaches every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chart:
    """How the dashboard draws a metric against step: its chart's title, and the factor from the stored
    base unit to the unit that title names (bytes drawn as GiB, ratios as percent, as the Runs page shows them)."""

    title: str
    scale: float = 1.0


@dataclass(frozen=True)
class StepMetric:
    column: str  # the step row's key and the run store's column; renaming one breaks every stored run
    dtype: type  # int, float or str: the store's column type and the readers' dtype
    unit: str  # the base unit (Prometheus naming guide): seconds, bytes, ratio (0..1); "" for none
    help: str  # one line: Prometheus' HELP, and what the column holds
    prometheus: str = ""  # the gauge's name (labels: run_id); "" when not exported. Alert rules query it
    wandb: bool = False  # logged to W&B, as `wandb_key`
    table: str | None = None  # its format in the `keel metrics` table ("{:.4g}", "" for pandas' own); None: left out (--csv has all)
    chart: Chart | None = None  # drawn on the dashboard's Run page and offered on its Compare page
    wandb_name: str = ""  # its W&B key when not train/<column> (the validation metrics are val/<name>, as W&B's examples log them)

    @property
    def wandb_key(self) -> str:
        return self.wandb_name or f"train/{self.column}"


# In table order: the store's columns, the `keel metrics` table and the dashboard's charts follow it.
STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric("step", int, "", "Last completed training step.", prometheus="keel_step", table=""),
    StepMetric("attempt", int, "", "Attempt of the last step (raised by each rollback or restart).", prometheus="keel_attempt",
               wandb=True, table=""),
    StepMetric("time", float, "seconds", "Unix time at which the last step completed.", prometheus="keel_last_step_timestamp_seconds"),
    StepMetric("loss", float, "", "Training loss of the last step (mean over the global batch).", prometheus="keel_loss", wandb=True,
               table="{:.4g}", chart=Chart("loss")),
    StepMetric("grad_norm", float, "", "Global gradient L2 norm of the last step, before clipping.", prometheus="keel_grad_norm",
               wandb=True, table="{:.4g}", chart=Chart("grad norm")),
    StepMetric("lr", float, "", "Learning rate used by the last step.", prometheus="keel_learning_rate", wandb=True, table="{:.3g}",
               chart=Chart("learning rate")),
    StepMetric("tokens", int, "", "Tokens trained on up to the step: the step times the global batch's tokens."),
    StepMetric("tokens_per_s", float, "tokens/s", "Global training throughput of the last step.", prometheus="keel_tokens_per_second",
               wandb=True, table="{:.0f}", chart=Chart("tokens/s")),
    StepMetric("mfu", float, "ratio", "Model FLOPs utilization of the last step (0..1).", prometheus="keel_mfu_ratio", wandb=True,
               table="{:.3g}", chart=Chart("MFU (%)", scale=100.0)),
    # The communication shares are NULL on steps where communication was not measured, rather than a repeated value.
    StepMetric("comm_share", float, "ratio", "Exposed communication time / step time, the ranks' mean, last sampled step (0..1).",
               prometheus="keel_comm_share_ratio", wandb=True, table="{:.3f}", chart=Chart("comm share (%)", scale=100.0)),
    StepMetric("comm_share_max", float, "ratio",
               "Exposed communication time / step time of the rank that waited longest, last sampled step (0..1).",
               prometheus="keel_comm_share_max_ratio"),
    StepMetric("step_time_s", float, "seconds", "Duration of the last step (slowest rank).", prometheus="keel_last_step_duration_seconds",
               wandb=True, table="{:.4g}", chart=Chart("step time (s)")),
    StepMetric("step_time_median_s", float, "seconds", "Median over the ranks of the step's duration."),
    StepMetric("step_time_min_s", float, "seconds", "Duration of the step on the fastest rank."),
    # NULL where communication was not measured: only that tells a slow rank from the ones waiting for it.
    StepMetric("slowest_ranks", str, "", "The few ranks with the longest busy time (step minus communication), slowest first: 5,0,3."),
    StepMetric("data_time_s", float, "seconds", "The longest time a rank took to load the step's batch.", wandb=True,
               chart=Chart("data time (s)")),
    StepMetric("mem_peak_bytes", int, "bytes", "Peak memory of the busiest rank.", prometheus="keel_memory_peak_bytes", wandb=True,
               chart=Chart("peak memory (GiB)", scale=2**-30)),
    StepMetric("skipped", int, "", "1 when the step made no update (a loss or gradient was not finite), else 0."),
    # NULL on steps without an evaluation (eval.every). The spike detector never reads them.
    StepMetric("validation_loss", float, "", "Validation loss after the last evaluated step's update (mean over the validation batches).",
               prometheus="keel_validation_loss", wandb=True, wandb_name="val/loss", table="{:.4g}", chart=Chart("validation loss")),
    StepMetric("validation_perplexity", float, "", "exp(validation loss) of the last evaluated step.", prometheus="keel_validation_perplexity",
               wandb=True, wandb_name="val/perplexity"),
    # Outside step_time_s: goodput counts it as evaluation, not training.
    StepMetric("eval_time_s", float, "seconds", "Seconds the evaluation after the step's update took (0: none)."),
)  # fmt: skip
