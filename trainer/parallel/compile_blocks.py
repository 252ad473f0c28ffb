"""torch.compile of each transformer block (training.compile), TorchTitan's granularity: the blocks are
alike, so one compiled graph serves them all, and the embedding, the head and the pipeline's sends stay
eager. fullgraph=True, so that a graph break is an error at the first step rather than a silent slowdown.

It goes on after tensor parallelism and before FSDP (TorchTitan's order): the graph holds the TP
collectives, and FSDP's hooks stay outside it because each block's forward is compiled, not the module,
so parameter names (which seed the initial weights and key the checkpoints) do not change either.
"""

from __future__ import annotations

import torch

from keel.trainer.config import ActivationCheckpointing
from keel.trainer.model import Transformer
from keel.trainer.parallel.activation_checkpoint import apply_activation_checkpointing


def apply_checkpointing_and_compile(model: Transformer, checkpointing: ActivationCheckpointing, compile: bool) -> None:
    """Activation checkpointing and compile, in the order that works: `selective` inside the compiled graph
    (its policy picks ops of the graph), `full` around it (the backward runs the compiled forward again).
    `full` inside the graph fails to compile under tensor parallelism on torch 2.13: a DeviceMesh among
    the tensors saved for the backward."""
    around = compile and checkpointing == "full"
    apply_activation_checkpointing(model, "none" if around else checkpointing)
    if compile:
        apply_compile(model)
    if around:
        apply_activation_checkpointing(model, "full")


def apply_compile(model: Transformer) -> None:
    """Compile each block of `model` (a pipeline stage) in place."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True)
    if model.tok_embeddings is not None and isinstance(model.tok_embeddings.weight, torch.distributed.tensor.DTensor):
        # Under tensor parallelism the embedding's output comes out of an all-reduce (a reduce-scatter under
        # sequence parallelism) as an AsyncCollectiveTensor, whose wait is deferred to its first use. Fed to
        # a compiled block as is, the block's backward hands DTensor's redistribute a plain-tensor gradient
        # ("'Tensor' object has no attribute '_local_tensor'" on torch 2.13). A copy waits for the result
        # and gives the block a plain tensor; it costs one activation of the embedding's size per step.
        model.tok_embeddings.register_forward_hook(lambda _module, _inputs, output: output.clone())
