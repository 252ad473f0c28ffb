"""A Llama-style decoder in one plain file: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention.

Layers live in a ModuleDict keyed by their global index, so a pipeline stage that keeps only some of
them still names its parameters exactly as the full model does ("layers.5.attention.wq.weight").
That keeps tensor-parallel plans, checkpoints and the per-parameter initialization identical across
parallel layouts. A stage without the embedding or the head simply has them set to None.

The embedding and the head have `padded_vocab` rows (keel.trainer.model_args.padded_vocab_size: a multiple
of 64 x tp, so tensor parallelism splits them evenly). The padding never shows: its rows start at zero,
no token id reaches them, and the head's logits are cut back to the real vocabulary before the loss, so
every layout computes the loss of the same unpadded model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from keel.trainer.model_args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even under bf16: the mean of squares loses too much precision otherwise.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, seq, heads, head_dim]; rotate each (even, odd) pair by its position's angle.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # The sequence length after the projections: under sequence parallelism x holds seq / tp positions
        # and the projections gather the whole sequence. -1 heads, not n_heads: under tensor parallelism
        # each rank holds n_heads / tp of them.
        b, t = q.shape[:2]
        cos, sin = cos[:t], sin[:t]
        q = apply_rotary(q.view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rotary(k.view(b, t, -1, self.head_dim), cos, sin)
        v = v.view(b, t, -1, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (`layer_ids`, `first`, `last`)."""

    def __init__(
        self, args: ModelArgs, layer_ids: range | None = None, first: bool = True, last: bool = True, padded_vocab: int | None = None
    ):
        super().__init__()
        self.args = args
        self.padded_vocab = padded_vocab or args.vocab_size
        if self.padded_vocab < args.vocab_size:
            raise ValueError(f"padded_vocab={padded_vocab} is smaller than the vocabulary ({args.vocab_size})")
        if args.tie_embeddings and not (first and last):
            raise ValueError("tie_embeddings needs the embedding and the head in one stage (config validation refuses pp > 1)")
        layer_ids = range(args.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(self.padded_vocab, args.dim) if first else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in layer_ids})
        self.norm = RMSNorm(args.dim, args.norm_eps) if last else None
        self.output = nn.Linear(args.dim, self.padded_vocab, bias=False) if last else None
        if args.tie_embeddings:
            self.tie_head()
        # Set by the loss parallel (keel.trainer.parallel.parallelize): the head's padding columns come out at -inf,
        # split over the ranks, rather than being cut off here.
        self.padding_masked = False
        cos, sin = rotary_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] on the first stage, hidden states [batch, seq, dim] after it."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.real_vocab_logits(self.output(self.norm(h)))
        return h

    def tie_head(self) -> None:
        """Makes the head use the embedding's matrix: one parameter, both gradients summed into it. Called
        again after tensor parallelism, which replaces each module's parameters with its own DTensor."""
        self.output.weight = self.tok_embeddings.weight

    def real_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the real vocabulary: the padded columns cut off, so the softmax and the loss are the
        unpadded model's. A copy, not a slice: a view as an FSDP2 module's output would lose FSDP's pre-backward
        hook to any in-place op on it (torch warns so). The gradient of the cut columns is zero."""
        if logits.shape[-1] == self.args.vocab_size or self.padding_masked:
            return logits
        return logits[..., : self.args.vocab_size].contiguous()

    def real_parameter_count(self) -> int:
        """This module's parameters without the vocabulary padding: what model_args.count_params counts."""
        padding_rows = self.padded_vocab - self.args.vocab_size
        padded_matrices = {id(m.weight) for m in (self.tok_embeddings, self.output) if m is not None}
        return sum(p.numel() for p in self.parameters()) - len(padded_matrices) * padding_rows * self.args.dim

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter drawn in place (draw_initial), for a module that holds whole tensors."""
        for name, p in self.named_parameters():  # a tied head is named once, as tok_embeddings.weight
            self.draw_initial(name, p, seed)

    @torch.no_grad()
    def draw_initial(self, name: str, value: torch.Tensor, seed: int) -> None:
        """Writes parameter `name`'s whole initial value into `value` (its global shape), drawn from a generator
        of its own seeded by (seed, its name): the values do not depend on which other parameters this process
        holds or how they are sharded, so every parallel layout starts from the same model as a single process,
        and a sharded parameter takes its slice of the whole (keel.trainer.parallel.parallelize.materialize)."""
        if name.endswith("norm.weight"):
            value.fill_(1.0)
            return
        g = torch.Generator(device=value.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)  # GPT-2: residual projections scaled by depth
        std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
        if name in ("tok_embeddings.weight", "output.weight"):
            # The real rows draw exactly what an unpadded matrix draws; the padding rows are zero.
            value[self.args.vocab_size :].zero_()
            value = value[: self.args.vocab_size]
        value.normal_(0.0, std, generator=g)

    def init_buffers(self) -> None:
        """The rotary tables, computed again where the model was built on the meta device (they are not
        parameters, and not saved)."""
        cos, sin = rotary_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
