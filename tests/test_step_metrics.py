"""What a step leaves in the run store: a step row on every step with the ranks' spread, per-rank rows on
the sampled steps only unless `metrics.rank_rows = "every_step"`; and the slowest ranks named by busy time."""

from __future__ import annotations

import math

import pytest
import torch

from keel.monitor.recorder import RunRecorder
from keel.monitor.store import RunStore, read_rank_steps, read_steps, step_columns
from keel.trainer.step_metrics import StepNumbers, StepReporter, slowest_ranks


@pytest.mark.parametrize("every_step", [False, True])
def test_rank_rows_are_kept_on_sampled_steps_unless_asked_for_every_step(tmp_path, every_step):
    recorder = RunRecorder("r", RunStore(tmp_path), sinks=[])
    reporter = StepReporter(torch.device("cpu"), 1, 64, 1e6, 1e12, recorder, None, rank_rows_every_step=every_step)
    for step in range(1, 13):
        reporter.report(StepNumbers(step, 0, 1e-3, 1.0, torch.tensor(2.0), 0.001, sampled=(step - 2) % 10 == 0))
    recorder.close()
    steps, ranks = read_steps(tmp_path), read_rank_steps(tmp_path)
    assert steps.step.tolist() == list(range(1, 13))
    assert ranks.step.tolist() == (list(range(1, 13)) if every_step else [2, 12])
    # One rank: its step time is the fastest, the median and the slowest.
    assert (steps.step_time_min_s == steps.step_time_s).all() and (steps.step_time_median_s == steps.step_time_s).all()
    assert steps.slowest_ranks.isna().all()  # no communication measured: nothing tells a slow rank from a waiting one


def test_the_step_row_has_every_registered_column_and_no_other():
    """keel.monitor.metric_registry declares the columns; the reporter computes each of them."""
    reporter = StepReporter(torch.device("cpu"), 1, 64, 1e6, 1e12, None, None)
    row, _ = reporter.report(StepNumbers(1, 0, 1e-3, 1.0, torch.tensor(2.0), 0.001))
    assert tuple(row) == step_columns()


def test_the_slowest_ranks_are_those_with_the_longest_busy_time():
    assert slowest_ranks(torch.tensor([0.5, 0.9, 0.2, 0.9, 0.7])) == "1,3,4"
    assert slowest_ranks(torch.tensor([0.5, math.nan])) == "0,1"  # a rank that measured nothing comes last
    assert slowest_ranks(torch.tensor([0.3, 0.1]), k=5) == "0,1"
