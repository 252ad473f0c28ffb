"""How long training waits for checkpoints: the same N steps with no save, with synchronous saves and
with async saves (one every 2 steps), through the real train loop in one process, interleaved ABBA
(none, sync, async, async, sync, none, ...).

Measured from outside the checkpointer: the wall time of the train loop (Trainer.train(), which ends
only when the last save has landed), minus that of the run without saves, per save. So everything a
save costs the run counts: DCP's write or its state copy, rank 0 hashing the files and sealing the
manifest, the optimizer waiting for a copy in flight, and the last save, which no next step hides.
Beside it, for reference, the median `blocking_s` the checkpointer records for itself.

The model is the "small" family widened to about 50 M parameters (with AdamW's two moments, about
0.8 GB of state), so that writing it takes long enough to measure; one process.

    python bench/checkpoint_blocking.py                # 2 ABBA rounds of 16 steps each way
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

from keel.monitor.event_kinds import EventKind
from keel.monitor.store import read_events
from keel.trainer.launch.launcher import parse_train_args
from keel.trainer.train import Trainer

WIDE = [
    "--config=small",
    "--pp=1",
    "--dp=1",
    "--tp=1",
    "--model.dim=1024",
    "--model.n_layers=4",
    "--model.ffn_dim=4096",
    "--model.n_heads=8",
    "--model.n_kv_heads=8",
    "--monitor.prometheus=false",
    "--monitor.wandb=false",
    "--checkpoint.interval_steps=2",
    "--metrics.log_every=1000",
]


MODES = {"none": 0, "sync": 2, "async": 2}  # checkpoint.interval_steps of each kind of run
TARGET = 0.10  # async saves may cost at most 10% of what synchronous ones do


def run(run_dir: Path, steps: int, mode: str) -> tuple[float, list[float]]:
    """(wall seconds of the train loop, the `blocking_s` each save recorded) of one run."""
    cfg, _ = parse_train_args(
        [
            *WIDE,
            f"--steps={steps}",
            f"--run-dir={run_dir}",
            f"--run.run_id={run_dir.name}",
            f"--checkpoint.interval_steps={MODES[mode]}",
            f"--checkpoint.async_save={str(mode == 'async').lower()}",
        ],
        world_size=1,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, torch.device("cpu"), rank=0, world=1)
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    events = read_events(run_dir)
    saves = events[events.kind == EventKind.CHECKPOINT_SAVED]
    return wall, [d["blocking_s"] for d in saves.data]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    saves = args.steps // MODES["sync"]
    cost: dict[str, list[float]] = {"sync": [], "async": []}
    recorded: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp) / "warmup", 2, "sync")  # first-call costs: allocator, DCP's planner, file cache
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]  # ABBA: a drift cancels out
            walls = {}
            for mode in order:
                walls[mode], blocked = run(Path(tmp) / f"r{r}-{mode}", args.steps, mode)
                recorded.get(mode, []).extend(blocked)
            for mode in cost:
                cost[mode].append((walls[mode] - walls["none"]) / saves)
            print(f"round {r + 1}: " + ", ".join(f"{m} {walls[m]:.2f} s" for m in order) + f" for {args.steps} steps", flush=True)
    sync_s, async_s = statistics.median(cost["sync"]), statistics.median(cost["async"])
    ratios = [a / s for a, s in zip(cost["async"], cost["sync"])]
    print(
        f"\n{args.steps} steps, a save every {MODES['sync']} ({saves} saves), {args.rounds} ABBA rounds; cost per save, measured from outside:"
    )
    print(f"  synchronous: {sync_s:.3f} s ({_spread(cost['sync'])}); the checkpointer records {statistics.median(recorded['sync']):.3f} s")
    print(
        f"  async:       {async_s:.3f} s ({_spread(cost['async'])}); the checkpointer records {statistics.median(recorded['async']):.3f} s"
    )
    ratio = statistics.median(ratios)
    verdict = "holds" if ratio <= TARGET else "MISSED"
    print(f"  async / synchronous = {ratio:.1%} ({_spread(ratios, '.1%')}); target <= {TARGET:.0%}: {verdict}")


def _spread(xs: list[float], fmt: str = ".3f") -> str:
    return f"range {min(xs):{fmt}} to {max(xs):{fmt}}"


if __name__ == "__main__":
    main()
