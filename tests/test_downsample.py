"""M4 display downsampling: what a chart of a million steps drawn at a thousand pixel columns must keep."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from keel.monitor.downsample import m4, m4_indices

N, BUCKETS = 1_000_000, 1_000
RNG = np.random.default_rng(7)
STEPS = np.arange(1, N + 1, dtype=np.float64)
NOISE = 3.0 + 0.05 * RNG.standard_normal(N)
# Every edge of a bucket and its neighbours, both ends of the series, and random places.
SPIKE_AT = sorted({0, 1, 999, 1000, 1001, N // 2, N - 1001, N - 1000, N - 2, N - 1, *RNG.integers(0, N, 20).tolist()})


@pytest.mark.parametrize("position", SPIKE_AT)
@pytest.mark.parametrize("sign", [1, -1])
def test_a_one_step_spike_anywhere_survives(position, sign):
    loss = NOISE.copy()
    loss[position] = 3.0 + sign * 50.0
    kept = m4_indices(STEPS, loss, BUCKETS)
    assert position in kept
    assert kept[0] == 0 and kept[-1] == N - 1  # the first and the last step are drawn
    assert len(kept) <= 4 * BUCKETS


@pytest.mark.parametrize("n", [1, 2, 5, 4 * BUCKETS, 4 * BUCKETS + 1, 123_457])
def test_never_more_than_four_points_a_bucket_and_every_bucket_drawn_exactly(n):
    x, y = STEPS[:n], NOISE[:n]
    kept = m4_indices(x, y, BUCKETS)
    assert len(kept) <= min(n, 4 * BUCKETS) and np.all(np.diff(kept) > 0)
    # Exactness: in every pixel column, the kept points reach the column's full minimum and maximum.
    column = np.minimum(((x - x[0]) / max(x[-1] - x[0], 1e-12) * BUCKETS).astype(int), BUCKETS - 1)
    full = pd.Series(y).groupby(column).agg(["min", "max"])
    drawn = pd.Series(y[kept]).groupby(column[kept]).agg(["min", "max"])
    pd.testing.assert_frame_equal(full, drawn)


def test_non_finite_values_neither_break_nor_hide_the_series():
    loss = NOISE[:10_000].copy()
    loss[100:200] = np.nan  # steps skipped as non-finite
    loss[5000] = np.inf
    kept = m4_indices(STEPS[:10_000], loss, 100)
    assert 5000 in kept and len(kept) <= 400
    assert np.isfinite(loss[kept]).sum() >= len(kept) - 3  # NaN is kept only where it starts or ends a bucket


def test_a_shared_grid_for_runs_drawn_together():
    """Two runs on one chart use the chart's x range: a shorter run's points fall in the same columns."""
    short = m4_indices(STEPS[:500], NOISE[:500], 10, x_range=(1, 1000))
    assert len(short) <= 4 * 5  # 500 steps fill 5 of the 10 columns of 100 steps each
    window = m4_indices(STEPS[:1000], NOISE[:1000], 10, x_range=(201, 300))  # a selected range, one column
    assert set(window) <= set(range(200, 300)) and {200, 299} <= set(window)


def test_frame_rows_and_bad_input():
    frame = pd.DataFrame({"step": STEPS[:50_000], "loss": NOISE[:50_000]})
    rows = m4(frame, "step", "loss", 200)
    assert len(rows) <= 800 and rows.index.is_monotonic_increasing and rows.loss.max() == frame.loss.max()
    with pytest.raises(ValueError, match="buckets=0"):
        m4_indices(STEPS[:10], NOISE[:10], 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        m4_indices(STEPS[:10][::-1], NOISE[:10], 5)
