"""What the Run page draws, as plain frames: each metric's effective trajectory and abandoned segments,
downsampled with M4 (Keel's step metrics and the user's own), and the event markers. No Streamlit here,
so it is tested on its own."""

from __future__ import annotations

import numpy as np
import pandas as pd

from keel.monitor import metric_registry
from keel.monitor.downsample import m4
from keel.monitor.event_kinds import EventKind
from keel.monitor.metric_registry import Chart

# The event kinds drawn as markers on the charts: the word a person reads in the legend, and its colour
# (faults and failures red, detections orange, recoveries green, routine saves grey). In causal order:
# events at one step are listed in it (the fault, what detected it, the alert, the recovery), whatever
# order their writers recorded them in (a restart records the fault that killed its process after the fact).
MARKERS = {
    EventKind.FAULT_INJECTED: ("injected fault", "#7f7f7f"), EventKind.LOSS_OUTLIER: ("loss outlier", "#fdae6b"),
    EventKind.SPIKE: ("confirmed spike", "#e6550d"), EventKind.NONFINITE: ("non-finite skip", "#d62728"),
    EventKind.BAD_BATCH: ("bad batch", "#bcbd22"), EventKind.OOM: ("out of memory", "#e377c2"), EventKind.HANG: ("hang", "#9467bd"),
    EventKind.STRAGGLER: ("straggler", "#ff7f0e"), EventKind.NODE_LOSS: ("node loss", "#393b79"),
    EventKind.CHECKPOINT_CORRUPT: ("checkpoint corrupt", "#8c564b"), EventKind.ALERT: ("alert", "#ff2d2d"),
    EventKind.ROLLBACK: ("rollback", "#2ca02c"), EventKind.SKIP_DATA: ("data skip", "#98df8a"),
    EventKind.OOM_RETRY: ("micro-batch retry", "#74c476"), EventKind.RESTART: ("restart", "#17becf"),
    EventKind.CHECKPOINT_SAVED: ("checkpoint saved", "#c7c7c7"),
}  # fmt: skip
MARKER_KINDS = {kind: word for kind, (word, _) in MARKERS.items()}
MARKER_COLOURS = {word: colour for word, colour in MARKERS.values()}
_CAUSAL_ORDER = {word: i for i, (word, _) in enumerate(MARKERS.values())}
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


# What the charts' x axis can be: the step, the tokens trained on up to it, or the wall-clock time since
# the run began (where a hang's lost minutes show as a gap).
AXES = {"step": "step", "tokens": "tokens trained on", "time": "wall-clock time"}
# A fault that lasts (a straggler, a run of bad batches): events of one kind on one rank no more than
# BAND_GAP steps apart, BAND_MIN of them or more, drawn as one shaded band instead of a rule per step.
BAND_GAP, BAND_MIN = 5, 5
RULE_PIXELS = 3  # events closer than this on a chart BUCKETS pixels wide share one rule


def run_origin(rows: pd.DataFrame, events: pd.DataFrame) -> float:
    """The unix time the run began, for the wall-clock axis: its first event, or the start of its first step."""
    starts = [events.time.min() if len(events) else float("nan")]
    if len(rows):
        starts.append((rows.time - rows.step_time_s.fillna(0.0)).min())
    return float(pd.Series(starts).min())


def with_x(rows: pd.DataFrame, axis: str, origin: float) -> pd.DataFrame:
    """Step rows with an `x` column on `axis` (one of AXES): the step, the tokens trained on up to it, or
    the seconds from `origin` to the step's end."""
    x = {"step": lambda: rows.step, "tokens": lambda: rows.tokens, "time": lambda: rows.time - origin}[axis]()
    return rows.assign(x=x.astype("float64"))


def metric_series(
    rows: pd.DataFrame, metric: str, grid: tuple[float, float], buckets: int = BUCKETS, smoothing: float = 0.0
) -> pd.DataFrame:
    """One charted metric (see chart_titles) ready to draw from step rows with `x` (see with_x) and
    `segment` (see segments) columns: columns x, step, value, segment (and smooth, with `smoothing`), each
    segment downsampled on the chart's grid of x and never joined to another (a line is drawn per segment)."""
    scale = _charts()[metric].scale  # drawn in the unit its title names; the store keeps base units
    return _segment_series(rows, metric, grid, buckets, scale, smoothing)


def custom_series(custom: pd.DataFrame, rows: pd.DataFrame, name: str, grid: tuple[float, float], buckets: int = BUCKETS,
                  smoothing: float = 0.0) -> pd.DataFrame:  # fmt: skip
    """One of the user's own metrics, as metric_series draws a step metric, from custom metric rows
    (keel.monitor.store.read_custom_metrics) with a `segment` column, placed on the x of the step rows
    `rows` of the same (step, attempt): drawn as reported, in the user's unit."""
    mine = custom[custom.name == name].merge(rows[["step", "attempt", "x"]], on=["step", "attempt"], how="inner")
    return _segment_series(mine, "value", grid, buckets, 1.0, smoothing)


def smoothed(values: pd.Series, weight: float) -> pd.Series:
    """The exponential moving average TensorBoard and W&B draw for a smoothing `weight` in [0, 1): each
    point weight x the average before it plus (1 - weight) x itself, divided by (1 - weight^n) so that
    the first points are not pulled towards zero (pandas' adjusted EWM is exactly that)."""
    return values.ewm(alpha=1.0 - weight, adjust=True, ignore_na=True).mean()


def _segment_series(
    rows: pd.DataFrame, column: str, grid: tuple[float, float], buckets: int, scale: float, smoothing: float
) -> pd.DataFrame:
    shown = rows[["x", "step", column, "segment"]].dropna(subset=[column, "x"]).rename(columns={column: "value"})
    frames = []
    for _, part in shown.groupby("segment", sort=False):
        part = part.sort_values("x", kind="stable").assign(value=lambda f: f.value * scale)
        if smoothing > 0:  # over every point in range, then downsampled at the raw line's points
            part = part.assign(smooth=smoothed(part.value, smoothing))
        frames.append(m4(part, "x", "value", buckets, grid))  # the raw line's extremes: no spike hidden
    columns = ["x", "step", "value", "segment", *(["smooth"] if smoothing > 0 else [])]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def event_markers(events: pd.DataFrame) -> pd.DataFrame:
    """The events to mark on the charts: step, time, attempt, rank, kind (the word read), severity,
    message. A restart and a node loss are marked where the failure happened (the step that failed and
    the time it did, from the event's data), not where the run resumed: after the hang or crash that
    caused them, not before it."""
    marked = events[events.kind.isin(MARKER_KINDS) & events.step.notna()]
    shown = marked[["step", "time", "attempt", "rank", "kind", "severity", "message"]].copy()
    failed_at = [_failure_point(kind, data) for kind, data in zip(marked.kind, marked.data)]
    shown["step"] = [s if f is None else f[0] for s, f in zip(shown.step, failed_at)]
    shown["time"] = [t if f is None else f[1] for t, f in zip(shown.time, failed_at)]
    shown["kind"] = shown.kind.map(MARKER_KINDS)
    shown["rank"] = shown["rank"].astype("string").fillna("all")
    return shown.astype({"step": "int64", "time": "float64"}).reset_index(drop=True)


def _failure_point(kind: str, data: dict) -> tuple[int, float] | None:
    """(step, time) of the failure a restart or node loss recovered from, when its data says."""
    if kind == EventKind.RESTART and "step" in data and "time" in data:
        return int(data["step"]) + 1, float(data["time"])  # data["step"]: the furthest step recorded before it
    return None


def marker_x(markers: pd.DataFrame, rows: pd.DataFrame, axis: str, origin: float) -> pd.Series:
    """Each marker's place on `axis`: its step; the tokens trained on at that step (read off the step
    rows with x, see with_x); or the seconds from `origin` to the event."""
    if axis == "time":
        return markers.time - origin
    if axis == "tokens":
        known = rows.dropna(subset=["x"]).sort_values("step")
        return pd.Series(np.interp(markers.step, known.step, known.x) if len(known) else np.nan, index=markers.index)
    return markers.step.astype("float64")


def marker_layers(markers: pd.DataFrame, domain: tuple[float, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The markers (event_markers, with an `x` column) as a chart over the x extent `domain` draws them:
    (rules, bands).

    bands: a lasting fault (see BAND_GAP) as one shaded span: x0, x1, first, last (steps), kind, colour,
    count, text. rules: every other event grouped with those less than RULE_PIXELS of BUCKETS pixel
    columns from it (at one step, or on a long range at steps a pixel apart: rules that would cover each
    other), one rule each: step (the first), x, kinds (the words, in the order they happened), colours
    (each kind's, in that order: the rule is drawn in stripes of them, so every kind the legend lists is
    seen), text (a line per event)."""
    in_band = pd.Series(False, index=markers.index)
    bands = []
    lasting = ["kind", "rank", *(["run"] if "run" in markers else [])]  # one run's fault, on the Compare page
    for (kind, *_), group in markers[~markers.kind.isin(ROUTINE_MARKERS)].groupby(lasting, sort=False):
        group = group.sort_values("step", kind="stable")
        run = (group.step.diff() > BAND_GAP).cumsum()  # a new run wherever a gap opens
        for _, part in group.groupby(run):
            if len(part) >= BAND_MIN:
                in_band[part.index] = True
                bands.append(_band(kind, part))
    single = markers[~in_band].sort_values("x", kind="stable")
    near = RULE_PIXELS * (domain[1] - domain[0]) / BUCKETS
    single = single.assign(cluster=(single.x.diff() > near).cumsum(), order=single.kind.map(_CAUSAL_ORDER))
    single = single.sort_values(["cluster", "step", "order", "time"], kind="stable")  # in the order they happened
    return pd.DataFrame(_rules(single), columns=_RULE_COLUMNS), pd.DataFrame(bands, columns=_BAND_COLUMNS)


_RULE_COLUMNS = ["step", "x", "kinds", "colours", "text"]
_BAND_COLUMNS = ["x0", "x1", "first", "last", "kind", "colour", "count", "text"]


def _rules(events: pd.DataFrame) -> list[dict]:
    """A rule per cluster of `events` (sorted by cluster, then in causal order), in plain Python: the few
    hundred events of a long run's range in milliseconds, where a pandas group took 4 ms each."""
    rules: dict[int, dict] = {}
    for e in events.itertuples():
        rule = rules.setdefault(e.cluster, {"step": int(e.step), "x": float(e.x), "kinds": [], "colours": [], "lines": []})
        rule["x"] = min(rule["x"], float(e.x))
        rule["kinds"].append(e.kind)
        rule["colours"].append(MARKER_COLOURS[e.kind])
        rule["lines"].append(f"{e.kind} at step {e.step:,} (attempt {e.attempt}, rank {e.rank}, {e.severity}): {e.message}")
    return [{**{k: r[k] for k in _RULE_COLUMNS if k != "text"}, "text": "\n".join(r["lines"])} for r in rules.values()]


def _band(kind: str, part: pd.DataFrame) -> dict:
    first, last = int(part.step.min()), int(part.step.max())
    text = f"{kind} from step {first:,} to {last:,} ({len(part)} events): {part.message.iloc[0]}"
    return {"x0": float(part.x.min()), "x1": float(part.x.max()), "first": first, "last": last, "kind": kind,
            "colour": MARKER_COLOURS[kind], "count": len(part), "text": text}  # fmt: skip


def straggler_marks(events: pd.DataFrame, steps: tuple[int, int]) -> pd.DataFrame:
    """The straggler events naming a rank, within the step range: step, rank, message."""
    found = events[(events.kind == EventKind.STRAGGLER) & events.step.notna() & events["rank"].notna()]
    found = found[found.step.between(*steps)]
    return found[["step", "rank", "message"]].astype({"step": "int64", "rank": "int64"}).reset_index(drop=True)


def compare_series(runs: dict[str, pd.DataFrame], metric: str, buckets: int = BUCKETS, smoothing: float = 0.0) -> pd.DataFrame:
    """Several runs' effective trajectories of one charted metric, each with its `x` (see with_x):
    columns x, step, value, run (and smooth), each run downsampled with M4 on one grid spanning every run,
    so the runs stay comparable point for point."""
    xs = pd.concat([f.x for f in runs.values()]).dropna() if runs else pd.Series(dtype="float64")
    grid = (float(xs.min()), float(xs.max())) if len(xs) else (0.0, 1.0)
    parts = [metric_series(kept.assign(segment=name), metric, grid, buckets, smoothing) for name, kept in runs.items()]
    drawn = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["x", "step", "value", "segment"])
    return drawn.rename(columns={"segment": "run"})


def slowest_rank_counts(rows: pd.DataFrame, top: int = 8) -> pd.DataFrame:
    """How often each rank was among the slowest few by busy time of a measured step (the step rows'
    `slowest_ranks`), for the `top` ranks named most: columns rank, steps. From the step rows alone, so
    it reads as fast at 16,384 ranks as at 8."""
    named = rows.slowest_ranks.dropna()
    ranks = named.str.split(",").explode().astype("int64")
    counts = ranks.value_counts().rename_axis("rank").rename("steps").reset_index()
    return counts.sort_values(["steps", "rank"], ascending=[False, True]).head(top).reset_index(drop=True)
