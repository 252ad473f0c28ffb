"""The train loop. Runs in every worker process, started by `keel train` (through torchrun), by
torchrun directly (`torchrun --nproc-per-node 8 -m keel.trainer.train --config small`), or by srun.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from keel.chaos.fault_specs import parse_fault, random_faults
from keel.chaos.faults import FaultPlan
from keel.monitor import run_lock
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_CONFIG, EXIT_OK, EXIT_ROLLBACK_CAP
from keel.monitor.redact import redact
from keel.monitor.run_dir import CONFIG_FILE, LOG_DIR, STORE_FILE, rank_log_name
from keel.monitor.store import last_event, read_events, read_meta, read_steps
from keel.monitor.stragglers import StragglerTracker
from keel.trainer import exposed_comm, flops, oom
from keel.trainer.checkpoint.checkpointer import Checkpointer, manifest_info
from keel.trainer.config import ConfigError, JobConfig, write_resolved_config
from keel.trainer.data.loader import BatchSampler, open_job_tokens, parse_skip_ranges
from keel.trainer.incidents import Incidents
from keel.trainer.launch.launcher import parse_train_args, resolve_run_dir
from keel.trainer.launch.lifetime import end_with_parent
from keel.trainer.launch.restarts import furthest_step, last_failure
from keel.trainer.model_args import flops_per_token, model_args
from keel.trainer.optim import build_optimizer, clip_grads, lr_at, set_lr
from keel.trainer.parallel import parallelize
from keel.trainer.parallel.distributed import init_distributed, set_collective_timeout, sum_over_ranks
from keel.trainer.planning.run_plan import keep_plan_of_run
from keel.trainer.progress import ProgressLine
from keel.trainer.recorder_setup import build_recorder
from keel.trainer.stability import StabilityGuard, Verdict
from keel.trainer.step import forward_backward
from keel.trainer.step_metrics import StepNumbers, StepReporter, held_tensor_bytes
from keel.trainer.watchdog import Watchdog, stalled_dumps

log = logging.getLogger("keel.train")
_fault_log = None  # the file faulthandler writes a crash's stacks to (see _setup_logging)
# How long a worker other than rank 0 waits, on a config error, for rank 0 to report it (see main).
CONFIG_ERROR_GRACE_S = 10.0


class Trainer:
    """One worker's share of a training job. The constructor sets everything up and, when the run is
    resumed or restarted, loads the newest good checkpoint; `train()` then runs the remaining steps.

    Every rank makes the same decisions at the same step (skip, roll back, save, stop) from agreed
    values, so the collectives of all ranks stay in step."""

    def __init__(self, cfg: JobConfig, device: torch.device, rank: int, world: int, process_start: float | None = None):
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.process_start = process_start or time.time()
        self.run_dir = Path(cfg.run.run_dir)
        _setup_logging(self.run_dir, rank)
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.resuming = cfg.run.resume or self.restart_count > 0
        self.microbatch_state = oom.load_state(cfg, self.run_dir, self.resuming)
        oom_note = self.microbatch_state.note()
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, rank)
        self._build_model()
        self._build_data()
        peak_total, mfu_basis = self._peak_flops_total()
        self.recorder = build_recorder(cfg, self.run_dir) if rank == 0 else None
        self.incidents = Incidents(self.recorder, cfg.run.run_id)
        self.attempt = _next_attempt(self.run_dir, rank, world) if self.resuming else 0
        last_step = _last_step_time(self.run_dir) if rank == 0 and self.resuming else None
        # Resumed by hand or by a scheduler after the processes ended with no record: a node loss.
        vanished = rank == 0 and cfg.run.resume and not self.restart_count and _ended_unrecorded(self.run_dir)
        run_began = _run_began(self.run_dir, self.process_start) if rank == 0 else self.process_start
        if self.recorder is not None:
            self._record_run_start(peak_total, mfu_basis, oom_note)
        if cfg.metrics.plan:
            keep_plan_of_run(cfg, device, world, peak_total, self.recorder)
        self.watchdog.on_hang = self.incidents.hang
        self._build_recovery()
        self.step, self.exit_code, self.memory_measured = 0, EXIT_OK, False
        if self.resuming:
            self._resume(last_step, vanished)
        if self.recorder is not None and self.exit_code == EXIT_OK:
            # After the resume check: a config the checkpoint refused never replaces the run's own.
            write_resolved_config(cfg, self.run_dir / CONFIG_FILE)
        self.progress = ProgressLine(cfg.training.steps, every=cfg.metrics.log_every, run_began=run_began) if rank == 0 else None
        if world > 1:
            exposed_comm.warm_up_profiler(device.type == "cuda")
        tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
        self.reporter = StepReporter(
            device, world, tokens_per_step, self.flop_per_token, peak_total, self.recorder, self.progress,
            rank_rows_every_step=cfg.metrics.rank_rows == "every_step",
        )  # fmt: skip
        log.info("starting training at step %d (attempt %d)", self.step + 1, self.attempt)
        # Process-group timeouts: watchdog.startup_s until the warm-up steps have run; then a collective
        # that waits past twice the longest the watchdog allows a step, plus a minute, is failed by the
        # process group itself. The watchdog normally fires first and leaves stack dumps; this is the backstop.
        self.tight_timeout_s = cfg.watchdog.startup_s

    # -- setup ------------------------------------------------------------------------------------

    def _build_model(self) -> None:
        """This rank's model parts, the pipeline schedule (pp > 1), the optimizer, and the fault plan whose
        hooks the step calls."""
        cfg, device = self.cfg, self.device
        bf16, self.autocast = parallelize.mixed_precision(cfg, device)
        if bf16 and device.type != "cuda":
            log.warning("training.dtype=bf16 on CPU: running bf16 autocast on CPU")
        log.info("process group up: rank %d of %d on %s", self.rank, self.world, device)
        self.layout = parallelize.build_layout(cfg, device)
        self.model_args = model_args(cfg)
        # The real vocabulary, not the padded one the modules are built with: MFU counts the model's own work.
        self.flop_per_token = flops_per_token(self.model_args, cfg.data.seq_len)
        self.parts = parallelize.build_model_parts(cfg, self.model_args, self.layout, device, bf16)
        self.faults = FaultPlan(fault_plan(cfg, self.world), self.rank, self.run_dir)
        self.schedule = parallelize.build_schedule(cfg, self.parts, self.layout, device, self.step_loss) if self.layout.pp > 1 else None
        self.optimizer = build_optimizer(self.parts, cfg.optim)
        log.info("model built: %d stage(s) on this rank", len(self.parts))

    def step_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch (the pipeline schedule calls it too)."""
        return self.faults.corrupt_loss(parallelize.loss_fn(logits, targets))  # the chaos hook point on the loss

    def _build_data(self) -> None:
        cfg = self.cfg
        self.source = open_job_tokens(cfg)
        self.sampler = BatchSampler(
            self.source.tokens,
            cfg.data.seq_len,
            cfg.training.global_batch_size,
            self.layout.dp_rank,
            self.layout.dp,
            cfg.training.seed,
            parse_skip_ranges(cfg.data.skip_batches),
            self.model_args.vocab_size,
            self.faults.corrupt_batch,
        )

    def _peak_flops_total(self) -> tuple[float, str]:
        """MFU's denominator: (the peak FLOPS of all devices together, how this device's peak was found).
        Measured once per run: a restarted or resumed run reuses the peak its first start measured, so
        MFU does not jump between attempts with the load of the moment (unless metrics.peak_tflops is set)."""
        saved = self._saved_peak() if self.resuming and not self.cfg.metrics.peak_tflops else None
        if saved is not None:
            per_device, basis = saved
            log.info("peak FLOPS: %.3g per device (%s; measured when the run began)", per_device, basis)
            return per_device * self.world, basis
        # Every rank measures (or looks up) its own peak at the same moment; the sum is over all devices.
        peak, basis = flops.device_peak_flops(self.device, self.cfg.metrics.peak_tflops)
        peak_total = sum_over_ranks(peak, self.device, self.world)
        log.info("peak FLOPS: %.3g per device (%s)", peak, basis)
        return peak_total, basis

    def _saved_peak(self) -> tuple[float, str] | None:
        """(peak FLOPS per device, basis) kept in the run's meta by its first start, on every rank; None
        when there is none or it was measured on another kind of device."""
        saved = [None]
        if self.rank == 0 and (self.run_dir / STORE_FILE).exists():
            meta = read_meta(self.run_dir)
            if meta.get("device", "").split(":")[0] == self.device.type and meta.get("peak_flops_per_device"):
                saved = [(float(meta["peak_flops_per_device"]), str(meta["mfu_basis"]))]
        if self.world > 1:
            dist.broadcast_object_list(saved, src=0)
        return saved[0]

    def _record_run_start(self, peak_total: float, mfu_basis: str, oom_note: dict | None) -> None:
        """Rank 0: the run's metadata, `run_started`, and the OOM restart that the previous attempt asked
        for, if it is not reported yet."""
        cfg, world, layout, recorder = self.cfg, self.world, self.layout, self.recorder
        for key, value in {
            "run_id": cfg.run.run_id,
            "config": redact(cfg.to_dict()),
            "world_size": world,
            "device": str(self.device),
            "mfu_basis": mfu_basis,
            "peak_flops_total": peak_total,
            "peak_flops_per_device": peak_total / world,
            "flops_per_token": self.flop_per_token,
            "data_version": self.source.version,
            "data": self.source.description,
            "torch_version": torch.__version__,
        }.items():
            recorder.store.set_meta(key, value)
        recorder.event(
            EventKind.RUN_STARTED,
            f"{world} processes, pp{layout.pp} dp{layout.dp} tp{layout.tp}",
            step=0,
            attempt=self.attempt,
            rank=0,
            data={"process_start": self.process_start, "restart_count": self.restart_count},
        )
        if oom_note:
            self.incidents.oom(
                oom_note["step"], self.attempt, oom_note["rank"], oom_note["previous"], oom_note["microbatches"], "coordinated restart"
            )
            oom.mark_reported(self.run_dir)

    def _build_recovery(self) -> None:
        """The checkpointer, the stability guard and the straggler tracker."""
        cfg, world, pp = self.cfg, self.world, self.layout.pp
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, self.parts, self.optimizer, self.rank, world, manifest_info(cfg, self.source.version)
        )
        self.guard = StabilityGuard(cfg.recovery, cfg.spike)
        stage_size = world // pp  # mesh order (pp, dp, tp): each pipeline stage is a block of ranks
        self.stragglers = StragglerTracker(cfg.stragglers, world, [range(k * stage_size, (k + 1) * stage_size) for k in range(pp)])

    def _resume(self, last_step: float | None, vanished: bool) -> None:
        """Loads the newest good checkpoint and the sampler and guard state saved with it; after a
        restart, also reports the stalls and the restart itself with its cause (rank 0), and after the
        processes vanished, the node loss. A checkpoint of another model or data ends the run instead
        (see `_refuse_resume`)."""
        self.watchdog.beat("checkpoint_load", 0, self.attempt)
        try:
            restored = self.checkpointer.load_latest(resuming=True)
        except ConfigError as e:
            self._refuse_resume(str(e))
            return
        if restored is not None:
            self.step = restored.step
            self.sampler.load_state_dict(restored.train_state["sampler"])
            self.guard.load_state_dict(restored.train_state["guard"])
            if restored.layout_change:
                log.info("%s", restored.layout_change)
            self.incidents.loaded(restored, self.attempt)
        else:
            self.incidents.no_checkpoint(self.attempt, self.checkpointer.corrupt)
        if self.restart_count and self.rank == 0:
            _report_stalls(self.run_dir, self.incidents)
        downtime_s = self.process_start - last_step if last_step else 0.0
        if self.restart_count:
            self.incidents.restart(self.attempt, self.restart_count, downtime_s, self.step, last_failure(self.run_dir))
        elif vanished:
            failure = last_failure(self.run_dir)
            killed = failure if failure is not None and failure.rank is None and failure.time > (last_step or 0) else None
            self.incidents.node_loss(self.attempt, downtime_s, self.step, furthest_step(self.run_dir), killed)

    def _refuse_resume(self, reason: str) -> None:
        """Ends the run before its first step with EXIT_CONFIG. Stopping on purpose: recorded as
        `run_stopped`, which `keel train` returns, and the workers end cleanly (a restart would be refused too)."""
        if self.rank == 0:
            print(f"keel train: error: {reason}", file=sys.stderr, flush=True)
        self.exit_code = EXIT_CONFIG
        self.incidents.stopped(self.step, self.attempt, reason, self.exit_code)

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> int:
        """Runs the remaining steps, then tears down; returns the exit code (see keel.monitor.exits)."""
        while self.exit_code == EXIT_OK and self.step < self.cfg.training.steps:
            self.step += 1
            outcome = self.train_step()
            if outcome is None:  # out of memory: recover_oom set the same step up to run again
                continue
            row, verdict = outcome
            if verdict.action == "stop":
                self.exit_code = EXIT_ROLLBACK_CAP
                self.incidents.stopped(self.step, self.attempt, verdict.reason, self.exit_code)
                break
            if verdict.action == "rollback":
                self.roll_back(verdict)
                continue
            self.save_if_due(row["time"])
        self.finish()
        return self.exit_code

    def train_step(self) -> tuple[dict, Verdict] | None:
        """Runs step `self.step` on the next batch and records it; returns the step's agreed metrics row
        and the guard's verdict. None when the step ran out of memory (see `recover_oom`)."""
        cfg, step = self.cfg, self.step
        self.watchdog.beat("step", step, self.attempt)
        self.retry_microbatch()
        self.faults.begin_step(step)
        t0 = time.perf_counter()
        batch_index = self.sampler.batch_index
        inputs, targets = self._next_batch()
        data_time = time.perf_counter() - t0
        lr = lr_at(step, cfg.optim, cfg.training.steps) * self.guard.lr_scale(step) * self.faults.lr_scale()
        set_lr(self.optimizer, lr)
        sampled = (step - 2) % cfg.metrics.comm_sample_every == 0  # per-rank rows kept; communication measured
        sample_comm = self.world > 1 and sampled
        # On CPU the first profiled step of a process also measures memory, as the GPU's allocator does: what
        # the step starts with, and the most it allocates beyond that. The steps that follow hold the same.
        measure_memory = sample_comm and self.device.type != "cuda" and not self.memory_measured
        held = held_tensor_bytes(self.parts, self.optimizer) if measure_memory else None
        try:
            with exposed_comm.sampled_step(sample_comm, self.device.type == "cuda", held) as profiled:
                loss, grad_norm, skipped = self._compute_and_update(inputs, targets)
        except torch.OutOfMemoryError:
            self.recover_oom(batch_index)
            return None
        self.faults.end_step()
        self.faults.before_collective()
        memory_peak = profiled.memory_peak_bytes()
        self.memory_measured = self.memory_measured or memory_peak is not None
        numbers = StepNumbers(
            step, self.attempt, lr, grad_norm, loss, data_time, comm_time=profiled.comm_seconds(), faults_fired=len(self.faults.fired),
            skipped=skipped, sampled=sampled, allocated_peak=memory_peak,
        )  # fmt: skip
        row, fault_ranks = self.reporter.report(numbers)
        self.watchdog.step_finished(row["step_time_s"])
        if self.watchdog.collective_timeout_s() != self.tight_timeout_s:
            self.tight_timeout_s = self.watchdog.collective_timeout_s()
            set_collective_timeout(self.layout, self.tight_timeout_s)
        return row, self._judge(row, fault_ranks, skipped, sample_comm)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets, on the device; rank 0 records the batches the sampler passed over."""
        inputs, targets = self.sampler.next_batch()
        rejected = self.sampler.take_rejected()
        if rejected:  # ids at or past the real vocabulary: a padded row of the embedding is no token either
            self.incidents.bad_batches(self.step, self.attempt, rejected, self.model_args.vocab_size)
        return torch.from_numpy(inputs).to(self.device, non_blocking=True), torch.from_numpy(targets).to(self.device, non_blocking=True)

    def _compute_and_update(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor | None, float, bool]:
        """Forward, backward and the gradient collectives, then the update unless a loss or gradient is
        not finite on some rank. Returns (this rank's loss, the global grad norm, whether the update was skipped)."""
        cfg, parts, faults = self.cfg, self.parts, self.faults
        faults.at_step_start(
            parts, cfg.microbatch_rows, self.checkpointer.wait
        )  # chaos hook points: the process, the parameters, the checkpoints
        loss = forward_backward(cfg, parts, self.schedule, self.layout, inputs, targets, self.autocast, self.step_loss)
        faults.corrupt_grads(parts)
        if cfg.parallel.dp > 1 and cfg.parallel.dp_mode == "replicate":
            faults.before_collective()
            parallelize.all_reduce_replicated_grads(parts, self.layout)
        loss_finite = loss is None or bool(torch.isfinite(loss))
        faults.before_collective()
        grad_norm = parallelize.global_grad_norm(parts, self.layout, loss_finite).item()
        skipped = not math.isfinite(grad_norm)  # the same verdict on every rank
        if skipped:
            log.warning("step %d skipped: a loss or gradient is not finite on some rank (global grad norm %s)", self.step, grad_norm)
        else:
            clip_grads(parts, cfg.optim.grad_clip, grad_norm)
            self.checkpointer.before_update()  # a save in flight must have copied the parameters
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, skipped

    def _judge(self, row: dict, fault_ranks: list[int], skipped: bool, sampled_comm: bool) -> Verdict:
        """The guard's verdict on the step; rank 0 records what the step showed (faults, a skip, the
        detector's findings, stragglers on steps whose communication was measured)."""
        verdict = self.guard.observe(self.step, row["loss"], row["grad_norm"], skipped)
        self.incidents.step(row, fault_ranks, verdict.findings)
        if sampled_comm and self.step > self.cfg.stragglers.warmup_steps:
            self.incidents.stragglers(self.step, self.attempt, self.stragglers.update(self.reporter.busy_s))
        return verdict

    def recover_oom(self, batch_index: int) -> None:
        """After the step ran out of memory: halves the micro-batch (oom.halve_microbatch ends the process
        when only a restart can) and sets the same step up to run again, on the same data."""
        self.optimizer.zero_grad(set_to_none=True)
        old = self.cfg.training.microbatches
        new = oom.halve_microbatch(self.cfg, self.microbatch_state, self.world, self.run_dir, self.rank, self.step)
        self.incidents.oom(self.step, self.attempt, self.rank, old, new, "in process")
        self.sampler.rewind_to(batch_index)
        self.step -= 1
        self.reporter.restart_clock()

    def retry_microbatch(self) -> None:
        """At the step an out-of-memory planned it (keel.trainer.oom): twice the micro-batch again, on every
        rank at once (they hold the same state); a pipeline's schedule is built again for the new count."""
        if not oom.retry_due(self.microbatch_state, self.step):
            return
        old = self.cfg.training.microbatches
        new = oom.retry_larger_microbatch(self.cfg, self.microbatch_state, self.step)
        if self.schedule is not None:
            self.schedule = parallelize.build_schedule(self.cfg, self.parts, self.layout, self.device, self.step_loss)
        self.incidents.oom_retry(self.step, self.attempt, old, new, self.microbatch_state.configured)

    def roll_back(self, verdict: Verdict) -> None:
        """Restores the newest good checkpoint saved before the bad steps and moves the sampler past the
        bad window (recovery.skip_data) or back to the checkpoint's data; a new attempt begins there."""
        step = self.step
        self.watchdog.beat("checkpoint_load", step, self.attempt)
        set_collective_timeout(self.layout, self.cfg.watchdog.checkpoint_s + 60)  # rank 0 verifies while the others wait
        restored = self.checkpointer.load_latest(before_step=verdict.bad_from)
        set_collective_timeout(self.layout, self.tight_timeout_s)
        if restored is None:
            self.incidents.no_rollback_target(step, self.attempt, verdict.reason, verdict.bad_from, self.checkpointer.corrupt)
        else:
            since = restored.train_state["sampler"]["batch_index"]
            if self.cfg.recovery.skip_data:  # every batch read since the checkpoint, and a margin beyond
                self.sampler.skip_to(self.sampler.batch_index + self.cfg.recovery.skip_margin)
            else:
                self.sampler.rewind_to(since)
            discarded = self.checkpointer.discard_after(restored.step)
            self.guard.rolled_back(restored.step, step)
            self.attempt += 1
            skipped_batches = (since, self.sampler.batch_index)
            self.incidents.rollback(step, self.attempt, verdict.reason, verdict.bad_from, restored, skipped_batches, discarded)
            self.step = restored.step
        self.reporter.restart_clock()

    def save_if_due(self, now: float) -> None:
        """Saves a checkpoint when one is due (`now` is the step's agreed time); rank 0 records the saves
        that finished since the last step."""
        step, attempt = self.step, self.attempt
        if self.checkpointer.maybe_save(
            step,
            now,
            step == self.cfg.training.steps,
            self._train_state,
            before_save=lambda: self.watchdog.beat("checkpoint_save", step, attempt),
        ):
            self.reporter.restart_clock()
        self.incidents.saved(self.checkpointer.poll(), attempt)

    def _train_state(self) -> dict:
        """What a checkpoint records besides the tensors, to resume the run from it."""
        return {
            "step": self.step,
            "attempt": self.attempt,
            "sampler": self.sampler.state_dict(),
            "microbatches": self.cfg.training.microbatches,
            "guard": self.guard.state_dict(),
        }

    # -- teardown ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Waits for the save in flight, stops the watchdog, closes the run's record (rank 0) and the process group."""
        self.watchdog.beat("checkpoint_save", self.step, self.attempt)
        self.checkpointer.close()
        self.incidents.saved(self.checkpointer.poll(), self.attempt)
        self.watchdog.stop()
        if self.recorder is not None:
            self._record_run_end()
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()

    def _record_run_end(self) -> None:
        """Rank 0: `run_finished` (unless the run stopped on purpose), the run's goodput, then the sinks close."""
        cfg, recorder = self.cfg, self.recorder
        self.progress.finish()
        if self.exit_code == EXIT_OK:
            recorder.event(EventKind.RUN_FINISHED, f"{cfg.training.steps} steps", step=cfg.training.steps, attempt=self.attempt, rank=0)
        # Imported here: goodput needs pandas, 0.5 s of CPU that only rank 0 pays, once, at the end.
        from keel.monitor.goodput import goodput_of_run

        goodput = goodput_of_run(self.run_dir)
        recorder.store.set_meta("goodput", goodput.to_dict())
        recorder.event(EventKind.GOODPUT, goodput.summary(), step=self.step, attempt=self.attempt, rank=0, data=goodput.to_dict())
        print(goodput.summary(), flush=True)
        if cfg.monitor.prometheus_linger_s > 0:
            log.info("keeping /metrics up for %.0f s (monitor.prometheus_linger_s)", cfg.monitor.prometheus_linger_s)
            time.sleep(cfg.monitor.prometheus_linger_s)
        recorder.close()


def fault_plan(cfg: JobConfig, world: int) -> list:
    """The run's faults: the listed ones, and the random ones when chaos.mtbf_steps is set."""
    plan = [parse_fault(spec) for spec in cfg.chaos.faults]
    if cfg.chaos.mtbf_steps > 0:
        plan += random_faults(
            cfg.chaos.mtbf_steps,
            cfg.chaos.random_kinds,
            cfg.training.steps,
            world,
            cfg.chaos.random_seed,
            cfg.spike,
            cfg.recovery.nonfinite_limit,
        )
        log.info("random faults (mean %g steps apart): %s", cfg.chaos.mtbf_steps, ", ".join(map(str, plan)))
    return plan


def _report_stalls(run_dir: Path, incidents: Incidents) -> None:
    """Reports the processes that faulthandler ended because their GIL was held, unless the attempt
    already reported its hang (the other ranks' watchdogs see the same stall from inside a collective)."""
    events = read_events(run_dir) if (run_dir / STORE_FILE).exists() else None
    reported = set() if events is None else set(events.loc[events.kind == EventKind.HANG, "attempt"].dropna().astype(int))
    for info in stalled_dumps(run_dir):
        if info["attempt"] not in reported:
            incidents.hang(info)
            reported.add(info["attempt"])


def _next_attempt(run_dir: Path, rank: int, world: int) -> int:
    """One more than any attempt in the run store, so a resumed run's rows never replace earlier ones."""
    value = [0]
    if rank == 0 and (run_dir / STORE_FILE).exists():
        steps, events = read_steps(run_dir), read_events(run_dir)
        attempts = [
            int(steps["attempt"].max()) if len(steps) else -1,
            int(events["attempt"].max()) if events["attempt"].notna().any() else -1,
        ]
        value = [max(attempts) + 1]
    if world > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


def _ended_unrecorded(run_dir: Path) -> bool:
    """Whether the run's last start has neither finished nor stopped on record: its processes vanished."""
    if not (run_dir / STORE_FILE).exists():
        return False
    last = last_event(run_dir, [EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED])
    return last is not None and last[0] == EventKind.RUN_STARTED


def _run_began(run_dir: Path, process_start: float) -> float:
    """When the run's first process started (the progress line's clock spans restarts and resumes)."""
    if not (run_dir / STORE_FILE).exists():
        return process_start
    events = read_events(run_dir)
    starts = [d.get("process_start") for d in events.loc[events.kind == EventKind.RUN_STARTED, "data"] if isinstance(d, dict)]
    return min([s for s in starts if s] + [process_start])


def _last_step_time(run_dir: Path) -> float | None:
    """When the failed group recorded its last step: its down time runs from there to the new processes.
    Not its last event: a watchdog records the hang when it detects it, after the stall, and goodput
    counts the stall as the hang inside this down time (keel.monitor.goodput)."""
    if not (run_dir / STORE_FILE).exists():
        return None
    last = read_steps(run_dir)["time"].max()
    return None if last != last else float(last)


def _setup_logging(run_dir: Path, rank: int) -> None:
    (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_DIR / rank_log_name(rank)
    # A segfault's Python stacks go to this rank's log, not to the console the whole job shares.
    global _fault_log
    _fault_log = open(log_path, "a")  # noqa: SIM115 (held open for the life of the process, for faulthandler)
    faulthandler.enable(file=_fault_log)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("keel")
    for old in list(root.handlers):  # a second Trainer in one process (benchmarks) logs to its own run only
        root.removeHandler(old)
        old.close()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        root.addHandler(console)


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    try:
        cfg, _ = parse_train_args(sys.argv[1:] if argv is None else argv, world_size=world)
    except ConfigError as e:
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"keel train: error: {e}", file=sys.stderr)
        else:
            # Rank 0 reports it. torchrun stops every worker as soon as one exits, so the others give rank 0
            # the time to, and are stopped when it exits (its exit code is the one torchrun reports).
            time.sleep(CONFIG_ERROR_GRACE_S)
        return EXIT_CONFIG
    faulthandler.enable()  # a segfault leaves the Python stacks in stderr until the rank's log is open
    end_with_parent()  # torchrun's death (or its launcher's) ends this worker too
    device, rank, world = init_distributed(cfg.watchdog.startup_s)
    if not cfg.run.run_dir:
        # Started by torchrun or srun directly: rank 0 names the run, everyone uses that name.
        resolve_run_dir(cfg)
        names = [cfg.run.run_id, cfg.run.run_dir]
        if world > 1:
            dist.broadcast_object_list(names, src=0)
        cfg.run.run_id, cfg.run.run_dir = names
    owner, refused = own_run_dir(cfg.run.run_dir, rank, world)
    if refused:
        return EXIT_CONFIG
    with owner:
        Trainer(cfg, device, rank, world, process_start).train()
    # A run that stopped on purpose (the rollback cap) recorded `run_stopped` with its exit code, which
    # `keel train` returns; the worker itself ends cleanly, or torchrun would restart it.
    return EXIT_OK


def own_run_dir(run_dir: str, rank: int, world: int) -> tuple[contextlib.AbstractContextManager, str]:
    """Rank 0 takes the run directory's lock for the life of the training (keel.monitor.run_lock); every
    rank learns whether it did. (the lock's holder, or a null context on other ranks; the refusal, or "")."""
    owner, refused = contextlib.nullcontext(), ""
    if rank == 0:
        try:
            owner = run_lock.own(run_dir)
        except run_lock.RunDirBusy as e:
            refused = str(e)
            # Printed before the others learn of it: they exit at once, and torchrun then stops rank 0.
            print(f"keel train: error: {refused}", file=sys.stderr, flush=True)
    if world > 1:
        verdict = [refused]
        dist.broadcast_object_list(verdict, src=0)
        refused = verdict[0]
    return owner, refused


def exit_worker(code: int) -> None:
    """Ends the worker without Python's teardown of its modules: with torch, DTensor, FSDP and pipelining
    imported, that teardown takes 1.7 s of CPU per process (7 s of a pp2 dp2 tp2 job's wall clock on two
    cores), at every exit and every restart. What the run writes was closed by then (the store, the
    sinks, the checkpoint writer); the logs and the standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_worker(main())
