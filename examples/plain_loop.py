"""A nanoGPT-shaped training loop (a small GPT on bytes, AdamW, warm-up and cosine, gradient clipping) under
torchrun, DDP or FSDP2, with Keel. The lines Keel adds or changes end in `# keel`: 9 of them, and a tenth to
record a metric of the loop's own.

    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py            # DDP
    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py --fsdp     # FSDP2
    KEEL_ARGS="--run-dir runs/mine --fault spike@step=30,steps=5" torchrun ...  # a drill by hand

Keel records every step (`keel dashboard runs`), rolls back a confirmed loss spike to its newest
checkpoint with the bad batches skipped, skips a step whose loss or gradient is not finite on any rank,
and ends a hung rank so that torchrun (`--max-restarts`) restarts the loop from its checkpoint.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from keel.trainer.toolkit import ResumableBatchSampler, init_distributed, open_run  # keel

BLOCK = 64  # tokens of context


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("causal", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal[: x.size(1), : x.size(1)], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(BLOCK, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def corpus(max_bytes: int = 1 << 20) -> torch.Tensor:
    """Bytes of Python's own standard library: a text corpus every machine with Python has."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def lr_lambda(steps: int, warmup: int):
    def factor(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all ranks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    args = ap.parse_args()
    _, rank, world = init_distributed()  # keel: was `dist.init_process_group("gloo")`; restartable under torchrun
    torch.manual_seed(1337)
    model = GPT()
    if world > 1 and args.fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif world > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps, warmup=10))
    data = corpus()
    sampler = ResumableBatchSampler(len(data) - BLOCK - 1, args.batch_size, rank, world, seed=0)  # keel
    run = open_run(model, optimizer, scheduler=scheduler, data=sampler, steps=args.steps, tokens_per_step=args.batch_size * BLOCK)  # keel
    for _step in run.steps():  # keel: was `for _step in range(args.steps):`
        offsets = torch.tensor(sampler.next_indices())[:, None] + torch.arange(BLOCK)
        x, y = data[offsets], data[offsets + 1]
        loss = run.loss(model(x, y))  # keel: was `loss = model(x, y)`
        loss.backward()
        run.clip_grad_norm(1.0)  # keel: was `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`
        run.optimizer_step()  # keel: was `optimizer.step(); scheduler.step()`
        optimizer.zero_grad(set_to_none=True)
        run.log(perplexity=math.exp(min(loss.item(), 50)))  # keel (optional): a metric of your own, drawn by the dashboard
    run.close()  # keel
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
