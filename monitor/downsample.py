"""Display downsampling that never hides a spike: M4 (Jugel et al., "M4: A Visualization-Oriented Time
Series Data Aggregation", PVLDB 7(10), 2014).

The x range is cut into one bucket per pixel column; each bucket keeps its first, last, smallest and
largest point. A line drawn through those points covers exactly the pixels the full series would, so a
one-step loss spike stays visible at any zoom, unlike the random or every-k-th sampling of common
dashboards. At most 4 points per bucket, whatever the length of the series.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def m4_indices(x: np.ndarray, y: np.ndarray, buckets: int, x_range: tuple[float, float] | None = None) -> np.ndarray:
    """Positions (ascending) of the points to draw of the series (x, y), x non-decreasing.

    `x_range` fixes the bucket grid (the chart's x extent), so several series drawn on one chart share
    it; points outside it are dropped. NaN values are ignored for the minimum and maximum (a bucket of
    NaN only keeps its first and last point); infinities count as extremes.
    """
    if buckets < 1:
        raise ValueError(f"buckets={buckets}: must be at least 1 (one per pixel column)")
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D and of one length, got {x.shape} and {y.shape}")
    if len(x) and np.any(np.diff(x) < 0):
        raise ValueError("x must be non-decreasing (sort the series by step first)")
    low, high = x_range if x_range is not None else ((x[0], x[-1]) if len(x) else (0.0, 0.0))
    inside = np.flatnonzero((x >= low) & (x <= high))
    if len(inside) <= 4:
        return inside
    width = (high - low) / buckets
    column = np.minimum(((x[inside] - low) / width).astype(np.int64), buckets - 1) if width > 0 else np.zeros(len(inside), np.int64)
    # x is sorted, so each column is one contiguous run of positions: its first and last are the run's ends.
    starts = np.flatnonzero(np.r_[True, column[1:] != column[:-1]])
    ends = np.r_[starts[1:] - 1, len(column) - 1]
    values = y[inside]
    lowest = _first_extreme(np.where(np.isnan(values), np.inf, values), np.minimum, column, starts, ends)
    highest = _first_extreme(np.where(np.isnan(values), -np.inf, values), np.maximum, column, starts, ends)
    keep = np.concatenate([starts, ends, lowest, highest])
    return inside[np.unique(keep)]


def _first_extreme(values: np.ndarray, reduce: np.ufunc, column: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per column, the first position holding the column's extreme (`reduce` is np.minimum or np.maximum)."""
    extreme = reduce.reduceat(values, starts)
    hits = np.flatnonzero(values == np.repeat(extreme, ends - starts + 1))
    _, first = np.unique(column[hits], return_index=True)
    return hits[first]


def m4(frame: pd.DataFrame, x: str, y: str, buckets: int, x_range: tuple[float, float] | None = None) -> pd.DataFrame:
    """The rows of `frame` (sorted by `x`) that draw column `y` exactly at `buckets` pixel columns."""
    return frame.iloc[m4_indices(frame[x].to_numpy(), frame[y].to_numpy(), buckets, x_range)]
