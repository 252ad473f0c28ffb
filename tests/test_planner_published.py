"""keel plan against published training runs: each run's own layout, its speed and memory as Keel predicts
them beside what was published, within the tolerance each row states and justifies
(keel.trainer.planning.published; the table is in docs/planning.md).

The calibration rows are the points the compute efficiency is fitted on (keel.trainer.planning.efficiency),
so their speed matches by construction; every other row is held out.
"""

from __future__ import annotations

import pytest

from keel.trainer.config import ConfigError
from keel.trainer.model_args import count_params
from keel.trainer.planning.efficiency import CURVES, calibrated_efficiency, curve_efficiency
from keel.trainer.planning.published import HELD_OUT_TOLERANCE, RUNS, calibrated_curves, compare, job, rank_split, speed_bounds

SPEED_ROWS = [r for r in RUNS if r.speed_tolerance is not None]
MEMORY_ROWS = [r for r in RUNS if r.memory_gib is not None]
BRACKETED_ROWS = [r for r in RUNS if r.bracketed]


@pytest.fixture(scope="module")
def compared():
    return {run.name: compare(run) for run in RUNS}


@pytest.mark.parametrize("run", SPEED_ROWS, ids=lambda r: r.name)
def test_the_published_speed_is_predicted_within_the_rows_tolerance(compared, run):
    c = compared[run.name]
    assert c.speed_ratio == pytest.approx(1, abs=run.speed_tolerance), (
        f"{run.name}: published {run.speed:g} {run.unit}, Keel predicts {c.speed:.4g} ({c.speed_ratio:.2f}x; {run.why})"
    )


@pytest.mark.parametrize("run", MEMORY_ROWS, ids=lambda r: r.name)
def test_the_published_memory_is_predicted_within_the_rows_tolerance(compared, run):
    c = compared[run.name]
    assert c.memory_ratio == pytest.approx(1, abs=run.memory_tolerance), (
        f"{run.name}: published {run.memory_gib:.1f} GiB, Keel predicts {c.memory_gib:.1f} ({c.memory_ratio:.2f}x; {run.why})"
    )


@pytest.mark.parametrize("run", BRACKETED_ROWS, ids=lambda r: r.name)
def test_a_bracketed_speed_lies_between_the_planners_bounds(run):
    low, high = speed_bounds(run, curve_efficiency(run.curve, count_params(run.model)[0])[0])
    assert low * (1 - HELD_OUT_TOLERANCE) <= run.speed <= high * (1 + HELD_OUT_TOLERANCE), f"{run.name}: {low:.3f} to {high:.3f}"
    assert low < high  # a bracket: full recomputation is slower than none


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_every_published_layout_is_accepted(run):
    """Interleaving with m = pp (or any count torch's schedule takes), 128 micro-batches, a tied embedding under a
    pipeline, zero1: the layouts real runs used are scored, not refused, and fit."""
    try:
        job(run)
    except ConfigError as e:
        pytest.fail(f"{run.name}: {run.layout} refused: {e}")
    c = compare(run)
    assert c.plan.fits, f"{run.name}: {c.plan.label()} does not fit: {c.plan.memory_bytes / 2**30:.1f} GiB"


@pytest.mark.slow  # every split of up to 16,384 GPUs: 80 s for all the rows
@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_the_published_split_is_among_the_planners_fastest(run):
    """Within the planner's own accuracy of its pick (the held-out tolerance), among the splits the run's framework
    could run: a published layout the planner thought poor would mean a planner that misleads."""
    place = rank_split(run)
    assert place.share_of_best >= 1 - HELD_OUT_TOLERANCE, (
        f"{run.name}: {place.share_of_best:.0%} of the pick's speed, {place.place} of {place.splits}"
    )


def test_interleaving_speeds_torchtitans_405b_as_much_as_it_measured(compared):
    """Float8 moves both schedules alike, so their ratio tests the bubble model: 128 against 100 tokens/s a GPU."""
    one_f_one_b, interleaved = (compared[f"TorchTitan Llama 3.1 405B, 512 GPUs, {s}"] for s in ("1F1B", "interleaved"))
    predicted = interleaved.speed / one_f_one_b.speed
    assert predicted == pytest.approx(128 / 100, rel=0.10)


def test_the_efficiency_follows_the_calibration_curve_between_its_points():
    h100 = CURVES["H100"]
    low, high = h100[0], h100[-1]
    middle = (low.params * high.params) ** 0.5
    value, source = calibrated_efficiency("H100 SXM", middle)
    assert min(p.efficiency for p in h100) < value < max(p.efficiency for p in h100)
    assert "between" in source
    assert calibrated_efficiency("H200", high.params * 10) == (high.efficiency, calibrated_efficiency("H100", high.params * 10)[1])
    assert calibrated_efficiency("B200", 1e9)[0] == 0.40  # no published run: the fallback, said so
    assert "no published run" in calibrated_efficiency("B200", 1e9)[1]


def test_the_stored_calibration_is_what_the_published_runs_give():
    """efficiency.CURVES keeps the calibration so that keel plan starts at once; the runs must still give it."""
    recomputed = calibrated_curves()
    assert set(recomputed) == set(CURVES)
    for name, points in recomputed.items():
        assert [(p.params, p.source) for p in points] == [(p.params, p.source) for p in CURVES[name]]
        assert [p.efficiency for p in points] == pytest.approx([p.efficiency for p in CURVES[name]], abs=5e-4)
