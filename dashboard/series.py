"""What the Run page draws, as plain frames: each metric's effective trajectory and abandoned segments,
downsampled with M4, and the event markers. No Streamlit here, so it is tested on its own."""

from __future__ import annotations

import pandas as pd

from keel.monitor.downsample import m4

# The event kinds drawn as markers on the charts: the word a person reads in the legend, and its colour
# (faults and failures red, detections orange, recoveries green, routine saves grey).
MARKERS = {
    "loss_outlier": ("loss outlier", "#fdae6b"), "spike": ("confirmed spike", "#e6550d"),
    "nonfinite": ("non-finite skip", "#d62728"), "rollback": ("rollback", "#2ca02c"), "skip_data": ("data skip", "#98df8a"),
    "bad_batch": ("bad batch", "#bcbd22"), "checkpoint_saved": ("checkpoint saved", "#c7c7c7"),
    "checkpoint_corrupt": ("checkpoint corrupt", "#8c564b"), "hang": ("hang", "#9467bd"), "restart": ("restart", "#17becf"),
    "node_loss": ("node loss", "#393b79"),
    "oom": ("out of memory", "#e377c2"), "oom_retry": ("micro-batch retry", "#74c476"), "straggler": ("straggler", "#ff7f0e"),
    "fault_injected": ("injected fault", "#7f7f7f"),
    "alert": ("alert", "#ff2d2d"),
}  # fmt: skip
MARKER_KINDS = {kind: word for kind, (word, _) in MARKERS.items()}
MARKER_COLOURS = {word: colour for word, colour in MARKERS.values()}
# Marked on the loss chart only: one every few hundred steps would hide the small charts' lines.
ROUTINE_MARKERS = {"checkpoint saved"}
# The step metrics charted against step, with their titles.
METRICS = {
    "loss": "loss", "grad_norm": "grad norm", "lr": "learning rate", "tokens_per_s": "tokens/s", "mfu": "MFU",
    "comm_share": "comm share", "step_time_s": "step time (s)", "data_time_s": "data time (s)",
    "mem_peak_bytes": "peak memory (GiB)",
}  # fmt: skip
UNIT_SCALE = {"mem_peak_bytes": 2**-30}  # drawn in the unit its title names; the store keeps base units
BUCKETS = 1000  # pixel columns of a chart: M4 keeps at most 4 points each


def segments(every: pd.DataFrame, abandoned: pd.Series) -> pd.Series:
    """Each row's line on the charts: "effective", or "attempt N" for the rows a rollback or a restart
    threw away (`abandoned`, from keel.monitor.store.abandoned_mask), one line per attempt."""
    # Labelled per attempt rather than per row: building a string per row took 0.6 s at a million rows.
    labels = {attempt: f"attempt {attempt}" for attempt in every.attempt.unique()}
    return every.attempt.map(labels).where(abandoned, "effective")


def metric_series(rows: pd.DataFrame, metric: str, grid: tuple[float, float], buckets: int = BUCKETS) -> pd.DataFrame:
    """One metric ready to draw from step rows with a `segment` column (see segments): columns step,
    value, segment, each segment downsampled on the chart's grid and never joined to another (a line is
    drawn per segment)."""
    shown = rows[["step", metric, "segment"]].dropna(subset=[metric])
    frames = [m4(part, "step", metric, buckets, grid) for _, part in shown.groupby("segment", sort=False)]  # rows come sorted by step
    frames = [f.rename(columns={metric: "value"}).assign(value=lambda f: f.value * UNIT_SCALE.get(metric, 1)) for f in frames]
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
    found = events[(events.kind == "straggler") & events.step.notna() & events["rank"].notna()]
    found = found[found.step.between(*steps)]
    return found[["step", "rank", "message"]].astype({"step": "int64", "rank": "int64"}).reset_index(drop=True)


def compare_series(runs: dict[str, pd.DataFrame], metric: str, x: str, buckets: int = BUCKETS) -> pd.DataFrame:
    """Several runs' effective trajectories of one metric against `x` ("step" or "tokens_seen", the
    tokens trained on up to and including the step): columns run, x, value, each run downsampled with
    M4 on one grid spanning every run, so the runs stay comparable point for point."""
    frames = {name: kept.assign(tokens_seen=kept.tokens.astype("float64").cumsum()) for name, kept in runs.items()}
    xs = pd.concat([f[x] for f in frames.values()]) if frames else pd.Series(dtype="float64")
    grid = (float(xs.min()), float(xs.max())) if len(xs) else None
    parts = []
    for name, frame in frames.items():
        shown = frame[[x, metric]].dropna().sort_values(x)
        drawn = m4(shown, x, metric, buckets, grid).rename(columns={x: "x", metric: "value"})
        parts.append(drawn.assign(value=drawn.value * UNIT_SCALE.get(metric, 1), run=name))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["x", "value", "run"])


def slowest_rank_counts(rows: pd.DataFrame, top: int = 8) -> pd.DataFrame:
    """How often each rank was among the slowest few by busy time of a measured step (the step rows'
    `slowest_ranks`), for the `top` ranks named most: columns rank, steps. From the step rows alone, so
    it reads as fast at 16,384 ranks as at 8."""
    named = rows.slowest_ranks.dropna()
    ranks = named.str.split(",").explode().astype("int64")
    counts = ranks.value_counts().rename_axis("rank").rename("steps").reset_index()
    return counts.sort_values(["steps", "rank"], ascending=[False, True]).head(top).reset_index(drop=True)
