"""The exporter speaks Keel's vocabulary: every metric, with run_id, in base units, counters counting events."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from keel.monitor import metrics
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
}
RANKS = [{"step": 7, "attempt": 1, "rank": r, "step_time_s": 0.25 + r / 100} for r in range(2)]


def scrape(sink: PrometheusSink) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    return {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}, text


def test_every_vocabulary_metric_is_exported_with_run_id():
    sink = PrometheusSink("r1", port=0)
    try:
        sink.on_step(ROW, RANKS)
        for kind in ("nonfinite", "nonfinite", "rollback", "fault_injected"):
            sink.on_event({"kind": kind, "severity": "warning", "data": {}})
        sink.on_event({"kind": "alert", "severity": "critical", "data": {"alert": "nonfinite_loss"}})
        samples, text = scrape(sink)
    finally:
        sink.close()
    for m in metrics.GAUGES + metrics.COUNTERS:
        assert f"# TYPE {m.name} {m.kind}" in text, m.name
    assert "_created" not in text  # one series per metric, not two
    assert "# TYPE keel_step_duration_seconds histogram" in text
    assert samples["keel_loss"].value == 2.5 and samples["keel_loss"].labels == {"run_id": "r1"}
    assert samples["keel_mfu_ratio"].value == 0.41 and samples["keel_step"].value == 7
    assert samples["keel_step_duration_seconds_count"].value == 1
    assert samples["keel_nonfinite_steps_total"].value == 2
    assert samples["keel_rollbacks_total"].value == 1 and samples["keel_loss_spikes_total"].value == 0
    assert samples["keel_alerts_total"].labels == {"run_id": "r1", "kind": "nonfinite_loss", "severity": "critical"}
    ranks = {
        s.labels["rank"]: s.value
        for s in text_string_to_metric_families(text)
        if s.name == "keel_rank_step_duration_seconds"
        for s in s.samples
    }
    assert ranks == {"0": 0.25, "1": 0.26}
