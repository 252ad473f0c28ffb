"""comm_share: exposed communication time ÷ step time, measured on sampled steps with torch.profiler.

Communication runs on other threads (gloo's workers) or CUDA streams (NCCL kernels). It is exposed
when nothing else is computing meanwhile: on CPU, the training thread is not inside a compute op; on
GPU, no compute kernel runs. Exposed time = |communication intervals minus compute intervals|.
"""

from __future__ import annotations

import contextlib

from torch.profiler import ProfilerActivity, profile, record_function

STEP_MARK = "keel.step"
_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "_c10d_functional::", "record_param_comms")


def _is_comm(name: str) -> bool:
    return name.startswith(_COMM_PREFIXES) or "nccl" in name.lower()


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Total length of the union of `comm` intervals not covered by any `compute` interval."""
    busy = _merge(compute)
    total, j = 0.0, 0
    for start, end in _merge(comm):
        cursor = start
        while j < len(busy) and busy[j][1] <= cursor:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < end:
            if busy[k][0] > cursor:
                total += busy[k][0] - cursor
            cursor = max(cursor, busy[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


def exposed_comm_seconds(prof: profile) -> float:
    """Exposed communication of the step marked with STEP_MARK in this profile."""
    events = prof.events()
    marks = [e for e in events if e.name == STEP_MARK and e.device_type.name == "CPU"]
    if not marks:
        return 0.0
    main_thread, window = marks[0].thread, marks[0].time_range
    on_gpu = any(e.device_type.name == "CUDA" for e in events)
    comm, compute = [], []
    for e in events:
        start, end = max(e.time_range.start, window.start), min(e.time_range.end, window.end)
        if end <= start or e.name == STEP_MARK:
            continue
        if on_gpu:
            # CPU-side c10d calls only enqueue work; on a GPU the kernels are what runs.
            if e.device_type.name == "CUDA":
                (comm if _is_comm(e.name) else compute).append((start, end))
        elif _is_comm(e.name):
            comm.append((start, end))
        elif e.thread == main_thread and not _inside_comm(e):
            compute.append((start, end))
    return exposed_time(comm, compute) / 1e6  # profiler times are in microseconds


def _inside_comm(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_comm(parent.name):
            return True
        parent = parent.cpu_parent
    return False


@contextlib.contextmanager
def sampled_step(enabled: bool, cuda: bool):
    """Profiles the enclosed step when enabled; yields a callable that returns its exposed comm seconds."""
    if not enabled:
        yield lambda: None
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function(STEP_MARK):
            yield lambda: exposed_comm_seconds(prof)

