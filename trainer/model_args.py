"""The model's shape: ModelArgs, the named presets, and what follows from a shape alone (parameters, FLOPs).

Plain Python with no torch, so that `keel train` validates a config (and fails on a bad one) without
paying for a torch import; keel.trainer.model builds the modules from these shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    # The tokenizer's vocabulary, unpadded: what the data's token ids must stay below and what parameter
    # counts and FLOPs count. The modules are built with padded_vocab_size rows (see there).
    vocab_size: int = 256  # byte-level tokens
    tie_embeddings: bool = False  # the output head reuses the token embedding matrix (one parameter)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA2_VOCAB = 32_000  # Llama 2's SentencePiece vocabulary
LLAMA3_VOCAB = 128_256  # Llama 3's tiktoken vocabulary (128,000 tokens + 256 special)

# The large presets are Llama 3.2 1B (tied embeddings), Llama 2 7B, Llama 3 70B and Llama 3.1 405B, with their
# own vocabularies: built on the meta device they hold 1.24 B, 6.74 B, 70.6 B and 405.9 B parameters
# (tests/test_vocab.py). They are used for FLOPs, MFU and (later) the planner; tiny and small train on a CPU
# on the builtin byte corpus, so their vocabulary is the 256 byte values.
MODEL_PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=192),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=768),
    "1b": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=LLAMA3_VOCAB, tie_embeddings=True, rope_theta=500000.0
    ),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=LLAMA2_VOCAB),
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=LLAMA3_VOCAB, rope_theta=500000.0),
    "405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=LLAMA3_VOCAB, rope_theta=500000.0),
}

# The embedding and the head are built with the vocabulary padded to a multiple of this times the tensor-parallel
# degree, as Megatron-LM does (make_vocab_size_divisible_by x tp; Megatron's default factor is 128): every tp rank
# then holds an equal slice of rows of a GPU-friendly size. Llama 3's 128,256 rows need no padding up to tp4,
# Llama 2's 32,000 none up to tp4 either; 300 becomes 320 at tp1 and 384 at tp2.
VOCAB_PAD_MULTIPLE = 64

# The model config fields that override a preset when set (keel.trainer.config.ModelConfig has each of them).
OVERRIDABLE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")


def model_args(cfg) -> ModelArgs:
    """The preset named in cfg.model with the fields the config sets explicitly."""
    base = MODEL_PRESETS[cfg.model.preset]
    fields = {k: getattr(cfg.model, k) for k in OVERRIDABLE_FIELDS}
    fields = {k: v for k, v in fields.items() if v is not None}
    if "n_heads" in fields and "n_kv_heads" not in fields and base.n_kv_heads == base.n_heads:
        fields["n_kv_heads"] = fields["n_heads"]
    return ModelArgs(**{**base.__dict__, **fields, "max_seq_len": max(base.max_seq_len, cfg.data.seq_len)})


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The rows the embedding and the head are built with at tensor-parallel degree `tp` (Megatron-LM's
    _vocab_size_with_padding). The padded rows start at zero, are never looked up, and their logits are cut
    off before the loss (keel.trainer.model), so they change neither the loss nor the real rows."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def count_params(args: ModelArgs, vocab_rows: int | None = None) -> tuple[int, int]:
    """(all parameters, token-embedding parameters) of the full model, computed from its shape. The
    vocabulary counts `vocab_rows` rows when given (the padded modules, for memory), else the real
    vocabulary (the model as named and trained, for FLOPs). A tied head adds no parameter."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * args.ffn_dim + 2 * d
    embedding = (vocab_rows or args.vocab_size) * d
    head = 0 if args.tie_embeddings else embedding
    return args.n_layers * per_layer + embedding + d + head, embedding


def allocated_params(args: ModelArgs, tp: int) -> int:
    """The parameters the modules hold at tensor-parallel degree `tp`: count_params with the vocabulary's
    padded rows, which are allocated (for memory) though never trained."""
    return count_params(args, padded_vocab_size(args.vocab_size, tp))[0]


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token as the PaLM paper counts them (its appendix B): 6·N + 12·layers·dim·seq_len, where N is
    every parameter used in a matmul: all but the token embedding (a lookup), plus the output head, which is a
    matmul whether or not it shares the embedding's matrix. Counted over the real vocabulary: the padded columns
    are not the model's work, and MFU counts the model's work only."""
    total, embedding = count_params(args)
    head = args.vocab_size * args.dim if args.tie_embeddings else 0  # untied, it is already in total
    return 6 * (total - embedding + head) + 12 * args.n_layers * args.dim * seq_len


@functools.cache  # the planner asks for every stage of every layout it scores: O(stages) each time
def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The layers of pipeline stage `stage`: as even a split as there is. Where it cannot be even, the stages at
    the ends, which also hold the embedding (first) and the head and the loss (last), take one layer fewer,
    first and last, then second and second-to-last, and so on: Llama 3 405B's 126 layers trained on 16 stages
    with one fewer on the first and the last ("The Llama 3 Herd of Models", 2024, section 3.3.2)."""
    per_stage = -(-n_layers // n_stages)
    ends = [i // 2 if i % 2 == 0 else n_stages - 1 - i // 2 for i in range(n_stages)]  # 0, n-1, 1, n-2, ...
    shorter = set(ends[: per_stage * n_stages - n_layers])
    sizes = [per_stage - (s in shorter) for s in range(n_stages)]
    first = sum(sizes[:stage])
    return range(first, first + sizes[stage])
