"""comm_share: exposed communication time ÷ step time, measured on sampled steps with torch.profiler (on CPU,
with the step's allocated peak memory, which the profiler records alongside: allocated_peak_bytes).

Communication runs on other threads (gloo's workers) or CUDA streams (NCCL kernels). It is exposed
when nothing else is computing meanwhile: on CPU, the training thread is not inside an aten op; on
GPU, no compute kernel runs. Exposed time = |communication intervals minus compute intervals|.

On CPU a wait can hide inside an aten op: tensor parallelism's async collectives are waited for
(`_c10d_functional::wait_tensor`) when the next op uses their result, so the wait is nested in that
op. The training thread's waits are therefore cut out of its compute intervals.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_MARK = "keel.step"
_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "_c10d_functional::", "record_param_comms")
# Compute on the training thread is its aten ops. Not the annotations around them: FSDP's
# "FSDP::pre_forward" / "FSDP::all_gather" and the pipeline's step labels wrap the waits for other
# ranks, and counting them as compute hid exactly the communication a slow rank makes the others wait in.
_COMPUTE_PREFIX = "aten::"


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


def subtract(intervals: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `intervals` (merged) not covered by any of `holes`."""
    out, cut = [], _merge(holes)
    for start, end in _merge(intervals):
        cursor = start
        for h_start, h_end in cut:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def exposed_comm_seconds(prof: profile) -> float:
    """Exposed communication of the step marked with STEP_MARK in this profile."""
    # The raw kineto events: building profile.events() costs seconds in Python for one step.
    events = prof.profiler.kineto_results.events()
    marks = [e for e in events if e.name() == STEP_MARK]
    if not marks:
        return 0.0
    main_thread, w_start, w_end = marks[0].start_thread_id(), marks[0].start_ns(), marks[0].end_ns()
    on_gpu = any(e.device_type() == DeviceType.CUDA for e in events)
    comm, compute, waits = [], [], []
    for e in events:
        start, end = max(e.start_ns(), w_start), min(e.end_ns(), w_end)
        if end <= start or e is marks[0]:
            continue
        if on_gpu:
            # CPU-side c10d calls only enqueue work; on a GPU the kernels are what runs.
            if e.device_type() == DeviceType.CUDA:
                (comm if _is_comm(e.name()) else compute).append((start, end))
        elif _is_comm(e.name()):
            comm.append((start, end))
            if e.start_thread_id() == main_thread:
                waits.append((start, end))
        elif e.start_thread_id() == main_thread and e.name().startswith(_COMPUTE_PREFIX):
            compute.append((start, end))
    return exposed_time(comm, subtract(compute, waits)) / 1e9


@contextlib.contextmanager
def _stderr_silenced():
    """Kineto prints a line to stderr at every profiler start and stop; keep the console clean."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def warm_up_profiler(cuda: bool) -> None:
    """The first profiler start of a process costs about a second; pay it before the first step. On CPU it
    also frees, while recording memory, a block allocated before: c10's allocator warns of each such free
    (once in a thousand), and its first warning goes here, to /dev/null, not to the user's console."""
    before = torch.empty(1)
    with _stderr_silenced(), profile(activities=_activities(cuda), profile_memory=not cuda):
        del before


def _activities(cuda: bool) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def allocated_peak_bytes(prof: profile) -> int:
    """The most CPU memory the profiled window held at once beyond what was allocated before it: the running
    sum of the allocator's allocations and frees (c10's CPU allocator reports them to the profiler while it
    records memory). Frees of older tensors are not reported, so a tensor from before the window that is
    freed inside it still counts. On CPU this is the counterpart of torch.cuda.max_memory_allocated: the
    tensors alone, without the process's code, Python objects or what glibc keeps after a free."""
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak


class StepProfile:
    """What a sampled step measured, read after the step: its exposed communication seconds (None when not
    profiled) and, where its memory was recorded, its peak: the bytes it started with plus its allocated peak."""

    def __init__(self) -> None:
        self._comm_s: float | None = None
        self._memory_peak: int | None = None

    def measure(self, prof: profile, memory_from: int | None) -> None:
        self._comm_s = exposed_comm_seconds(prof)
        if memory_from is not None:
            self._memory_peak = memory_from + allocated_peak_bytes(prof)

    def comm_seconds(self) -> float | None:
        return self._comm_s

    def memory_peak_bytes(self) -> int | None:
        return self._memory_peak


@contextlib.contextmanager
def sampled_step(enabled: bool, cuda: bool, memory_from: int | None = None):
    """Profiles the enclosed step when enabled, and its CPU memory too when `memory_from` (the bytes of the
    tensors the step starts with) is given; yields a StepProfile, filled in when the block ends."""
    measured = StepProfile()
    if not enabled:
        yield measured
        return
    prof = profile(activities=_activities(cuda), profile_memory=memory_from is not None)
    with _stderr_silenced():
        prof.start()
    try:
        with record_function(STEP_MARK):
            yield measured
    finally:
        with _stderr_silenced():
            prof.stop()
    measured.measure(prof, memory_from)
    # The profile object sits in a reference cycle with its results (thousands of events, about 14 MB a
    # sampled step of the main job): only the cycle collector frees them, and its full collections come ever
    # more seldom as a process grows. Every rank's memory grew without bound (0.45 to 1 GiB over 300 steps).
    prof.profiler = None
