"""Per-step metrics: each rank's own numbers, exchanged in one all-gather, turned into the step row
(with the ranks' spread: fastest, median and slowest step time; on steps whose communication was
measured, the slowest few ranks by busy time), the per-rank rows of the run store (written by rank 0)
and the console progress line.

Per-rank rows are kept on the sampled steps only (those whose communication is measured, one in
`metrics.comm_sample_every`), unless `metrics.rank_rows = "every_step"`: at 16,384 ranks a row per rank
and step would be 1.6 billion rows per 100k steps. The straggler detector needs no more, since only a
measured step tells a rank's own work from its waiting for the others (see keel.monitor.stragglers)."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keel.monitor.recorder import RunRecorder
from keel.monitor.store import SLOWEST_RANKS
from keel.trainer.progress import ProgressLine

MAX_EXP_ARG = 709.0  # math.exp overflows a float past about 709.78


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


ALLOCATED_PEAK_META = "mem_allocated_peak_bytes"


def held_tensor_bytes(parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's parameters (its shards), gradients and optimizer state, each storage once: what
    a step starts with, beside which its own allocations are counted (exposed_comm.allocated_peak_bytes)."""
    tensors = [p for part in parts for p in part.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def gather_rows(row: list[float], device: torch.device, world: int) -> torch.Tensor:
    """[world, len(row)] float64 on CPU: every rank's row, on every rank."""
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    if world == 1:
        return mine[None].cpu()
    out = torch.empty(world * len(row), dtype=torch.float64, device=device)
    dist.all_gather_single(out, mine)
    return out.view(world, len(row)).cpu()


def perplexity(loss: float) -> float:
    """exp(loss): the number of equally likely tokens the model hesitates between; inf past float range, NaN for NaN."""
    return math.inf if loss > MAX_EXP_ARG else math.exp(loss)


def slowest_ranks(busy_s: torch.Tensor, k: int = SLOWEST_RANKS) -> str:
    """The k ranks with the longest busy time (step minus exposed communication), slowest first, as
    "5,0,3" (ties: the lower rank first); a rank that measured none (NaN) comes last. Busy time, not step
    time: the others wait for a slow rank inside the collectives, so every rank's step takes as long."""
    order = torch.argsort(-torch.nan_to_num(busy_s, nan=-math.inf), stable=True)[:k]
    return ",".join(str(r) for r in order.tolist())


def rank_rows(step: int, attempt: int, step_times, comm_times, data_times, mems) -> list[dict]:
    """The run store's per-rank rows of one step from the gathered columns (comm time NaN: not measured)."""
    rows = zip(step_times.tolist(), comm_times.tolist(), data_times.tolist(), mems.tolist())
    return [
        {
            "step": step,
            "attempt": attempt,
            "rank": rank,
            "step_time_s": step_s,
            "comm_time_s": None if math.isnan(comm_s) else comm_s,
            "data_time_s": data_s,
            "mem_peak_bytes": int(mem),
        }
        for rank, (step_s, comm_s, data_s, mem) in enumerate(rows)
    ]


@dataclass(frozen=True)
class StepNumbers:
    """One step's numbers on this rank, as the loop has them: what StepReporter.report agrees with the
    other ranks into the step row (whose columns are keel.monitor.metric_registry's)."""

    step: int
    attempt: int
    lr: float
    grad_norm: float  # global: the same on every rank
    loss: torch.Tensor | None  # None on pipeline ranks without the last stage
    data_time: float  # seconds this rank waited for its batch
    comm_time: float | None = None  # exposed communication seconds; None when not measured
    faults_fired: int = 0  # faults this rank injected during the step
    skipped: bool = False  # no update: a loss or gradient was not finite on some rank
    sampled: bool = False  # a step whose per-rank rows are kept
    # On a profiled CPU step, the most bytes of tensors this rank held (kept per rank in the run's meta,
    # ALLOCATED_PEAK_META, for `keel plan --check`).
    allocated_peak: int | None = None
    custom: dict[str, float] | None = None  # a user's loop's own metrics (rank 0's are recorded)
    val_loss: float | None = None  # the validation loss after the step's update (the same on every rank); None: not evaluated
    eval_s: float = 0.0  # seconds the evaluation took: not part of the step's time


class StepReporter:
    """Measures step time on this rank, agrees the step's metrics with all ranks, records them."""

    def __init__(
        self,
        device: torch.device,
        world: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops_total: float,
        recorder: RunRecorder | None,
        progress: ProgressLine | None,
        rank_rows_every_step: bool = False,
    ):
        self.device, self.world = device, world
        self.tokens_per_step, self.flops_per_token, self.peak_flops_total = tokens_per_step, flops_per_token, peak_flops_total
        self.recorder, self.progress = recorder, progress
        self.rank_rows_every_step = rank_rows_every_step
        self.last_comm_share: float | None = 0.0 if world == 1 else None
        self.step_end = time.perf_counter()
        self.busy_s: list[float] = []
        self.preempt_signals: dict[int, int] = {}  # rank -> the signal that asked it to preempt, at the last step
        self.snapshot_cost_s = math.nan  # the slowest rank's last snapshot cost, in seconds (NaN: not every rank has one)
        self.save_failures_in_row = 0  # checkpoint saves failed in a row, as the rank that saw most reports it
        self.allocated_peaks = torch.full((world,), math.nan, dtype=torch.float64)  # per rank, over the profiled steps

    def restart_clock(self) -> None:
        """Time spent since the last step (a checkpoint save, a rollback) is not counted in the next step."""
        self.step_end = time.perf_counter()

    def report(
        self, numbers: StepNumbers, preempt_signal: int = 0, snapshot_cost_s: float = math.nan, save_failures: int = 0
    ) -> tuple[dict, list[int]]:
        """Returns the agreed step row and the ranks that injected a fault this step (the same on every
        rank). Where communication was measured, also sets `busy_s`: per rank, step time minus
        communication time (NaN for a rank that measured none). `preempt_signal`: the signal that asked
        this rank to preempt the run (0: none); every rank's is in `preempt_signals` (rank -> signal).
        `snapshot_cost_s`: what this rank's last in-memory snapshot took from training (NaN: none yet); the
        slowest rank's is in `snapshot_cost_s`, an agreed value the snapshot interval is measured from.
        `save_failures`: the checkpoint saves this rank saw fail in a row; the most of any rank is in
        `save_failures_in_row`."""
        now = time.perf_counter()
        step_time, self.step_end = now - self.step_end - numbers.eval_s, now
        step, attempt, loss, comm_time = numbers.step, numbers.attempt, numbers.loss, numbers.comm_time
        mine = [
            0.0 if loss is None else 1.0,
            0.0 if loss is None else loss.item(),
            step_time,
            math.nan if comm_time is None else comm_time,
            numbers.data_time,
            float(peak_memory_bytes(self.device)),
            float(numbers.faults_fired),
            time.time(),
            math.nan if numbers.allocated_peak is None else float(numbers.allocated_peak),
            float(preempt_signal),
            snapshot_cost_s,
            float(save_failures),
        ]
        gathered = gather_rows(mine, self.device, self.world).T
        has_loss, losses, step_times, comm_times, data_times, mems, faults, clocks, allocated, preempts, snapshot_costs, failures = gathered
        self.preempt_signals = {rank: int(sig) for rank, sig in enumerate(preempts.tolist()) if sig}
        self.snapshot_cost_s = float(snapshot_costs.max()) if not torch.isnan(snapshot_costs).any() else math.nan
        self.save_failures_in_row = int(failures.max())
        self._keep_allocated_peaks(allocated)
        slowest = float(step_times.max())  # a synchronous step is as slow as its slowest rank
        tokens_per_s = self.tokens_per_step / slowest
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops_total
        comm_share = comm_share_max = self.last_comm_share if self.world == 1 else None
        named = None
        if comm_time is not None:
            comm_share = self.last_comm_share = float(comm_times.mean()) / slowest
            comm_share_max = float(comm_times.max()) / slowest
            busy = step_times - comm_times
            self.busy_s, named = busy.tolist(), slowest_ranks(busy)
        row = {
            "step": step,
            "attempt": attempt,
            "time": float(clocks.max()),  # the latest clock of all ranks: one every rank agrees on, so time-based decisions match
            "loss": float(losses[has_loss > 0].mean()),
            "grad_norm": numbers.grad_norm,
            "lr": numbers.lr,
            "tokens": step * self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "comm_share": comm_share,
            "comm_share_max": comm_share_max,
            "step_time_s": slowest,
            "step_time_median_s": float(step_times.quantile(0.5)),
            "step_time_min_s": float(step_times.min()),
            "slowest_ranks": named,
            "data_time_s": float(data_times.max()),
            "mem_peak_bytes": int(mems.max()),
            "skipped": int(numbers.skipped),
            "validation_loss": numbers.val_loss,
            "validation_perplexity": None if numbers.val_loss is None else perplexity(numbers.val_loss),
            "eval_time_s": numbers.eval_s,
        }
        if numbers.custom:
            row["custom"] = numbers.custom
        if self.recorder is not None:
            keep_ranks = numbers.sampled or comm_time is not None or self.rank_rows_every_step
            self.recorder.step(row, rank_rows(step, attempt, step_times, comm_times, data_times, mems) if keep_ranks else [])
        if self.progress is not None:
            self.progress.update(step, row["loss"], tokens_per_s, mfu, self.last_comm_share, slowest)
            if numbers.val_loss is not None:
                self.progress.validation(step, numbers.val_loss, row["validation_perplexity"])
        return row, torch.nonzero(faults > 0).flatten().tolist()

    def _keep_allocated_peaks(self, allocated: torch.Tensor) -> None:
        if torch.isnan(allocated).all():
            return
        self.allocated_peaks = torch.fmax(self.allocated_peaks, allocated)
        if self.recorder is not None:
            self.recorder.store.set_meta(ALLOCATED_PEAK_META, [None if math.isnan(b) else int(b) for b in self.allocated_peaks.tolist()])
