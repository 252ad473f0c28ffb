"""How long training waits for a checkpoint: async_save's blocking time against a synchronous save of
the same state, side by side in one process (alternating sync, async, async, sync, ...).

The state is a model of the "small" family widened to about 50 M parameters (with AdamW's two moments,
about 0.6 GB), so that writing it takes long enough to measure. The async blocking time is what the
train loop sees (staging the state aside); the write itself goes on in DCP's thread.

    python bench/checkpoint_blocking.py                # 4 rounds
    python bench/checkpoint_blocking.py --dim 512      # a smaller state
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from keel.trainer import parallel
from keel.trainer.checkpoint import Checkpointer, manifest_info
from keel.trainer.config import load_config
from keel.trainer.model import model_args
from keel.trainer.optim import build_optimizer


def build(dim: int, layers: int):
    cfg = load_config("small", {"model.dim": dim, "model.n_layers": layers, "model.ffn_dim": 4 * dim, "model.n_heads": 8, "model.n_kv_heads": 8})
    layout = parallel.Layout(mesh=None, pp=1, dp=1, tp=1)
    parts = parallel.build_model_parts(cfg, model_args(cfg), layout, torch.device("cpu"), bf16=False)
    optimizer = build_optimizer(parts, cfg.optim)
    for p in parts[0].parameters():  # one real update, so the optimizer holds its moments
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return cfg, parts, optimizer


def save_once(cfg, parts, optimizer, folder: Path, async_save: bool) -> tuple[float, float]:
    """(seconds the caller was blocked, seconds until the checkpoint was sealed)."""
    cfg.checkpoint.async_save = async_save
    ckpt = Checkpointer(cfg.checkpoint, folder, parts, optimizer, rank=0, world=1, manifest_info=manifest_info(cfg, "bench"))
    blocking = ckpt.save(1, {"step": 1}, now=0.0)
    ckpt.wait()
    (result,) = ckpt.poll()
    assert result.error is None, result.error
    return blocking, result.total_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cfg, parts, optimizer = build(args.dim, args.layers)
    n = sum(p.numel() for p in parts[0].parameters())
    print(f"state: {n / 1e6:.1f} M parameters, {3 * n * 4 / 1e9:.2f} GB with AdamW moments (fp32)")
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        save_once(cfg, parts, optimizer, Path(tmp) / "warmup", True)
        for r in range(args.rounds):
            for async_save in ((False, True) if r % 2 == 0 else (True, False)):
                folder = Path(tmp) / f"r{r}-{async_save}"
                results[async_save].append(save_once(cfg, parts, optimizer, folder, async_save))
                shutil.rmtree(folder)
    sync_block = statistics.median(b for b, _ in results[False])
    async_block = statistics.median(b for b, _ in results[True])
    async_total = statistics.median(t for _, t in results[True])
    print(f"synchronous save: training blocked {sync_block:.3f} s (median of {args.rounds})")
    print(f"async save:       training blocked {async_block:.3f} s; sealed after {async_total:.3f} s")
    print(f"async blocking / synchronous save = {async_block / sync_block:.1%} (target <= 10%)")


if __name__ == "__main__":
    main()
