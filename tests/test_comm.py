"""comm_share's core: communication time that no compute covers."""

from keel.trainer.comm import exposed_time


def test_exposed_time_subtracts_overlapping_compute():
    assert exposed_time([(0, 10)], []) == 10
    assert exposed_time([(0, 10)], [(2, 3), (5, 12)]) == 4  # exposed: 0-2 and 3-5
    assert exposed_time([(0, 10)], [(-5, 20)]) == 0  # fully overlapped
    assert exposed_time([(0, 4), (2, 6), (8, 9)], [(3, 8)]) == 4  # overlapping comm merged: 0-3 and 8-9
    assert exposed_time([], [(0, 1)]) == 0
