"""Simulated scale: one process plays one rank of a job of any size, to see what that rank would hold.

A fake process group (PyTorch's, from its test utilities: every collective returns at once without
moving data) stands in for the job's thousands of ranks, so the real device mesh, tensor-parallel plan
and FSDP2 sharding are built for the rank asked for, on the meta device: shapes, no memory. Gradients
of the same shapes are attached and one real AdamW step (keel.trainer.optim) makes the optimizer's
state, so every figure is read off the tensors that training would allocate, not from a formula: the
ground truth a planner's estimate is checked against.

    keel simulate --model.preset=70b --pp 1 --dp 64 --tp 8 --training.global_batch_size=1024    # first and last rank
    keel simulate --model.preset=405b --pp 8 --dp 256 --tp 8 --training.microbatches=8 \
        --training.global_batch_size=2048 --rank 0 --rank 9000 --rank -1
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.launch.launcher import parse_train_args
from keel.trainer.model_args import model_args
from keel.trainer.optim import build_optimizer
from keel.trainer.parallel import parallelize
from keel.trainer.planning.memory_model import ModelStates


@dataclass(frozen=True)
class RankMemory(ModelStates):
    """What one rank holds for training, read off its built tensors, and where it sits in the layout."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int


def simulate_rank(cfg: JobConfig, rank: int) -> RankMemory:
    """Rank `rank` of cfg's layout (0 <= rank < cfg.world_size), built on meta under a fake process group."""
    if not 0 <= rank < cfg.world_size:
        raise ValueError(f"rank={rank}: the layout has ranks 0 to {cfg.world_size - 1}")
    dist.init_process_group("fake", rank=rank, world_size=cfg.world_size, store=FakeStore())
    try:
        layout = parallelize.build_layout(cfg, torch.device("cpu"))
        parts = parallelize.build_model_parts(cfg, model_args(cfg), layout, torch.device("meta"), bf16=False)
        optimizer = build_optimizer(parts, cfg.optim, fused=False)
        params = [p for part in parts for p in part.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # makes AdamW's state, on meta
        # The two moments per parameter; AdamW's step counters are scalars (4 bytes a parameter tensor), left out.
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        return RankMemory(
            rank=rank, pp_rank=layout.pp_rank, dp_rank=layout.dp_rank, tp_rank=layout.tp_rank,
            layers=sum(len(part.layers) for part in parts),
            params=sum(_local(p).numel() for p in params),
            param_bytes=sum(_bytes(p) for p in params),
            grad_bytes=sum(_bytes(p.grad) for p in params),
            optimizer_bytes=sum(_bytes(t) for t in state),
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="keel simulate", description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--rank", type=int, action="append", help="a rank to simulate (repeatable; default: the first and the last)")
    opts, train_argv = parser.parse_known_args(argv)
    try:
        cfg, _ = parse_train_args(train_argv)
        ranks = opts.rank or [0, cfg.world_size - 1]
        results = [simulate_rank(cfg, r + cfg.world_size if r < 0 else r) for r in ranks]  # -1: the last
    except (ConfigError, ValueError) as e:
        print(f"keel simulate: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    par = cfg.parallel
    print(f"{cfg.model.preset} at pp{par.pp} dp{par.dp} tp{par.tp} ({cfg.world_size:,} ranks, dp_mode {par.dp_mode}), fp32 + AdamW:")
    print(
        f"{'rank':>7} {'pp,dp,tp':>12} {'layers':>6} {'parameters':>14} {'weights GiB':>11} {'grads GiB':>9} {'AdamW GiB':>9} {'total GiB':>9}"
    )
    for m in results:
        where = f"{m.pp_rank},{m.dp_rank},{m.tp_rank}"
        gib = [b / 2**30 for b in (m.param_bytes, m.grad_bytes, m.optimizer_bytes, m.total_bytes)]
        print(f"{m.rank:>7} {where:>12} {m.layers:>6} {m.params:>14,} {gib[0]:>11.2f} {gib[1]:>9.2f} {gib[2]:>9.2f} {gib[3]:>9.2f}")
    return EXIT_OK
