"""What the Run and Compare pages draw of a run, on stores written through RunStore as a trainer writes
them (no training: the fast tier): the events grouped and banded, a restart where its failure was, the
x axes, the smoothing, the units, and the charts left out. The pages are driven by Streamlit's AppTest;
the browser's side is tests/test_dashboard_browser.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from keel.dashboard.runs_page import RUNS_ENV
from keel.dashboard.series import MARKER_COLOURS, smoothed
from keel.monitor.event_kinds import EventKind
from keel.monitor.store import RunStore

START = 1.7e9
STEPS = 60
HANG_STEP, DOWN_S = 30, 40.0  # the step that hung, and the seconds it and the restart cost
LATE = range(40, 52)  # the steps rank 2 was late for


def _write_run(run_dir: Path, ranks: int, finished: bool) -> None:
    """A run of STEPS steps at 1 s a step on `ranks` ranks: a hang at HANG_STEP, torchrun's restart, the
    rank 2 late for the steps of LATE, a checkpoint every 10 steps; `finished`: it ended (else it went silent)."""
    with RunStore(run_dir) as store:
        for step in range(1, STEPS + 1):
            late = DOWN_S if step >= HANG_STEP else 0.0  # the time the hang cost, on every step after it
            row = {"step": step, "attempt": int(step >= HANG_STEP), "time": START + step + late, "loss": 5.0 - step / 30,
                   "grad_norm": 1.0, "lr": 1e-3, "tokens": 256 * step, "tokens_per_s": 256.0, "mfu": 0.25, "comm_share": 0.125,
                   "step_time_s": 1.0, "data_time_s": 0.01, "mem_peak_bytes": 2**30, "skipped": 0,
                   "slowest_ranks": ",".join(str(r) for r in range(min(3, ranks)))}  # fmt: skip
            store.write_step(row, [{"rank": r, "step_time_s": 1.0, "comm_time_s": 0.1, "mem_peak_bytes": 2**30} for r in range(ranks)])
        for step in range(10, STEPS + 1, 10):
            store.write_event(EventKind.CHECKPOINT_SAVED, f"step-{step:08d}", step=step, attempt=0, time=START + step)
        hang_at = START + HANG_STEP + 10
        store.write_event(EventKind.HANG, "hang: no progress for 10 s", severity="critical", step=HANG_STEP, attempt=0, time=hang_at)
        store.write_event(EventKind.ALERT, "KeelHang", severity="critical", step=HANG_STEP, attempt=0, time=hang_at + 0.1)
        # Written by the next attempt, at the step it resumed from, after the fact (as keel.trainer.incidents writes it).
        failure = {"step": HANG_STEP - 1, "time": hang_at + 1, "down_s": DOWN_S - 11}
        store.write_event(EventKind.RESTART, f"workers restarted, resuming at step {HANG_STEP - 9}", severity="warning",
                          step=HANG_STEP - 10, attempt=1, rank=1, data=failure, time=START + HANG_STEP + DOWN_S)  # fmt: skip
        store.write_event(EventKind.FAULT_INJECTED, "hang@step=30", severity="warning", step=HANG_STEP, attempt=0, rank=1,
                          time=START + HANG_STEP + DOWN_S + 0.1)  # fmt: skip
        for step in LATE:
            store.write_event(
                EventKind.STRAGGLER, "rank 2 is late", severity="warning", step=step, attempt=1, rank=2, time=START + step + DOWN_S
            )
        if finished:
            store.write_event(EventKind.RUN_FINISHED, "done", step=STEPS, attempt=1, time=START + STEPS + DOWN_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("views")
    _write_run(folder / "eight", ranks=8, finished=False)
    _write_run(folder / "three", ranks=3, finished=True)
    return folder


def _page(module: str, render: str, folder: Path, monkeypatch, params: dict) -> AppTest:
    """A page of the dashboard (keel.dashboard.MODULE's RENDER) over the runs in `folder`, run once without error."""
    monkeypatch.setenv(RUNS_ENV, str(folder))
    app = AppTest.from_string(f"from keel.dashboard.{module} import {render}\n{render}()", default_timeout=60)
    app.query_params.update(params)
    app.run()
    assert not app.exception and not app.error, (app.exception, app.error)
    return app


def _run_page(folder: Path, monkeypatch, **params: str) -> AppTest:
    return _page("run_page", "render_run", folder, monkeypatch, params)


def _charts(app: AppTest) -> dict[str, dict]:
    """The page's line charts and bar charts by title: each panel as sent, its frames as DataFrames."""
    charts = {}
    for element in app.get("bidi_component"):
        for panel in json.loads(element.proto.json)["panels"]:
            charts[panel["title"]] = panel | {"frames": {k: pd.DataFrame(v) for k, v in panel["frames"].items()}}
    return charts


def test_events_at_one_step_are_one_rule_in_causal_order_with_the_restart_where_it_failed(runs, monkeypatch):
    loss = _charts(_run_page(runs, monkeypatch, run="eight"))["loss"]
    rules = loss["frames"]["rules"].set_index("step")
    assert rules.index.is_unique
    # Recorded hang, alert, restart (by the next attempt, at its resumed step), injected fault (after the fact):
    # drawn at the step that hung, in the order they happened.
    assert rules.loc[HANG_STEP].kinds == ["injected fault", "hang", "alert", "restart", "checkpoint saved"]
    assert rules.loc[HANG_STEP - 10].kinds == ["checkpoint saved"]  # not where the run resumed, before the hang
    assert "resuming at step 21" in rules.loc[HANG_STEP].text
    # Drawn in a stripe of each kind's colour, so that every kind the legend lists is seen.
    assert rules.loc[HANG_STEP].colours == [MARKER_COLOURS[k] for k in rules.loc[HANG_STEP].kinds]
    assert len(rules.loc[HANG_STEP].text.splitlines()) == 5


def test_a_fault_lasting_many_steps_is_one_band_not_a_rule_per_step(runs, monkeypatch):
    charts = _charts(_run_page(runs, monkeypatch, run="eight"))
    for title in ("loss", "grad norm"):
        bands, rules = charts[title]["frames"]["bands"], charts[title]["frames"]["rules"]
        assert bands[["first", "last", "kind", "count"]].values.tolist() == [[LATE[0], LATE[-1], "straggler", len(LATE)]]
        assert not any("straggler" in kinds for kinds in rules.kinds)
    assert "straggler from step 40 to 51 (12 events): rank 2 is late" == charts["loss"]["frames"]["bands"].text[0]


def test_the_wall_clock_axis_shows_the_time_the_hang_cost(runs, monkeypatch):
    loss = _charts(_run_page(runs, monkeypatch, run="eight", x="time"))["loss"]
    assert loss["x_title"] == "wall-clock time" and loss["x_format"] == "duration"
    lines = loss["frames"]["lines"].set_index("step")
    gaps = lines.x.diff()
    assert gaps.loc[HANG_STEP] == pytest.approx(1 + DOWN_S) and gaps.drop(HANG_STEP).dropna().eq(1.0).all()
    # Each event at its own time (from the run's start, a step before step 1's end): the hang and its alert
    # one rule, the restart at its failure's time after them, not at the step it resumed from.
    [hang] = [r for r in loss["frames"]["rules"].itertuples() if "hang" in r.kinds]
    [restart] = [r for r in loss["frames"]["rules"].itertuples() if "restart" in r.kinds]
    assert hang.kinds[:2] == ["hang", "alert"] and hang.x == pytest.approx(HANG_STEP + 10)
    assert restart.kinds == ["restart"] and restart.x == pytest.approx(HANG_STEP + 11)
    tokens = _charts(_run_page(runs, monkeypatch, run="eight", x="tokens"))["loss"]
    assert tokens["frames"]["lines"].x.tolist() == [256.0 * s for s in range(1, STEPS + 1)]


def test_smoothing_is_the_debiased_average_over_the_raw_line(runs, monkeypatch):
    loss = _charts(_run_page(runs, monkeypatch, run="eight", smooth="0.9"))["loss"]
    lines = loss["frames"]["lines"]
    assert loss["smoothed"] and lines.value.tolist() == [5.0 - s / 30 for s in range(1, STEPS + 1)]  # the raw line, whole
    weight, raw = 0.9, lines.value.to_numpy()
    expected, average = [], 0.0
    for n, value in enumerate(raw, start=1):  # TensorBoard's smoothing, written out
        average = weight * average + (1 - weight) * value
        expected.append(average / (1 - weight**n))
    assert np.allclose(lines.smooth, expected) and np.allclose(smoothed(pd.Series(raw), weight), expected)


def test_shares_are_percent_as_on_the_runs_page_and_unrecorded_metrics_get_no_chart(runs, monkeypatch):
    app = _run_page(runs, monkeypatch, run="eight")
    charts = _charts(app)
    assert charts["MFU (%)"]["frames"]["lines"].value.eq(25.0).all()
    assert charts["comm share (%)"]["frames"]["lines"].value.eq(12.5).all()
    assert "validation loss" not in charts  # never evaluated
    monkeypatch.setenv(RUNS_ENV, str(runs))
    table = AppTest.from_string("from keel.dashboard.runs_page import render_runs\nrender_runs()", default_timeout=60).run()
    shown = table.dataframe[0].value.set_index("run")
    assert shown.MFU.eq(25.0).all() and shown.comm.eq(12.5).all()


def test_the_slowest_ranks_chart_needs_more_ranks_than_it_names(runs, monkeypatch):
    assert "steps among the slowest" in _charts(_run_page(runs, monkeypatch, run="eight"))
    assert "steps among the slowest" not in _charts(_run_page(runs, monkeypatch, run="three"))


def _compare_page(folder: Path, monkeypatch, params: dict) -> AppTest:
    return _page("compare_page", "render_compare", folder, monkeypatch, params)


def test_compare_draws_several_metrics_with_each_runs_events(runs, monkeypatch):
    app = _compare_page(runs, monkeypatch, {"run": ["eight", "three"], "metric": ["loss", "grad_norm"], "x": "tokens"})
    charts = _charts(app)
    assert {"loss by tokens trained on", "grad norm by tokens trained on"} <= set(charts)
    for chart in (charts["loss by tokens trained on"], charts["grad norm by tokens trained on"]):
        lines = chart["frames"]["lines"]
        assert set(lines.run) == {"eight", "three"}
        # The tokens trained on, as the store keeps them (a running total): 256 a step, not summed again.
        assert lines[lines.run == "three"].x.tolist() == [256.0 * s for s in range(1, STEPS + 1)]
        texts = "\n".join(chart["frames"]["rules"].text) + "\n".join(chart["frames"]["bands"].text)
        assert "eight: hang" in texts and "three: hang" in texts  # each run's events, naming the run
        assert len(chart["frames"]["bands"]) == 2  # each run's late rank: a band each, not one for both


def test_compare_offers_the_runs_a_name_or_status_filter_keeps(runs, monkeypatch):
    app = _compare_page(runs, monkeypatch, {"filter": "thr"})
    assert app.multiselect(key="compare-runs").options == ["three"] and app.multiselect(key="compare-runs").value == ["three"]
    app.text_input(key="compare-filter").set_value("").run()
    assert app.multiselect(key="compare-status").options == ["failed", "finished"]  # eight went silent, three ended
    assert app.multiselect(key="compare-runs").options == ["eight", "three"]
    app.multiselect(key="compare-runs").set_value([]).run()
    app.multiselect(key="compare-status").set_value(["failed"]).run()
    assert app.multiselect(key="compare-runs").options == ["eight"]


def test_the_tokens_axis_of_a_run_without_tokens_falls_back_to_steps_and_says_so(tmp_path, monkeypatch):
    with RunStore(tmp_path / "loop") as store:  # a user's loop opened without tokens_per_step
        for step in range(1, 6):
            store.write_step({"step": step, "attempt": 0, "time": START + step, "loss": 3.0, "tokens": 0, "step_time_s": 1.0})
    app = _run_page(tmp_path, monkeypatch, run="loop", x="tokens")
    assert any("recorded no tokens" in c.value for c in app.caption)
    loss = _charts(app)["loss"]
    assert loss["x_title"] == "step" and loss["frames"]["lines"].x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_chart_of_an_inf_loss_is_json_the_browser_can_parse():
    """A run with an Inf loss (a fault, an overflow) drew no chart at all: Python wrote `Infinity`, which the
    browser's JSON.parse refuses. The step is a gap instead; its `nonfinite` event marks it."""
    from keel.dashboard.charts import View, line_chart

    series = pd.DataFrame({"x": [1.0, 2.0, 3.0], "step": [1, 2, 3], "value": [2.5, np.inf, -np.inf], "line": ["loss"] * 3})
    panel = line_chart(series, "line", {"loss": {"colour": "#000", "dash": False}}, "loss", 200, View(), (1.0, 3.0))
    payload = json.loads(json.dumps(panel, allow_nan=False))  # raises ValueError for an Infinity left in
    assert payload["frames"]["lines"]["value"] == [2.5, None, None]
