"""Custom metrics: the user's own values for a step (a validation loss, an accuracy), each under a name
the user chose. The trainer passes them in the step row under CUSTOM_KEY as {name: float}; the run
store keeps them in a table of their own (keel.monitor.store), W&B logs them as custom/<name> and
Prometheus as one gauge labelled by name (keel.monitor.metrics.CUSTOM_METRIC), and the dashboard's Run
page draws one chart per name.

Unlike the step metrics of keel.monitor.metric_registry, they are not declared anywhere: a name is
checked (check_custom_metric_name) by whoever takes it from the user, before the first step.
"""

from __future__ import annotations

import re

from keel.monitor import metric_registry

CUSTOM_KEY = "custom"  # the step row's key holding {name: value}; absent or empty when the user names none
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
_NAME = re.compile(NAME_PATTERN)
_RULE = "letters, digits and underscores, not starting with a digit, at most 64 characters"


def check_custom_metric_name(name: str) -> None:
    """Raises ValueError, one line naming the metric and the fix, unless `name` can name a custom metric:
    it matches NAME_PATTERN (a Prometheus label value, a W&B key and a dashboard title alike) and is not
    the column of a step metric of keel.monitor.metric_registry (read at each call), which it would shadow."""
    if not isinstance(name, str):
        raise ValueError(f"custom metric name {name!r} is a {type(name).__name__}: name it with a string of {_RULE}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"custom metric name {name!r} is not allowed: use {_RULE}, e.g. {_suggestion(name)!r}")
    if name in {m.column for m in metric_registry.STEP_METRICS}:
        raise ValueError(f"custom metric name {name!r} is one of Keel's own step metrics: rename yours, e.g. {_suggestion('my_' + name)!r}")


def _suggestion(name: str) -> str:
    """`name` made valid: other characters as underscores, an underscore before a leading digit, cut to 64."""
    fixed = re.sub(r"[^A-Za-z0-9_]", "_", name.strip()) or "my_metric"
    return ("_" + fixed if fixed[0].isdigit() else fixed)[:64]
