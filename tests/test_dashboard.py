"""`keel dashboard`: the Streamlit app driven by AppTest on real run directories, and the server it starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
from conftest import keel
from streamlit.testing.v1 import AppTest

from keel.dashboard import run_data
from keel.dashboard.actions import ACTIONS_ENV, ActionRefused, inject_fault, start_drill
from keel.dashboard.launch import actions_state
from keel.dashboard.run_page import read_run
from keel.dashboard.runs_page import RUNS_ENV
from keel.dashboard.series import MARKER_KINDS, chart_titles
from keel.monitor.store import RunStore, read_appended, read_events, read_steps

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


@pytest.fixture
def runs_folder(reference_dir, tmp_path) -> Path:
    """A folder as a user has one: a real finished run, and a run directory whose store is damaged."""
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "tiny").symlink_to(reference_dir, target_is_directory=True)
    (folder / "broken").mkdir()
    (folder / "broken" / "run.sqlite").write_bytes(b"half-written" * 50)
    return folder


def test_runs_page_lists_the_runs_and_names_the_broken_one(runs_folder, monkeypatch):
    monkeypatch.setenv(RUNS_ENV, str(runs_folder))
    app = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not app.exception, app.exception
    table = app.dataframe[0].value.set_index("run id")
    [run_id] = [r for r in table.index if r != "broken"]
    assert table.loc[run_id, "status"] == "finished" and table.loc[run_id, "step"] == "20 / 20"
    assert table.loc[run_id, "layout"] == "pp1 dp1 tp1" and table.loc[run_id, "loss"] > 0
    assert table.loc["broken", "status"] == "unreadable"
    assert table.loc[run_id, "run"] == "run?run=tiny"  # a link to the Run page, by the folder's name
    assert any("broken" in w.value and "cannot read its run store" in w.value for w in app.warning)


def test_runs_page_with_no_runs_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNS_ENV, str(tmp_path))
    app = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not app.exception and "No runs found yet" in app.info[0].value


def _run_page(run_folder: Path, run: str, monkeypatch) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, str(run_folder))
    app = AppTest.from_string("from keel.dashboard.run_page import render_run\nrender_run()", default_timeout=60)
    app.query_params["run"] = run
    return app.run()


def _charts(app: AppTest) -> dict[str, dict[str, pd.DataFrame]]:
    """The page's charts by title (keel.dashboard.charts' panels), each as the data frames it draws, by name
    (a line chart's "lines", "rules" and "bands")."""
    charts = {}
    for element in app.get("bidi_component"):
        assert element.proto.component_name == "keel_chart"
        for panel in json.loads(element.proto.json)["panels"]:
            charts[panel["title"]] = {name: pd.DataFrame(columns) for name, columns in panel["frames"].items()}
    return charts


def _drawn_events(chart: dict[str, pd.DataFrame]) -> list[tuple[int, str]]:
    """(step, kind) of every event a line chart marks: each kind listed on a rule at its step, and each
    step a band spans for its kind (a band covers several events)."""
    drawn = [(step, kind) for step, kinds in zip(chart["rules"].step, chart["rules"].kinds) for kind in kinds]
    return drawn + [(step, band.kind) for band in chart["bands"].itertuples() for step in range(band.first, band.last + 1)]


def _assert_marks(chart: dict[str, pd.DataFrame], events: pd.DataFrame) -> None:
    """Every event is on the chart: on the rule at its step, or within a band of its kind; each step has
    one rule at most."""
    drawn = set(_drawn_events(chart))
    for event in events.itertuples():
        assert (event.step, MARKER_KINDS[event.kind]) in drawn, event
    assert chart["rules"].step.is_unique


def test_run_page_marks_every_event_and_draws_the_rolled_back_steps_apart(spike_run, monkeypatch):
    app = _run_page(spike_run.parent, "spike", monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    charts = _charts(app)
    kept = read_steps(spike_run, effective=True)
    titles = chart_titles()
    # A chart for every metric the run recorded, none for those it did not (no evaluation: no validation loss),
    # nor for the communication share of one process (always 0).
    assert {titles[m] for m in titles if kept[m].notna().any() and m != "comm_share"} == set(titles.values()) & set(charts)
    assert "validation loss" not in charts and "comm share (%)" not in charts
    events = read_events(spike_run)
    marked = events[events.kind.isin(MARKER_KINDS)]
    _assert_marks(charts["loss"], marked)
    assert {"confirmed spike", "rollback", "data skip", "checkpoint saved", "injected fault"} <= {
        k for _, k in _drawn_events(charts["loss"])
    }
    # The small charts mark the same events but the routine checkpoint saves.
    _assert_marks(charts["grad norm"], marked[marked.kind != "checkpoint_saved"])
    assert "checkpoint saved" not in {k for _, k in _drawn_events(charts["grad norm"])}
    # The abandoned segment is exactly what the rollback threw away: the steps after its checkpoint.
    lines = charts["loss"]["lines"]
    rollback = events[events.kind == "rollback"].iloc[0].data
    abandoned = lines[lines.segment != "effective"]
    assert set(abandoned.segment) == {"attempt 0"}
    assert sorted(abandoned.step) == list(range(rollback["to_step"] + 1, rollback["from_step"] + 1))
    effective = lines[lines.segment == "effective"].sort_values("step")
    assert effective.step.tolist() == kept.step.tolist() and effective.value.tolist() == kept.loss.tolist()


def test_run_page_lists_checkpoints_goodput_and_the_config(spike_run, monkeypatch):
    app = _run_page(spike_run.parent, "spike", monkeypatch)
    saved = read_events(spike_run).query("kind == 'checkpoint_saved'")
    table = app.dataframe[0].value.set_index("step")
    on_disk = {p.name for p in (spike_run / "checkpoints").iterdir()}
    assert sorted(table.index) == sorted(set(saved.step.astype(int)))
    for _, row in table.iterrows():  # every save still on disk is verified; the rest say so
        assert row.state == ("verified" if row.folder in on_disk else "removed"), row
        assert row.blocked_s > 0 and row.write_s >= row.blocked_s
    assert (table.MiB[table.state == "verified"] > 0).all()
    goodput = read_events(spike_run).query("kind == 'goodput'").iloc[-1].data
    bars = _charts(app)["where the time went (s)"]["bars"]
    assert dict(zip(bars["where"], bars.seconds))["recomputed"] == pytest.approx(goodput["lost_s"]["recomputed"], rel=1e-6)
    assert 'preset = "tiny"' in app.code[0].value and "interval_steps = 10" in app.code[0].value
    # One process measures no communication: said in words, not drawn as an empty heatmap.
    assert "communication time (s)" not in _charts(app)
    assert any(c.value.startswith("communication time (s): not measured") for c in app.caption)


def test_run_page_step_range_shows_every_step_of_it_and_stays_in_the_url(spike_run, monkeypatch):
    monkeypatch.setenv(RUNS_ENV, str(spike_run.parent))
    app = AppTest.from_string("from keel.dashboard.run_page import render_run\nrender_run()", default_timeout=60)
    app.query_params.update({"run": "spike", "steps": "25-35"})
    app.run()
    assert app.slider(key="steps").value == (25, 35)
    loss = _charts(app)["loss"]
    kept = read_steps(spike_run, effective=True)
    assert loss["lines"][loss["lines"].segment == "effective"].step.tolist() == kept.step[kept.step.between(25, 35)].tolist()
    assert all(25 <= step <= 35 for step, _ in _drawn_events(loss))
    app.slider(key="steps").set_range(30, 60).run()  # the user widens it to the newest step
    assert app.query_params["steps"] == "30-60"


def test_run_page_refuses_a_crafted_run_name(spike_run, monkeypatch):
    app = _run_page(spike_run.parent, "../../etc", monkeypatch)
    assert not app.exception
    assert "No run named '../../etc'" in app.error[0].value
    assert app.selectbox[0].value == "spike"  # the page shows a run that was found, nothing else


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_keel_dashboard_serves_on_loopback(runs_folder):
    port = _free_port()
    cmd = [sys.executable, "-m", "keel.cli", "dashboard", str(runs_folder), f"--port={port}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as server:
        try:
            health, deadline = None, time.time() + 90
            while health is None and time.time() < deadline and server.poll() is None:
                try:
                    health = urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read()
                except OSError:
                    time.sleep(0.5)
            assert health == b"ok", "the dashboard did not answer on 127.0.0.1"
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            assert "<html" in page.lower()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            output = server.communicate(timeout=30)[0]
    assert f"http://127.0.0.1:{port}/" in output


def test_bad_folder_is_one_line_error(tmp_path):
    proc = keel("dashboard", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "is not a folder" in proc.stderr


def _events_page(run_folder: Path, params: dict[str, list[str]], monkeypatch) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, str(run_folder))
    app = AppTest.from_string("from keel.dashboard.events_page import render_events\nrender_events()", default_timeout=60)
    app.query_params.update(params)
    return app.run()


def test_events_page_lists_every_event_and_filters_from_the_url(spike_run, monkeypatch):
    events = read_events(spike_run)
    app = _events_page(spike_run.parent, {"run": ["spike"]}, monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    table = app.dataframe[0].value
    assert len(table) == len(events) and list(table.kind) == list(events.kind[::-1])  # newest first
    critical = _events_page(spike_run.parent, {"run": ["spike"], "severity": ["critical"], "kind": ["alert", "rollback"]}, monkeypatch)
    shown = critical.dataframe[0].value
    expected = events[(events.severity == "critical") & events.kind.isin(["alert", "rollback"])]
    assert len(shown) == len(expected) > 0 and set(shown.kind) == {"alert", "rollback"}
    assert critical.multiselect[1].value == ["critical"]  # the filter the URL asked for is the one shown


def test_run_page_of_a_hang_and_restart_marks_both_and_covers_every_rank(drill_runs, monkeypatch):
    app = _run_page(drill_runs, "hang", monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    charts = _charts(app)
    events = read_events(drill_runs / "hang")
    [hang] = events[events.kind == "hang"].step
    # The restart is marked where the hang it recovered from happened, not where the run resumed (before it).
    rule = charts["loss"]["rules"].set_index("step").loc[hang]
    assert rule.kinds.index("hang") < rule.kinds.index("restart") and "resuming at step" in rule.text
    marked = events[events.kind.isin(MARKER_KINDS) & (events.kind != "restart")]
    _assert_marks(charts["loss"], marked)
    cells = charts["step time (s)"]["cells"]
    assert sorted(set(cells["rank"])) == list(range(8))
    # Every rank, on every step whose per-rank rows were kept (the sampled ones, every attempt's).
    sampled = read_steps(drill_runs / "hang").comm_share_max.notna().sum()
    assert sampled >= 2
    for _, rows in cells.groupby("rank"):
        assert rows.rows.sum() == sampled
    memory = charts["peak GiB by rank"]["bars"]
    assert sorted(memory["rank"]) == list(range(8)) and (memory.GiB > 0).all()


def test_run_page_rings_the_straggler_the_detector_named(drill_runs, monkeypatch):
    app = _run_page(drill_runs, "late_collective", monkeypatch)
    named = read_events(drill_runs / "late_collective").query("kind == 'straggler'")
    assert 7 in set(named["rank"])  # the slow rank; a busy machine can get others named too
    charts = _charts(app)
    rings = charts["communication time (s)"]["rings"]
    assert sorted(zip(rings.step, rings["rank"])) == sorted(zip(named.step.astype(int), named["rank"].astype(int)))
    # From the step rows alone: how often each rank was among a measured step's slowest, the late rank
    # on every measured step once it was late (it waits before each of its collectives: its own time).
    slowest = charts["steps among the slowest"]["bars"]
    steps = read_steps(drill_runs / "late_collective", effective=True)
    named_first = steps.slowest_ranks.dropna().str.split(",").explode().value_counts()
    assert dict(zip(slowest["rank"], slowest.steps)) == {r: n for r, n in named_first.items() if r in set(slowest["rank"])}
    began = read_events(drill_runs / "late_collective").query("kind == 'fault_injected'").step.min()
    late = steps[(steps.step >= began) & steps.slowest_ranks.notna()]
    assert len(late) >= 3 and (late.slowest_ranks.str.split(",").str[0] == "7").all(), late.slowest_ranks.tolist()
    assert dict(zip(slowest["rank"], slowest.steps))["7"] >= len(late)


def _page(render: str, runs_env: Path, monkeypatch, params: dict | None = None, actions: bool = False) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, str(runs_env))
    monkeypatch.setenv(ACTIONS_ENV, "1" if actions else "0")
    module = {"render_drills": "drills_page", "render_compare": "compare_page"}[render]
    app = AppTest.from_string(f"from keel.dashboard.{module} import {render}\n{render}()", default_timeout=60)
    app.query_params.update(params or {})
    return app.run()


def test_drills_page_shows_the_verdicts_and_the_plot(collective_drill, monkeypatch):
    _, report, folder, _ = collective_drill
    app = _page("render_drills", folder.parents[1], monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    listed = app.dataframe[0].value
    assert listed.drill.tolist() == [f"job/{folder.name}"] and listed.result.tolist() == ["PASS"]
    verdicts = app.dataframe[1].value.set_index("drill")
    assert list(verdicts.index) == ["hang", "crash", "late_collective"]
    for r in report["results"]:
        row = verdicts.loc[r["name"]]
        assert row["detected by"] == r["detected_by"] and row["steps lost"] == r["steps_lost"]
        assert row["detection (s)"] == pytest.approx(r["detection_latency_s"])
    assert len(app.get("image")) == 1
    assert not [b for b in app.button if "drill" in b.label.lower()]  # actions off: no form
    assert "Actions are off" in app.caption[-1].value


def test_drills_page_refuses_a_crafted_drill_name(collective_drill, monkeypatch):
    app = _page("render_drills", collective_drill[2].parents[1], monkeypatch, {"drill": ["../../etc/passwd"]})
    assert "No drill named '../../etc/passwd'" in app.error[0].value
    assert app.selectbox[0].value == f"job/{collective_drill[2].name}"


def test_actions_are_off_read_only_and_on_a_non_loopback_bind():
    assert actions_state("127.0.0.1", read_only=False, allow_actions=False)[0]
    assert actions_state("::1", read_only=False, allow_actions=False)[0]
    assert actions_state("localhost", read_only=False, allow_actions=False)[0]
    assert not actions_state("127.0.0.1", read_only=True, allow_actions=True)[0]
    on, why = actions_state("0.0.0.0", read_only=False, allow_actions=False)
    assert not on and "--allow-actions" in why
    assert not actions_state("dashboard.example.com", read_only=False, allow_actions=False)[0]
    assert actions_state("0.0.0.0", read_only=False, allow_actions=True)[0]


def test_actions_refuse_when_off_and_names_that_leave_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(ACTIONS_ENV, "0")
    with pytest.raises(ActionRefused, match="actions are off"):
        start_drill(tmp_path, "job", "tiny", (1, 1, 1), "nan")
    with pytest.raises(ActionRefused, match="actions are off"):
        inject_fault(tmp_path, "nan", None)
    monkeypatch.setenv(ACTIONS_ENV, "1")
    for name in ("../escape", "a/b", "", ".hidden", "x" * 65):
        with pytest.raises(ActionRefused, match="run name"):
            start_drill(tmp_path / "runs", name, "tiny", (1, 1, 1), "nan")
    with pytest.raises(ActionRefused, match="config"):
        start_drill(tmp_path / "runs", "job", "; rm -rf /", (1, 1, 1), "nan")
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []


def test_drill_form_starts_keel_drill_and_shows_its_output(tmp_path, monkeypatch):
    app = _page("render_drills", tmp_path, monkeypatch, actions=True)
    assert "No drill yet" in app.info[0].value
    app.text_input[0].input("job")
    app.text_input[1].input("no-such-preset")  # keel drill checks the job and stops at once
    app.button[0].click().run()
    deadline = time.time() + 60
    while "ended with exit code 2" not in " ".join(m.value for m in app.markdown) and time.time() < deadline:
        time.sleep(1)
        app.run()
    assert "**Drill on `job`**: ended with exit code 2" in [m.value for m in app.markdown]
    output = app.code[-1].value
    assert "no-such-preset" in output and len(output.strip().splitlines()) == 1, output


def test_compare_page_overlays_runs_by_tokens(spike_run, reference_dir, tmp_path, monkeypatch):
    (tmp_path / "spike").symlink_to(spike_run, target_is_directory=True)
    (tmp_path / "tiny").symlink_to(reference_dir, target_is_directory=True)
    params = {"run": ["spike", "tiny", "../../etc"], "x": ["tokens"], "metric": ["grad_norm"]}
    app = _page("render_compare", tmp_path, monkeypatch, params)
    assert not app.exception and "No run named '../../etc'" in app.error[0].value
    series = _charts(app)["grad norm by tokens trained on"]["lines"]
    assert set(series.run) == {"spike", "tiny"}
    for name, run_dir in (("spike", spike_run), ("tiny", reference_dir)):
        kept = read_steps(run_dir, effective=True)
        shown = series[series.run == name].sort_values("x")
        # The store's tokens are already the running total (step x the global batch's tokens): drawn as they
        # are, one point a step (under 1,000 steps), not summed again.
        per_step = kept.tokens.iloc[0] // kept.step.iloc[0]
        assert shown.x.tolist() == (kept.step * per_step).astype(float).tolist() == kept.tokens.astype(float).tolist()
        assert shown.value.tolist() == kept.grad_norm.tolist()


def test_run_page_reads_a_store_again_when_it_changes_and_not_before(tmp_path, monkeypatch):
    run_dir = tmp_path / "growing"
    with RunStore(run_dir) as store:
        for step in (1, 2, 3):
            store.write_step({"step": step, "attempt": 0, "loss": 4.0 - step / 10, "time": 1.7e9 + step})
    app = _run_page(tmp_path, "growing", monkeypatch)
    assert app.caption[0].value.startswith("Steps 1 to 3:")
    read_run.clear()  # the cache is per process: count the reads of the next two refreshes
    with RunStore(run_dir) as store:
        store.write_step({"step": 4, "attempt": 0, "loss": 3.5, "time": 1.7e9 + 4})
    reads = []  # the step rows each read of the store gave
    monkeypatch.setattr(run_data, "read_appended", lambda d, since: reads.append(len((new := read_appended(d, since)).steps)) or new)
    app.run()
    assert app.caption[0].value.startswith("Steps 1 to 4:") and reads == [1]  # only the step written since
    app.run()  # nothing written since: served from the cache
    assert app.caption[0].value.startswith("Steps 1 to 4:") and reads == [1]
