"""A step metric is declared once, in keel.monitor.metric_registry: one added there and nowhere else is
a column of the run store, a gauge on the exporter's /metrics, a column of `keel metrics` and a chart of
the dashboard."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from keel.dashboard.series import chart_titles, metric_series, segments, with_x
from keel.monitor import metric_registry, metrics_cli
from keel.monitor.metric_registry import STEP_METRICS, Chart, StepMetric
from keel.monitor.prometheus import PrometheusSink
from keel.monitor.store import RunStore, abandoned_mask, read_steps, step_columns

# Drawn in milliseconds, stored in seconds: the dashboard must scale it as its entry says.
EXTRA = StepMetric(
    "optimizer_time_s",
    float,
    "seconds",
    "Duration of the optimizer's update in the last step.",
    prometheus="keel_optimizer_duration_seconds",
    wandb=True,
    table="{:.3g}",
    chart=Chart("optimizer time (ms)", scale=1e3),
)


def register_extra(monkeypatch) -> None:
    """EXTRA appended to the registry, as a new entry in STEP_METRICS would be; undone after the test."""
    monkeypatch.setattr(metric_registry, "STEP_METRICS", (*STEP_METRICS, EXTRA))


def step_row(step: int, **values) -> dict:
    return {"step": step, "attempt": 0, "time": 1.7e9 + step, "loss": 3.0 / step, "step_time_s": 0.25, **values}


def scrape(port: int) -> dict:
    """The exporter's /metrics as served, by metric family name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_a_metric_added_to_the_registry_reaches_the_store_the_exporter_the_table_and_the_dashboard(tmp_path, monkeypatch, capsys):
    # A run that began before the metric existed, resumed after it was added: the store gains the column.
    with RunStore(tmp_path) as store:
        store.write_step(step_row(1))
    register_extra(monkeypatch)
    with RunStore(tmp_path) as store:
        store.write_step(step_row(2, optimizer_time_s=0.002))
        store.write_step(step_row(3, optimizer_time_s=0.004))

    steps = read_steps(tmp_path)
    assert step_columns()[-1] == "optimizer_time_s" and tuple(steps.columns) == step_columns()
    assert steps.optimizer_time_s.dtype == "float64"
    assert steps.optimizer_time_s.isna().tolist() == [True, False, False] and steps.optimizer_time_s.iloc[1:].tolist() == [0.002, 0.004]

    sink = PrometheusSink("r1", port=0)  # on 127.0.0.1, a free port
    try:
        sink.on_step(step_row(3, optimizer_time_s=0.004), [])
        family = scrape(sink.port)["keel_optimizer_duration_seconds"]
    finally:
        sink.close()
    assert (family.type, family.documentation) == ("gauge", EXTRA.help)
    assert [(s.labels, s.value) for s in family.samples] == [({"run_id": "r1"}, 0.004)]

    assert metrics_cli.main([str(tmp_path)]) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert table[0][-1] == "optimizer_time_s" and [row[-1] for row in table[1:]] == ["-", "0.002", "0.004"]

    assert chart_titles()["optimizer_time_s"] == "optimizer time (ms)"
    rows = with_x(steps.assign(segment=segments(steps, abandoned_mask(steps))), "step", origin=0.0)
    drawn = metric_series(rows, "optimizer_time_s", grid=(1, 3))
    assert drawn.step.tolist() == [2, 3] and drawn.value.tolist() == pytest.approx([2.0, 4.0])


def test_the_registry_spells_each_name_once_and_in_base_units():
    columns = [m.column for m in STEP_METRICS]
    exported = [m.prometheus for m in STEP_METRICS if m.prometheus]
    assert len(set(columns)) == len(columns) and len(set(exported)) == len(exported)
    assert {"step", "attempt"} <= set(columns)  # the store's key
    for m in STEP_METRICS:
        assert m.dtype in (int, float, str), m.column
        if m.prometheus and m.unit in ("seconds", "bytes", "ratio"):
            assert m.prometheus.startswith("keel_") and m.prometheus.endswith(f"_{m.unit}"), m.prometheus
