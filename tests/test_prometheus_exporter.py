"""The exporter speaks Keel's vocabulary: every metric, with run_id, in base units, counters counting events."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from keel.monitor.prometheus import PrometheusSink

ROW = {
    "step": 7,
    "attempt": 1,
    "time": 1.7e9,
    "loss": 2.5,
    "grad_norm": 0.8,
    "lr": 1e-3,
    "tokens": 7168,
    "tokens_per_s": 4096.0,
    "mfu": 0.41,
    "comm_share": 0.12,
    "step_time_s": 0.25,
    "data_time_s": 0.001,
    "mem_peak_bytes": 2**30,
    "skipped": 0,
    "validation_loss": 2.75,  # an evaluated step (eval.every)
    "validation_perplexity": 15.642631884188171,
}
# A sampled step (communication measured) of a pp2 job: ranks 0-1 are stage 0, ranks 2-3 stage 1.
RANKS = [{"step": 7, "attempt": 1, "rank": r, "step_time_s": 0.25 + r / 100, "comm_time_s": 0.05 * r} for r in range(4)]


def scrape(sink: PrometheusSink) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    return {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}, text


def families(text: str) -> dict[str, list]:
    """Metric name -> its samples."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_every_vocabulary_metric_is_exported_with_run_id():
    sink = PrometheusSink("r1", port=0, pipeline_stages=2)
    try:
        sink.on_step(ROW, RANKS)
        for kind in ("nonfinite", "nonfinite", "rollback", "fault_injected"):
            sink.on_event({"kind": kind, "severity": "warning", "data": {}})
        sink.on_event({"kind": "alert", "severity": "critical", "data": {"alert": "nonfinite_loss"}})
        samples, text = scrape(sink)
    finally:
        sink.close()
    # Written out, not read from the vocabulary the exporter is built from: these are the names users'
    # rules and dashboards query, and renaming or dropping one must fail here.
    exported = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE keel_")}
    assert exported == {
        "keel_loss": "gauge", "keel_grad_norm": "gauge", "keel_learning_rate": "gauge", "keel_tokens_per_second": "gauge",
        "keel_mfu_ratio": "gauge", "keel_comm_share_ratio": "gauge", "keel_comm_share_max_ratio": "gauge", "keel_step": "gauge", "keel_attempt": "gauge",
        "keel_last_step_timestamp_seconds": "gauge", "keel_last_step_duration_seconds": "gauge", "keel_memory_peak_bytes": "gauge", "keel_rank_step_duration_seconds": "gauge",
        "keel_rank_busy_seconds": "gauge", "keel_custom_metric": "gauge", "keel_run_ended": "gauge", "keel_step_duration_seconds": "histogram", "keel_nonfinite_steps_total": "counter", "keel_loss_spikes_total": "counter",
        "keel_rollbacks_total": "counter", "keel_data_skips_total": "counter", "keel_checkpoints_total": "counter",
        "keel_checkpoints_corrupt_total": "counter", "keel_hangs_total": "counter", "keel_oom_total": "counter",
        "keel_oom_retries_total": "counter",
        "keel_restarts_total": "counter", "keel_node_losses_total": "counter", "keel_faults_injected_total": "counter",
        "keel_alerts_total": "counter", "keel_validation_loss": "gauge", "keel_validation_perplexity": "gauge",
    }  # fmt: skip
    assert "_created" not in text  # one series per metric, not two
    assert samples["keel_loss"].value == 2.5 and samples["keel_loss"].labels == {"run_id": "r1"}
    assert samples["keel_mfu_ratio"].value == 0.41 and samples["keel_step"].value == 7
    assert samples["keel_step_duration_seconds_count"].value == 1
    assert samples["keel_validation_loss"].value == 2.75 and samples["keel_validation_loss"].labels == {"run_id": "r1"}
    assert samples["keel_nonfinite_steps_total"].value == 2
    assert samples["keel_rollbacks_total"].value == 1 and samples["keel_loss_spikes_total"].value == 0
    assert samples["keel_alerts_total"].labels == {"run_id": "r1", "kind": "nonfinite_loss", "severity": "critical"}
    by_name = families(text)
    assert {s.labels["rank"]: s.value for s in by_name["keel_rank_step_duration_seconds"]} == {"0": 0.25, "1": 0.26, "2": 0.27, "3": 0.28}
    # Busy time = step time - communication time, labelled with the rank's pipeline stage.
    busy = {(s.labels["rank"], s.labels["stage"]): round(s.value, 9) for s in by_name["keel_rank_busy_seconds"]}
    assert busy == {("0", "0"): 0.25, ("1", "0"): 0.21, ("2", "1"): 0.17, ("3", "1"): 0.13}
    assert samples["keel_run_ended"].value == 0


def test_busy_time_is_kept_from_the_last_sampled_step_and_the_run_ends():
    sink = PrometheusSink("r2", port=0)
    try:
        sink.on_step(ROW, [{"rank": r, "step_time_s": 0.5, "comm_time_s": 0.1 + 0.2 * r} for r in range(2)])
        # An unsampled step (no communication measured) leaves the busy gauges as they were, and a
        # step whose communication took all of it says nothing about speed.
        sink.on_step(ROW, [{"rank": r, "step_time_s": 0.6, "comm_time_s": None} for r in range(2)])
        sink.on_step(ROW, [{"rank": r, "step_time_s": 0.6, "comm_time_s": 0.6 if r else None} for r in range(2)])
        busy = {s.labels["rank"]: round(s.value, 9) for s in families(scrape(sink)[1])["keel_rank_busy_seconds"]}
        assert busy == {"0": 0.4, "1": 0.2}
        sink.on_event({"kind": "run_finished", "severity": "info", "data": {}})
        assert scrape(sink)[0]["keel_run_ended"].value == 1
    finally:
        sink.close()


def test_a_metric_is_exported_only_once_the_run_has_a_value_for_it():
    """A run that never evaluates has no validation loss: exported at 0 it would read as a perfect model."""
    sink = PrometheusSink("r3", port=0)
    unevaluated = {k: v for k, v in ROW.items() if not k.startswith("validation_")}
    try:
        sink.on_step(unevaluated, [])
        samples = scrape(sink)[0]
        assert samples["keel_loss"].value == 2.5
        assert "keel_validation_loss" not in samples and "keel_validation_perplexity" not in samples
        sink.on_step(ROW, [])
        assert scrape(sink)[0]["keel_validation_loss"].value == 2.75
    finally:
        sink.close()
