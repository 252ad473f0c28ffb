"""The drill verdict's loss comparison: what passes and what must not."""

from __future__ import annotations

import math

import pandas as pd

from keel.chaos.verdict import compare_losses


def _losses(*values: float) -> pd.DataFrame:
    return pd.DataFrame({"step": range(1, len(values) + 1), "loss": values})


def test_a_run_that_follows_the_reference_passes_with_its_difference():
    worst, reason = compare_losses(_losses(5.0, 4.0), _losses(5.0, 4.0 * (1 + 1e-7)), rtol=1e-5)
    assert reason is None and 0 < worst < 1e-6


def test_a_reference_that_is_not_finite_fails_the_comparison():
    for broken in (math.nan, math.inf):
        worst, reason = compare_losses(_losses(5.0, 4.0, 3.0), _losses(5.0, broken, 3.0), rtol=1e-5)
        assert worst == math.inf and reason == "the reference's loss is not finite at step 2"


def test_a_run_that_differs_or_kept_other_steps_fails():
    assert "from step 2 on" in compare_losses(_losses(5.0, 4.1), _losses(5.0, 4.0), rtol=1e-5)[1]
    assert "kept steps 1..1 (1)" in compare_losses(_losses(5.0), _losses(5.0, 4.0), rtol=1e-5)[1]
    assert "non-finite loss kept at step 1" in compare_losses(_losses(math.nan), _losses(5.0), rtol=1e-5)[1]
