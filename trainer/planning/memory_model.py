"""The memory model of the planner and of preflight: what a rank of a layout holds, without building it.

Model states (the ZeRO paper's term: parameters, gradients, optimizer state) are counted from the model's
shape with the trainer's own splits; keel.trainer.planning.simulate builds the same rank on meta and reads the
real tensors, and the two agree exactly (tests/test_scale.py), for every preset at layouts of 8 to 16,384
GPUs. Activations are the tensors autograd keeps for Keel's block, counted as Korthikanti et al. 2022 count
GPT's (activation_bytes; their own formulas: korthikanti_activation_bytes).

The splits, as keel.trainer.parallel.parallelize makes them:
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

import functools
from dataclasses import dataclass

from keel.trainer.config import JobConfig
from keel.trainer.model_args import ModelArgs, model_args, padded_vocab_size, stage_layers

WEIGHT_BYTES = GRAD_BYTES = 4  # fp32
ADAMW_BYTES = 8  # two fp32 moments
# What every parameter holds however the layout splits it: the lower bound of any layout's memory.
MODEL_STATE_BYTES_PER_PARAM = WEIGHT_BYTES + GRAD_BYTES + ADAMW_BYTES


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


@functools.cache  # ModelArgs is frozen: the planner asks again for the same stages of every layout it scores
def stage_shapes(args: ModelArgs, tp: int, n_stages: int, stage: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """(layers, (rows, columns, count) of each parameter shape a tp rank holds) of pipeline stage `stage`.
    Counted, not listed: an 80-layer stage is nine block shapes, not 720 entries (the planner sums them
    for every layout it scores)."""
    d, vocab = args.dim, padded_vocab_size(args.vocab_size, tp)
    layers = len(stage_layers(args.n_layers, n_stages, stage))
    shapes = [(rows, cols, layers) for rows, cols in block_shapes(args, tp)] if layers else []
    first, last = stage == 0, stage == n_stages - 1
    if first:
        shapes.append((vocab // tp, d, 1))
    if last:
        shapes.append((d, 1, 1))  # the final norm
        if not (args.tie_embeddings and first):  # a tied head is the embedding's matrix, counted once
            shapes.append((vocab // tp, d, 1))
    return layers, tuple(shapes)


def rank_model_states(
    args: ModelArgs, pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, virtual_stages: int = 1, dp_mode: str = "zero3"
) -> ModelStates:
    """The model states of the rank at (pp_rank, dp_rank) of a pp x dp x tp layout (every tp rank holds
    the same amount). `dp` is every rank a tensor is sharded or replicated over: dp·cp under context
    parallelism, whose ranks hold the same weights. zero1 shards the optimizer state alone."""
    n_stages = pp * virtual_stages
    sharded = dp > 1 and dp_mode != "replicate"
    layers, whole, shard = 0, 0, 0
    for stage in (pp_rank + k * pp for k in range(virtual_stages)):
        stage_layer_count, shapes = stage_shapes(args, tp, n_stages, stage)
        layers += stage_layer_count
        whole += sum(rows * cols * count for rows, cols, count in shapes)
        shard += sum((_chunk(rows, dp, dp_rank) if sharded else rows) * cols * count for rows, cols, count in shapes)
    params = whole if dp_mode == "zero1" else shard
    return ModelStates(layers, params, WEIGHT_BYTES * params, GRAD_BYTES * params, ADAMW_BYTES * shard)


def busiest_rank_state_bytes(cfg: JobConfig, gathered_bytes: int = WEIGHT_BYTES) -> int:
    """The model states of the rank that holds the most (dp rank 0 holds the largest FSDP chunk; the pipeline
    rank with the most parameters) at its peak, with what FSDP2 holds beside its shards then:
    - gathered weights, `gathered_bytes` a parameter (4: fp32; 2: bf16 mixed precision, which gathers in
      bf16): under zero2 the whole stage, gathered from its forward to its backward; under zero3 the block
      computing, the next one prefetched and the flat all-gather buffer it arrived in, and the root unit
      (embedding, final norm, head); under a pipeline the whole stage for zero3 too, since the schedule
      keeps it gathered after each backward (set_reshard_after_backward(False));
    - gradients unsharded, in fp32, when a step has several micro-batches: they accumulate unreduced until
      the last one (set_requires_gradient_sync), and the last backward begins with all of them held.
    zero1 and replicate hold the weights whole, in fp32, and cast them per layer (one block's copy).
    (tests/test_plan_check.py holds this against the allocator's measured peak.)"""
    par, args = cfg.parallel, model_args(cfg)
    shards = par.dp * par.cp
    states = [rank_model_states(args, par.pp, shards, par.tp, r, 0, par.pp_virtual_stages, par.dp_mode) for r in range(par.pp)]
    busiest = max(states, key=lambda s: s.total_bytes)
    if shards == 1 or par.dp_mode in ("replicate", "zero1"):
        return busiest.total_bytes
    whole = rank_model_states(args, par.pp, 1, par.tp, states.index(busiest), 0, par.pp_virtual_stages)
    block = sum(rows * cols for rows, cols in block_shapes(args, par.tp))
    root = whole.params - whole.layers * block
    gathered = whole.params if par.dp_mode == "zero2" or par.pp > 1 else 3 * block + root
    unreduced = (whole.params - busiest.params) * GRAD_BYTES if cfg.training.microbatches > 1 else 0
    return busiest.total_bytes + gathered_bytes * gathered + unreduced


FP32 = 4  # bytes: what the norms compute in and the loss casts the logits to, whatever the training dtype


def activation_bytes(cfg: JobConfig, element_bytes: int = 4, every_second_matmul: bool = False) -> int:
    """Activations kept for backward on the busiest rank: the tensors autograd keeps for Keel's block
    (keel.trainer.model), counted the way Korthikanti et al. 2022 count GPT's, with `element_bytes` per
    element of the training dtype: 4 (fp32, what the CPU trains in) or 2 (bf16). Per token of a micro-batch,
    on one tp rank (u = tp under sequence parallelism, else 1):
    - each RMSNorm keeps its fp32 input and its normalized value, (4 + e)·d/u, and its output feeds a
      matmul that keeps it whole, e·d (under sequence parallelism: the all-gathered input);
    - attention keeps rotated q and k, v and its output, e·(2d + 2·kv)/t, plus fp32 logsumexps, 4·heads/t:
      scaled_dot_product_attention's flash kernels keep no attention scores, so Korthikanti's 5·a·s/h term
      is gone (tests/test_plan_check.py holds this against measured runs);
    - SwiGLU keeps the gate, its SiLU, the up projection and their product, 4·e·ffn/t.
    `selective` checkpointing keeps the block's input, the matmuls' and attention's outputs instead, and holds
    the rest of one layer while it recomputes it; `full` keeps the block's input and recomputes a whole layer.
    `every_second_matmul`: TorchTitan's selective (op) checkpointing, which keeps the output of every second
    matmul of a block only (wq, wv, w1, w2; wk, wo and w3 recomputed): what torchtitan_activation_bytes counts.
    Plus the backward's working set, the pipeline's stage outputs in flight, and on the last stage the final
    norm and the logits (docs/planning.md)."""
    par, args = cfg.parallel, model_args(cfg)
    e, t, u = element_bytes, par.tp, par.tp if par.sequence_parallel else 1
    d, kv, ffn, heads = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    norms = 2 * ((FP32 + e) * d / u + e * d)
    attention_out = e * d / t + FP32 * heads / t  # the output and its logsumexps, which selective also keeps
    whole_layer = norms + e * (d + 2 * kv) / t + attention_out + 4 * e * ffn / t
    block_input = e * d / u
    if every_second_matmul:
        selective = block_input + e * (d + kv + ffn) / t + attention_out + e * d  # w2: a partial sum, whole
        kept_again = block_input + e * (kv + ffn) / t + attention_out
    else:
        selective = block_input + e * (d + 2 * kv + 2 * ffn) / t + attention_out + 2 * e * d  # wo, w2: partial sums, whole
        kept_again = block_input + e * (kv + 2 * ffn) / t + attention_out  # what the recomputation finds kept already
    per_token = {"none": (whole_layer, 0.0), "selective": (selective, whole_layer - kept_again), "full": (block_input, whole_layer)}[
        cfg.training.activation_checkpointing
    ]
    tokens = cfg.data.seq_len // par.cp * cfg.microbatch_rows  # context parallelism splits each sequence
    kept, recomputing = per_token[0] * tokens, per_token[1] * tokens
    layers = args.n_layers / par.pp
    # The first pipeline stage holds the most micro-batches, and each one's output until its backward, plus
    # the gradient that arrives for it; the last stage holds one micro-batch, the final norm and the loss's
    # working set (logits_bytes).
    # Under tp the peak comes in the backward, at a sub-block's all-reduce of its input's gradient: beside the
    # kept activations, the gradients of the gate and the up projection, and that input gradient, summed from
    # the matmuls and copied by the collective. Without tp it comes at the backward's start (the logits').
    working = tokens * (2 * e * ffn / t + 3 * e * d) if t > 1 else 0
    last = kept * layers + recomputing + working + tokens * (norms / 2 + logits_bytes(cfg, e))
    if par.pp == 1:
        return int(last)
    chunks = _in_flight_chunks(cfg)
    first = kept * layers / par.pp_virtual_stages * chunks + recomputing + working + tokens * e * d / u * (chunks + 1)
    return int(max(first, last))


def logits_bytes(cfg: JobConfig, element_bytes: int) -> float:
    """Bytes a token of the loss holds at its peak, the start of its backward: the log-softmax kept from the
    forward, its gradient and the logits' gradient, in fp32 (the loss casts the logits up), and under a
    pipeline the logits themselves in the training dtype, which the stage keeps as its output (measured
    with torch's profiler: 12 and 14 bytes a bf16 logit; 12 and 16 in fp32). 1/tp of the vocabulary under
    the loss parallel."""
    par, args = cfg.parallel, model_args(cfg)
    vocab = padded_vocab_size(args.vocab_size, par.tp) / (par.tp if par.loss_parallel else 1)
    return vocab * (3 * FP32 + (element_bytes if par.pp > 1 else 0))


def torchtitan_activation_bytes(cfg: JobConfig, element_bytes: int = 4) -> int:
    """activation_bytes with TorchTitan's selective (op) checkpointing: every second matmul recomputed."""
    return activation_bytes(cfg, element_bytes, every_second_matmul=True)


def korthikanti_activation_bytes(cfg: JobConfig, element_bytes: int = 2) -> int:
    """The same, by Korthikanti et al. 2022's formulas for a GPT block (LayerNorm, GeLU, dropout, attention
    scores kept): per layer and micro-batch s·b·d·(10 + 24/t + 5·h·s/(d·t)) bytes at 16 bits (eq. 2), scaled
    by element_bytes / 2; sequence parallelism splits the 10 (eq. 4), `selective` drops the attention term
    (eq. 5), `full` keeps each layer's input (2·s·b·d) and holds one layer's whole activations while it
    recomputes it. What Megatron-LM's memory estimate assumes: `keel plan --activations korthikanti`."""
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
    # The paper leaves the head out: the logits and their gradient in fp32, 1/t of them under the loss parallel.
    logits = 2 * FP32 * s * b * padded_vocab_size(args.vocab_size, t) / (t if par.loss_parallel else 1)
    recomputing = whole_layer if tr.activation_checkpointing == "full" else 0
    stages = args.n_layers / par.pp / par.pp_virtual_stages  # layers of one of a rank's stages
    return int((kept_per_layer[tr.activation_checkpointing] * stages * _in_flight_chunks(cfg) + recomputing + logits) / par.cp)


def _in_flight_chunks(cfg: JobConfig) -> int:
    """(micro-batch, stage) pairs whose activations the first pipeline rank holds at once, each a stage of
    layers/(pp·v) layers: all m under GPipe; min(m, pp) under 1F1B; under Interleaved1F1B the forwards torch
    runs before the first backward ((v−1) rounds of micro-batches, and two for each rank after the first)
    and the one in flight, at most m·v (torch's _get_warmup_ops; Narayanan et al. 2021, section 2.2.2)."""
    par, m, v = cfg.parallel, cfg.training.microbatches, cfg.parallel.pp_virtual_stages
    if par.pp == 1:
        return 1
    if par.pp_schedule == "GPipe":
        return m
    if par.pp_schedule == "1F1B":
        return min(m, par.pp)
    per_round = m // max(1, m // par.pp)
    return min(m * v, (v - 1) * per_round + 2 * (par.pp - 1) + 1)
