"""What the Run page draws, as plain frames: each metric's effective trajectory and abandoned segments,
downsampled with M4 (Keel's step metrics and the user's own), and the event markers. No Streamlit here,
so it is tested on its own."""

from __future__ import annotations

import pandas as pd

from keel.monitor import metric_registry
from keel.monitor.downsample import m4
from keel.monitor.event_kinds import EventKind
from keel.monitor.metric_registry import Chart

# The event kinds drawn as markers on the charts: the word a person reads in the legend, and its colour
# (faults and failures red, detections orange, recoveries green, routine saves grey).
MARKERS = {
    EventKind.LOSS_OUTLIER: ("loss outlier", "#fdae6b"), EventKind.SPIKE: ("confirmed spike", "#e6550d"),
    EventKind.NONFINITE: ("non-finite skip", "#d62728"), EventKind.ROLLBACK: ("rollback", "#2ca02c"),
    EventKind.SKIP_DATA: ("data skip", "#98df8a"), EventKind.BAD_BATCH: ("bad batch", "#bcbd22"),
    EventKind.CHECKPOINT_SAVED: ("checkpoint saved", "#c7c7c7"), EventKind.CHECKPOINT_CORRUPT: ("checkpoint corrupt", "#8c564b"),
    EventKind.HANG: ("hang", "#9467bd"), EventKind.RESTART: ("restart", "#17becf"), EventKind.NODE_LOSS: ("node loss", "#393b79"),
    EventKind.OOM: ("out of memory", "#e377c2"), EventKind.OOM_RETRY: ("micro-batch retry", "#74c476"),
    EventKind.STRAGGLER: ("straggler", "#ff7f0e"), EventKind.FAULT_INJECTED: ("injected fault", "#7f7f7f"),
    EventKind.ALERT: ("alert", "#ff2d2d"),
}  # fmt: skip
MARKER_KINDS = {kind: word for kind, (word, _) in MARKERS.items()}
MARKER_COLOURS = {word: colour for word, colour in MARKERS.values()}
# Marked on the loss chart only: one every few hundred steps would hide the small charts' lines.
ROUTINE_MARKERS = {"checkpoint saved"}
BUCKETS = 1000  # pixel columns of a chart: M4 keeps at most 4 points each


def _charts() -> dict[str, Chart]:
    """The step metrics charted against step, by column, in the order of keel.monitor.metric_registry
    (read at each call)."""
    return {m.column: m.chart for m in metric_registry.STEP_METRICS if m.chart}


def chart_titles() -> dict[str, str]:
    """Each charted step metric's title, which names the unit it is drawn in."""
    return {metric: chart.title for metric, chart in _charts().items()}


def segments(every: pd.DataFrame, abandoned: pd.Series) -> pd.Series:
    """Each row's line on the charts: "effective", or "attempt N" for the rows a rollback or a restart
    threw away (`abandoned`, from keel.monitor.store.abandoned_mask), one line per attempt."""
    # Labelled per attempt rather than per row: building a string per row took 0.6 s at a million rows.
    labels = {attempt: f"attempt {attempt}" for attempt in every.attempt.unique()}
    return every.attempt.map(labels).where(abandoned, "effective")


def metric_series(rows: pd.DataFrame, metric: str, grid: tuple[float, float], buckets: int = BUCKETS) -> pd.DataFrame:
    """One charted metric (see chart_titles) ready to draw from step rows with a `segment` column (see
    segments): columns step, value, segment, each segment downsampled on the chart's grid and never joined
    to another (a line is drawn per segment)."""
    scale = _charts()[metric].scale  # drawn in the unit its title names; the store keeps base units
    return _segment_series(rows, metric, grid, buckets, scale)


def custom_series(custom: pd.DataFrame, name: str, grid: tuple[float, float], buckets: int = BUCKETS) -> pd.DataFrame:
    """One of the user's own metrics, as metric_series draws a step metric, from custom metric rows
    (keel.monitor.store.read_custom_metrics) with a `segment` column: drawn as reported, in the user's unit."""
    return _segment_series(custom[custom.name == name], "value", grid, buckets, 1.0)


def _segment_series(rows: pd.DataFrame, column: str, grid: tuple[float, float], buckets: int, scale: float) -> pd.DataFrame:
    shown = rows[["step", column, "segment"]].dropna(subset=[column])
    frames = [m4(part, "step", column, buckets, grid) for _, part in shown.groupby("segment", sort=False)]  # rows come sorted by step
    frames = [f.rename(columns={column: "value"}).assign(value=lambda f: f.value * scale) for f in frames]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "value", "segment"])


def event_markers(events: pd.DataFrame) -> pd.DataFrame:
    """The events to mark on the charts: step, attempt, rank, kind (as read), severity, message."""
    marked = events[events.kind.isin(MARKER_KINDS) & events.step.notna()]
    shown = marked[["step", "attempt", "rank", "kind", "severity", "message"]].copy()
    shown["kind"] = shown.kind.map(MARKER_KINDS)
    shown["rank"] = shown["rank"].astype("string").fillna("all")
    return shown.astype({"step": "int64"}).reset_index(drop=True)


def straggler_marks(events: pd.DataFrame, steps: tuple[int, int]) -> pd.DataFrame:
    """The straggler events naming a rank, within the step range: step, rank, message."""
    found = events[(events.kind == EventKind.STRAGGLER) & events.step.notna() & events["rank"].notna()]
    found = found[found.step.between(*steps)]
    return found[["step", "rank", "message"]].astype({"step": "int64", "rank": "int64"}).reset_index(drop=True)


def compare_series(runs: dict[str, pd.DataFrame], metric: str, x: str, buckets: int = BUCKETS) -> pd.DataFrame:
    """Several runs' effective trajectories of one charted metric against `x` ("step" or "tokens_seen", the
    tokens trained on up to and including the step): columns run, x, value, each run downsampled with
    M4 on one grid spanning every run, so the runs stay comparable point for point."""
    frames = {name: kept.assign(tokens_seen=kept.tokens.astype("float64")) for name, kept in runs.items()}  # a running total
    xs = pd.concat([f[x] for f in frames.values()]) if frames else pd.Series(dtype="float64")
    grid = (float(xs.min()), float(xs.max())) if len(xs) else None
    parts, scale = [], _charts()[metric].scale
    for name, frame in frames.items():
        shown = frame[[x, metric]].dropna().sort_values(x)
        drawn = m4(shown, x, metric, buckets, grid).rename(columns={x: "x", metric: "value"})
        parts.append(drawn.assign(value=drawn.value * scale, run=name))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["x", "value", "run"])


def slowest_rank_counts(rows: pd.DataFrame, top: int = 8) -> pd.DataFrame:
    """How often each rank was among the slowest few by busy time of a measured step (the step rows'
    `slowest_ranks`), for the `top` ranks named most: columns rank, steps. From the step rows alone, so
    it reads as fast at 16,384 ranks as at 8."""
    named = rows.slowest_ranks.dropna()
    ranks = named.str.split(",").explode().astype("int64")
    counts = ranks.value_counts().rename_axis("rank").rename("steps").reset_index()
    return counts.sort_values(["steps", "rank"], ascending=[False, True]).head(top).reset_index(drop=True)
