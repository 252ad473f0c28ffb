"""The memory model of the planner and of preflight: what a rank of a layout holds, without building it.

Model states (the ZeRO paper's term: parameters, gradients, optimizer state) are counted from the model's
shape with the trainer's own splits; keel.trainer.simulate builds the same rank on meta and reads the
real tensors, and the two agree exactly (tests/test_scale.py), for every preset at layouts of 8 to 16,384
GPUs. Activations are estimated with Korthikanti et al. 2022's per-layer formulas (activation_bytes).

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

from keel.trainer.config import JobConfig
from keel.trainer.model_args import ModelArgs, model_args, padded_vocab_size, stage_layers

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


def block_shapes(args: ModelArgs, tp: int) -> list[tuple[int, int]]:
    """The (rows, columns) of each parameter of one transformer block on a tp rank: wq, wk, wv, wo, w1, w3,
    w2 and the two norms."""
    d, kv, ffn = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    return [(d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), (ffn // tp, d), (ffn // tp, d), (d, ffn // tp), (d, 1), (d, 1)]


def stage_shapes(args: ModelArgs, tp: int, n_stages: int, stage: int) -> tuple[int, list[tuple[int, int]]]:
    """(layers, the (rows, columns) of each parameter a tp rank holds) of pipeline stage `stage`."""
    d, vocab = args.dim, padded_vocab_size(args.vocab_size, tp)
    layers = len(stage_layers(args.n_layers, n_stages, stage))
    shapes = block_shapes(args, tp) * layers
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


def busiest_rank_state_bytes(cfg: JobConfig, gathered_bytes: int = WEIGHT_BYTES) -> int:
    """The model states of the rank that holds the most (dp rank 0 holds the largest FSDP chunk; the pipeline
    rank with the most parameters), plus the gathered copies FSDP2 holds beside its shards at the peak:
    under zero2 the whole stage stays gathered from its forward to its backward; under zero3 one block is,
    plus the next one prefetched, and the root unit (embedding, final norm, head). The gathered copies
    take `gathered_bytes` a parameter: 4 (fp32; an upper bound under bf16) or 2 (bf16 mixed precision,
    which gathers in bf16)."""
    par, args = cfg.parallel, model_args(cfg)
    states = [rank_model_states(args, par.pp, par.dp, par.tp, r, 0, par.pp_virtual_stages, par.dp_mode) for r in range(par.pp)]
    busiest = max(states, key=lambda s: s.total_bytes)
    if par.dp == 1 or par.dp_mode == "replicate":
        return busiest.total_bytes
    whole = rank_model_states(args, par.pp, 1, par.tp, states.index(busiest), 0, par.pp_virtual_stages)
    block = sum(rows * cols for rows, cols in block_shapes(args, par.tp))
    root = whole.params - whole.layers * block
    gathered = whole.params if par.dp_mode == "zero2" else 2 * block + root
    return busiest.total_bytes + gathered_bytes * gathered


def activation_bytes(cfg: JobConfig, element_bytes: int = 4) -> int:
    """Activations kept for backward on the busiest rank, with `element_bytes` per element: 4 (fp32, what the
    CPU trains in, and an upper bound under bf16) or 2 (bf16, the planner's GPU jobs). Per layer and
    micro-batch s·b·d·(10 + 24/t + 5·h·s/(d·t)) bytes at 16 bits (Korthikanti et al. 2022, no sequence
    parallelism), scaled by element_bytes / 2. Under training.activation_checkpointing, that paper's figures too:
    `selective` drops the attention term (s·b·d·(10 + 24/t)), `full` keeps each layer's input (2·s·b·d)
    and holds one layer's whole activations while it recomputes it. A pipeline's first stage holds
    min(micro-batches, pp) micro-batches under 1F1B (interleaved counted alike) and all of them under
    GPipe; plus the logits and their gradient. Sequence parallelism splits the 10 (norms, residual,
    dropout: s·b·d·34/t with it, the paper's eq. 5), and the loss parallel keeps 1/t of the logits."""
    par, tr, args = cfg.parallel, cfg.training, model_args(cfg)
    s, b, d, h, t = cfg.data.seq_len, cfg.microbatch_rows, args.dim, args.n_heads, par.tp
    scale = element_bytes / 2  # the paper's figures are bytes at 16 bits
    outside = 10 / t if par.sequence_parallel else 10  # the activations between the tensor-parallel matmuls
    whole_layer = scale * s * b * d * (outside + 24 / t + 5 * h * s / (d * t))
    kept_per_layer = {
        "none": whole_layer,
        "selective": scale * s * b * d * (outside + 24 / t),
        "full": scale * 2 * s * b * d / (t if par.sequence_parallel else 1),
    }
    recomputing = whole_layer if tr.activation_checkpointing == "full" else 0
    in_flight = 1 if par.pp == 1 else tr.microbatches if par.pp_schedule == "GPipe" else min(tr.microbatches, par.pp)
    # Gathered and padded, before the cut to the real vocabulary; each rank's own columns under the loss parallel.
    # fp32 whatever the training dtype: the loss casts the logits up (keel.trainer.parallel.loss_fn).
    logits = 2 * 4 * s * b * padded_vocab_size(args.vocab_size, t) / (t if par.loss_parallel else 1)
    return int(kept_per_layer[tr.activation_checkpointing] * args.n_layers / par.pp * in_flight + recomputing + logits)
