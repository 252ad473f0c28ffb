"""What the Runs page tells of a run, and what it links to: a trainer killed with SIGKILL is `killed` once
its run lock is free (before, it showed as running for two minutes), the lock is probed without being
taken, the goodput is the same figure on the Runs and the Run page, a busy port is one line before any
URL, runs of the same name in two folders get names and links of their own, and no cell reads "None"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pandas as pd
import pytest
from conftest import keel
from streamlit.testing.v1 import AppTest

from keel.dashboard.run_data import RunReader
from keel.dashboard.runs_page import RUNS_ENV, run_names
from keel.monitor import run_lock
from keel.monitor.goodput import CAUSES, Goodput, compute_goodput
from keel.monitor.run_dir import LOCK_FILE
from keel.monitor.run_lock import lock_held, own
from keel.monitor.runs import KILLED_AFTER_S, summarize_run
from keel.monitor.store import RunStore, read_events, read_meta, read_steps, step_bounds

RUNS_PAGE = "from keel.dashboard.runs_page import render_runs\nrender_runs()"
STEP_TIME = 0.5

# A trainer as the Runs page sees one: rank 0 takes the run's lock (own), writes its store, and trains on.
TRAINER = f"""
import sys, time
from keel.monitor.run_lock import own
from keel.monitor.store import RunStore
lock = own(sys.argv[1])
with RunStore(sys.argv[1]) as store:
    store.set_meta("config", {{"training": {{"steps": 100}}}})
    store.write_event("run_started", "1 process", step=0, attempt=0, rank=0)
    for step in (1, 2):
        store.write_step({{"step": step, "attempt": 0, "time": time.time(), "loss": 5.0, "tokens_per_s": 1e3, "step_time_s": {STEP_TIME}}})
print("training", flush=True)
time.sleep(600)
"""

# Takes and lets go of the run's lock again and again, as trainers starting one after another would; prints
# how many times it was refused.
OWNER_LOOP = """
import sys
from keel.monitor.run_lock import RunDirBusy, own
print("ready", flush=True)
refused = 0
for _ in range(int(sys.argv[2])):
    try:
        own(sys.argv[1]).close()
    except RunDirBusy:
        refused += 1
print(refused, flush=True)
"""


def write_run(run_dir: Path, run_id: str, steps: int = 10, config: dict | None = None, comm_share: float | None = 0.2) -> None:
    """A run store as a trainer leaves it, without its lock: `steps` steps ending now, then `run_finished`."""
    start = time.time() - steps * STEP_TIME
    with RunStore(run_dir) as store:
        store.set_meta("run_id", run_id)
        if config is not None:
            store.set_meta("config", config)
        store.write_event("run_started", "1 process", step=0, attempt=0, rank=0, data={"process_start": start - 2})
        for s in range(1, steps + 1):
            store.write_step({"step": s, "attempt": 0, "time": start + s * STEP_TIME, "loss": 4.0, "tokens_per_s": 1e3, "mfu": 0.1,
                              "comm_share": comm_share, "step_time_s": STEP_TIME})  # fmt: skip
        store.write_event("run_finished", f"{steps} steps", step=steps, attempt=0, rank=0)


def start_trainer(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "training"
    return proc


def test_a_trainer_killed_with_sigkill_is_killed_once_its_lock_is_free(tmp_path):
    run_dir = tmp_path / "run"
    trainer = start_trainer(run_dir)
    try:
        last = summarize_run(run_dir)["last_seen"]
        # Alive: running, even quiet for longer than a restart takes, with its ETA; silent far longer than
        # any phase may take, hung (a live process the watchdog could not end).
        for now in (None, last + KILLED_AFTER_S + 60):
            row = summarize_run(run_dir, now)
            assert (row["status"], row["eta_s"]) == ("running", 98 * STEP_TIME), row
        assert summarize_run(run_dir, last + 3600)["status"] == "hung"
    finally:
        trainer.kill()
        trainer.wait()
    assert lock_held(run_dir) is False
    assert summarize_run(run_dir, last + KILLED_AFTER_S / 2)["status"] == "running"  # torchrun may be restarting it
    row = summarize_run(run_dir, last + KILLED_AFTER_S + 1)
    assert (row["status"], row["eta_s"]) == ("killed", None)
    with RunStore(run_dir) as store:
        store.write_event("run_finished", "100 steps", step=100, attempt=0, rank=0)
    assert summarize_run(run_dir, last + 3600)["status"] == "finished"


def test_lock_held_says_held_free_or_cannot_tell(tmp_path, monkeypatch):
    assert lock_held(tmp_path) is None  # no lock file: a run from before the lock, or not a trainer's
    handle = own(tmp_path)
    assert lock_held(tmp_path) is True
    handle.close()
    assert lock_held(tmp_path) is False
    # A holder on another host (a shared filesystem): its lock is not in this kernel's table.
    (tmp_path / LOCK_FILE).write_text('{"host": "another-node", "pid": 1, "since": 0}')
    assert lock_held(tmp_path) is None
    # Without /proc/locks, the holder's record: its pid, alive or not, when it ran on this host.
    monkeypatch.setattr(run_lock, "PROC_LOCKS", str(tmp_path / "no-such-table"))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    for pid, held in ((os.getpid(), True), (int(ended.stdout), False)):
        (tmp_path / LOCK_FILE).write_text(f'{{"host": "{socket.gethostname()}", "pid": {pid}, "since": 0}}')
        assert lock_held(tmp_path) is held


def test_probing_the_lock_never_refuses_a_trainer_taking_it(tmp_path):
    own(tmp_path).close()
    owner = subprocess.Popen([sys.executable, "-c", OWNER_LOOP, str(tmp_path), "500"], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "ready"
    answers = []

    def probe() -> None:
        while owner.poll() is None:
            answers.append(lock_held(tmp_path))

    prober = threading.Thread(target=probe)
    prober.start()
    refused = owner.stdout.read().strip()
    prober.join()
    assert owner.wait() == 0 and refused == "0", f"{refused} of 500 own() refused while lock_held probed"
    assert {True, False} <= set(answers)  # it probed while the lock was held and while it was free


def test_goodput_is_the_recorded_figure_on_both_pages_until_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, "run", steps=20)
    recorded = compute_goodput(read_steps(run_dir), read_events(run_dir))
    with RunStore(run_dir) as store:  # as the trainer ends: the figure, then the records written after it
        store.set_meta("goodput", recorded.to_dict())
        store.write_event("goodput", recorded.summary(), step=20, attempt=0, rank=0, data=recorded.to_dict())
        time.sleep(0.1)  # the sinks closing
        store.write_event("sinks_closed", "sinks closed", step=20, attempt=0, rank=0)
    reader = RunReader(str(run_dir), heatmap_bins=8)
    shown = reader.read(step_bounds(run_dir)).goodput
    assert shown == recorded and summarize_run(run_dir)["goodput"] == recorded.goodput
    # Resumed: the record is of the run as it was; both pages compute it anew, alike.
    with RunStore(run_dir) as store:
        store.write_event("run_started", "1 process", step=20, attempt=1, rank=0, data={"process_start": time.time()})
        store.write_step({"step": 21, "attempt": 1, "time": time.time() + 1, "loss": 4.0, "step_time_s": STEP_TIME})
    shown = reader.read(step_bounds(run_dir)).goodput
    assert shown != recorded and shown == compute_goodput(read_steps(run_dir), read_events(run_dir))
    assert summarize_run(run_dir)["goodput"] == shown.goodput


@pytest.mark.slow
def test_a_run_with_a_rollback_shows_one_goodput_on_the_runs_and_run_pages(spike_run):
    recorded = Goodput(**{k: v for k, v in read_meta(spike_run)["goodput"].items() if k != "goodput"})
    shown = RunReader(str(spike_run), heatmap_bins=120).read(step_bounds(spike_run)).goodput
    assert summarize_run(spike_run)["goodput"] == shown.goodput == recorded.goodput
    assert shown.wall_s == recorded.wall_s and set(shown.lost_s) == set(CAUSES)


def test_a_busy_port_is_one_line_naming_port_before_any_url(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = keel("dashboard", str(tmp_path), "--port", str(port), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"keel dashboard: error: --port={port}: ") and "in use" in line, line
    assert "http://" not in proc.stdout


def test_runs_of_the_same_name_in_two_folders_get_names_and_links_of_their_own(tmp_path, monkeypatch):
    a, b, c = tmp_path / "A" / "exp", tmp_path / "B" / "exp", tmp_path / "A" / "solo"
    for run_dir, run_id in ((a, "exp-a"), (b, "exp-b"), (c, "solo")):
        write_run(run_dir, run_id)
    folders = [tmp_path / "A", tmp_path / "B"]
    names = run_names(folders)
    assert names == {"A/exp": a, "B/exp": b, "solo": c}
    monkeypatch.setenv(RUNS_ENV, os.pathsep.join(map(str, folders)))
    app = AppTest.from_string(RUNS_PAGE, default_timeout=60).run()
    assert not app.exception, app.exception
    links = app.dataframe[0].value.set_index("run id")["run"]
    assert links.is_unique
    opened = {run_id: names[urllib.parse.unquote(link.partition("run?run=")[2])] for run_id, link in links.items()}
    assert opened == {"exp-a": a, "exp-b": b, "solo": c}


def test_run_names_fall_back_to_the_whole_path_when_parents_clash_too(tmp_path):
    runs = [tmp_path / "A" / "x" / "exp", tmp_path / "B" / "x" / "exp", tmp_path / "B" / "y" / "other"]
    for run_dir in runs:
        write_run(run_dir, run_dir.name)
    assert run_names([tmp_path]) == {str(runs[0]): runs[0], str(runs[1]): runs[1], "other": runs[2]}


def test_the_runs_table_shows_how_each_run_goes_first_and_its_names_last(tmp_path, monkeypatch):
    """At 800 px the first 11 columns are in view, through `alerts` (766 px of 1,266 in Chromium, a run of
    100,000 steps among them); the layout, run id and problem that find a run come last, where they took
    places among the first six."""
    write_run(tmp_path / "a", "a")
    monkeypatch.setenv(RUNS_ENV, str(tmp_path))
    app = AppTest.from_string(RUNS_PAGE, default_timeout=60).run()
    shown = list(app.dataframe[0].value.columns)
    assert shown == ["run", "status", "step", "loss", "tok/s", "MFU", "comm", "goodput", "rollbacks", "restarts", "alerts",
                     "layout", "run id", "problem"]  # fmt: skip


def test_no_cell_of_the_runs_table_reads_none(tmp_path, monkeypatch):
    write_run(tmp_path / "single", "single", config={"parallel": {"pp": 1, "dp": 1, "tp": 1}}, comm_share=None)
    write_run(tmp_path / "loop", "loop")  # a user's own loop: no layout
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.sqlite").write_bytes(b"not a database" * 50)
    monkeypatch.setenv(RUNS_ENV, str(tmp_path))
    app = AppTest.from_string(RUNS_PAGE, default_timeout=60).run()
    assert not app.exception, app.exception
    table = app.dataframe[0]
    assert table.value.isna().any().any()  # the missing values are there, shown as the placeholder
    # What the browser draws: a missing value as the placeholder, or as "None" without one.
    missing = table.proto.placeholder if table.proto.HasField("placeholder") else "None"
    shown = table.value.map(lambda v: missing if pd.isna(v) else str(v))
    assert not shown.isin(["None", "nan", "NaN", "<NA>"]).any().any(), shown.to_string()
    assert "None" not in "".join(shown.to_numpy().ravel())
