"""What torch.compile of the blocks (training.compile) buys, with each activation checkpointing mode: one
process trains a model of 4 layers, dim 256, on 4 sequences of 512 tokens, in fp32 on the CPU (inductor's
C++ backend), and reports per mode

- compile: the first forward and backward's wall time (inductor compiles there; its on-disk cache makes
  later processes faster than the first);
- step time: the next forward and backwards' median wall time, and the compiled/eager ratio;
- activation memory: the process's peak resident memory during a forward and backward less its resident
  memory just before, measured by the kernel (getrusage) from outside the trainer's code. glibc keeps
  freed blocks once its mmap threshold has grown, so an extra step before the measured one (the compile
  step here) would hide the activations in the resident memory "before": the memory is measured in a
  second process with the threshold fixed (MALLOC_MMAP_THRESHOLD_), the times in one with glibc's default.

Each measurement is a fresh pair of processes, eager and compiled interleaved ABBA over the rounds. Target: the
compiled step faster than the eager one under each checkpointing mode (ratio < 1).

    python bench/compile_speed.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from memory_table import abba, measure_steps

CHECKPOINTING = ["none", "selective", "full"]
MODES = [f"{how}-{ac}" for ac in CHECKPOINTING for how in ("eager", "compiled")]
SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 768, "max_seq_len": 512}
BATCH, SEQ = 4, 512


def measure(mode: str) -> dict:
    """In this process: the first step's seconds, then activation bytes and median step seconds."""
    import torch
    import torch.nn.functional as F

    from keel.trainer.model import Transformer
    from keel.trainer.model_args import ModelArgs
    from keel.trainer.parallel.compile_blocks import apply_checkpointing_and_compile

    how, ac = mode.split("-")
    torch.set_num_threads(1)
    model = Transformer(ModelArgs(**SHAPE))
    model.init_weights(0)
    apply_checkpointing_and_compile(model, ac, compile=how == "compiled")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=False)
    return {"first_step_s": first, **measure_steps(step, optimizer)}


def _child(mode: str) -> dict:
    def run(env: dict) -> dict:
        cmd = [sys.executable, __file__, "--child", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ | env).stdout
        return json.loads(out.strip().splitlines()[-1])

    timed, sized = run({}), run({"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
    return {"first_step_s": timed["first_step_s"], "step_s": timed["step_s"], "activation_bytes": sized["activation_bytes"]}


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def print_table(got: dict[str, list[dict]]) -> None:
    print(f"{'mode':<18} | {'first step s':>22} | {'step s, median (min-max)':>26} | {'activations MiB':>22} | target")
    for mode in MODES:
        rows = got[mode]
        how, ac = mode.split("-")
        target = ""
        if how == "compiled":
            ratio = statistics.median(r["step_s"] for r in rows) / statistics.median(r["step_s"] for r in got[f"eager-{ac}"])
            target = f"compiled/eager {ratio:.2f} < 1: {'met' if ratio < 1 else 'MISSED'}"
        print(
            f"{mode:<18} | {_spread([r['first_step_s'] for r in rows], '.2f'):>22} | {_spread([r['step_s'] for r in rows], '.3f'):>26}"
            f" | {_spread([r['activation_bytes'] / 2**20 for r in rows], '.0f'):>22} | {target}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each mode measured twice per round)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.child)))
    else:
        print_table(abba(MODES, _child, opts.rounds))
