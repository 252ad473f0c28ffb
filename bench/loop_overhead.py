"""What Keel costs a user's loop: examples/plain_loop.py's GPT trained by the same plain DDP loop with Keel
(open_run, run.loss, run.clip_grad_norm, run.optimizer_step: recording, the guard, the watchdog, the chaos
hooks, the sampled communication profile) and without it (torch's clip_grad_norm_, optimizer and scheduler
steps), under one torchrun of `--nproc` gloo processes.

The two sides run in the same processes, step by step: each iteration of Keel's loop also runs one step of
an identical bare model, first on even steps and last on odd ones (ABBA), so a drift of the machine's load
falls on both alike (separate runs of each side drifted 20% apart on a shared 2-core machine). Keel's time
for a step is the iteration's wall clock, from the end of the previous one (so its recording, judging and
the next step's start count), minus the bare step's. On the steps whose communication Keel profiles (one
in metrics.comm_sample_every) the bare step is left out, so that the profiler's cost stays Keel's. The
clocks are this script's, around the calls; rank 0 reports.

    torchrun --standalone --nproc-per-node 2 bench/loop_overhead.py [--steps 300] [--dim 256]

Target: Keel's mean step at most 1% longer than the bare one's (the mean over steps: a profiled step's
cost counts at its frequency), with the spread of the per-step ratio over blocks of 20 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from plain_loop import BLOCK, GPT, corpus, lr_lambda  # noqa: E402 (the example's model and data)

from keel.trainer.toolkit import ResumableBatchSampler, init_distributed, open_run  # noqa: E402

WARMUP = 20  # steps left out: first allocations, DDP's bucket rebuild, the profiler's first start
TARGET = 1.01
BLOCKS = 20  # steps per block for the spread


def model_and_data(args, rank: int, world: int, data: torch.Tensor):
    torch.manual_seed(0)
    model = GPT(dim=args.dim, layers=4, heads=4)
    model = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps, 10))
    return model, optimizer, scheduler, ResumableBatchSampler(len(data) - BLOCK - 1, args.batch * world, rank, world)


def batch(sampler: ResumableBatchSampler, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor(sampler.next_indices())[:, None] + torch.arange(BLOCK)
    return data[offsets], data[offsets + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=256, help="the GPT's width (4 layers): sets the step's length")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    args = ap.parse_args()
    _, rank, world = init_distributed()
    data = corpus()
    bare, bare_opt, bare_sched, bare_data = model_and_data(args, rank, world, data)
    model, optimizer, scheduler, sampler = model_and_data(args, rank, world, data)

    def bare_step() -> float:
        started = time.perf_counter()
        x, y = batch(bare_data, data)
        loss = bare(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        bare_opt.step()
        bare_sched.step()
        bare_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    run_dir = tempfile.mkdtemp(prefix="keel-loop-overhead-") if rank == 0 else ""
    names = [run_dir]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    quiet = {"monitor.prometheus": False, "monitor.wandb": False}
    run = open_run(model, optimizer, scheduler=scheduler, data=sampler, steps=args.steps, run_dir=names[0], config=quiet)
    every = run.keel.cfg.metrics.comm_sample_every
    bare_s, keel_s, profiled = [], [], []
    last = time.perf_counter()
    for step in run.steps():
        sampled = (step - 2) % every == 0  # Keel profiles this step: no bare step beside it
        before = 0.0 if sampled or step % 2 else bare_step()
        x, y = batch(sampler, data)
        loss = run.loss(model(x, y))
        loss.backward()
        run.clip_grad_norm(1.0)
        run.optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        after = 0.0 if sampled or not step % 2 else bare_step()
        now = time.perf_counter()
        if step > WARMUP:
            keel_s.append(now - last - before - after)
            profiled.append(sampled)
            if not sampled:
                bare_s.append(before + after)
        last = now
    run.close()
    if rank == 0:
        report(args, world, every, bare_s, keel_s, profiled)
    if world > 1:
        dist.destroy_process_group()


def report(args, world: int, every: int, bare_s: list[float], keel_s: list[float], profiled: list[bool]) -> None:
    bare, keel = statistics.mean(bare_s), statistics.mean(keel_s)
    plain = statistics.mean(k for k, p in zip(keel_s, profiled) if not p)
    sampled = [k for k, p in zip(keel_s, profiled) if p]
    blocks = [
        statistics.mean(keel_s[i : i + BLOCKS]) / statistics.mean(bare_s[i : i + BLOCKS])
        for i in range(0, len(bare_s) - BLOCKS + 1, BLOCKS)
    ]
    print(f"{world} processes (gloo, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), GPT dim {args.dim} x 4 layers, "
          f"{args.batch} sequences of {BLOCK} per rank, {len(keel_s)} steps after {WARMUP} warm-up, interleaved step by step")  # fmt: skip
    print(f"bare loop        {1000 * bare:8.2f} ms/step (mean)")
    print(f"with Keel        {1000 * keel:8.2f} ms/step (mean; unprofiled steps {1000 * plain:.2f} ms, "
          f"{len(sampled)} profiled steps (1 in {every}) {1000 * statistics.mean(sampled) if sampled else float('nan'):.2f} ms)")  # fmt: skip
    print(f"keel / bare      {keel / bare:.4f}   target <= {TARGET:.2f}   "
          f"unprofiled steps alone {plain / bare:.4f}; per {BLOCKS}-step block {min(blocks):.4f} .. {max(blocks):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
