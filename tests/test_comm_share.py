"""comm_share measured on a controlled collective: two real gloo processes, one of which sleeps X ms before
an all-reduce. The other waits those X ms inside the all-reduce, and that wait is the exposed communication
Keel's profiler-based measure must report (the sleeper's own share stays small). And the memory
peak the same profile measures on CPU, on allocations of known sizes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.trainer.exposed_comm import sampled_step, warm_up_profiler

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

SLEEP_S = 1.0
# A rank's exposed communication against its own wall time inside the all-reduce. The profile misses the
# start and the end of a wait: the training thread blocks in the all-reduce before gloo's worker thread,
# whose event is the communication, is scheduled to take the work, and wakes up after it. On a loaded
# machine that hid up to 0.18 s (43 runs at a load average of 8 to 17 on 2 cores: 0.1 to 177 ms less), so
# the sleep is long enough that 0.4 s cannot blur a wait counted as compute (1 s less) or twice (1 s more).
# It never showed more than the wall time: the events lie inside the call.
MISSED_AT_MOST_S = 0.4
OVER_AT_MOST_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(rank: int, port: int, out: str, waiter_in_collective) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x, grads = torch.randn(256, 256), torch.ones(1 << 16)
    dist.all_reduce(grads)  # the connection is made before anything is timed
    warm_up_profiler(cuda=False)
    dist.barrier()
    with sampled_step(True, cuda=False) as exposed:
        for _ in range(20):
            x = torch.tanh(x @ x)  # compute on both ranks, which no communication overlaps
        if rank == 1:
            # The slow rank: it sleeps from when its peer is in the all-reduce, so that the peer waits at least
            # SLEEP_S however late a loaded machine ran either rank's compute (tens of ms) or barrier exit (0.5 s).
            waiter_in_collective.wait(timeout=60)
            time.sleep(SLEEP_S)
        entered = time.perf_counter()
        if rank == 0:
            waiter_in_collective.set()
        dist.all_reduce(grads)
        in_collective_s = time.perf_counter() - entered
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"exposed_s": exposed.comm_seconds(), "in_collective_s": in_collective_s}, f)
    # As the trainer ends (Trainer.finish): both ranks out of their last collective before the group goes.
    # Without it, one rank's teardown raced its peer's (gloo aborted a process 2 times in 8).
    dist.barrier()
    dist.destroy_process_group()


def test_the_peer_of_a_rank_that_sleeps_x_before_an_all_reduce_has_x_of_exposed_communication(tmp_path):
    """X, and whatever a loaded machine adds to the wait: each rank's exposed communication is held to the time
    it sat in the all-reduce by its own clock (the waiter's at least X, the sleeper's milliseconds)."""
    out = str(tmp_path / "exposed")
    waiter_in_collective = mp.get_context("spawn").Event()
    mp.spawn(_measure, args=(_free_port(), out, waiter_in_collective), nprocs=2, join=True)
    waiter, sleeper = (json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1))
    assert waiter["in_collective_s"] >= SLEEP_S, waiter
    for measured in (waiter, sleeper):
        in_collective, exposed = measured["in_collective_s"], measured["exposed_s"]
        assert in_collective - MISSED_AT_MOST_S < exposed < in_collective + OVER_AT_MOST_S, (waiter, sleeper)


def test_a_profiled_steps_memory_peak_is_what_it_started_with_plus_the_most_it_held():
    """The CPU counterpart of torch.cuda.max_memory_allocated: 8 MiB and 4 MiB held together, the 8 freed
    and 2 more taken, is a peak of 12 MiB above the bytes the step started with; a tensor from before the
    step, freed inside it, does not lower it."""
    mib = 2**20
    before = torch.empty(mib // 4)
    warm_up_profiler(cuda=False)
    with sampled_step(True, cuda=False, memory_from=5 * mib) as step:
        a, b = torch.empty(2 * mib), torch.empty(mib)  # float32: 8 and 4 MiB
        del a, before
        c = torch.empty(mib // 2)
    assert step.memory_peak_bytes() == 5 * mib + 12 * mib
    assert b.numel() + c.numel() > 0
    with sampled_step(True, cuda=False) as unmeasured:
        torch.empty(mib)
    assert unmeasured.memory_peak_bytes() is None


def test_sampled_steps_do_not_keep_their_profiles():
    """A profile's results sit in a reference cycle that only the cycle collector frees, and its full
    collections come ever more seldom as a process grows: every rank's memory grew by the results of every
    sampled step (0.45 to 1 GiB over the main job's 300 steps). 300 profiled blocks of 50 matmuls, in a fresh
    process: kept, they grew its peak resident memory by 54 MiB (measured); released, by about 2."""
    script = (
        "import resource, torch\n"
        "from keel.trainer.exposed_comm import sampled_step, warm_up_profiler\n"
        "x = torch.randn(256, 256)\n"
        "warm_up_profiler(cuda=False)\n"
        "def blocks(n):\n"
        "    for _ in range(n):\n"
        "        with sampled_step(True, cuda=False) as step:\n"
        "            for _ in range(50):\n"
        "                x @ x\n"
        "        step.comm_seconds()\n"
        "blocks(20)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "blocks(300)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown_mib = float(proc.stdout.strip().splitlines()[-1])
    assert grown_mib < 20, f"peak resident memory grew {grown_mib:.0f} MiB over 300 profiled blocks"
