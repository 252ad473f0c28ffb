"""Stability end to end: checkpoints and exact resume, the NaN guard, spike rollback with data skip,
and out-of-memory recovery. Each test runs `keel train` as a user would: real torchrun, gloo workers,
faults injected through chaos fault plans. (Crashes, hangs and stragglers under pp2·dp2·tp2 and dp2
are in test_drill.py, where the drill compares them with a reference run.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import keel, train

from keel.monitor.checkpoints import verify
from keel.monitor.exits import EXIT_ROLLBACK_CAP
from keel.monitor.run_dir import list_checkpoints
from keel.monitor.store import read_events, read_steps

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY = ["--config", "tiny", "--monitor.prometheus=false"]


def kinds(run_dir) -> list[str]:
    return list(read_events(run_dir)["kind"])


def events_of(run_dir, kind: str):
    events = read_events(run_dir)
    return events[events["kind"] == kind]


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path):
    run_dir = tmp_path / "run"
    # A run of 16 steps that dies at step 13, with no restarts left: checkpoints of steps 4, 8 and 12
    # (saved synchronously, so the save of step 12 is surely complete when the crash comes).
    proc = keel(
        "train",
        f"--run-dir={run_dir}",
        *TINY,
        "--steps=16",
        "--checkpoint.interval_steps=4",
        "--checkpoint.async_save=false",
        "--fault=crash@step=13",
        "--max-restarts=0",
    )
    assert proc.returncode != 0
    first = read_steps(run_dir)
    assert [s for s, _ in list_checkpoints(run_dir)] == [4, 8, 12]
    newest = list_checkpoints(run_dir)[-1][1]
    shard = next(p for p in sorted(newest.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of a shard
    shard.write_bytes(bytes(data))
    assert "does not match its sha256" in verify(newest)

    proc = keel("train", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    corrupt = events_of(run_dir, "checkpoint_corrupt")
    assert len(corrupt) == 1 and "step-00000012" in corrupt.iloc[0]["message"]
    assert events_of(run_dir, "checkpoint_loaded").iloc[-1]["step"] == 8
    assert (newest.parent / (newest.name + ".corrupt")).is_dir()
    run = read_steps(run_dir, effective=True)
    assert list(run.step) == list(range(1, 17))
    # Steps 9..12 ran again from the good checkpoint and gave exactly what they gave the first time.
    np.testing.assert_array_equal(run[run.step.between(9, 12)].loss.to_numpy(), first[first.step.between(9, 12)].loss.to_numpy())

    # With every checkpoint corrupt, a resume says so for each one and starts over rather than load any.
    saved = list_checkpoints(run_dir)
    assert [s for s, _ in saved] == [4, 8, 12, 16]  # the newest three, and the oldest of the last 200 steps (keep_lookback_steps)
    for _, path in saved:
        (path / "manifest.json").write_text("{not json")
    proc = keel("train", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(run_dir)
    last_start = events[events.kind == "run_started"].index[-1]
    after = events.loc[last_start:]
    assert len(after[after.kind == "checkpoint_corrupt"]) == 4 and "checkpoint_missing" in set(after.kind)
    assert list(read_steps(run_dir, effective=True).step) == list(range(1, 17))


def test_nan_is_skipped_on_every_rank_and_three_in_a_row_roll_back(tmp_path):
    run_dir = tmp_path / "run"
    faults = ["nan@step=5,rank=1", "nan@step=10,rank=0", "inf@step=11,rank=1", "nan@step=12,rank=1"]
    run = train(run_dir, *TINY, "--dp", "2", "--checkpoint.interval_steps=4", *[f"--fault={f}" for f in faults])
    rows = read_steps(run_dir)
    skipped = rows[rows.skipped == 1]
    assert list(skipped.step) == [5, 10, 11, 12]
    for rank in (0, 1):  # every rank skipped the same steps, whichever rank's loss was bad
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert [f"step {s} skipped" in log for s in (5, 10, 11, 12)] == [True] * 4
    assert list(events_of(run_dir, "nonfinite").step) == [5, 10, 11, 12]
    rollback = events_of(run_dir, "rollback").iloc[0]
    # Back to the newest in-memory snapshot before the first of the three (a checkpoint every 4 steps would give 8).
    to_step = rollback["data"]["to_step"]
    assert rollback["data"]["from_step"] == 12 and rollback["data"]["bad_from"] == 10
    assert rollback["data"]["in_memory"] and 0 <= to_step < 10
    assert len(events_of(run_dir, "skip_data")) == 1
    assert list(run.step) == list(range(1, 21))
    # 10..12 were rolled back; step 5 stays a skipped step unless the snapshot was older (the fault fires once)
    assert list(run[run.skipped == 1].step) == ([5] if to_step >= 5 else [])
    assert np.isfinite(run[run.skipped == 0].loss).all()
    assert (run[run.step > to_step].attempt == 1).all() and (run[run.step <= to_step].attempt == 0).all()
    assert run.loss.iloc[-1] < run.loss.iloc[0] - 1.0


SPIKE_RUN = [*TINY, "--steps", "160", "--checkpoint.interval_steps=20", "--spike.warmup_steps=30", "--optim.warmup_steps=20"]


def test_real_loss_spike_is_detected_rolled_back_and_its_data_skipped_with_default_settings(tmp_path):
    """Five batches of random bytes at steps 100..104 give a real spike, in a run with Keel's default
    checkpoint settings: no checkpoint until its end (Young's interval is 30 minutes). The detector confirms
    the spike, the run restores its newest in-memory snapshot before step 100, skips every batch read since
    then, and ends on its trend."""
    spike_run = [arg for arg in SPIKE_RUN if not arg.startswith("--checkpoint.")]
    ref = train(tmp_path / "ref", *spike_run)
    run_dir = tmp_path / "spike"
    run = train(run_dir, *spike_run, "--fault", "spike@step=100,steps=5")
    events = read_events(run_dir)
    assert list(events[events.kind == "checkpoint_saved"].step) == [160]
    story = events[events.kind.isin(["loss_outlier", "spike", "rollback", "rollback_failed", "skip_data"])]
    assert list(story.kind) == ["loss_outlier", "spike", "rollback", "skip_data"]
    outlier, spike, rollback, skip = (story.iloc[i] for i in range(4))
    assert outlier["step"] == 100 and spike["data"]["start_step"] == 100 and 100 < spike["step"] <= 110
    to_step = rollback["data"]["to_step"]
    assert rollback["data"]["in_memory"] and 0 <= to_step < 100 and rollback["data"]["from_step"] == spike["step"]
    assert f"to the in-memory snapshot of step {to_step}" in rollback["message"]
    # Batches to_step.. (read from step to_step + 1 on) up to the confirmation and the margin are never read again.
    assert skip["data"]["first_batch"] == to_step and skip["data"]["end_batch"] == spike["step"] + 5
    assert list(run.step) == list(range(1, 161))
    # Steps up to the snapshot are the clean run's. After it, the run is exactly a clean run that never
    # read the skipped batches: the rollback left nothing of the spike behind.
    np.testing.assert_array_equal(run[run.step <= to_step].loss.to_numpy(), ref[ref.step <= to_step].loss.to_numpy())
    same_skip = train(tmp_path / "same-skip", *spike_run, f"--data.skip_batches={to_step}:{skip['data']['end_batch']}")
    np.testing.assert_array_equal(run.loss.to_numpy(), same_skip.loss.to_numpy())
    # And it ends on the clean run's trend: the last 30 losses (per-step noise about 0.3) agree in the mean.
    assert abs(run.loss.tail(30).mean() - ref.loss.tail(30).mean()) < 0.1 * ref.loss.tail(30).mean()


def test_spike_without_data_skip_hits_the_rollback_cap(tmp_path):
    """With the data skip turned off the poisoned batches come back after every rollback: the run must stop
    with the rollback-cap exit code and an alert, not loop."""
    run_dir = tmp_path / "run"
    proc = keel(
        "train",
        f"--run-dir={run_dir}",
        *SPIKE_RUN,
        "--fault=spike@step=100,steps=5",
        "--recovery.skip_margin=0",
        "--recovery.max_rollbacks=2",
        "--recovery.skip_data=false",
    )
    assert proc.returncode == EXIT_ROLLBACK_CAP, proc.stderr[-3000:]
    assert len(events_of(run_dir, "rollback")) == 2
    stopped = events_of(run_dir, "run_stopped").iloc[0]
    assert "rollbacks without progress" in stopped["message"]
    assert "run_finished" not in kinds(run_dir)


def test_oom_in_one_process_halves_the_micro_batch_in_place_until_it_fits(tmp_path):
    ref = train(tmp_path / "ref", *TINY, "--training.microbatches=4")
    run_dir = tmp_path / "run"
    # 8 sequences per micro-batch; the fault's memory holds 2, so the step must run out twice more.
    run = train(run_dir, *TINY, "--training.microbatches=1", "--fault", "oom@step=6,rows=2")
    assert events_of(run_dir, "oom")["data"].tolist() == [
        {"microbatches": 2, "previous": 1, "how": "in process"},
        {"microbatches": 4, "previous": 2, "how": "in process"},
    ]
    assert list(run.step) == list(range(1, 21)) and list(run.tokens) == list(ref.tokens)  # global batch unchanged
    np.testing.assert_allclose(run.loss, ref.loss, rtol=1e-5)


def test_oom_with_collectives_restarts_with_half_the_micro_batch(tmp_path):
    ref = train(tmp_path / "ref", *TINY, "--dp", "2", "--training.microbatches=2", "--checkpoint.interval_steps=4")
    run_dir = tmp_path / "run"
    # 4 sequences per dp rank in one micro-batch; rank 1's memory holds 2: a restart that did not halve it would run out again.
    run = train(
        run_dir, *TINY, "--dp", "2", "--training.microbatches=1", "--checkpoint.interval_steps=4", "--fault", "oom@step=6,rank=1,rows=2"
    )
    [oom] = events_of(run_dir, "oom").to_dict("records")
    assert oom["rank"] == 1 and oom["data"]["microbatches"] == 2 and oom["data"]["how"] == "coordinated restart"
    assert list(run.step) == list(range(1, 21)) and list(run.tokens) == list(ref.tokens)
    after = run.step > 4  # resumed from the checkpoint of step 4 with two micro-batches
    np.testing.assert_allclose(run[after].loss, ref[after].loss, rtol=1e-5)
