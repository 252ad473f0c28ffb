"""What activation checkpointing saves and costs (training.activation_checkpointing): one process trains
a model of 4 layers, dim 256, on 4 sequences of 512 tokens, in fp32 on the CPU, and reports

- activation memory: the process's peak resident memory during a forward and backward, less its
  resident memory just before (model, gradients and optimizer state already allocated by a first step),
  measured by the kernel (getrusage) from outside the trainer's code;
- step time: the forward and backward's wall time, median of 3.

Each measurement is a fresh process (a peak is per process), the modes interleaved ABBA over the rounds,
beside preflight's estimate of the activations (keel.chaos.preflight_worker.activation_bytes, the same
formulas). Target: each mode keeps less than the one before it (none > selective > full), full at most
half of none.

    python bench/activation_memory.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

MODES = ["none", "selective", "full"]
SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 768, "max_seq_len": 512}
BATCH, SEQ = 4, 512


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(mode: str) -> dict:
    """In this process: (activation bytes, median step seconds) of `mode`."""
    import torch
    import torch.nn.functional as F

    from keel.trainer.activation_checkpoint import apply_activation_checkpointing
    from keel.trainer.model import Transformer
    from keel.trainer.model_args import ModelArgs

    torch.set_num_threads(1)
    model = Transformer(ModelArgs(**SHAPE))
    model.init_weights(0)
    apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return time.perf_counter() - start

    step()  # allocates the gradients; the optimizer step allocates its state
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    before = _rss_bytes()
    seconds = [step()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds += [step() for _ in range(2)]
    return {"activation_bytes": peak - before, "step_s": statistics.median(seconds)}


def estimate(mode: str) -> int:
    from keel.chaos.preflight_worker import activation_bytes
    from keel.trainer.config import load_config

    overrides = {f"model.{k}": v for k, v in SHAPE.items() if k != "max_seq_len"} | {
        "data.seq_len": SEQ, "training.global_batch_size": BATCH, "training.microbatches": 1, "training.activation_checkpointing": mode}  # fmt: skip
    return activation_bytes(load_config("tiny", overrides))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each mode measured twice per round)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.child)))
        return
    got = {mode: [] for mode in MODES}
    for _ in range(opts.rounds):
        for mode in MODES + MODES[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=True).stdout
            got[mode].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'mode':<10} | {'activations MiB, median (min-max)':>34} | {'estimate MiB':>12} | {'step s, median (min-max)':>26} | target")
    medians = {m: statistics.median(r["activation_bytes"] for r in got[m]) for m in MODES}
    for i, mode in enumerate(MODES):
        mib, secs = [r["activation_bytes"] / 2**20 for r in got[mode]], [r["step_s"] for r in got[mode]]
        kept = f"{statistics.median(mib):.1f} ({min(mib):.1f}-{max(mib):.1f})"
        took = f"{statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f})"
        target = "" if i == 0 else f"< {MODES[i - 1]}: {'met' if medians[mode] < medians[MODES[i - 1]] else 'MISSED'}"
        if mode == "full":
            target += f"; <= none/2: {'met' if medians[mode] <= medians['none'] / 2 else 'MISSED'}"
        print(f"{mode:<10} | {kept:>34} | {estimate(mode) / 2**20:>12.1f} | {took:>26} | {target}")


if __name__ == "__main__":
    main()
