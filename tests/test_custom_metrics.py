"""Custom metrics, the ones a user names (keel.monitor.custom_metrics): the run store keeps them beside the
step they came with and reads back the trajectory that counts, the name check says what to do, W&B and
Prometheus export them, and the dashboard's Run page draws them. Rows are written through RunStore
directly: no training run."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing

import numpy as np
import pandas as pd
import pytest
from test_alert_channels import run_wandb_child, wandb_records
from test_dashboard import _charts, _run_page
from test_prometheus_exporter import ROW, families, scrape
from test_store import full_step

from keel.monitor import metric_registry
from keel.monitor.custom_metrics import CUSTOM_KEY, check_custom_metric_name
from keel.monitor.metric_registry import STEP_METRICS, StepMetric
from keel.monitor.prometheus import PrometheusSink
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import CUSTOM_COLUMNS, RunStore, read_appended, read_custom_metrics, read_steps


def write(run_dir, steps, attempt: int, custom) -> None:
    """Step rows of `attempt`, each with custom(step) as its custom metrics (None: no such key)."""
    with RunStore(run_dir) as store:
        for step in steps:
            metrics = custom(step)
            store.write_step(full_step(step, attempt) | ({} if metrics is None else {CUSTOM_KEY: metrics}))


def pairs(frame: pd.DataFrame) -> list[tuple[int, int]]:
    return list(zip(frame.step, frame.attempt))


# --- the run store ----------------------------------------------------------------------------------------


def test_custom_metrics_round_trip_nan_and_none_as_missing(tmp_path):
    with RunStore(tmp_path) as store:
        store.write_step(full_step(1, custom={"val_loss": 2.5, "acc": np.float32(0.25), "broken": float("nan")}))
        store.write_step(full_step(2, custom={"val_loss": np.float64(2.0), "acc": None, "peak": math.inf}))
        store.write_step(full_step(3))  # Keel's own trainer: no custom metrics at all
        store.write_step(full_step(4, custom={}))
    custom = read_custom_metrics(tmp_path)
    assert tuple(custom.columns) == CUSTOM_COLUMNS == ("step", "attempt", "name", "value")
    assert custom.dtypes.astype(str).tolist() == ["int64", "int64", "object", "float64"]
    got = {(r.step, r.name): r.value for r in custom.itertuples()}
    assert set(got) == {(1, "acc"), (1, "broken"), (1, "val_loss"), (2, "acc"), (2, "peak"), (2, "val_loss")}
    assert got[(1, "val_loss")] == 2.5 and got[(1, "acc")] == 0.25 and got[(2, "val_loss")] == 2.0 and got[(2, "peak")] == math.inf
    assert math.isnan(got[(1, "broken")]) and math.isnan(got[(2, "acc")])
    with closing(sqlite3.connect(tmp_path / STORE_FILE)) as conn:  # NaN is NULL in the table, as in the steps table
        assert conn.execute("SELECT COUNT(*) FROM custom_metrics WHERE value IS NULL").fetchone()[0] == 2
    assert custom.step.tolist() == sorted(custom.step) and custom[custom.step == 1].name.tolist() == ["acc", "broken", "val_loss"]
    # The step rows are as they would be without custom metrics.
    assert read_steps(tmp_path).step.tolist() == [1, 2, 3, 4] and read_steps(tmp_path).iloc[0].to_dict() == full_step(1)


def test_effective_custom_metrics_drop_the_attempt_a_rollback_abandoned(tmp_path):
    write(tmp_path, range(1, 6), attempt=0, custom=lambda s: {"val_loss": 10.0 + s})
    write(tmp_path, range(3, 7), attempt=1, custom=lambda s: {"val_loss": 20.0 + s})  # a rollback to step 2
    effective = read_custom_metrics(tmp_path, effective=True)
    assert pairs(effective) == pairs(read_steps(tmp_path, effective=True)) == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert effective.value.tolist() == [11.0, 12.0, 23.0, 24.0, 25.0, 26.0]
    assert len(read_custom_metrics(tmp_path)) == 9  # every attempt's rows are kept


def test_an_attempt_abandons_custom_rows_even_before_it_reports_any(tmp_path):
    # The rule is read_steps': attempt 1 started at step 3, so attempt 0's custom rows from step 3 on no
    # longer count, although attempt 1 has reported custom metrics only from step 5 (an eval every few steps).
    write(tmp_path, range(1, 6), attempt=0, custom=lambda s: {"val_loss": 10.0 + s})
    write(tmp_path, range(3, 7), attempt=1, custom=lambda s: {"val_loss": 20.0 + s} if s >= 5 else None)
    assert pairs(read_custom_metrics(tmp_path, effective=True)) == [(1, 0), (2, 0), (5, 1), (6, 1)]


def test_a_step_written_again_keeps_only_its_new_custom_metrics(tmp_path):
    with RunStore(tmp_path) as store:
        store.write_step(full_step(1, custom={"a": 1.0, "b": 2.0}))
        mark = read_appended(tmp_path).mark
        store.write_step(full_step(1, custom={"a": 3.0}))
        again = read_appended(tmp_path, mark)
        store.write_step(full_step(1))
        emptied = read_appended(tmp_path, again.mark)
        store.write_step(full_step(2, custom={"c": 4.0}))
        after = read_appended(tmp_path, emptied.mark)
    assert read_custom_metrics(tmp_path)[["step", "name", "value"]].values.tolist() == [[2, "c", 4.0]]
    # A reader following the run gets the step again with its custom rows as they are now, never a row
    # it has passed: ids are not reused after the delete.
    assert not again.fresh and again.custom[["name", "value"]].values.tolist() == [["a", 3.0]] and again.steps.step.tolist() == [1]
    assert not emptied.fresh and emptied.custom.empty and emptied.steps.step.tolist() == [1]
    assert not after.fresh and after.custom[["step", "name"]].values.tolist() == [[2, "c"]]


def test_bad_custom_metrics_are_rejected_and_nothing_is_written(tmp_path):
    with RunStore(tmp_path) as store:
        with pytest.raises(ValueError, match="custom metric 'acc' of step 1 is 'high': pass a number"):
            store.write_step(full_step(1, custom={"val_loss": 1.0, "acc": "high"}))
        with pytest.raises(ValueError, match="'custom' is a list"):
            store.write_step(full_step(1, custom=[1.0]))
    assert read_steps(tmp_path).empty and read_custom_metrics(tmp_path).empty


def test_a_store_without_the_table_reads_as_none_and_gets_it_when_written(tmp_path):
    """A store of an earlier Keel: no custom_metrics table. It reads as no custom metrics, and a run
    resumed on it gains the table; a reader following it then reads on from where it was."""
    with RunStore(tmp_path) as store:
        store.write_step(full_step(1))
    with closing(sqlite3.connect(tmp_path / STORE_FILE)) as conn, conn:
        conn.execute("DROP TABLE custom_metrics")
    old = read_custom_metrics(tmp_path, effective=True)
    assert old.empty and tuple(old.columns) == CUSTOM_COLUMNS and old.dtypes.astype(str).tolist() == ["int64", "int64", "object", "float64"]
    assert read_custom_metrics(tmp_path).empty
    first = read_appended(tmp_path)
    assert first.custom.empty and tuple(first.custom.columns) == CUSTOM_COLUMNS and first.steps.step.tolist() == [1]
    write(tmp_path, [2], attempt=0, custom=lambda s: {"acc": 0.5})
    then = read_appended(tmp_path, first.mark)
    assert not then.fresh and then.steps.step.tolist() == [2]
    assert then.custom[["step", "name", "value"]].values.tolist() == [[2, "acc", 0.5]]
    assert read_custom_metrics(tmp_path, effective=True).value.tolist() == [0.5]


# --- the name check ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["acc", "val_loss", "_x", "A1", "x" * 64, "Loss"])
def test_names_that_can_name_a_custom_metric(name):
    check_custom_metric_name(name)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("val acc", "custom metric name 'val acc' is not allowed: use letters, digits and underscores, not starting with a digit, "
                    "at most 64 characters, e.g. 'val_acc'"),
        ("1st_loss", "e.g. '_1st_loss'"),
        ("val/loss", "e.g. 'val_loss'"),
        ("", "custom metric name '' is not allowed"),
        ("x" * 65, "at most 64 characters, e.g. '" + "x" * 64 + "'"),
        ("loss", "custom metric name 'loss' is one of Keel's own step metrics: rename yours, e.g. 'my_loss'"),
        ("step", "'step' is one of Keel's own step metrics"),
        (7, "custom metric name 7 is a int: name it with a string"),
    ],
)  # fmt: skip
def test_a_bad_name_is_one_line_naming_it_and_the_fix(name, says):
    with pytest.raises(ValueError) as excinfo:
        check_custom_metric_name(name)
    message = str(excinfo.value)
    assert says in message and "\n" not in message


def test_a_step_metric_added_to_the_registry_is_no_custom_name(monkeypatch):
    check_custom_metric_name("optimizer_time_s")
    monkeypatch.setattr(metric_registry, "STEP_METRICS", (*STEP_METRICS, StepMetric("optimizer_time_s", float, "seconds", "x")))
    with pytest.raises(ValueError, match="one of Keel's own step metrics"):
        check_custom_metric_name("optimizer_time_s")


# --- the sinks --------------------------------------------------------------------------------------------


def test_prometheus_exports_each_custom_metric_by_name():
    sink = PrometheusSink("r1", port=0)
    try:
        sink.on_step(ROW, [])  # no custom metrics: the gauge is declared, with no series
        assert families(scrape(sink)[1])["keel_custom_metric"] == []
        sink.on_step(ROW | {CUSTOM_KEY: {"val_loss": 2.25, "acc": np.float32(0.5), "later": None}}, [])
        sink.on_step(ROW | {CUSTOM_KEY: {"val_loss": 2.0}}, [])  # acc not reported this step: keeps its last value
        sink.on_step(ROW | {CUSTOM_KEY: {}}, [])
        _, text = scrape(sink)
    finally:
        sink.close()
    assert "# TYPE keel_custom_metric gauge" in text
    series = {s.labels["name"]: (s.labels, s.value) for s in families(text)["keel_custom_metric"]}
    assert series == {"val_loss": ({"run_id": "r1", "name": "val_loss"}, 2.0), "acc": ({"run_id": "r1", "name": "acc"}, 0.5)}


@pytest.mark.slow  # W&B's service process, as the other W&B tests
def test_wandb_logs_custom_metrics_as_custom_name(tmp_path):
    # The child's rows (tests/test_alert_channels.py) carry custom metrics on even steps only.
    run_wandb_child(tmp_path, {"model": {}}, mode="offline")
    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*-run-42/run-run-42.wandb")
    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(run_file)
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [(row["train/step"], row["train/attempt"], row.get("custom/val_acc"), "train/loss" in row) for row in history]
    assert logged == [(1, 0, None, True), (2, 0, 0.2, True), (3, 0, None, True), (2, 1, 1.2, True), (3, 1, None, True), (4, 1, 1.4, True)]
    assert all(key.startswith(("train/", "custom/val_acc", "_")) for row in history for key in row)


# --- the dashboard ----------------------------------------------------------------------------------------


def test_run_page_draws_a_chart_per_custom_metric_and_none_without(tmp_path, monkeypatch):
    mine, plain = tmp_path / "mine", tmp_path / "plain"
    write(mine, range(1, 11), attempt=0, custom=lambda s: {"val_loss": 5.0 / s} | ({"acc": s / 20} if s % 2 == 0 else {}))
    write(mine, range(6, 13), attempt=1, custom=lambda s: {"val_loss": 4.0 / s})  # a rollback to step 5; acc not reported since
    write(plain, range(1, 11), attempt=0, custom=lambda s: None)

    app = _run_page(tmp_path, "mine", monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    assert "Your metrics" in [h.value for h in app.subheader]
    charts = _charts(app)
    assert {"loss", "grad norm", "acc", "val_loss"} <= set(charts)  # the user's metrics beside Keel's own
    effective = read_custom_metrics(mine, effective=True)
    for name in ("acc", "val_loss"):
        lines = charts[name]["lines"]
        kept = effective[effective.name == name]
        drawn = lines[lines.segment == "effective"]
        assert drawn.step.tolist() == kept.step.tolist() and drawn.value.tolist() == kept.value.tolist(), name
    # The steps attempt 1 ran again are drawn apart, dashed, as for Keel's own metrics.
    lines = charts["val_loss"]["lines"]
    assert sorted(lines[lines.segment == "attempt 0"].step) == [6, 7, 8, 9, 10]

    app = _run_page(tmp_path, "plain", monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    assert "Your metrics" not in [h.value for h in app.subheader]
    assert not {"acc", "val_loss"} & set(_charts(app))
