"""comm_share's core: communication time that no compute covers."""

from keel.trainer.exposed_comm import exposed_time, subtract


def test_exposed_time_subtracts_overlapping_compute():
    assert exposed_time([(0, 10)], []) == 10
    assert exposed_time([(0, 10)], [(2, 3), (5, 12)]) == 4  # exposed: 0-2 and 3-5
    assert exposed_time([(0, 10)], [(-5, 20)]) == 0  # fully overlapped
    assert exposed_time([(0, 4), (2, 6), (8, 9)], [(3, 8)]) == 4  # overlapping comm merged: 0-3 and 8-9
    assert exposed_time([], [(0, 1)]) == 0


def test_a_wait_nested_in_an_aten_op_is_not_compute():
    """Tensor parallelism's async collective is waited for inside the next aten op that uses it: the
    480 ms an op spent in `wait_tensor` for a straggler is communication, not compute."""
    compute, waits = [(0, 500)], [(10, 490)]
    assert subtract(compute, waits) == [(0, 10), (490, 500)]
    assert exposed_time([(5, 495)], subtract(compute, waits)) == 480
    assert subtract([(0, 4), (6, 10)], [(2, 7)]) == [(0, 2), (7, 10)]
    assert subtract([(0, 4)], []) == [(0, 4)]
