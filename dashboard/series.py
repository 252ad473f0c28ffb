"""What the Run page draws, as plain frames: each metric's effective trajectory and abandoned segments,
downsampled with M4, and the event markers. No Streamlit here, so it is tested on its own."""

from __future__ import annotations

import pandas as pd

from keel.monitor.downsample import m4

# The event kinds drawn as markers on the charts, with the word a person reads in the legend.
MARKER_KINDS = {
    "loss_outlier": "loss outlier", "spike": "confirmed spike", "nonfinite": "non-finite skip", "rollback": "rollback",
    "skip_data": "data skip", "bad_batch": "bad batch", "checkpoint_saved": "checkpoint saved",
    "checkpoint_corrupt": "checkpoint corrupt", "hang": "hang", "restart": "restart", "oom": "out of memory",
    "straggler": "straggler", "fault_injected": "injected fault", "alert": "alert",
}  # fmt: skip
# The step metrics charted against step, with their titles.
METRICS = {
    "loss": "loss", "grad_norm": "grad norm", "lr": "learning rate", "tokens_per_s": "tokens/s", "mfu": "MFU",
    "comm_share": "comm share", "step_time_s": "step time (s)", "data_time_s": "data time (s)",
    "mem_peak_bytes": "peak memory (bytes)",
}  # fmt: skip
BUCKETS = 1000  # pixel columns of a chart: M4 keeps at most 4 points each


def abandoned_rows(every: pd.DataFrame, kept: pd.DataFrame) -> pd.DataFrame:
    """The rows of `every` attempt that are not in the effective trajectory: the steps a rollback or a
    restart threw away, each attempt's rows one segment (column `segment`)."""
    merged = every.merge(kept[["step", "attempt"]], on=["step", "attempt"], how="left", indicator=True)
    dropped = merged[merged["_merge"] == "left_only"].drop(columns="_merge")
    return dropped.assign(segment="attempt " + dropped.attempt.astype(str)).reset_index(drop=True)


def metric_series(every: pd.DataFrame, kept: pd.DataFrame, metric: str, buckets: int = BUCKETS) -> pd.DataFrame:
    """One metric ready to draw: columns step, value, segment ("effective" or "attempt N"), each segment
    downsampled on one shared grid and never joined to another (a line is drawn per segment)."""
    steps = pd.concat([every.step, kept.step])
    grid = (float(steps.min()), float(steps.max())) if len(steps) else None
    parts = [kept.assign(segment="effective"), *(rows for _, rows in abandoned_rows(every, kept).groupby("attempt"))]
    frames = []
    for part in parts:
        shown = part[["step", metric, "segment"]].dropna(subset=[metric])
        frames.append(m4(shown.sort_values("step"), "step", metric, buckets, grid).rename(columns={metric: "value"}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "value", "segment"])


def event_markers(events: pd.DataFrame) -> pd.DataFrame:
    """The events to mark on the charts: step, attempt, rank, kind (as read), severity, message."""
    marked = events[events.kind.isin(MARKER_KINDS) & events.step.notna()]
    shown = marked[["step", "attempt", "rank", "kind", "severity", "message"]].copy()
    shown["kind"] = shown.kind.map(MARKER_KINDS)
    shown["rank"] = shown["rank"].astype("string").fillna("all")
    return shown.astype({"step": "int64"}).reset_index(drop=True)
