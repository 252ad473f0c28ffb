"""The global gradient norm and clipping of a user's model, DDP or FSDP2, the same number on every rank.

Keel's trainer knows its layout (keel.trainer.parallel.parallelize.global_grad_norm); a user's model is
one of two kinds here. A DTensor gradient (FSDP2's `fully_shard`) holds a shard: each rank sums the
squares of its local shard, divided by how many ranks of the world hold that same shard. A plain tensor
gradient is taken to be replicated over the world (DDP all-reduced it in the backward): each rank adds
its share, 1/world of it. One all-reduce then gives every rank the same sum, and a NaN or Inf on any
rank (a fault injected after DDP's all-reduce, a non-finite loss) makes it NaN everywhere: every rank
skips the same step. torch.nn.utils.clip_grad_norm_ would compute each rank's own norm, which differs
across ranks exactly when one rank's gradient went bad.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: Iterable[torch.nn.Parameter], world: int, loss_finite: bool = True) -> float:
    """The L2 norm of the whole model's gradient over all ranks; NaN on every rank when any rank's gradient
    or loss (`loss_finite`) is not finite. Each group of tensors held by as many ranks takes one call of
    torch's fused norm (in the gradients' dtype, as clip_grad_norm_): summing squares in float64 tensor by
    tensor cost 25 ms a step on a 3.3M-parameter model on CPU, against 1.2 ms."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        grad, copies = p.grad, world
        if isinstance(grad, DTensor):
            shards = math.prod(grad.device_mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_shard())
            grad, copies = grad.to_local(), world // shards
        by_copies.setdefault(copies, []).append(grad.detach())
    device = next((g[0].device for g in by_copies.values()), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for copies, grads in by_copies.items():
        total += torch.nn.utils.get_total_norm(grads).double().square() / copies
    if not loss_finite:
        total += math.nan
    if world > 1:
        dist.all_reduce(total)
    return float(total.sqrt())


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scales every gradient by max_norm / total_norm when that is below 1 (0 turns clipping off)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
