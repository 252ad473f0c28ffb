"""A rank's peak memory while it builds its model: its shards plus one whole parameter, never its whole stage.

Each layout is built by one process playing rank 0 of it (PyTorch's fake process group stands in for the
other ranks, so a layout of 8 ranks needs one process and no more memory than that rank's): the real
meta-device build, tensor-parallel plan, FSDP2 sharding and initialization of keel.trainer.parallel.parallelize. The
peak is measured from outside the build, as the process's high-water resident memory (getrusage) less
what it held before the build. Beside it: the rank's shards, the target (shards plus the largest whole
parameter, which initialization makes one at a time) and the whole stage (what every rank held before
the model was built on the meta device). Layouts are repeated in ABBA order; memory is deterministic,
so the spread says how steady the measurement is.

    python bench/build_memory.py                 # 7b's shape with 4 layers (4 GiB), 2 ABBA rounds
    python bench/build_memory.py --layers 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace

from keel.trainer.model_args import MODEL_PRESETS, count_params, padded_vocab_size

ALLOWANCE = 64 * 2**20  # what else the build may hold: allocator slack, the runtime's own growth (tests/test_scale.py uses it too)
LAYOUTS = {"one process": (1, 1), "dp2": (2, 1), "tp2": (1, 2), "dp4 tp2": (4, 2), "dp8": (8, 1)}  # (dp, tp)

# Runs in a process of its own: the build of rank 0 of a layout, its peak and its shards, as JSON.
BUILD = """
import json, resource, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from keel.trainer.parallel import parallelize
from keel.trainer.launch.launcher import parse_train_args
from keel.trainer.model_args import model_args
cfg, _ = parse_train_args(sys.argv[1:])
if cfg.world_size > 1:
    dist.init_process_group("fake", rank=0, world_size=cfg.world_size, store=FakeStore())
layout = parallelize.build_layout(cfg, torch.device("cpu"))
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
parts = parallelize.build_model_parts(cfg, model_args(cfg), layout, torch.device("cpu"), bf16=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
shards = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for m in parts for p in m.parameters())
print(json.dumps({"peak": peak, "shards": shards}))
"""


def build_peak(preset: str, layers: int, dp: int, tp: int) -> dict:
    flags = [f"--model.preset={preset}", f"--model.n_layers={layers}", "--pp=1", f"--dp={dp}", f"--tp={tp}",
             "--training.microbatches=1", f"--training.global_batch_size={dp}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", BUILD, *flags], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7b", help="the model shape (untied, so the embedding is the largest parameter)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (7b has 32)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    opts = p.parse_args()
    args = MODEL_PRESETS[opts.preset]
    peaks: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    shards: dict[str, int] = {}
    order = list(LAYOUTS) + list(LAYOUTS)[::-1]
    for _ in range(opts.rounds):
        for name in order:
            got = build_peak(opts.preset, opts.layers, *LAYOUTS[name])
            peaks[name].append(got["peak"])
            shards[name] = got["shards"]
            print(f"  {name:>12}: peak {got['peak'] / 2**30:.2f} GiB, shards {got['shards'] / 2**30:.2f} GiB", flush=True)
    gib = 2**30
    print(f"\n{opts.preset} shape, {opts.layers} layers, rank 0 of each layout (GiB; peak: median and range)")
    print(f"{'layout':>12} | {'whole stage':>11} | {'shards':>6} | {'peak':>18} | target: shards + largest parameter + 64 MiB")
    for name, (_, tp) in LAYOUTS.items():
        vocab = padded_vocab_size(args.vocab_size, tp)
        whole = 4 * count_params(replace(args, n_layers=opts.layers), vocab)[0]
        # The embedding (and the head), made whole one at a time, and 64 MiB for the allocator and the runtime.
        target = shards[name] + 4 * vocab * args.dim + ALLOWANCE
        xs = peaks[name]
        spread = f"{statistics.median(xs) / gib:.2f} ({min(xs) / gib:.2f}-{max(xs) / gib:.2f})"
        verdict = "holds" if statistics.median(xs) <= target else "MISSED"
        print(f"{name:>12} | {whole / gib:>11.2f} | {shards[name] / gib:>6.2f} | {spread:>18} | <= {target / gib:.2f}: {verdict}")


if __name__ == "__main__":
    main()
