"""Keel's single-process trainer against a bare PyTorch loop: same model, batch, optimizer and threads.

Runs `keel train` and the bare loop alternately in ABBA order (Keel first, then the bare loop first, ...),
several rounds in one invocation, and prints the tokens/s of each and the ratio Keel / bare (median step
time over the steps after warm-up). Both measure a step the same way: the time between the ends of
consecutive steps, so everything a loop does per step (data, metrics, the run store, and the console
progress line, printed at every step as users see it) is counted.

    python bench/trainer_vs_bare.py                 # small preset, 3 rounds of 40 steps
    python bench/trainer_vs_bare.py --config tiny --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP_STEPS = 5
TARGET = 0.97  # Keel's tokens/s at least 97% of the bare loop's


def bare_loop(config: str, steps: int) -> list[float]:
    """A plain loop over the same Transformer, the same batches, AdamW, warmup-cosine LR and clipping."""
    import math

    import torch

    from keel.trainer.config import load_config
    from keel.trainer.data.loader import BatchSampler, open_tokens
    from keel.trainer.model import Transformer
    from keel.trainer.model_args import model_args

    cfg = load_config(config, {"parallel.pp": 1, "parallel.dp": 1, "parallel.tp": 1, "training.steps": steps})
    o = cfg.optim
    args = model_args(cfg)
    model = Transformer(args)
    model.init_weights(cfg.training.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    data = BatchSampler(
        open_tokens(cfg.data.source, cfg.data.seq_len, args.vocab_size).tokens,
        cfg.data.seq_len,
        cfg.training.global_batch_size,
        0,
        1,
        cfg.training.seed,
    )
    m = cfg.training.microbatches
    times, last = [], time.perf_counter()
    for step in range(1, steps + 1):
        x, y = (torch.from_numpy(t) for t in data.next_batch())
        warm = step / o.warmup_steps
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))))
        lr = o.lr * warm if step <= o.warmup_steps else o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cos)
        for g in opt.param_groups:
            g["lr"] = lr
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = torch.nn.functional.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / m
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def keel_run(config: str, steps: int, run_dir: Path, env: dict) -> list[float]:
    from keel.monitor.store import read_steps

    cmd = [
        sys.executable,
        "-m",
        "keel.cli",
        "train",
        f"--config={config}",
        "--pp=1",
        "--dp=1",
        "--tp=1",
        f"--steps={steps}",
        f"--run-dir={run_dir}",
        "--monitor.wandb=false",  # the bare loop logs nowhere either; bench/sink_overhead.py measures the sinks
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return list(read_steps(run_dir).step_time_s)


def bare_run(a: argparse.Namespace, env: dict) -> list[float]:
    """The bare loop in a process of its own, as Keel's runs are."""
    out = subprocess.run(
        [sys.executable, __file__, "--bare-worker", "--config", a.config, "--steps", str(a.steps)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare_worker:
        print(json.dumps(bare_loop(a.config, a.steps)))
        return

    from keel.trainer.config import load_config

    cfg = load_config(a.config)
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())), "PYTHONWARNINGS": "ignore"}
    keel_tps, bare_tps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["keel", "bare"] if r % 2 == 0 else ["bare", "keel"]  # ABBA: neither side always runs first
            times = {
                side: keel_run(a.config, a.steps, Path(tmp) / f"keel-{r}", env) if side == "keel" else bare_run(a, env) for side in order
            }
            k, b = times["keel"], times["bare"]
            keel_tps.append(tokens_per_step / statistics.median(k[WARMUP_STEPS:]))
            bare_tps.append(tokens_per_step / statistics.median(b[WARMUP_STEPS:]))
            print(
                f"round {r + 1}: keel {keel_tps[-1]:9,.0f} tok/s   bare {bare_tps[-1]:9,.0f} tok/s   ratio {keel_tps[-1] / bare_tps[-1]:.3f}"
            )
    kt, bt = statistics.median(keel_tps), statistics.median(bare_tps)
    ratios = [k / b for k, b in zip(keel_tps, bare_tps)]
    ratio = statistics.median(ratios)
    print(f"\n{a.config}: {tokens_per_step} tokens/step, {a.steps} steps x {a.rounds} rounds, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    print(f"keel {kt:,.0f} tok/s | bare {bt:,.0f} tok/s | keel / bare = {ratio:.3f} per round (range {min(ratios):.3f} to {max(ratios):.3f}); "
          f"target >= {TARGET}: {'holds' if ratio >= TARGET else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
