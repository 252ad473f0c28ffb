"""Per-rank metrics at scale: what recording a step costs rank 0, and how big the run store grows per
100k steps, at 8, 512 and 16,384 simulated ranks, with per-rank rows on every step (Keel before, and
`metrics.rank_rows = "every_step"`) against per-rank rows on the sampled steps only (the default: one
step in `metrics.comm_sample_every`, with the ranks' spread in every step row).

The timed code is Keel's own `StepReporter.report` writing to a real run store, from the moment the
ranks' numbers have been gathered: the bench hands it a gathered matrix of plausible values (step times
around 1 s, one rank 30% slower, communication measured on sampled steps) in place of the all-gather,
which needs the ranks. What the all-gather moves is printed beside it: 8 float64 per rank, on every
step, in both modes.

Rounds in ABBA order per world size; each side is a fresh store. The store size is the database after
it is closed (the write-ahead log folded in), scaled from the steps written to 100k steps.

    python bench/rank_metrics.py                 # 2 ABBA rounds at 8, 512 and 16,384 ranks
    python bench/rank_metrics.py --worlds 8 512 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from keel.monitor.recorder import RunRecorder
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import RunStore
from keel.trainer import step_metrics
from keel.trainer.step_metrics import StepNumbers, StepReporter

SAMPLE_EVERY = 10  # metrics.comm_sample_every's default
STEPS = {8: 2000, 512: 400, 16384: 60}  # steps written per side: enough sampled steps at every size
PER_100K = 100_000
# Target: with a row per rank on one step in 10, the per-rank rows dominate at many ranks, so the store
# and rank 0's cost per step should shrink about as much: at least 5x at 16,384 ranks.
TARGET_RATIO, TARGET_WORLD = 5.0, 16384


def gathered(world: int, step: int, sampled: bool, gen: torch.Generator) -> torch.Tensor:
    """What the all-gather hands every rank: per rank (has_loss, loss, step_time, comm_time, data_time,
    peak memory, faults fired, clock)."""
    rows = torch.zeros(world, 8, dtype=torch.float64)
    rows[:, 0] = 1.0
    rows[:, 1] = 3.0 + 0.01 * torch.rand(world, generator=gen, dtype=torch.float64)
    rows[:, 2] = 1.0 + 0.02 * torch.rand(world, generator=gen, dtype=torch.float64)
    rows[world // 3, 2] *= 1.3  # one slow rank
    rows[:, 3] = 0.2 * rows[:, 2] if sampled else float("nan")
    rows[:, 4] = 0.003
    rows[:, 5] = float(40 * 2**30)
    rows[:, 7] = 1.7e9 + step
    return rows


def record(world: int, every_step: bool, steps: int, run_dir: Path) -> tuple[float, int]:
    """Mean seconds per `report` (rank 0: agree the row, write the store) and the store's bytes."""
    gen = torch.Generator().manual_seed(world)
    recorder = RunRecorder("bench", RunStore(run_dir), sinks=[])
    reporter = StepReporter(torch.device("cpu"), world, 4096, 6e9, 1e15, recorder, None, rank_rows_every_step=every_step)
    spent = 0.0
    for step in range(1, steps + 1):
        sampled = (step - 2) % SAMPLE_EVERY == 0
        rows = gathered(world, step, sampled, gen)
        with mock.patch.object(step_metrics, "gather_rows", return_value=rows):
            start = time.perf_counter()
            reporter.report(StepNumbers(step, 0, 3e-4, 1.0, torch.tensor(3.0), 0.003, 0.2 if sampled else None, sampled=sampled))
            spent += time.perf_counter() - start
    recorder.close()
    return spent / steps, (run_dir / STORE_FILE).stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 512, 16384])
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per world size")
    args = parser.parse_args()
    print(f"{'ranks':>6} {'rank rows':>10} {'ms/step (min-max)':>22} {'GiB per 100k steps':>19} {'all-gather/step':>16}  target")
    for world in args.worlds:
        steps = STEPS.get(world, 200)
        results: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for every_step in (True, False, False, True):
                with tempfile.TemporaryDirectory() as tmp:
                    results[every_step].append(record(world, every_step, steps, Path(tmp)))
        ms = {side: [s * 1e3 for s, _ in runs] for side, runs in results.items()}
        gib = {side: statistics.median(b for _, b in runs) / steps * PER_100K / 2**30 for side, runs in results.items()}
        for every_step in (True, False):
            spread = f"{statistics.median(ms[every_step]):.3f} ({min(ms[every_step]):.3f}-{max(ms[every_step]):.3f})"
            target = ""
            if not every_step:
                store_x, step_x = gib[True] / gib[False], statistics.median(ms[True]) / statistics.median(ms[False])
                verdict = ("met" if min(store_x, step_x) >= TARGET_RATIO else "NOT met") if world == TARGET_WORLD else "(target at 16,384)"
                target = f"{store_x:.1f}x smaller store, {step_x:.1f}x cheaper step; >= {TARGET_RATIO:g}x: {verdict}"
            label = "every step" if every_step else "sampled"
            print(f"{world:>6} {label:>10} {spread:>22} {gib[every_step]:>19.3f} {world * 64 / 2**10:>12.1f} KiB  {target}")


if __name__ == "__main__":
    main()
