"""The model states a rank holds (the ZeRO paper's term: parameters, gradients, optimizer state), counted
from the model's shape with the trainer's own splits, without building anything: the planner's memory
figures. keel.trainer.simulate builds the same rank on meta and reads the real tensors; the two agree
exactly (tests/test_scale.py), for every preset at the layouts of 8 to 16,384 GPUs.

The splits, as keel.trainer.parallel makes them:
- pipeline: pp rank r holds stages r, r + pp, ... (one per virtual stage), with model_args.stage_layers'
  layers each; the first stage also holds the embedding, the last the final norm and the head;
- tensor parallel (Megatron): q, k, v, gate and up split by output row, attention out and down by input
  column, the embedding and the head by vocabulary row (padded to 64 x tp rows), norms whole;
- data parallel: FSDP2 (zero2 and zero3 alike at rest) splits each tensor's first dimension with
  torch.chunk over dp, so the last ranks may hold fewer rows, or none; replicate keeps every tensor whole.
Weights and gradients are fp32 (under bf16 FSDP2 keeps fp32 shards and reduces in fp32), AdamW keeps two
fp32 moments: 4 + 4 + 8 = 16 bytes a parameter, the ZeRO paper's 16 for mixed-precision Adam (2 + 2 + 12)
split differently: no half-precision copy is kept (bf16 weights are cast per layer) and the gradients
are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.trainer.model_args import ModelArgs, padded_vocab_size, stage_layers

WEIGHT_BYTES = GRAD_BYTES = 4  # fp32
ADAMW_BYTES = 8  # two fp32 moments


@dataclass(frozen=True)
class ModelStates:
    layers: int  # transformer blocks in the rank's pipeline stages
    params: int  # parameter elements the rank holds: its shards
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _chunk(rows: int, parts: int, index: int) -> int:
    """Rows of torch.chunk(rows, parts)[index], FSDP2's split of a first dimension."""
    per = -(-rows // parts)
    return max(0, min(per, rows - index * per))


def stage_shapes(args: ModelArgs, tp: int, n_stages: int, stage: int) -> tuple[int, list[tuple[int, int]]]:
    """(layers, the (rows, columns) of each parameter a tp rank holds) of pipeline stage `stage`."""
    d, kv, ffn = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    vocab = padded_vocab_size(args.vocab_size, tp)
    block = [(d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), (ffn // tp, d), (ffn // tp, d), (d, ffn // tp), (d, 1), (d, 1)]
    layers = len(stage_layers(args.n_layers, n_stages, stage))
    shapes = block * layers
    first, last = stage == 0, stage == n_stages - 1
    if first:
        shapes.append((vocab // tp, d))
    if last:
        shapes.append((d, 1))  # the final norm
        if not (args.tie_embeddings and first):  # a tied head is the embedding's matrix, counted once
            shapes.append((vocab // tp, d))
    return layers, shapes


def rank_model_states(
    args: ModelArgs, pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, virtual_stages: int = 1, dp_mode: str = "zero3"
) -> ModelStates:
    """The model states of the rank at (pp_rank, dp_rank) of a pp x dp x tp layout (every tp rank holds
    the same amount)."""
    n_stages = pp * virtual_stages
    layers, params = 0, 0
    for stage in (pp_rank + k * pp for k in range(virtual_stages)):
        stage_layer_count, shapes = stage_shapes(args, tp, n_stages, stage)
        layers += stage_layer_count
        sharded = dp > 1 and dp_mode != "replicate"
        params += sum((_chunk(rows, dp, dp_rank) if sharded else rows) * cols for rows, cols in shapes)
    return ModelStates(layers, params, WEIGHT_BYTES * params, GRAD_BYTES * params, ADAMW_BYTES * params)
