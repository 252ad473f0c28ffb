"""A Lightning `Trainer` (a small GPT on bytes, AdamW, warm-up and cosine, gradient clipping, a checkpoint
every 10 steps) with Keel. The lines Keel adds end in `# keel`: 2 of them.

    python examples/lightning_loop.py --max-steps 60                               # CPU is enough
    KEEL_ARGS="--run-dir runs/pl --fault spike@step=30,steps=3,lr=100,data=0 --spike.warmup_steps=10" python examples/lightning_loop.py
    python examples/lightning_loop.py --devices 2                                  # DDP: every rank runs the callback

Keel records every step (`keel dashboard runs`), skips a step whose gradient is not finite on any rank,
and stops training cleanly on a confirmed loss spike, naming the checkpoint to resume from
(docs/any-loop.md, "Lightning").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from plain_loop import BLOCK, Block, corpus, lr_lambda  # the plain loop's model parts and data, beside this file
from torch import nn
from torch.nn import functional as F

from keel.trainer.toolkit.lightning import KeelLightningCallback  # keel


class ByteBlocks(torch.utils.data.Dataset):
    """plain_loop's corpus (Python's standard library as bytes) in blocks of BLOCK + 1 tokens."""

    def __init__(self):
        self.data = corpus()

    def __len__(self) -> int:
        return (len(self.data) - 1) // BLOCK

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * BLOCK : (i + 1) * BLOCK + 1]


class GPT(L.LightningModule):
    def __init__(self, steps: int, lr: float, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.steps, self.lr = steps, lr
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(BLOCK, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.steps, warmup=10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step and rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--output-dir", default="runs/lightning", help="Lightning's checkpoints")
    ap.add_argument("--ckpt-path", default=None, help="a checkpoint to resume from")
    ap.add_argument("--seed", type=int, default=1337, help="the model's initialization and the sample order")
    args = ap.parse_args()
    L.seed_everything(args.seed)
    model = GPT(args.max_steps, args.lr)
    data = torch.utils.data.DataLoader(ByteBlocks(), batch_size=args.batch_size, shuffle=True)
    checkpoints = ModelCheckpoint(dirpath=Path(args.output_dir) / "checkpoints", every_n_train_steps=10, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        devices=args.devices,
        gradient_clip_val=1.0,
        default_root_dir=args.output_dir,
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[checkpoints, KeelLightningCallback()],  # keel
    )
    trainer.fit(model, data, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
