"""`keel dashboard`: the Streamlit app driven by AppTest on real run directories, and the server it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from conftest import keel, train
from streamlit.testing.v1 import AppTest

from keel.dashboard.runs_page import RUNS_ENV
from keel.dashboard.series import MARKER_KINDS, METRICS
from keel.monitor.store import read_events, read_steps

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
    table = app.dataframe[0].value.set_index("run")
    [run_id] = [r for r in table.index if r != "broken"]
    assert table.loc[run_id, "status"] == "finished" and table.loc[run_id, "step"] == "20 / 20"
    assert table.loc[run_id, "layout"] == "pp1 dp1 tp1" and table.loc[run_id, "loss"] > 0
    assert table.loc["broken", "status"] == "unreadable"
    assert any("broken" in w.value and "cannot read its run store" in w.value for w in app.warning)


def test_runs_page_with_no_runs_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNS_ENV, str(tmp_path))
    app = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not app.exception and "No runs found yet" in app.info[0].value


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory) -> Path:
    """A real run with checkpoints, a loss spike from bad data, the rollback and the data skip."""
    run_dir = tmp_path_factory.mktemp("dashboard") / "spike"
    train(run_dir, "--config=tiny", "--pp=1", "--dp=1", "--tp=1", "--steps=60", "--checkpoint.interval_steps=10",
          "--spike.warmup_steps=12", "--spike.min_baseline=8", "--fault=spike@step=30,steps=3")  # fmt: skip
    assert (read_events(run_dir).kind == "rollback").sum() == 1
    return run_dir


def _run_page(run_folder: Path, run: str, monkeypatch) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, str(run_folder))
    app = AppTest.from_string("from keel.dashboard.run_page import render_run\nrender_run()", default_timeout=60)
    app.query_params["run"] = run
    return app.run()


def _chart_frames(chart) -> list[pd.DataFrame]:
    return [pa.ipc.open_stream(d.data.data).read_pandas() for d in chart.proto.datasets]


def test_run_page_marks_every_event_and_draws_the_rolled_back_steps_apart(spike_run, monkeypatch):
    app = _run_page(spike_run.parent, "spike", monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    charts = app.get("vega_lite_chart")
    assert len(charts) == len(METRICS)
    markers, lines = sorted(_chart_frames(charts[0]), key=lambda f: "segment" in f.columns)  # the loss chart
    events = read_events(spike_run)
    marked = events[events.kind.isin(MARKER_KINDS)]
    assert sorted(markers.step) == sorted(marked.step.astype(int))
    assert {"confirmed spike", "rollback", "data skip", "checkpoint saved", "injected fault"} <= set(markers.kind)
    # The abandoned segment is exactly what the rollback threw away: the steps after its checkpoint.
    rollback = events[events.kind == "rollback"].iloc[0].data
    abandoned = lines[lines.segment != "effective"]
    assert set(abandoned.segment) == {"attempt 0"}
    assert sorted(abandoned.step) == list(range(rollback["to_step"] + 1, rollback["from_step"] + 1))
    kept = read_steps(spike_run, effective=True)
    effective = lines[lines.segment == "effective"].sort_values("step")
    assert effective.step.tolist() == kept.step.tolist() and effective.value.tolist() == kept.loss.tolist()


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
