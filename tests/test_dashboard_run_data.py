"""The Run page's reads of a live run (keel.dashboard.run_data): what a RunReader gives after reading only
what a trainer appended equals a read of the whole store, through rollbacks, restarts and rewrites."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from keel.dashboard import run_data
from keel.dashboard.run_data import RunData, RunReader, bin_width
from keel.dashboard.series import segments
from keel.monitor.goodput import compute_goodput
from keel.monitor.store import (
    RunStore,
    abandoned_mask,
    read_appended,
    read_attempt_starts,
    read_custom_metrics,
    read_events,
    read_meta,
    read_rank_bins,
    read_steps,
    step_bounds,
)

RANKS = 3
BINS = 8  # few heatmap bins, so that a bin holds several steps and bins are read again in part


def write_steps(run_dir, steps, attempt: int, loss_shift: float = 0.0) -> None:
    with RunStore(run_dir) as store:
        for step in steps:
            row = {"step": step, "attempt": attempt, "time": 1.7e9 + 10 * attempt + step, "loss": 5.0 / step + loss_shift,
                   "step_time_s": 0.5 + 0.01 * (step % 7), "skipped": int(step % 13 == 0)}  # fmt: skip
            # The user's own metrics: one every step, one every third step but on a step written again.
            row["custom"] = {"val_loss": 6.0 / step + loss_shift} | ({"acc": step / 100} if step % 3 == 0 and not loss_shift else {})
            ranks = [{"rank": r, "step_time_s": 0.5 + 0.01 * r * step % 5, "comm_time_s": 0.1 * r if step % 2 else None,
                      "mem_peak_bytes": 1000 * r + step + attempt} for r in range(RANKS)]  # fmt: skip
            store.write_step(row, ranks)
            if step % 10 == 0:
                store.write_event("checkpoint_saved", f"step {step}", step=step, attempt=attempt, data={"blocking_s": 0.02})


def write_event(run_dir, kind: str, step: int, attempt: int) -> None:
    with RunStore(run_dir) as store:
        store.write_event(kind, f"{kind} at {step}", step=step, attempt=attempt, rank=1, data={"down_s": 3.0})


def whole_read(run_dir, steps: tuple[int, int]) -> RunData:
    """The Run page's data as read from the whole store, the way the page read it before RunReader."""
    every, events = read_steps(run_dir, steps=steps), read_events(run_dir)
    rows = every.assign(segment=segments(every, abandoned_mask(every, read_attempt_starts(run_dir))))
    ranks = read_rank_bins(run_dir, steps, bin_width(steps, BINS))
    every_custom = read_custom_metrics(run_dir)
    custom = every_custom[every_custom.step.between(*steps)].reset_index(drop=True)
    custom = custom.assign(segment=segments(custom, abandoned_mask(custom, read_attempt_starts(run_dir))))
    names = tuple(sorted(every_custom.name.unique()))
    whole = read_steps(run_dir)
    return RunData(rows, events, ranks, compute_goodput(whole, events), custom, names, whole, read_meta(run_dir))


# Each batch is what a trainer wrote between two refreshes.
BATCHES = [
    lambda d: write_steps(d, range(1, 31), attempt=0),
    lambda d: write_steps(d, range(31, 47), attempt=0),
    lambda d: write_steps(d, [47], attempt=0),
    # A rollback: attempt 1 runs steps 38.. again, abandoning attempt 0's steps from 38 on.
    lambda d: (write_event(d, "rollback", 38, 1), write_steps(d, range(38, 42), attempt=1)),
    lambda d: write_steps(d, range(42, 61), attempt=1),
    # A restart before the rollback's start, and a step row written again (a new loss for the same key).
    lambda d: (write_event(d, "restart", 35, 2), write_steps(d, range(35, 40), attempt=2)),
    lambda d: write_steps(d, [39], attempt=2, loss_shift=1.0),
    lambda d: write_steps(d, range(40, 75), attempt=2),
    lambda d: None,  # nothing written: the same data
]


def assert_same(got: RunData, want: RunData) -> None:
    pd.testing.assert_frame_equal(got.rows, want.rows, check_exact=True)
    pd.testing.assert_frame_equal(got.events, want.events, check_exact=True)
    pd.testing.assert_frame_equal(got.every, want.every, check_exact=True)
    pd.testing.assert_frame_equal(got.ranks, want.ranks, check_exact=True)
    assert got.goodput == want.goodput
    pd.testing.assert_frame_equal(got.custom, want.custom, check_exact=True)
    assert got.custom_names == want.custom_names


def test_a_live_run_read_in_parts_equals_the_whole_store(tmp_path, monkeypatch):
    reads = []  # the step rows each read of the store gave
    monkeypatch.setattr(run_data, "read_appended", lambda d, since: reads.append(len((a := read_appended(d, since)).steps)) or a)
    reader = RunReader(str(tmp_path), heatmap_bins=BINS)
    for batch in BATCHES:
        batch(tmp_path)
        first, last = step_bounds(tmp_path)
        # Following the newest step, a range narrowed to the middle, and one ending before the newest step.
        for steps in ((first, last), (12, 44), (first, max(first, last - 9))):
            assert_same(reader.read(steps), whole_read(tmp_path, steps))
    # Each batch's rows were read once (step 39 written again: one row), never the whole store again.
    assert reads[::3] == [30, 16, 1, 4, 19, 5, 1, 35, 0] and set(reads) - set(reads[::3]) <= {0}
    assert set(reader.read((1, 74)).rows.segment) == {"effective", "attempt 0", "attempt 1"}
    # Step 39 written again without its acc: the row read before is gone from what the reader keeps.
    custom = reader.read((1, 74)).custom
    assert set(custom.segment) == {"effective", "attempt 0", "attempt 1"} and reader.read((1, 74)).custom_names == ("acc", "val_loss")
    assert custom.query("step == 39 and attempt == 2").name.tolist() == ["val_loss"]


def test_a_store_made_anew_in_the_folder_is_read_from_the_start(tmp_path):
    reader = RunReader(str(tmp_path), heatmap_bins=BINS)
    write_steps(tmp_path, range(1, 51), attempt=0)
    assert len(reader.read((1, 50)).rows) == 50
    shutil.rmtree(tmp_path)
    write_steps(tmp_path, range(1, 61), attempt=3)  # more rows than before: rowids alone would not tell
    assert_same(reader.read((1, 60)), whole_read(tmp_path, (1, 60)))


@pytest.mark.parametrize(("steps", "width"), [((1, 1), 1), ((1, 120), 1), ((1, 121), 2), ((1, 100_000), 1000), ((5, 130_004), 2000)])
def test_heatmap_bins_have_round_widths_and_at_most_the_bins_asked_for(steps, width):
    assert bin_width(steps, 120) == width and -(-(steps[1] - steps[0] + 1) // width) <= 120
