"""The replay's reading of a run's own record (rule_replay.lowest_held_throughput) against promtool's.

The e2e clean-run replay expects the shipped throughput rule to fire exactly where the trainer's record
of its steps shows a held drop, so that record must be read as Prometheus's `rate()` reads a counter. These
runs are made up, step by step, and the real promtool decides; each case is one where reading a window
only over the part of it the run covers predicts the other outcome. And one run recorded on CI, where
counting the steps in each whole window predicted a held drop that rate() never saw.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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


def scrape_times(times: np.ndarray) -> np.ndarray:
    return np.arange(START, times[-1] + 1.0, 1.0)


def scraped(times: np.ndarray) -> list[dict]:
    """The step counter as a scrape each second saw it, in the form the e2e fixture records."""
    scrapes = scrape_times(times)
    values = np.searchsorted(times, scrapes, side="right")
    return [{"metric": {"__name__": COUNTER, "run_id": "made-up"}, "values": [[t, str(v)] for t, v in zip(scrapes, values)]}]


def promtool_fires(recorded: list[dict], compression: float, tmp_path) -> bool:
    """Whether the shipped KeelThroughputDrop fires on the replayed counter (promtool decides)."""
    series = input_series(recorded, {COUNTER}, START, compression, 1.0)
    last = max(float(t) for t, _ in recorded[0]["values"])
    end = (last - START + 1) * compression + 3600
    path = tmp_path / "replay.test.yml"
    path.write_text(promtool_test_file(SHIPPED, series, compression, [fired_by(end, ["KeelThroughputDrop"])]))
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
    times = step_times(stretches)
    lowest = lowest_held_throughput(times, scrape_times(times), START, *windows(COMPRESSION), every_s=60 / COMPRESSION)
    assert (lowest <= RuleParams().throughput_ratio) == fires, f"the record read {lowest:.3f}"
    assert promtool_fires(scraped(times), COMPRESSION, tmp_path) == fires


def test_a_clean_run_recorded_on_ci_is_read_as_promtool_reads_it(tmp_path):
    """Its steps counted over each whole window held 0.912 for the rule's 15 minutes, under the shipped
    0.95; rate() on the same counts, as on what Prometheus scraped, never held below 0.969, and promtool
    stayed silent (the e2e test then failed, expecting the rule to fire)."""
    run = json.loads((Path(__file__).parent / "data" / "clean_run_step_counter.json").read_text())
    compression = 48  # the e2e replay's, when this run was recorded
    times = START + np.array(run["step_end_s"])
    scrapes = [[START + t, str(count)] for t, count in run["scrapes"]]
    lowest = lowest_held_throughput(times, np.array([t for t, _ in scrapes]), START, *windows(compression), every_s=60 / compression)
    assert lowest > RuleParams().throughput_ratio, f"the record read {lowest:.3f}"
    assert not promtool_fires([{"metric": {"__name__": COUNTER, "run_id": "ci"}, "values": scrapes}], compression, tmp_path)


def windows(compression: float) -> list[float]:
    """The shipped throughput rule's window, baseline and `for`, in the replayed run's seconds."""
    shipped = RuleParams()
    durations = (shipped.throughput_window, shipped.throughput_baseline, shipped.throughput_for)
    return [pd.Timedelta(d).total_seconds() / compression for d in durations]
