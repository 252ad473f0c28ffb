"""The model's shape: ModelArgs, the named presets, and what follows from a shape alone (parameters, FLOPs).

Plain Python with no torch, so that `keel train` validates a config (and fails on a bad one) without
paying for a torch import; keel.trainer.model builds the modules from these shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 256  # byte-level tokens
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# The large presets have the layer shapes of Llama 3.2 1B, Llama 2 7B, Llama 3 70B and Llama 3.1 405B,
# with Keel's byte vocabulary. They are used for FLOPs, MFU and (later) the planner; tiny and small train on a CPU.
MODEL_PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=192),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=768),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, rope_theta=500000.0),
    "405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, rope_theta=500000.0),
}


def model_args(cfg) -> ModelArgs:
    """The preset named in cfg.model with the fields the config sets explicitly."""
    base = MODEL_PRESETS[cfg.model.preset]
    fields = {k: getattr(cfg.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")}
    fields = {k: v for k, v in fields.items() if v is not None}
    if "n_heads" in fields and "n_kv_heads" not in fields and base.n_kv_heads == base.n_heads:
        fields["n_kv_heads"] = fields["n_heads"]
    return ModelArgs(**{**base.__dict__, **fields, "max_seq_len": max(base.max_seq_len, cfg.data.seq_len)})


def count_params(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, token-embedding parameters) of the full model, computed from its shape."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * args.ffn_dim + 2 * d
    embedding = args.vocab_size * d
    return args.n_layers * per_layer + embedding + d + args.vocab_size * d, embedding


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token as the PaLM paper counts them (its appendix B): 6·N + 12·layers·dim·seq_len, where N is
    every parameter but the token embedding (a lookup, not a matmul; the output head does count)."""
    total, embedding = count_params(args)
    return 6 * (total - embedding) + 12 * args.n_layers * args.dim * seq_len
