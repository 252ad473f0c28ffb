"""The process group: starting it from torchrun's or srun's variables, its collective timeouts, and
the small collectives the trainer needs outside the model (a sum over ranks, a probe of a link)."""

from __future__ import annotations

import logging
import os
import statistics
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # a name for the annotation only: the sum over ranks serves loops without Keel's layout
    from keel.trainer.parallel.parallelize import Layout

# The train loop's logger: these lines belong to its start-up and recovery story in the rank logs.
log = logging.getLogger("keel.train")
_namespaced = False  # whether init_distributed started this process's group (see store_namespaced_per_restart)


def init_distributed(startup_timeout_s: float = 600.0) -> tuple[torch.device, int, int]:
    """(device, rank, world size). Reads torchrun's variables, or srun's when torchrun's are absent.
    Collectives may wait `startup_timeout_s` at first (ranks load and build at different speeds)."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"], LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0")
        )
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        timeout = timedelta(seconds=startup_timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store = dist.PrefixStore(_store_namespace(), store)
        global _namespaced
        _namespaced = True
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    return device, rank, world


def _store_namespace() -> str:
    """Where this group's keys go in the store. The agent's own store (one node: torchrun shares its
    rendezvous store with the workers) still holds the previous group's keys after a restart (its workers'
    addresses): a namespace per restart keeps the new group from reading them. Across nodes each round gets
    a new store (keel train sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE): no namespace, for torchrun counts
    restarts per node, and a node that replaced a lost one starts at 0 while the others do not."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"keel/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/"
    return "keel/"


def store_namespaced_per_restart() -> bool:
    """Whether this process's group was started by init_distributed, whose store keys are new at each torchrun
    restart. A group started by torch's own init_process_group shares the rendezvous store with the attempts
    before it (torch 2.13): a subgroup made after a restart (dist.new_group) reads the dead attempt's
    addresses under the same name and fails to connect."""
    return _namespaced


def set_collective_timeout(layout: Layout, seconds: float) -> None:
    """Sets the timeout of the default process group and the mesh groups (a private torch API: if it
    moves, the start-up timeout stays, which is safe, only less tight)."""
    if layout.mesh is None:
        return
    try:
        for group in [None] + [layout.group(d) for d in ("pp", "dp", "tp")]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    except (AttributeError, RuntimeError) as e:
        log.info("could not change process-group timeouts (%s)", e)


def sum_over_ranks(value: float, device: torch.device, world: int) -> float:
    """`value` summed over all ranks (float64), on every rank."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


PROBE_BYTES = 8 * 2**20  # big enough that the time is the link's, not the call's overhead
PROBE_WARMUP, PROBE_ROUNDS = 2, 7
PROBE_CALLS, LATENCY_CALLS = 1, 4  # calls a round: one 8 MiB all-reduce; small ones in fours, to time more than the clock


def _seconds_per_call(fn, calls: int, device: torch.device) -> float:
    """The median over PROBE_ROUNDS rounds of a round's time per call: a round in which the scheduler took the
    core away (a loaded machine) moves the mean, not the median."""
    rounds = []
    for _ in range(PROBE_ROUNDS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def probe_link(group, ranks: int, device: torch.device) -> tuple[float, float]:
    """(all-reduce bus bandwidth in bytes/s, as nccl-tests reports it: each byte crosses 2(n-1)/n links;
    latency in seconds) of `group`, from timed all-reduces of 8 MiB and of 4 bytes. Every rank of the job
    calls it; the slowest rank's times count, as it sets the pace of a step."""
    big = torch.zeros(PROBE_BYTES // 4, device=device)  # zeros: the sums stay finite however often they run
    small = torch.zeros(1, device=device)
    for _ in range(PROBE_WARMUP):
        dist.all_reduce(big, group=group)
        dist.all_reduce(small, group=group)
    times = torch.tensor(
        [
            _seconds_per_call(lambda: dist.all_reduce(big, group=group), PROBE_CALLS, device),
            _seconds_per_call(lambda: dist.all_reduce(small, group=group), LATENCY_CALLS, device),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    big_s, small_s = times.tolist()
    return PROBE_BYTES * 2 * (ranks - 1) / ranks / big_s, small_s
