"""A training step's compute: forward and backward over the micro-batches, through the pipeline
schedule when there is one. Shared by the train loop and `keel preflight`'s overfit check."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from keel.trainer.parallel import parallelize


def forward_backward(cfg, parts, schedule, layout, inputs, targets, autocast, step_loss) -> torch.Tensor | None:
    """Runs one step's forward and backward over all micro-batches. Returns this rank's mean loss,
    or None on pipeline ranks that do not hold the last stage. `step_loss(logits, targets)` is the
    loss of one micro-batch (the pipeline schedule was built with the same function)."""
    with parallelize.loss_context(cfg, layout):
        if schedule is not None:
            losses: list[torch.Tensor] = []
            with autocast:
                if layout.pp_rank == 0:  # holds the first stage, which takes the token ids
                    schedule.step(inputs, target=targets, losses=losses)
                else:
                    schedule.step(target=targets, losses=losses)
            return torch.stack([whole_loss(loss) for loss in losses]).mean().detach() if layout.is_last_stage_rank else None
        model, m = parts[0], cfg.training.microbatches
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
            if parallelize.uses_fsdp(cfg):
                model.set_requires_gradient_sync(i == m - 1)  # reduce-scatter once, after the last micro-batch
            with autocast:
                loss = step_loss(model(x), y) / m
            loss.backward()
            total += whole_loss(loss.detach())
        return total


def whole_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: the loss parallel's is a DTensor, the same value on every tp rank."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
