"""What the trainer's straggler alert relies on from keel.monitor.stragglers: scores from median busy
times, each straggler flagged once until it recovers or gets twice as slow, unmeasured samples and
single outliers ignored."""

from __future__ import annotations

import math

import pytest

from keel.monitor.stragglers import StragglerConfig, StragglerTracker

NAN = float("nan")


def feed(tracker: StragglerTracker, samples: list[list[float]]) -> list[tuple[int, float]]:
    flagged = []
    for busy in samples:
        flagged += tracker.update(busy)
    return flagged


def test_equal_ranks_score_one_and_nothing_is_flagged():
    tracker = StragglerTracker(StragglerConfig(), world=4)
    assert feed(tracker, [[0.2, 0.2, 0.2, 0.2]] * 10) == []
    assert tracker.scores() == [1.0, 1.0, 1.0, 1.0]


def test_no_score_before_min_samples():
    tracker = StragglerTracker(StragglerConfig(min_samples=3), world=2)
    assert feed(tracker, [[0.1, 0.4]] * 2) == []
    assert all(math.isnan(s) for s in tracker.scores())
    assert tracker.update([0.1, 0.4]) == [(1, 0.25)]


def test_a_rank_twice_as_slow_is_flagged_once():
    tracker = StragglerTracker(StragglerConfig(), world=4)
    flagged = feed(tracker, [[0.2, 0.2, 0.4, 0.2]] * 10)
    assert flagged == [(2, pytest.approx(0.5))]
    assert tracker.scores() == pytest.approx([1.0, 1.0, 0.5, 1.0])


def test_a_rank_that_recovered_and_slowed_again_is_flagged_again():
    tracker = StragglerTracker(StragglerConfig(window=5), world=2)
    assert feed(tracker, [[0.2, 0.4]] * 5) == [(1, pytest.approx(0.5))]
    assert feed(tracker, [[0.2, 0.2]] * 5) == []  # back on par: the flag is cleared
    assert tracker.scores() == [1.0, 1.0]
    assert feed(tracker, [[0.2, 0.5]] * 5) == [(1, pytest.approx(0.4))]


def test_a_flagged_rank_that_gets_much_slower_is_reported_again():
    """Flagged by noise at 0.7, then a real slowdown: the second report is the one that matters."""
    tracker = StragglerTracker(StragglerConfig(window=3, min_samples=3), world=2)
    assert feed(tracker, [[0.7, 1.0]] * 3) == [(1, pytest.approx(0.7))]
    assert feed(tracker, [[0.7, 1.2]] * 3) == []  # 0.58: slower, but not half the reported score
    assert feed(tracker, [[0.7, 2.8]] * 3) == [(1, pytest.approx(0.25))]
    assert feed(tracker, [[0.7, 2.8]] * 3) == []  # the same slowness is not news


def test_unmeasured_samples_are_ignored():
    tracker = StragglerTracker(StragglerConfig(window=3, min_samples=3), world=3)
    samples = [[0.2, 0.2, 0.4], [0.2, NAN, 0.4], [0.2, 0.2, NAN], [NAN, 0.2, NAN], [0.2, NAN, 0.4]]
    assert feed(tracker, samples[:4]) == []  # rank 2 has only two measured samples so far
    assert tracker.scores()[:2] == [1.0, 1.0] and math.isnan(tracker.scores()[2])
    assert tracker.update(samples[4]) == [(2, pytest.approx(0.5))]
    assert feed(tracker, [[NAN, NAN, NAN]] * 10) == []  # nothing measured: the verdict stands
    assert tracker.scores() == pytest.approx([1.0, 1.0, 0.5])


def test_a_single_slow_sample_does_not_flag():
    tracker = StragglerTracker(StragglerConfig(window=5), world=2)
    samples = [[0.2, 0.2]] * 4 + [[0.2, 2.0]] + [[0.2, 0.2]] * 4
    assert feed(tracker, samples) == []
    assert tracker.scores() == [1.0, 1.0]


def test_misuse_is_an_error():
    with pytest.raises(ValueError, match="min_samples"):
        StragglerTracker(StragglerConfig(window=2, min_samples=3), world=2)
    with pytest.raises(ValueError, match="expected 2 busy times"):
        StragglerTracker(StragglerConfig(), world=2).update([0.1])


def test_ranks_are_compared_with_their_own_pipeline_stage():
    """The last stage computes the loss and is slower by design: that is not a straggler. A slow rank
    inside a stage still is."""
    tracker = StragglerTracker(StragglerConfig(), 4, peers=[[0, 1], [2, 3]])
    flagged = []
    for _ in range(5):
        flagged += tracker.update([1.0, 1.0, 2.0, 4.0])
    assert flagged == [(3, 0.5)]
    assert tracker.scores() == [1.0, 1.0, 1.0, 0.5]
