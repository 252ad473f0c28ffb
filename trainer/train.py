"""The train loop. Runs in every worker process, started by `keel train` (through torchrun), by
torchrun directly (`torchrun --nproc-per-node 8 -m keel.trainer.train --config small`), or by srun.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import DATA_SOURCES_META, read_meta
from keel.trainer import exposed_comm, flops, oom, preemption
from keel.trainer.checkpoint.checkpointer import WholeModel, manifest_info
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.blend import open_job_data
from keel.trainer.data.documents import eod_to_mask, mask_after_eod
from keel.trainer.data.loader import BatchSampler, parse_skip_ranges
from keel.trainer.data.validation import split_for_validation
from keel.trainer.evaluate import validation_loss
from keel.trainer.launch.launcher import parse_train_args, resolve_run_dir
from keel.trainer.launch.lifetime import end_with_parent
from keel.trainer.model_args import flops_per_token, model_args
from keel.trainer.optim import build_optimizer, clip_grads, lr_at, set_lr
from keel.trainer.parallel import parallelize
from keel.trainer.parallel.distributed import init_distributed, set_collective_timeout, sum_over_ranks
from keel.trainer.planning.run_plan import keep_plan_of_run
from keel.trainer.step import forward_backward
from keel.trainer.step_metrics import StepNumbers, held_tensor_bytes
from keel.trainer.toolkit.run import KeelRun, own_run_dir

log = logging.getLogger("keel.train")
# How long a worker other than rank 0 waits, on a config error, for rank 0 to report it (see main).
CONFIG_ERROR_GRACE_S = 10.0


class Trainer:
    """One worker's share of a training job. The constructor sets everything up and, when the run is
    resumed or restarted, loads the newest good checkpoint; `train()` then runs the remaining steps.

    Keel's trainer is the first client of the toolkit a user's loop gets (keel.trainer.toolkit): its
    KeelRun records, guards, watches and injects faults here as it does there. Every rank makes the same
    decisions at the same step (skip, roll back, save, stop) from agreed values, so the collectives of all
    ranks stay in step."""

    def __init__(self, cfg: JobConfig, device: torch.device, rank: int, world: int, process_start: float | None = None):
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.evaluating = False  # the loss hook's switch: chaos corrupts training losses, never the validation loss
        self.run = run = KeelRun(cfg, rank, world, device, process_start, program="keel train")
        self.run_dir = run.run_dir
        self.microbatch_state = oom.load_state(cfg, self.run_dir, run.resuming)
        oom_note = self.microbatch_state.note()
        self._build_model()
        self._build_data()
        peak_total, mfu_basis = self._peak_flops_total()
        stage_size = world // self.layout.pp  # mesh order (pp, dp, tp): each pipeline stage is a block of ranks
        stages = [range(k * stage_size, (k + 1) * stage_size) for k in range(self.layout.pp)]
        run.attach(WholeModel(self.parts), self.optimizer, self.sampler, manifest_info(cfg, self.source.version), peer_groups=stages)
        run.set_collective_timeout = lambda seconds: set_collective_timeout(self.layout, seconds)
        run.train_state_extra = lambda: {"microbatches": cfg.training.microbatches}
        meta = {
            "mfu_basis": mfu_basis,
            "peak_flops_total": peak_total,
            "peak_flops_per_device": peak_total / world,
            "flops_per_token": self.flop_per_token,
            "data_version": self.source.version,
            "data": self.source.description,
        }
        layout = self.layout
        run.record_start(meta, f"{world} processes, pp{layout.pp} dp{layout.dp} tp{layout.tp}")
        if oom_note:
            run.incidents.oom(
                oom_note["step"], run.attempt, oom_note["rank"], oom_note["previous"], oom_note["microbatches"], "coordinated restart"
            )
            oom.mark_reported(self.run_dir)
        if cfg.metrics.plan:
            keep_plan_of_run(cfg, device, world, peak_total, run.recorder)
        run.resume()
        self.memory_measured = False
        if world > 1:
            exposed_comm.warm_up_profiler(device.type == "cuda")
        run.start_steps(cfg.training.global_batch_size * cfg.data.seq_len, self.flop_per_token, peak_total)

    # -- setup ------------------------------------------------------------------------------------

    def _build_model(self) -> None:
        """This rank's model parts, the pipeline schedule (pp > 1) and the optimizer."""
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
        self.schedule = parallelize.build_schedule(cfg, self.parts, self.layout, device, self.step_loss) if self.layout.pp > 1 else None
        self.optimizer = build_optimizer(self.parts, cfg.optim)
        log.info("model built: %d stage(s) on this rank", len(self.parts))

    def step_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch (the pipeline schedule calls it too, in training and in evaluation)."""
        loss = parallelize.loss_fn(logits, targets)
        return loss if self.evaluating else self.run.faults.corrupt_loss(loss)  # the chaos hook point on the training loss

    def _build_data(self) -> None:
        """The job's data (data.source, or a blend of sources: keel.trainer.data.blend), its validation batches
        and the sampler. Rank 0 records a blend's sources and the tokens each step reads from each of them."""
        cfg, run = self.cfg, self.run
        self.source = open_job_data(cfg)
        self.masked_eod = eod_to_mask(cfg, self.source)
        training_tokens, self.validation = split_for_validation(
            cfg, self.source, self.model_args.vocab_size, self.layout.dp_rank, self.layout.dp
        )
        store = run.recorder.store if run.recorder is not None and len(training_tokens) > 1 else None
        if store is not None:
            store.set_meta(DATA_SOURCES_META, self.source.record())
        self.sampler = BatchSampler(
            training_tokens,
            cfg.data.seq_len,
            cfg.training.global_batch_size,
            self.layout.dp_rank,
            self.layout.dp,
            cfg.training.seed,
            parse_skip_ranges(cfg.data.skip_batches),
            self.model_args.vocab_size,
            run.faults.corrupt_batch,
            weights=self.source.weights,
            on_batch=None if store is None else (lambda tokens: store.write_data_tokens(run.step, run.attempt, tokens)),
        )

    def _peak_flops_total(self) -> tuple[float, str]:
        """MFU's denominator: (the peak FLOPS of all devices together, how this device's peak was found).
        Measured once per run: a restarted or resumed run reuses the peak its first start measured, so
        MFU does not jump between attempts with the load of the moment (unless metrics.peak_tflops is set)."""
        saved = self._saved_peak() if self.run.resuming and not self.cfg.metrics.peak_tflops else None
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

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> int:
        """Runs the remaining steps, then tears down; returns the exit code (see keel.monitor.exits)."""
        while self.run.running():
            numbers = self.train_step()
            if numbers is not None:  # None: out of memory, and recover_oom set the same step up to run again
                self.run.end_step(numbers)
        self.finish()
        return self.run.exit_code

    def train_step(self) -> StepNumbers | None:
        """Runs the next step on the next batch; returns this rank's numbers of it for the run to agree,
        record and judge. None when the step ran out of memory (see `recover_oom`)."""
        cfg, run = self.cfg, self.run
        step = run.begin_step()
        self.retry_microbatch()
        t0 = time.perf_counter()
        batch_index = self.sampler.batch_index
        inputs, targets = self._next_batch()
        data_time = time.perf_counter() - t0
        lr = lr_at(step, cfg.optim, cfg.training.steps) * run.lr_scale()
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
        memory_peak = profiled.memory_peak_bytes()
        self.memory_measured = self.memory_measured or memory_peak is not None
        val_loss, eval_s = self.evaluate_if_due(step)
        return StepNumbers(
            step, run.attempt, lr, grad_norm, loss, data_time, comm_time=profiled.comm_seconds(), faults_fired=len(run.faults.fired),
            skipped=skipped, sampled=sampled, allocated_peak=memory_peak, val_loss=val_loss, eval_s=eval_s,
        )  # fmt: skip

    def evaluate_if_due(self, step: int) -> tuple[float | None, float]:
        """(the validation loss, the seconds it took) at every eval.every-th step and the last; (None, 0) otherwise."""
        every = self.cfg.eval.every
        if self.validation is None or (step % every and step != self.cfg.training.steps):
            return None, 0.0
        t0 = time.perf_counter()
        self.run.watchdog.beat("eval", step, steps_allowed=len(self.validation))
        self.evaluating = True
        try:
            val_loss = validation_loss(self.cfg, self.parts, self.schedule, self.layout, self.validation, self.autocast, self.device)
        finally:
            self.evaluating = False
        return val_loss, time.perf_counter() - t0

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets, on the device; rank 0 records the batches the sampler passed over."""
        inputs, targets = self.sampler.next_batch()
        targets = mask_after_eod(inputs, targets, self.masked_eod)
        rejected = self.sampler.take_rejected()
        if rejected:  # ids at or past the real vocabulary: a padded row of the embedding is no token either
            self.run.incidents.bad_batches(self.run.step, self.run.attempt, rejected, self.model_args.vocab_size)
        return torch.from_numpy(inputs).to(self.device, non_blocking=True), torch.from_numpy(targets).to(self.device, non_blocking=True)

    def _compute_and_update(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor | None, float, bool]:
        """Forward, backward and the gradient collectives, then the update unless a loss or gradient is
        not finite on some rank. Returns (this rank's loss, the global grad norm, whether the update was skipped)."""
        cfg, parts, faults, checkpointer = self.cfg, self.parts, self.run.faults, self.run.checkpointer
        faults.at_step_start(
            parts, cfg.microbatch_rows, checkpointer.wait
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
            log.warning("step %d skipped: a loss or gradient is not finite on some rank (global grad norm %s)", self.run.step, grad_norm)
        else:
            clip_grads(parts, cfg.optim.grad_clip, grad_norm)
            checkpointer.before_update()  # a save in flight must have copied the parameters
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, skipped

    def recover_oom(self, batch_index: int) -> None:
        """After the step ran out of memory: halves the micro-batch (oom.halve_microbatch ends the process
        when only a restart can) and sets the same step up to run again, on the same data."""
        run = self.run
        self.optimizer.zero_grad(set_to_none=True)
        old = self.cfg.training.microbatches
        new = oom.halve_microbatch(self.cfg, self.microbatch_state, self.world, self.run_dir, self.rank, run.step)
        run.incidents.oom(run.step, run.attempt, self.rank, old, new, "in process")
        self.sampler.rewind_to(batch_index)
        run.step -= 1
        run.reporter.restart_clock()

    def retry_microbatch(self) -> None:
        """At the step an out-of-memory planned it (keel.trainer.oom): twice the micro-batch again, on every
        rank at once (they hold the same state); a pipeline's schedule is built again for the new count."""
        run = self.run
        if not oom.retry_due(self.microbatch_state, run.step):
            return
        old = self.cfg.training.microbatches
        new = oom.retry_larger_microbatch(self.cfg, self.microbatch_state, run.step)
        if self.schedule is not None:
            self.schedule = parallelize.build_schedule(self.cfg, self.parts, self.layout, self.device, self.step_loss)
        run.incidents.oom_retry(run.step, run.attempt, old, new, self.microbatch_state.configured)

    # -- teardown ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Closes the run (the save in flight, the watchdog, rank 0's record), then the process group."""
        self.run.finish()
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    preemption.notice.watch()  # first: it must see the process before any other thread exists
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
    owner, refused = own_run_dir(cfg.run.run_dir, rank, world, program="keel train")
    if refused:
        return EXIT_CONFIG
    with owner:
        Trainer(cfg, device, rank, world, process_start).train()
    # A run that stopped on purpose (the rollback cap) recorded `run_stopped` with its exit code, which
    # `keel train` returns; the worker itself ends cleanly, or torchrun would restart it.
    return EXIT_OK


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
