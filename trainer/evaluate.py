"""The validation loss: a forward pass over the validation batches on every layout, leaving training as it was.

It runs between a step's update and its report, under no_grad: no gradient, no optimizer step, no draw of
the training data or of any RNG (the model has no dropout), so a run's training losses are the same, bit for
bit, with evaluation on or off. A pipeline evaluates through its schedule's forward-only pass
(PipelineSchedule.eval), on the micro-batches it trains with; loss parallelism evaluates the loss on the
vocabulary-parallel logits as training does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from keel.trainer.config import JobConfig
from keel.trainer.data.validation import ValidationBatches
from keel.trainer.parallel import parallelize
from keel.trainer.step import whole_loss


def validation_loss(
    cfg: JobConfig,
    parts,
    schedule,
    layout: parallelize.Layout,
    batches: ValidationBatches,
    autocast: AbstractContextManager,
    device: torch.device,
) -> float:
    """The mean loss over every token of the validation batches, the same number on every rank."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad(), parallelize.loss_context(cfg, layout):
        for index in range(len(batches)):
            inputs, targets = (torch.from_numpy(a).to(device) for a in batches.batch(index))
            loss = _batch_loss(cfg, parts, schedule, layout, inputs, targets, autocast)
            if loss is not None:
                total += loss.double()
    # The ranks of the last pipeline stage hold the loss of their dp rank's rows (every tp rank the same
    # value): the mean over them is the mean over the whole batch, as dp ranks hold equal shares.
    holders = torch.tensor(float(layout.is_last_stage_rank), dtype=torch.float64, device=device)
    agreed = torch.stack([total, holders])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(agreed)
    return (agreed[0] / agreed[1]).item() / len(batches)


def _batch_loss(cfg: JobConfig, parts, schedule, layout, inputs, targets, autocast) -> torch.Tensor | None:
    """This rank's mean loss over one validation batch's rows; None on pipeline ranks without the last stage."""
    if schedule is not None:
        losses: list[torch.Tensor] = []
        with autocast:
            if layout.pp_rank == 0:
                schedule.eval(inputs, target=targets, losses=losses)
            else:
                schedule.eval(target=targets, losses=losses)
        return torch.stack([whole_loss(loss) for loss in losses]).mean() if layout.is_last_stage_rank else None
    model, m = parts[0], cfg.training.microbatches
    with autocast:
        losses = [whole_loss(parallelize.loss_fn(model(x), y)) for x, y in zip(inputs.chunk(m), targets.chunk(m))]
    return torch.stack(losses).mean()
