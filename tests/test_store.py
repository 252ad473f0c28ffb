"""What the trainer, dashboard, drills and `keel metrics` rely on from keel.monitor.store."""

from __future__ import annotations

import io
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from keel.monitor import metrics_cli
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import (
    RANK_COLUMNS,
    RunStore,
    abandoned_mask,
    read_attempt_starts,
    read_events,
    read_meta,
    read_rank_bins,
    read_rank_steps,
    read_steps,
    step_columns,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def full_step(step: int, attempt: int = 0, **values) -> dict:
    row = {
        "step": step,
        "attempt": attempt,
        "time": 1_700_000_000.0 + step,
        "loss": 4.0 / step,
        "grad_norm": 1.5,
        "lr": 3e-4,
        "tokens": 4096,
        "tokens_per_s": 12345.5,
        "mfu": 0.41,
        "comm_share": 0.125,
        "comm_share_max": 0.2,
        "step_time_s": 0.25,
        "step_time_median_s": 0.24,
        "step_time_min_s": 0.23,
        "slowest_ranks": "1,0",
        "data_time_s": 0.01,
        "mem_peak_bytes": 3 * 2**30,
        "skipped": 0,
        "validation_loss": 2.25,
        "validation_perplexity": 9.487735836358526,  # exp(2.25)
        "eval_time_s": 0.5,
    }
    return row | values


def test_steps_rank_rows_events_and_meta_round_trip(tmp_path):
    config = {"optim": {"lr": 3e-4}, "parallel": [1, 2, 2]}
    with RunStore(tmp_path) as store:
        rank_rows = [
            {"rank": 0, "step_time_s": 0.25, "comm_time_s": 0.03, "data_time_s": 0.01, "mem_peak_bytes": 7},
            {"rank": 1, "step_time_s": 0.26, "data_time_s": 0.02, "mem_peak_bytes": 8},
        ]
        store.write_step(full_step(1), rank_rows)
        # Optional columns may be left out, and numpy scalars and bools are accepted.
        store.write_step(dict(step=2, attempt=0, loss=np.float32(0.5), tokens=np.int64(8), skipped=True))
        store.write_event(
            "rollback", "loss spike", severity="warning", step=2, attempt=0, rank=0, data={"to_step": 1, "z": np.float32(7.5)}, time=123.0
        )
        store.write_event("checkpoint_saved", "saved step 1")
        store.set_meta("run_id", "run-1")
        store.set_meta("config", config)

    steps = read_steps(tmp_path)
    assert tuple(steps.columns) == step_columns()
    assert steps.iloc[0].to_dict() == full_step(1)
    second = steps.iloc[1]
    assert (second["step"], second["loss"], second["tokens"], second["skipped"]) == (2, 0.5, 8, 1)
    assert pd.isna(second["comm_share"]) and pd.isna(second["mem_peak_bytes"])

    ranks = read_rank_steps(tmp_path)
    assert tuple(ranks.columns) == RANK_COLUMNS
    assert ranks[["step", "attempt", "rank"]].values.tolist() == [[1, 0, 0], [1, 0, 1]]
    assert ranks["comm_time_s"].iloc[0] == 0.03 and pd.isna(ranks["comm_time_s"].iloc[1])

    events = read_events(tmp_path)
    assert events["kind"].tolist() == ["rollback", "checkpoint_saved"]
    rollback = events.iloc[0]
    assert (rollback["time"], rollback["step"], rollback["attempt"], rollback["rank"]) == (123.0, 2, 0, 0)
    assert (rollback["severity"], rollback["message"]) == ("warning", "loss spike")
    assert rollback["data"] == {"to_step": 1, "z": 7.5}
    saved = events.iloc[1]
    assert saved["severity"] == "info" and saved["data"] == {} and pd.isna(saved["step"])
    assert saved["time"] > 1_600_000_000  # defaults to now

    assert read_meta(tmp_path) == {"run_id": "run-1", "config": config}


def test_a_store_of_an_earlier_keel_is_read_and_continued(tmp_path):
    """A run resumed after an upgrade: the store lacks the columns added since (the ranks' spread)."""
    old_columns = ("step", "attempt", "time", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu", "comm_share",
                   "step_time_s", "data_time_s", "mem_peak_bytes", "skipped")  # fmt: skip
    with closing(sqlite3.connect(tmp_path / STORE_FILE)) as conn, conn:
        conn.execute(f"CREATE TABLE steps ({', '.join(old_columns)}, PRIMARY KEY (step, attempt))")
        conn.execute(f"INSERT INTO steps VALUES ({', '.join('?' * len(old_columns))})", [full_step(1)[c] for c in old_columns])
    before = read_steps(tmp_path)
    assert tuple(before.columns) == step_columns() and before.slowest_ranks.isna().all() and before.step_time_min_s.isna().all()
    with RunStore(tmp_path) as store:
        store.write_step(full_step(2))
    steps = read_steps(tmp_path)
    assert tuple(steps.columns) == step_columns()
    assert steps.iloc[1].to_dict() == full_step(2)
    assert steps.iloc[0].loss == full_step(1)["loss"] and pd.isna(steps.iloc[0].comm_share_max)


def test_rewriting_a_step_replaces_it(tmp_path):
    with RunStore(tmp_path) as store:
        store.write_step(full_step(1, loss=9.0))
        store.write_step(full_step(1, loss=2.0))
    assert read_steps(tmp_path)["loss"].tolist() == [2.0]


def test_effective_steps_follow_the_last_attempt(tmp_path):
    with RunStore(tmp_path) as store:
        for step in range(1, 7):  # attempt 0 runs to step 6, then rolls back
            store.write_step(full_step(step, attempt=0))
        for step in range(4, 8):  # attempt 1 reruns from step 4 and gets further
            store.write_step(full_step(step, attempt=1))

    effective = read_steps(tmp_path, effective=True)
    expected = [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert list(zip(effective["step"], effective["attempt"])) == expected
    everything = read_steps(tmp_path)
    assert len(everything) == 10 and everything["step"].is_monotonic_increasing


def test_effective_steps_drop_an_abandoned_tail_not_yet_rerun(tmp_path):
    # While attempt 1 is replaying from step 3, attempt 0's steps 5 and 6 are abandoned, not effective.
    with RunStore(tmp_path) as store:
        for step in range(1, 7):
            store.write_step(full_step(step, attempt=0))
        for step in (3, 4):
            store.write_step(full_step(step, attempt=1))
    effective = read_steps(tmp_path, effective=True)
    assert list(zip(effective["step"], effective["attempt"])) == [(1, 0), (2, 0), (3, 1), (4, 1)]


def test_a_closed_store_is_one_file_that_reads_leave_as_they_found_it(tmp_path):
    store = RunStore(tmp_path)
    store.write_step({"step": 1, "attempt": 0, "loss": 5.0})
    read_steps(tmp_path)  # a reader while the writer is open shares its WAL
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.sqlite"]
    assert read_steps(tmp_path).loss.tolist() == [5.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.sqlite"]  # before: run.sqlite-wal and -shm


def test_reads_while_a_writer_is_open(tmp_path):
    store = RunStore(tmp_path)
    try:
        for step in range(1, 4):
            store.write_step(full_step(step))
        assert read_steps(tmp_path)["step"].tolist() == [1, 2, 3]
        store.write_step(full_step(4))  # a reader must not lock the writer out
        store.write_event("alert", "slow step", step=4)
        assert read_steps(tmp_path)["step"].tolist() == [1, 2, 3, 4]
        assert read_events(tmp_path)["kind"].tolist() == ["alert"]
    finally:
        store.close()


WRITER = """
import sys, time
from keel.monitor.store import RunStore

store = RunStore(sys.argv[1])
for step in range(1, int(sys.argv[2]) + 1):
    store.write_step({"step": step, "attempt": 0, "loss": 1.0 / step}, [{"rank": 0}])
print("committed", flush=True)
time.sleep(60)
"""


def test_sigkilled_writer_leaves_every_committed_step_readable(tmp_path):
    n = 50
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert writer.stdout.readline().strip() == "committed"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=10) == -signal.SIGKILL
    finally:
        writer.kill()
        writer.stdout.close()

    # The rows are still only in the write-ahead log, so reading them back exercises its recovery.
    assert (tmp_path / "run.sqlite-wal").stat().st_size > 0
    steps = read_steps(tmp_path)
    assert steps["step"].tolist() == list(range(1, n + 1))
    assert steps["loss"].tolist() == [1.0 / s for s in range(1, n + 1)]
    assert len(read_rank_steps(tmp_path)) == n


def test_bad_rows_are_rejected_and_nothing_is_written(tmp_path):
    with RunStore(tmp_path) as store:
        with pytest.raises(ValueError, match="losss"):
            store.write_step({"step": 1, "attempt": 0, "losss": 1.0})
        with pytest.raises(ValueError, match="comm_tim"):
            store.write_step(full_step(1), [{"rank": 0, "comm_tim": 0.1}])
        with pytest.raises(ValueError, match="attempt"):
            store.write_step({"step": 1, "loss": 1.0})
    assert read_steps(tmp_path).empty and read_rank_steps(tmp_path).empty


def test_readers_name_a_missing_store_and_create_nothing(tmp_path):
    missing = tmp_path / "no-such-run"
    for read in (read_steps, read_rank_steps, read_events, read_meta):
        with pytest.raises(FileNotFoundError, match="keel train") as excinfo:
            read(missing)
        assert str(missing / "run.sqlite") in str(excinfo.value)
    assert not missing.exists()


def _as_reader_without_write_access(read):
    """`read()` in a child process that cannot write the folders it reads: as user nobody when the tests
    run as root (root writes anywhere), else as ourselves. Returns what it returned, or the error's text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only calls what is already imported, so it needs no access to the venv
        os.close(read_end)
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            result = repr(read())
        except Exception as e:
            result = f"{type(e).__name__}: {e}"
        os.write(write_end, result.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        result = f.read()
    os.waitpid(pid, 0)
    return result


def test_a_store_in_a_folder_the_reader_cannot_write_is_readable(tmp_path):
    # A finished run (no WAL files left) and a run whose writer is still open, both in folders
    # readable by everyone and writable by nobody but their owner.
    shared = Path(tempfile.mkdtemp(prefix="keel-ro-"))
    try:
        finished, live = shared / "finished", shared / "live"
        with RunStore(finished) as store:
            store.write_step({"step": 1, "attempt": 0, "loss": 2.5})
        writer = RunStore(live)
        writer.write_step({"step": 1, "attempt": 0, "loss": 3.5})
        for folder in (shared, finished, live):
            folder.chmod(0o755 if folder == shared else 0o555)
        assert sorted(os.listdir(finished)) == ["run.sqlite"]

        def last_losses():
            return [float(read_steps(d).loss.iloc[-1]) for d in (finished, live)]

        assert _as_reader_without_write_access(last_losses) == "[2.5, 3.5]"
        writer.close()
    finally:
        for folder in (shared / "finished", shared / "live"):
            folder.chmod(0o755)
        shutil.rmtree(shared)


@pytest.fixture
def rolled_back_run(tmp_path) -> Path:
    with RunStore(tmp_path) as store:
        store.write_step(full_step(1, attempt=0))
        store.write_step(full_step(2, attempt=0, loss=float("inf")))
        store.write_step(full_step(2, attempt=1, loss=1.875, comm_share=None))
    return tmp_path


def test_metrics_prints_the_effective_table(rolled_back_run, capsys):
    assert metrics_cli.main([str(rolled_back_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "step",
        "attempt",
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
        "comm_share",
        "step_time_s",
        "validation_loss",
    ]
    assert [line.split() for line in lines[1:]] == [
        ["1", "0", "4", "1.5", "0.0003", "12346", "0.41", "0.125", "0.25", "2.25"],
        ["2", "1", "1.875", "1.5", "0.0003", "12346", "0.41", "-", "0.25", "2.25"],
    ]


def test_metrics_leaves_out_a_column_the_run_never_recorded(tmp_path, capsys):
    with RunStore(tmp_path) as store:  # a run without evaluation (eval.every=0)
        store.write_step(full_step(1, validation_loss=None, validation_perplexity=None))
    assert metrics_cli.main([str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert "validation_loss" not in header and header[-1] == "step_time_s"


def test_metrics_csv_has_every_column_and_all_attempts(rolled_back_run, capsys):
    assert metrics_cli.main([str(rolled_back_run), "--csv", "--all-attempts"]) == 0
    parsed = pd.read_csv(io.StringIO(capsys.readouterr().out))
    expected = read_steps(rolled_back_run)
    assert tuple(parsed.columns) == step_columns()
    assert parsed["attempt"].tolist() == [0, 0, 1]
    pd.testing.assert_frame_equal(parsed, expected, check_dtype=False)

    assert metrics_cli.main([str(rolled_back_run), "--csv"]) == 0
    assert pd.read_csv(io.StringIO(capsys.readouterr().out))["attempt"].tolist() == [0, 1]


def test_metrics_on_a_missing_run_is_a_one_line_error(tmp_path, capsys):
    assert metrics_cli.main([str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("keel metrics: error: ") and captured.err.count("\n") == 1


def test_steps_read_by_range_and_rank_bins_sum_up_every_rank(tmp_path):
    with RunStore(tmp_path) as store:
        for step in range(1, 101):
            ranks = [{"step": step, "attempt": 0, "rank": r, "step_time_s": 1.0 + r, "comm_time_s": 0.25 * r,
                      "mem_peak_bytes": 1000 * r + step} for r in range(4)]  # fmt: skip
            store.write_step(full_step(step, attempt=0), ranks)
        for step in range(51, 61):  # a rollback reran 51..60
            store.write_step(full_step(step, attempt=1))
    assert read_steps(tmp_path, steps=(40, 55)).step.tolist() == [*range(40, 51), *[s for s in range(51, 56) for _ in (0, 1)]]
    kept = read_steps(tmp_path, effective=True, steps=(58, 62))  # attempt 0's steps 61..100 were abandoned
    assert kept.step.tolist() == [58, 59, 60] and kept.attempt.tolist() == [1, 1, 1]
    for lo, hi in ((1, 100), (40, 55), (58, 62), (70, 90)):  # the pandas rule agrees with the SQL on any range
        part = read_steps(tmp_path, steps=(lo, hi))
        masked = part[~abandoned_mask(part, read_attempt_starts(tmp_path))].reset_index(drop=True)
        pd.testing.assert_frame_equal(masked, read_steps(tmp_path, effective=True, steps=(lo, hi)))
    bins = read_rank_bins(tmp_path, (1, 100), width=10)
    assert sorted(set(bins["rank"])) == [0, 1, 2, 3] and len(bins) == 40
    first = bins[bins["rank"] == 3].iloc[0]
    assert (first.first_step, first.last_step, first.rows) == (1, 10, 10)
    assert first.step_time_s == 4.0 and first.comm_time_s == 0.75 and first.busy_time_s == 3.25 and first.mem_peak_bytes == 3010
    assert read_rank_bins(tmp_path, (91, 100), width=4).groupby("rank").rows.sum().tolist() == [10] * 4
    # Bins counted from an earlier origin are the same bins: the tail of a range can be read again alone.
    tail = read_rank_bins(tmp_path, (41, 100), width=10, origin=1)
    pd.testing.assert_frame_equal(tail, bins[bins.first_step >= 41].reset_index(drop=True))
