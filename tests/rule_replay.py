"""Replays series Prometheus scraped of a real run through `promtool test rules`, time compressed.

A real run of a few minutes cannot hold the shipped rules' windows (a throughput baseline of an hour,
15 minutes sustained), and the rules must not be edited to fit. So the replay stretches the run instead:
one scrape a second becomes one sample every `compression` seconds, and what the run reported in seconds
is stretched with it (the step's time stamp and durations multiplied), as if the same run had gone
`compression` times slower. Ratios (comm share, straggler scores from busy seconds), losses and counters
are unchanged: a counter's rate is divided by the stretched time.

MFU is the exception: a CPU run's MFU against any real accelerator's peak is near zero, so the replay
states the peak as the one at which the run's clean steps reach `clean_mfu` (a good GPU run's figure).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import yaml

SCRAPE_INTERVAL_S = 1.0  # the e2e Prometheus scrapes every second


def series_the_rules_read(rules: Path) -> set[str]:
    return set(re.findall(r"\bkeel_[a-z_]+\b", rules.read_text()))


def replayed_value(name: str, value: str, t0: float, compression: float, mfu_scale: float) -> str:
    """One sample as the stretched run would have reported it."""
    if value in ("NaN", "+Inf", "-Inf"):
        return value
    v = float(value)
    if name == "keel_last_step_timestamp_seconds":  # a time: measured from the replay's start, stretched
        v = (v - t0) * compression
    elif name.endswith("_seconds"):  # a duration
        v *= compression
    elif name == "keel_mfu_ratio":
        v *= mfu_scale
    return repr(float(v))  # a plain float: a numpy scalar prints as np.float64(...)


def input_series(recorded: list[dict], names: set[str], t0: float, compression: float, mfu_scale: float) -> list[dict]:
    """promtool's input_series: sample i is what the scrape i seconds after t0 saw, `_` where no scrape
    landed, and a staleness marker after a series' last sample (as Prometheus writes one when its target
    goes away), so that a run that ended is not read as a run whose last value stands still."""
    out = []
    for found in recorded:
        labels = dict(found["metric"])
        name = labels.pop("__name__")
        if name not in names:
            continue
        by_index: dict[int, str] = {}
        for t, value in found["values"]:
            by_index[round((float(t) - t0) / SCRAPE_INTERVAL_S)] = replayed_value(name, value, t0, compression, mfu_scale)
        last = max(by_index)
        values = [by_index.get(i, "_") for i in range(last + 1)] + ["stale"]
        selector = ", ".join(f'{key}="{labels[key]}"' for key in sorted(labels))
        out.append({"series": f"{name}{{{selector}}}", "values": " ".join(values)})
    return out


def start_of(recorded: list[dict]) -> float:
    return min(float(t) for found in recorded for t, _ in found["values"])


def fired_by(at_s: float, names: list[str], unchecked: str | None = None) -> dict:
    """A promtool expression test: the rules that have fired (in any run) by at_s seconds of the replay are
    exactly `names`, leaving out the rule `unchecked`."""
    window = max(1, math.floor(at_s))
    left_out = "" if unchecked is None else f', alertname!="{unchecked}"'
    return {
        "expr": f'group by (alertname) (max_over_time(ALERTS{{alertstate="firing"{left_out}}}[{window}s]))',
        "eval_time": f"{window}s",
        "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1} for name in sorted(names)],
    }


def promtool_test_file(rules: Path, series: list[dict], compression: float, checks: list[dict]) -> str:
    """A promtool unit-test file for the shipped rules, their own evaluation interval of a minute."""
    doc = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{"interval": f"{compression:g}s", "input_series": series, "promql_expr_test": checks}],
    }
    return yaml.safe_dump(doc, sort_keys=False, width=1 << 20)


def prometheus_rate(times: np.ndarray, counts: np.ndarray, at: float, window: float) -> float | None:
    """rate(counter[window]) at `at` as Prometheus 2.x computes it (promql/functions.go, extrapolatedRate):
    the samples in [at - window, at], their increase extrapolated to the window's edges where the first and
    last samples lie within 1.1 sample intervals of them (else half an interval), and no further back than
    the counter's zero. None with fewer than two samples, as Prometheus gives no result."""
    inside = (times >= at - window) & (times <= at)
    if np.count_nonzero(inside) < 2:
        return None
    t, c = times[inside], counts[inside]
    increase, sampled = c[-1] - c[0], t[-1] - t[0]
    to_start, to_end, interval = t[0] - (at - window), at - t[-1], sampled / (len(t) - 1)
    if increase > 0 and c[0] >= 0:
        to_start = min(to_start, sampled * c[0] / increase)
    reach = 1.1 * interval
    extrapolated = sampled + (to_start if to_start < reach else interval / 2) + (to_end if to_end < reach else interval / 2)
    return increase * extrapolated / sampled / window


def lowest_held_throughput(
    step_times: np.ndarray, scrape_times: np.ndarray, start: float, window_s: float, baseline_s: float, for_s: float, every_s: float
) -> float:
    """The throughput rule computed from a run's own record of its steps (when each ended), in the run's
    seconds: the lowest ratio of rate() over the last `window_s` to rate() over the `baseline_s` that ended
    `baseline_s` ago that held for `for_s`, evaluated every `every_s` from `start` (the replay's first scrape:
    its evaluations fall on the same instants). The counter's samples are the steps the record holds at each
    scrape, placed where the replay places that scrape (on the second), so that only what the exporter
    showed can differ from promtool's reading. NaN when no stretch held that long."""
    steps = np.sort(step_times)
    times = np.round(np.sort(scrape_times) - start) * SCRAPE_INTERVAL_S
    counts = np.searchsorted(steps, np.sort(scrape_times), side="right").astype(float)
    moments = np.arange(0.0, times[-1] + baseline_s + window_s, every_s)
    ratios = np.full(len(moments), np.nan)  # NaN where the rule has no result: the alert resets
    for i, t in enumerate(moments):
        now, before = prometheus_rate(times, counts, t, window_s), prometheus_rate(times, counts, t - baseline_s, baseline_s)
        if now is not None and before:
            ratios[i] = now / before
    held = math.ceil(for_s / every_s) + 1  # pending at its first evaluation, firing `for_s` later
    stretches = np.array([ratios[i : i + held].max() for i in range(len(ratios) - held + 1)])
    stretches = stretches[~np.isnan(stretches)]
    return float(stretches.min()) if len(stretches) else math.nan
