"""The replay's reading of a run's own record (rule_replay.lowest_held_throughput) against promtool's.

The e2e clean-run replay expects the shipped throughput rule to fire exactly where the trainer's record
of its steps shows a held drop, so that record must be read as Prometheus's `rate()` reads a counter. These
runs are made up, step by step, and the real promtool decides; each case is one where reading a window
only over the part of it the run covers predicts the other outcome.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pandas as pd
import pytest
from rule_replay import fired_by, input_series, lowest_held_throughput, promtool_test_file

from keel.monitor.alert_rules import SHIPPED, RuleParams

COMPRESSION = 30  # as the e2e replay: a real second is half a minute
START = 1_000_000.0  # the first scrape, in seconds since the epoch
COUNTER = "keel_step_duration_seconds_count"


def step_times(stretches: list[tuple[float, float]]) -> np.ndarray:
    """When each step ended, for stretches of (seconds, steps a second) one after the other from START."""
    times, t = [], START
    for seconds, per_s in stretches:
        times.extend(t + np.arange(1, round(seconds * per_s) + 1) / per_s)
        t += seconds
    return np.array(times)


def scraped(times: np.ndarray) -> list[dict]:
    """The step counter as a scrape each second saw it, in the form the e2e fixture records."""
    scrapes = np.arange(START, times[-1] + 1.0, 1.0)
    values = np.searchsorted(times, scrapes, side="right")
    return [{"metric": {"__name__": COUNTER, "run_id": "made-up"}, "values": [[t, str(v)] for t, v in zip(scrapes, values)]}]


def promtool_fires(times: np.ndarray, tmp_path) -> bool:
    """Whether the shipped KeelThroughputDrop fires on the replayed counter (promtool decides)."""
    series = input_series(scraped(times), {COUNTER}, START, COMPRESSION, 1.0)
    end = (times[-1] - START + 1) * COMPRESSION + 3600
    path = tmp_path / "replay.test.yml"
    path.write_text(promtool_test_file(SHIPPED, series, COMPRESSION, [fired_by(end, ["KeelThroughputDrop"])]))
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


@pytest.mark.parametrize(
    ("stretches", "fires"),
    [
        # A drop to 5/8 at 150-210 s (75-105 minutes replayed): the baseline hour before it is still half
        # before the run, so rate() reads it at half the run's rate and the rule stays silent.
        ([(150, 8), (60, 5), (90, 8)], False),
        # The same drop once the run covers the whole baseline hour (from 240 s): the rule fires.
        ([(250, 8), (60, 5), (20, 8)], True),
    ],
    ids=["baseline-half-covered", "baseline-covered"],
)
def test_the_record_is_read_as_rate_reads_the_counter(stretches, fires, tmp_path):
    shipped = RuleParams()
    windows = [
        pd.Timedelta(d).total_seconds() / COMPRESSION
        for d in (shipped.throughput_window, shipped.throughput_baseline, shipped.throughput_for)
    ]
    times = step_times(stretches)
    lowest = lowest_held_throughput(times, START, *windows, every_s=60 / COMPRESSION)
    assert (lowest <= shipped.throughput_ratio) == fires, f"the record read {lowest:.3f}"
    assert promtool_fires(times, tmp_path) == fires
