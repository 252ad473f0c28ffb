"""The Events page's links to the Run page and its hangs with their stack dumps (keel.dashboard.events_page,
keel.monitor.dumps), on a run store written through RunStore and dumps the watchdog itself wrote: two
gloo ranks, one stopped outside any collective, the other waiting for it in an all-reduce."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.parse
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from keel.dashboard.events_page import LINK
from keel.dashboard.run_page import RANGE_KEY
from keel.dashboard.runs_page import RUNS_ENV
from keel.monitor.dumps import DUMP_TAIL_BYTES, hang_dumps, stopped_outside_collectives
from keel.monitor.store import RunStore, read_events

RUN = "hang #2"  # a folder name a URL must quote
HANG_STEP, LAST_STEP = 40, 60

# Rank 0 waits in an all-reduce that rank 1 never joins; each rank's watchdog writes its dump, and rank 0
# records the hang as the trainer does (its Incidents). Rank 1 is allowed longer: its exit would end rank
# 0's all-reduce with an error before rank 0's watchdog fired.
_RANK = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from keel.trainer.config import WatchdogConfig
    from keel.trainer.watchdog import Watchdog

    run_dir, rendezvous, rank, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    on_hang = None
    if rank == 0:
        from keel.monitor.recorder import RunRecorder
        from keel.monitor.store import RunStore
        from keel.trainer.incidents import Incidents
        on_hang = Incidents(RunRecorder("hang-test", RunStore(run_dir), []), "hang-test").hang
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)  # both beat together after it
    dog = Watchdog(WatchdogConfig(startup_s=1 + 3 * rank, poll_s=0.5), run_dir, rank, on_hang)

    def load_the_next_batch():
        time.sleep(60)

    dog.beat("step", step, attempt=0)
    dist.all_reduce(torch.ones(1)) if rank == 0 else load_the_next_batch()
""")


def _hang(run_dir: Path, rendezvous: Path, step: int) -> None:
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(run_dir), str(rendezvous), str(r), str(step)]) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in ranks] == [3, 3]  # EXIT_HANG, after each rank's dump
    assert sorted(p.name for p in (run_dir / "dumps").glob("hang-*")) == [f"hang-attempt0-step{step}-rank{r}.txt" for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder holding one run: steps 1-39, a checkpoint at 35, a hang at step 40 (rank 1), the restart from
    35 and steps to 60; and a note of no step."""
    folder = tmp_path_factory.mktemp("runs")
    run_dir = folder / RUN
    with RunStore(run_dir) as store:
        store.write_event("run_started", "2 processes", step=0, attempt=0, rank=0)
        for step in range(1, HANG_STEP):
            store.write_step({"step": step, "attempt": 0, "loss": 4.0 - step / 100, "time": 1.7e9 + step})
        store.write_event("checkpoint_saved", "step-00000035", step=35, attempt=0)
        store.write_event("note", "a note of no step")
    _hang(run_dir, folder / "rendezvous", HANG_STEP)
    with RunStore(run_dir) as store:
        store.write_event("restart", "restarted from step 35", step=35, attempt=1, rank=1)
        for step in range(36, LAST_STEP + 1):
            store.write_step({"step": step, "attempt": 1, "loss": 4.0 - step / 100, "time": 1.8e9 + step})
    return folder


def _page(render: str, folder: Path, params: dict[str, str | list[str]], monkeypatch) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, str(folder))
    module = {"render_events": "events_page", "render_run": "run_page"}[render]
    app = AppTest.from_string(f"from keel.dashboard.{module} import {render}\n{render}()", default_timeout=60)
    app.query_params.update(params)
    app.run()
    assert not app.exception and not app.error, (app.exception, app.error)
    return app


def _hang_event(run_dir: Path):
    return read_events(run_dir).query("kind == 'hang'").iloc[0]


def test_every_event_with_a_step_links_to_its_steps_on_the_run_page(runs, monkeypatch):
    app = _page("render_events", runs, {"run": RUN}, monkeypatch)
    table = app.dataframe[0].value
    links = dict(zip(table.kind, table[LINK]))
    quoted = urllib.parse.quote(RUN, safe="")
    assert links["hang"] == f"run?run={quoted}&steps={HANG_STEP - 25}-{HANG_STEP + 25}"
    assert links["run_started"] == f"run?run={quoted}&steps=1-25"  # step 0: from step 1
    assert links["note"] == ""  # no step, no link
    assert not table.isna().any().any() and not table.isin(["None", "<NA>", "nan"]).any().any()
    [link] = [c for c in json.loads(app.dataframe[0].proto.columns).values() if c.get("type_config", {}).get("type") == "link"]
    assert link["type_config"]["display_text"] == r"steps=(\d+-\d+)"
    # The link, opened: the Run page of that run, its slider on that range (the end clamped to the last step).
    path, _, query = links["hang"].partition("?")
    run_page = _page("render_run", runs, {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}, monkeypatch)
    assert path == "run" and run_page.selectbox[0].value == app.selectbox[0].value == RUN  # the chooser's name for it
    assert run_page.slider(key=RANGE_KEY).value == (HANG_STEP - 25, LAST_STEP)


def test_a_hang_names_the_rank_that_stopped_and_shows_its_stacks(runs, monkeypatch):
    app = _page("render_events", runs, {"run": RUN}, monkeypatch)
    assert [h.value for h in app.subheader] == ["Hangs"]
    text = " ".join(m.value for m in app.markdown)
    assert f"Step {HANG_STEP}, attempt 0" in text and "phase `step`" in text and "reported by rank 0" in text
    assert "Hung: rank 1**" in text  # the event names rank 0, which recorded it; rank 1's stack is the stuck one
    hung, other = app.expander
    assert hung.label == f"rank 1 (hung): hang-attempt0-step{HANG_STEP}-rank1.txt" and hung.proto.expanded
    assert other.label == f"rank 0: hang-attempt0-step{HANG_STEP}-rank0.txt" and not other.proto.expanded
    assert "load_the_next_batch" in hung.code[0].value and "all_reduce" in other.code[0].value
    # The filtered view's hangs only: none when the filter leaves hangs out.
    filtered = _page("render_events", runs, {"run": RUN, "kind": ["checkpoint_saved"]}, monkeypatch)
    assert not filtered.subheader and not filtered.expander


def test_the_dumps_of_a_hang_come_stuck_rank_first(runs):
    run_dir = runs / RUN
    dumps = hang_dumps(run_dir, _hang_event(run_dir))
    assert [(d.rank, d.stuck, d.note) for d in dumps] == [(1, True, ""), (0, False, "")]
    assert stopped_outside_collectives(dumps[0].text) and not stopped_outside_collectives(dumps[1].text)
    assert "rank 1 made no progress" in dumps[0].text


def _copy(run_dir: Path, to: Path) -> Path:
    (to / "dumps").mkdir(parents=True)
    for path in (run_dir / "dumps").glob("hang-*.txt"):
        (to / "dumps" / path.name).write_bytes(path.read_bytes())
    return to


def test_a_recorded_path_outside_the_dumps_folder_is_refused(runs, tmp_path):
    event = _hang_event(runs / RUN)
    run_dir = _copy(runs / RUN, tmp_path / "run")
    for crafted in ("/etc/passwd", "/etc/hang-attempt0-step40-rank0.txt", "dumps/../../hang-attempt0-step40-rank0.txt"):
        dumps = hang_dumps(run_dir, {**event, "data": {**event.data, "dump": crafted}})
        [refused] = [d for d in dumps if d.name == crafted]
        assert refused.note.startswith("refused:") and refused.text == ""
        assert [d.rank for d in dumps if d.text] == [1, 0]  # the attempt's own dumps are still read
    # A dump that is a link out of the folder is not followed.
    outside = tmp_path / "secret.txt"
    outside.write_text("not a dump")
    stuck = run_dir / "dumps" / "hang-attempt0-step40-rank1.txt"
    stuck.unlink()
    stuck.symlink_to(outside)
    [linked] = [d for d in hang_dumps(run_dir, event) if d.rank == 1]
    assert linked.note.startswith("refused:") and linked.text == "" and not linked.stuck


def test_a_missing_dump_is_a_note_and_a_long_one_is_cut_to_its_end(runs, tmp_path):
    event = _hang_event(runs / RUN)
    run_dir = _copy(runs / RUN, tmp_path / "run")
    (run_dir / "dumps" / f"hang-attempt0-step{HANG_STEP}-rank0.txt").unlink()  # the dump the event names
    [stuck, gone] = hang_dumps(run_dir, event)
    assert gone.rank == 0 and gone.text == "" and "is not there" in gone.note and "\n" not in gone.note
    stuck_path = run_dir / "dumps" / stuck.name
    stuck_path.write_text("x" * (2 * DUMP_TAIL_BYTES) + "\n" + stuck_path.read_text())
    [long, _] = hang_dumps(run_dir, event)
    assert long.stuck and len(long.text.encode()) < DUMP_TAIL_BYTES and "load_the_next_batch" in long.text
    assert long.note == f"the last {len(long.text.encode()) // 1024} KiB of {stuck_path.stat().st_size // 1024} KiB"
    assert hang_dumps(tmp_path / "nowhere", {"attempt": 0, "data": {}}) == []


def test_the_page_shows_the_notes_of_a_refused_and_a_missing_dump(tmp_path, monkeypatch):
    with RunStore(tmp_path / "crafted") as store:
        store.write_step({"step": 1, "attempt": 0, "loss": 4.0, "time": 1.7e9})
        data = {"rank": 0, "step": 1, "attempt": 0, "phase": "step", "stalled_s": 12.0, "timeout_s": 10.0, "dump": "/etc/passwd"}
        store.write_event("hang", "hang at step 1", severity="critical", step=1, attempt=0, data=data)
        store.write_event("hang", "hang at step 1", severity="critical", step=1, attempt=1, data={**data, "attempt": 1,
                          "dump": str(tmp_path / "crafted" / "dumps" / "hang-attempt1-step1-rank0.txt")})  # fmt: skip
    app = _page("render_events", tmp_path, {"run": "crafted"}, monkeypatch)
    missing, refused = app.expander  # newest first
    assert refused.label == "rank 0: /etc/passwd" and refused.caption[0].value.startswith("refused:") and not refused.code
    assert "is not there" in missing.caption[0].value and not missing.code
    assert "root:" not in str([e.proto for e in app.expander])
    assert "No stack dump of this attempt" in " ".join(m.value for m in app.markdown)


@pytest.mark.slow
def test_the_hang_of_a_pp2_dp2_tp2_drill_names_rank_7(collective_drill, tmp_path, monkeypatch):
    """The real thing: eight ranks, a hang injected on rank 7 before the step's first collective."""
    (tmp_path / "hang").symlink_to(collective_drill[2] / "runs" / "hang", target_is_directory=True)
    app = _page("render_events", tmp_path, {"run": "hang", "kind": ["hang"]}, monkeypatch)
    [hang] = read_events(tmp_path / "hang").query("kind == 'hang'").itertuples()
    assert app.dataframe[0].value[LINK].tolist() == [f"run?run=hang&steps={max(1, hang.step - 25)}-{hang.step + 25}"]
    assert "Hung: rank 7**" in " ".join(m.value for m in app.markdown)
    assert len(app.expander) == 8 and app.expander[0].label.startswith("rank 7 (hung)")
    assert "at_step_start" in app.expander[0].code[0].value
