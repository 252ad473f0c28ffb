"""Activation checkpointing per transformer block (training.activation_checkpointing): the backward
recomputes what the forward did not keep, trading compute for activation memory.

- `full` keeps only each block's input and recomputes the whole block (Chen et al. 2016, "Training Deep
  Nets with Sublinear Memory Cost"): about one more forward pass of compute.
- `selective` keeps the outputs of the matrix multiplications and of attention, the costly ops, and
  recomputes the cheap elementwise ones (norms, rotary, SiLU, the gating product), in the op-level form
  TorchTitan calls `selective op` (after Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models").

Applied in place: each block's forward becomes torch.utils.checkpoint's non-reentrant `checkpoint` of
itself. No wrapper module, so every parameter keeps its name (the initial weights are seeded by name and
checkpoints are keyed by it); and no hooks, so torch.compile traces the checkpoint into the block's graph
(torch.distributed's composable `checkpoint` works by hooks that enter a context manager, which dynamo
cannot trace). It goes on after tensor parallelism and before torch.compile and FSDP, TorchTitan's order.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from keel.trainer.config import ActivationCheckpointing
from keel.trainer.model import Transformer

# Kept under `selective`: their outputs cost a matrix multiplication (or attention) to recompute.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _keep_costly(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: ActivationCheckpointing) -> None:
    """Checkpoint each block of `model` (a pipeline stage) in place; `none` leaves it as it is."""
    if mode == "none":
        return
    context_fn = partial(create_selective_checkpoint_contexts, _keep_costly) if mode == "selective" else noop_context_fn
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward, context_fn)


def _checkpointed(forward, context_fn):
    """`forward`, recomputed in the backward. A plain function rather than a functools.partial of
    `checkpoint`: torch.compile starts tracing at the first frame outside torch, and `checkpoint` itself
    is one it only traces when called from such a frame."""

    def checkpointed_forward(*args):
        # The recomputation calls the block's own forward, not the module: its hooks (FSDP's unshard, which
        # the backward has already run for this block) do not run twice. The blocks draw no random numbers
        # (no dropout), so the RNG state need not be kept.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn)

    return checkpointed_forward
