"""What the Run page draws of a run, read from its store a little at a time: a live trainer appends a
few steps between two refreshes, and reading the whole run again at each of them cost seconds (16 s at
a million steps on eight ranks). A RunReader keeps what it has read of one run (its step rows, events and
the user's own metrics) and, at each read, adds what was committed since (keel.monitor.store.read_appended);
it reads the rank heatmap's bins again only from the first bin that new rows fall in. What it gives
equals a read of the whole store: the test holds it. No Streamlit here, so it is tested on its own.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pandas as pd

from keel.dashboard.series import segments
from keel.monitor.goodput import Goodput, run_goodput
from keel.monitor.store import StoreMark, abandoned_mask, read_appended, read_meta, read_rank_bins

_STEP_KEY = ["step", "attempt"]
_GRIDS_KEPT = 8  # heatmap grids kept per run: the step ranges several people watching it chose


@dataclass(frozen=True)
class RunData:
    """What the Run page draws of one step range, as read from the store (never modified once read)."""

    rows: pd.DataFrame  # every attempt's rows in the range, as read_steps, each with its line (series.segments)
    events: pd.DataFrame
    ranks: pd.DataFrame  # read_rank_bins over the range, on the grid of bin_width
    goodput: Goodput  # of the whole run
    custom: pd.DataFrame  # the user's own metrics in the range, as read_custom_metrics, each row with its line
    custom_names: tuple[str, ...]  # every name the run reported, in or out of the range, sorted: a chart each
    every: pd.DataFrame  # every attempt's rows of the whole run, as read_steps (for the run's summary)
    meta: dict


def bin_width(steps: tuple[int, int], bins: int) -> int:
    """The heatmap's bin width for a step range: the smallest 1, 2 or 5 times a power of ten that cuts
    it into at most `bins` bins. Round widths stay the same while a live run grows (from 100k to 120k
    steps at 120 bins), so the bins already read stay valid and only the last ones are read again."""
    need = -(-(steps[1] - steps[0] + 1) // bins)
    power = 1
    while True:
        for multiple in (1, 2, 5):
            if multiple * power >= need:
                return multiple * power
        power *= 10


@dataclass
class _Bins:
    """The heatmap's bins of one grid (first step, width) as read up to step `hi`."""

    hi: int
    frame: pd.DataFrame
    dirty_from: float = math.inf  # the lowest step that rank rows were written to since they were read


class RunReader:
    """One run's store as read so far; safe to share between sessions (threads)."""

    def __init__(self, run_dir: str, heatmap_bins: int) -> None:
        self.run_dir, self.heatmap_bins = run_dir, heatmap_bins
        self._lock = threading.Lock()
        self._mark: StoreMark | None = None
        self._steps = self._events = self._custom = pd.DataFrame()
        self._grids: dict[tuple[int, int], _Bins] = {}

    def read(self, steps: tuple[int, int]) -> RunData:
        """The step range `steps` of the run as it is now: read_steps's rows with their lines, every
        event, the rank bins, the whole run's goodput and the user's own metrics with their lines."""
        with self._lock:
            self._catch_up()
            every = self._steps
            # Over the whole run: a later attempt may start before the range.
            starts = every.groupby("attempt")["step"].min() if len(every) else None
            rows = _with_segments(every, steps, starts)
            custom = _with_segments(self._custom, steps, starts)
            names = tuple(sorted(self._custom.name.unique())) if len(self._custom) else ()
            meta = read_meta(self.run_dir)
            goodput = run_goodput(meta, every, self._events)  # the Runs page's figure too
            return RunData(rows, self._events, self._rank_bins(steps), goodput, custom, names, every, meta)

    def _catch_up(self) -> None:
        new = read_appended(self.run_dir, self._mark)
        if new.fresh:
            self._steps, self._events, self._custom, self._grids = new.steps, new.events, new.custom, {}
        else:
            self._custom = _merged_custom(self._custom, new.custom, new.steps)  # before the steps: it compares with them
            self._steps = _merged(self._steps, new.steps)
            self._events = pd.concat([self._events, new.events], ignore_index=True) if len(new.events) else self._events
            for grid in self._grids.values():
                grid.dirty_from = min(grid.dirty_from, math.inf if new.first_rank_step is None else new.first_rank_step)
        self._mark = new.mark

    def _rank_bins(self, steps: tuple[int, int]) -> pd.DataFrame:
        """The bins of `steps`, reading again only those from the first one that changed: the one new
        rank rows fell in, or the one the range's old end was in when the range grew (following a live
        run's newest step)."""
        first, last = steps
        width = bin_width(steps, self.heatmap_bins)
        kept = self._grids.pop((first, width), None)
        changed = first if kept is None or last < kept.hi else max(first, min(kept.dirty_from, kept.hi + 1))
        if changed <= last:
            start = first + (changed - first) // width * width  # the first step of changed's bin
            fresh = read_rank_bins(self.run_dir, (start, last), width, origin=first)
            frame = fresh if kept is None else _replace_bins(kept.frame, fresh, start)
            kept = _Bins(last, frame)
        self._grids[(first, width)] = kept
        while len(self._grids) > _GRIDS_KEPT:
            del self._grids[next(iter(self._grids))]  # the grid used least recently
        return kept.frame


def _merged(rows: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """Step rows read before and new ones, as read_steps orders them: by (step, attempt), a row written
    again replacing the one read before."""
    if new.empty:
        return rows
    both = pd.concat([rows, new], ignore_index=True)
    if rows.empty or tuple(new[_STEP_KEY].iloc[0]) > tuple(rows[_STEP_KEY].iloc[-1]):
        return both  # a trainer going on: every new row comes after those read
    # A new attempt running earlier steps again, or a row written again: the new one last among equals.
    both = both.sort_values(_STEP_KEY, kind="stable", ignore_index=True)
    return both[~both.duplicated(_STEP_KEY, keep="last")].reset_index(drop=True)


def _with_segments(frame: pd.DataFrame, steps: tuple[int, int], attempt_starts: pd.Series | None) -> pd.DataFrame:
    """The rows of `frame` (sorted by step) in the range, each with its line (series.segments)."""
    lo, hi = frame.step.searchsorted(steps[0], "left"), frame.step.searchsorted(steps[1], "right")
    part = frame.iloc[lo:hi].reset_index(drop=True)
    return part.assign(segment=segments(part, abandoned_mask(part, attempt_starts)))


_CUSTOM_ORDER = ["step", "attempt", "name"]


def _merged_custom(rows: pd.DataFrame, new: pd.DataFrame, new_steps: pd.DataFrame) -> pd.DataFrame:
    """Custom metric rows read before and new ones, as read_custom_metrics orders them. A step row among
    `new_steps` written again brought its custom rows as they are now (the store wrote both in one
    transaction): those read before for its (step, attempt) go, even when it brought none."""
    if new_steps.empty:
        return rows
    if rows.empty or tuple(new_steps[_STEP_KEY].iloc[0]) > tuple(rows[_STEP_KEY].iloc[-1]):
        return pd.concat([rows, new], ignore_index=True) if len(new) else rows  # a trainer going on
    written = pd.MultiIndex.from_frame(new_steps[_STEP_KEY])
    kept = rows[~pd.MultiIndex.from_frame(rows[_STEP_KEY]).isin(written)]
    return pd.concat([kept, new], ignore_index=True).sort_values(_CUSTOM_ORDER, kind="stable", ignore_index=True)


def _replace_bins(kept: pd.DataFrame, fresh: pd.DataFrame, start: int) -> pd.DataFrame:
    """The bins before `start` as kept, and those from it as read again, ordered as read_rank_bins."""
    before = kept[kept.first_step < start]
    if fresh.empty or before.empty:
        return (before if fresh.empty else fresh).reset_index(drop=True)
    return pd.concat([before, fresh]).sort_values(["rank", "first_step"], ignore_index=True)
