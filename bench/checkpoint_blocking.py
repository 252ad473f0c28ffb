"""How long training waits for a checkpoint: async saves against synchronous saves of the same state,
through the real train loop, alternated in one process (sync, async, async, sync, ...).

The model is the "small" family widened to about 50 M parameters (with AdamW's two moments, about
0.8 GB of state), so that writing it takes long enough to measure; one process, a save every 2 steps.
Blocked time is what the run store records for each save (`checkpoint_saved.blocking_s`): the save
call, plus any wait of the next optimizer step for the state copy still in flight.

    python bench/checkpoint_blocking.py                # 2 rounds of 8 steps each way
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
from pathlib import Path

import torch

from keel.monitor.store import read_events, read_steps
from keel.trainer.launch import parse_train_args
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


def run(run_dir: Path, steps: int, async_save: bool) -> tuple[list[float], float]:
    """(blocked seconds of each save, median step time) of one run."""
    cfg, _ = parse_train_args(
        [
            *WIDE,
            f"--steps={steps}",
            f"--run-dir={run_dir}",
            f"--run.run_id={run_dir.name}",
            f"--checkpoint.async_save={str(async_save).lower()}",
        ],
        world_size=1,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(cfg, torch.device("cpu"), rank=0, world=1).train()
    saves = read_events(run_dir).query("kind == 'checkpoint_saved'")
    return [d["blocking_s"] for d in saves.data][1:], statistics.median(
        read_steps(run_dir).step_time_s[1:]
    )  # the first save allocates buffers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    blocked: dict[bool, list[float]] = {False: [], True: []}
    step_times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for async_save in (False, True) if r % 2 == 0 else (True, False):
                saves, step_s = run(Path(tmp) / f"r{r}-{async_save}", args.steps, async_save)
                blocked[async_save] += saves
                step_times[async_save].append(step_s)
    sync_s, async_s = statistics.median(blocked[False]), statistics.median(blocked[True])
    print(f"synchronous save: training blocked {sync_s:.3f} s per save (median of {len(blocked[False])})")
    print(f"async save:       training blocked {async_s:.3f} s per save (median of {len(blocked[True])}); max {max(blocked[True]):.3f} s")
    print(
        f"median step time: {statistics.median(step_times[False]):.2f} s (sync runs), {statistics.median(step_times[True]):.2f} s (async runs)"
    )
    print(f"async blocking / synchronous save = {async_s / sync_s:.1%} (target <= 10%)")


if __name__ == "__main__":
    main()
