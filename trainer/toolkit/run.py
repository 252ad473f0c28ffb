"""KeelRun: what Keel does around a training loop, one object per rank, shared by Keel's own trainer
(keel.trainer.train) and by the loops Keel did not write (keel.trainer.toolkit.loop, the HF and Lightning
callbacks).

- Record: rank 0 holds the run store and the sinks (Prometheus, W&B, webhooks); every rank's step time
  reaches it through one all-gather per step (StepReporter), which the straggler detector reads.
- Guard: each step's verdict from StabilityGuard: go on, skip (not finite: no update on any rank), roll
  back (model, optimizer, LR scheduler, RNG and data position from the newest verified checkpoint before
  the bad steps; the bad batches skipped), or stop.
- Watchdog: a thread per rank that ends a stalled process, so torchrun restarts it and the run resumes.
- Chaos: the run's faults (`chaos.faults`, `chaos.mtbf_steps`), fired at the hook points the loop calls.

Every rank makes the same decisions at the same step from agreed values, so collectives stay in step.
The loop calls, in order: `KeelRun(...)`, `attach`, `record_start`, `resume`, `start_steps`, then per step `begin_step()`,
its own work with the fault hooks (`faults`), `end_step(numbers)`; `finish()` at the end.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from keel.chaos.fault_specs import parse_fault, random_faults
from keel.chaos.faults import FaultPlan
from keel.monitor import run_lock
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_CONFIG, EXIT_OK, EXIT_PREEMPTED, EXIT_ROLLBACK_CAP, EXIT_SAVES_FAILING
from keel.monitor.log_file import LogFile
from keel.monitor.redact import redact
from keel.monitor.run_dir import CONFIG_FILE, LOG_DIR, rank_log_name
from keel.monitor.stragglers import StragglerTracker
from keel.trainer import preemption
from keel.trainer.checkpoint.checkpointer import Checkpointer
from keel.trainer.config import ConfigError, JobConfig, write_resolved_config
from keel.trainer.incidents import Incidents
from keel.trainer.launch.restarts import ended_unrecorded, furthest_step, last_failure
from keel.trainer.progress import ProgressLine
from keel.trainer.recorder_setup import build_recorder
from keel.trainer.stability import StabilityGuard, Verdict
from keel.trainer.step_metrics import StepNumbers, StepReporter
from keel.trainer.toolkit import run_history
from keel.trainer.toolkit.data_position import DataPosition
from keel.trainer.watchdog import Watchdog

log = logging.getLogger("keel.run")
_fault_log = None  # the file faulthandler writes a crash's stacks to (see setup_logging)
# A failed save is recorded and retried at the next; this many in a row (a disk that stays full) stop the
# run, with the cause, rather than train on with nothing durable to come back to.
SAVE_FAILURES_TO_STOP = 3


class KeelUsageError(RuntimeError):
    """The API was called in a way Keel cannot record or recover: the message says which call and the fix."""


class KeelRun:
    """One rank's share of a run's recording, guarding, watching and fault injection. `step` is the step
    running (begin_step .. end_step) or the last one finished; a rollback moves it back."""

    def __init__(
        self, cfg: JobConfig, rank: int, world: int, device: torch.device, process_start: float | None = None, program: str = "keel"
    ):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.program = program  # what its one-line errors begin with
        self.process_start = process_start or time.time()
        self.run_dir = Path(cfg.run.run_dir)
        setup_logging(self.run_dir, rank)
        self.restart_count, self.resuming = agreed_start(cfg.run.resume, world, device)
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, rank)
        self.faults = FaultPlan(fault_plan(cfg, world), rank, self.run_dir, cfg.checkpoint.snapshot_folder(self.run_dir))
        self.step, self.exit_code = 0, EXIT_OK
        self.recorder = build_recorder(cfg, self.run_dir) if rank == 0 else None
        self.incidents = Incidents(self.recorder, cfg.run.run_id)
        self.watchdog.on_hang = self.incidents.hang
        self.attempt = run_history.next_attempt(self.run_dir, rank, world) if self.resuming else 0
        # Process-group timeouts: watchdog.startup_s until the warm-up steps have run; then a collective that
        # waits past twice the longest the watchdog allows a step, plus a minute, is failed by the process
        # group itself. The watchdog normally fires first and leaves stack dumps; this is the backstop.
        self.tight_timeout_s = cfg.watchdog.startup_s
        self.set_collective_timeout: Callable[[float], None] = lambda seconds: None
        self.guard = StabilityGuard(cfg.recovery, cfg.spike)
        preemption.notice.grace_s = cfg.checkpoint.preempt_grace_s
        self.stragglers = StragglerTracker(cfg.stragglers, world, [range(world)])
        self.checkpointer: Checkpointer | None = None  # see attach
        self.data: DataPosition | None = None
        self.train_state_extra: Callable[[], dict] = dict  # what the client adds to a checkpoint's train state

    # -- set-up -----------------------------------------------------------------------------------

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: DataPosition,
        manifest_info: dict,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        host_rng: bool = False,
        peer_groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """What a checkpoint saves and a rollback restores (the model, its optimizer and scheduler, the data
        position), and the groups of ranks whose step times the straggler detector compares (default: all).
        A run never attached (a framework that checkpoints itself) records and judges, and leaves acting on
        a verdict to its caller."""
        cfg = self.cfg
        self.data = data
        # How far before a verdict's step its first bad step can be: a spike's run of outliers begins up to
        # persistence - 1 steps before its first outlier and is confirmed persistence - 1 steps after it.
        lookback = max(2 * cfg.spike.persistence, cfg.recovery.nonfinite_limit)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, model, optimizer, self.rank, self.world, manifest_info, scheduler, host_rng, lookback
        )
        if peer_groups is not None:
            self.stragglers = StragglerTracker(cfg.stragglers, self.world, peer_groups)
        if not self.resuming and self.checkpointer.files is not None:
            self.checkpointer.files.remove()  # left by an earlier run of this directory that died: never this run's

    def record_start(self, meta: dict, description: str) -> None:
        """Rank 0: `meta` into the store's meta and `run_started` with `description`; what the earlier starts
        left (when the run began, whether its processes vanished) is read first, for `resume`."""
        self._last_step = run_history.last_step_time(self.run_dir) if self.rank == 0 and self.resuming else None
        # Resumed by hand or by a scheduler after the processes ended with no record: a node loss.
        self._vanished = self.rank == 0 and self.resuming and not self.restart_count and ended_unrecorded(self.run_dir)
        self._began = run_history.run_began(self.run_dir, self.process_start) if self.rank == 0 else self.process_start
        if self.recorder is not None:
            self._record_run_start(meta, description)

    def resume(self) -> None:
        """When the run is resumed or restarted: loads the newest state, from snapshot files or the newest good
        checkpoint (see `_resume`). Then rank 0 writes the run's config (not when the checkpoint refused it:
        the run's own stays)."""
        if self.resuming and self.checkpointer is not None:
            self._resume(self._last_step, self._vanished)
        if self.recorder is not None and self.exit_code == EXIT_OK:
            write_resolved_config(self.cfg, self.run_dir / CONFIG_FILE)

    def start_steps(self, tokens_per_step: int, flops_per_token: float, peak_flops_total: float, progress: bool = True) -> None:
        """Starts timing steps: tokens_per_s, MFU (NaN where the FLOPs are not known) and, with `progress`,
        rank 0's console line."""
        steps = self.cfg.training.steps
        line = ProgressLine(steps, every=self.cfg.metrics.log_every, run_began=self._began) if self.rank == 0 and progress else None
        self.reporter = StepReporter(
            self.device, self.world, tokens_per_step, flops_per_token, peak_flops_total, self.recorder, line,
            rank_rows_every_step=self.cfg.metrics.rank_rows == "every_step",
        )  # fmt: skip
        if self.checkpointer is not None and self.checkpointer.snapshots.enabled:
            self.checkpointer.snapshots.take(self.step, self._train_state())  # a rollback can always go back to the start
        log.info("starting training at step %d (attempt %d)", self.step + 1, self.attempt)

    def _record_run_start(self, meta: dict, description: str) -> None:
        """Rank 0: the run's metadata and `run_started`."""
        cfg, recorder = self.cfg, self.recorder
        basics = {"run_id": cfg.run.run_id, "config": redact(cfg.to_dict()), "world_size": self.world, "device": str(self.device)}
        basics["rank0_host"] = socket.gethostname()  # where this start's store writer and exporter run (docs/cluster.md)
        for key, value in {**basics, **meta, "torch_version": torch.__version__}.items():
            recorder.store.set_meta(key, value)
        data = {"process_start": self.process_start, "restart_count": self.restart_count}
        recorder.event(EventKind.RUN_STARTED, description, step=0, attempt=self.attempt, rank=0, data=data)

    def _resume(self, last_step: float | None, vanished: bool) -> None:
        """Loads the newest snapshot files every rank has, or else the newest good checkpoint, and the data
        position and guard state saved with it; after a restart, also reports the stalls and the restart
        itself with its cause (rank 0), and after the processes vanished, the node loss. A checkpoint of
        another model or data ends the run instead."""
        self.watchdog.beat("checkpoint_load", 0, self.attempt)
        try:
            restored = self.checkpointer.resume_latest(self.device)
        except ConfigError as e:
            self.refuse(str(e))
            return
        if restored is not None:
            self.step = restored.step
            self.data.load_state_dict(restored.train_state["sampler"])
            self.guard.load_state_dict(restored.train_state["guard"])
            if restored.layout_change:
                log.info("%s", restored.layout_change)
            self.incidents.loaded(restored, self.attempt)
        else:
            self.incidents.no_checkpoint(self.attempt, self.checkpointer.corrupt)
        if self.restart_count and self.rank == 0:
            run_history.report_stalls(self.run_dir, self.incidents)
        downtime_s = self.process_start - last_step if last_step else 0.0
        if self.restart_count:
            self.incidents.restart(self.attempt, self.restart_count, downtime_s, self.step, last_failure(self.run_dir))
        elif vanished:
            failure = last_failure(self.run_dir)
            killed = failure if failure is not None and failure.rank is None and failure.time > (last_step or 0) else None
            self.incidents.node_loss(self.attempt, downtime_s, self.step, furthest_step(self.run_dir), killed)

    def refuse(self, reason: str) -> None:
        """Ends the run before its first step with EXIT_CONFIG. Stopping on purpose: recorded as
        `run_stopped`, and the workers end cleanly (a restart would be refused too)."""
        if self.rank == 0:
            print(f"{self.program}: error: {reason}", file=sys.stderr, flush=True)
        self.exit_code = EXIT_CONFIG
        self.incidents.stopped(self.step, self.attempt, reason, self.exit_code)

    # -- each step --------------------------------------------------------------------------------

    def running(self) -> bool:
        """Whether another step is due: the run has not stopped and has steps left."""
        return self.exit_code == EXIT_OK and self.step < self.cfg.training.steps

    def follow_step(self, step: int) -> None:
        """For a framework that counts its own steps (HF's global_step, Lightning's): the next step is `step`,
        so Keel's step numbers are the framework's. Steps only go forward: a step numbered at or before one
        already recorded would mix two trajectories under one attempt (a rollback is Keel's to make)."""
        if step <= self.step:
            raise KeelUsageError(f"step {step} after step {self.step}: steps must go forward; a rollback is Keel's to make")
        self.step = step - 1

    def begin_step(self) -> int:
        """Starts the next step: the watchdog's beat, the fault plan's step. Returns the step."""
        self.step += 1
        self.watchdog.beat("step", self.step, self.attempt)
        self.faults.begin_step(self.step)
        return self.step

    def lr_scale(self) -> float:
        """What the step's LR is multiplied by: the guard's after a rollback (recovery.lr_factor), and a fault's.
        Call once per step: a fault's LR surge fires here."""
        return self.guard.lr_scale(self.step) * self.faults.lr_scale()

    def end_step(self, numbers: StepNumbers) -> tuple[dict, Verdict]:
        """Agrees the step's numbers with every rank and records them, judges the step, and acts on the
        verdict: stops, rolls back, or saves a checkpoint when one is due. Returns the row and the verdict."""
        self.faults.end_step()
        self.faults.before_collective()
        checkpointer = self.checkpointer
        snapshot_cost_s, save_failures = (
            (checkpointer.snapshots.last_cost_s(), checkpointer.failed_in_row) if checkpointer else (math.nan, 0)
        )
        row, fault_ranks = self.reporter.report(numbers, preemption.notice.requested, snapshot_cost_s, save_failures)
        self.watchdog.step_finished(row["step_time_s"])
        if self.watchdog.collective_timeout_s() != self.tight_timeout_s:
            self.tight_timeout_s = self.watchdog.collective_timeout_s()
            self.set_collective_timeout(self.tight_timeout_s)
        verdict = self._judge(row, fault_ranks, numbers.skipped, numbers.comm_time is not None and self.world > 1)
        if self.checkpointer is None:  # not attached: the caller acts
            return row, verdict
        if self.reporter.preempt_signals:
            self.preempt(self.reporter.preempt_signals)
        elif verdict.action == "stop":
            self.exit_code = EXIT_ROLLBACK_CAP
            self.incidents.stopped(self.step, self.attempt, verdict.reason, self.exit_code)
        elif verdict.action == "rollback":
            self.roll_back(verdict)
        elif self.reporter.save_failures_in_row >= SAVE_FAILURES_TO_STOP:
            self.exit_code = EXIT_SAVES_FAILING
            reason = f"{self.reporter.save_failures_in_row} checkpoints in a row failed, the last: {checkpointer.last_error}"
            self.incidents.stopped(self.step, self.attempt, reason, self.exit_code)
        else:
            self.save_if_due(row["time"])
            self.snapshot_if_due(row["step_time_s"])
        return row, verdict

    def _judge(self, row: dict, fault_ranks: list[int], skipped: bool, sampled_comm: bool) -> Verdict:
        """The guard's verdict on the step; rank 0 records what the step showed (faults, a skip, the
        detector's findings, stragglers on steps whose communication was measured)."""
        verdict = self.guard.observe(self.step, row["loss"], row["grad_norm"], skipped)
        self.incidents.step(row, fault_ranks, verdict.findings)
        if sampled_comm and self.step > self.cfg.stragglers.warmup_steps:
            self.incidents.stragglers(self.step, self.attempt, self.stragglers.update(self.reporter.busy_s))
        return verdict

    def roll_back(self, verdict: Verdict) -> None:
        """Restores the newest in-memory snapshot, or else good checkpoint, from before the bad steps and moves
        the data past the bad window (recovery.skip_data) or back to the restored data position; a new attempt
        begins there."""
        step = self.step
        # A save still being written belongs to this attempt: recorded before the next attempt begins.
        self.checkpointer.wait()
        self.incidents.saved(self.checkpointer.poll(), self.attempt)
        self.watchdog.beat("checkpoint_load", step, self.attempt)
        self.set_collective_timeout(self.cfg.watchdog.checkpoint_s + 60)  # rank 0 verifies while the others wait
        restored = self.checkpointer.restore_before(verdict.bad_from)
        self.set_collective_timeout(self.tight_timeout_s)
        if restored is None:
            self.incidents.no_rollback_target(step, self.attempt, verdict.reason, verdict.bad_from, self.checkpointer.corrupt)
        else:
            since = restored.train_state["sampler"]["batch_index"]
            if self.cfg.recovery.skip_data:  # every batch read since the checkpoint, and a margin beyond
                self.data.skip_to(self.data.batch_index + self.cfg.recovery.skip_margin)
            else:
                self.data.rewind_to(since)
            discarded = self.checkpointer.discard_after(restored.step)
            self.guard.rolled_back(restored.step, step)
            self.attempt += 1
            skipped_batches = (since, self.data.batch_index)
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

    def snapshot_if_due(self, step_time_s: float) -> None:
        """Takes an in-memory snapshot of the state after this step when one is due (keel.trainer.checkpoint.snapshots)."""
        snapshots = self.checkpointer.snapshots
        if snapshots.due(self.step, step_time_s, self.reporter.snapshot_cost_s):
            snapshots.take(self.step, self._train_state())

    def _train_state(self) -> dict:
        """What a checkpoint records besides the tensors, to resume the run from it."""
        return {
            "step": self.step,
            "attempt": self.attempt,
            "sampler": self.data.state_dict(),
            **self.train_state_extra(),
            "guard": self.guard.state_dict(),
        }

    def preempt(self, signals: dict[int, int]) -> None:
        """A scheduler is taking the job's machines (signals: rank -> the signal it got): every rank saves
        this step and the run stops with EXIT_PREEMPTED, recorded as `preempted`, a warning (the scheduler
        requeues the job; no one need be woken)."""
        requested = preemption.notice.time
        if self.checkpointer.saved_step < self.step:
            self.watchdog.beat("checkpoint_save", self.step, self.attempt)
            self.checkpointer.save(self.step, self._train_state(), time.time())
        self.checkpointer.wait()
        self.incidents.saved(self.checkpointer.poll(), self.attempt)
        self.exit_code = EXIT_PREEMPTED
        rank, sig = min(signals.items())
        cause = (preemption.take_signal_note(self.run_dir) if self.rank == 0 else None) or f"{signal.Signals(sig).name} on rank {rank}"
        self.incidents.preempted(self.step, self.attempt, cause, requested)

    # -- the end ----------------------------------------------------------------------------------

    def finish(self) -> None:
        """Waits for the save in flight, stops the watchdog, and closes the run's record (rank 0)."""
        if self.checkpointer is not None:
            self.watchdog.beat("checkpoint_save", self.step, self.attempt)
            self.checkpointer.close()
            self.incidents.saved(self.checkpointer.poll(), self.attempt)
        self.watchdog.stop()
        if self.recorder is not None:
            self._record_run_end()

    def _record_run_end(self) -> None:
        """Rank 0: `run_finished` (unless the run stopped on purpose), the run's goodput, then the sinks close."""
        cfg, recorder = self.cfg, self.recorder
        if self.reporter.progress is not None:
            self.reporter.progress.finish(None if self.exit_code == EXIT_OK else self.step)
        if self.exit_code == EXIT_OK:
            recorder.event(EventKind.RUN_FINISHED, f"{cfg.training.steps} steps", step=cfg.training.steps, attempt=self.attempt, rank=0)
        # Imported here: goodput needs pandas, 0.5 s of CPU that only rank 0 pays, once, at the end.
        from keel.monitor.goodput import goodput_of_run

        recorder.flush()  # goodput reads the store back

        goodput = goodput_of_run(self.run_dir)
        recorder.store.set_meta("goodput", goodput.to_dict())
        recorder.event(EventKind.GOODPUT, goodput.summary(), step=self.step, attempt=self.attempt, rank=0, data=goodput.to_dict())
        print(goodput.summary(), flush=True)
        if cfg.monitor.prometheus_linger_s > 0:
            log.info("keeping /metrics up for %.0f s (monitor.prometheus_linger_s)", cfg.monitor.prometheus_linger_s)
            time.sleep(cfg.monitor.prometheus_linger_s)
        recorder.close()


def own_run_dir(run_dir: str, rank: int, world: int, program: str | None = None) -> tuple[contextlib.AbstractContextManager, str]:
    """Rank 0 takes the run directory's lock for the life of the training (keel.monitor.run_lock); every
    rank learns whether it did. (the lock's holder, or a null context on other ranks; the refusal, or "").
    With `program`, rank 0 also prints a refusal as `program: error: ...`."""
    owner, refused = contextlib.nullcontext(), ""
    if rank == 0:
        try:
            owner = run_lock.own(run_dir)
        except run_lock.RunDirBusy as e:
            refused = str(e)
            if program:  # printed before the others learn of it: they exit at once, and torchrun then stops rank 0
                print(f"{program}: error: {refused}", file=sys.stderr, flush=True)
    if world > 1:
        verdict = [refused]
        dist.broadcast_object_list(verdict, src=0)
        refused = verdict[0]
    return owner, refused


def agreed_start(resume: bool, world: int, device: torch.device) -> tuple[int, bool]:
    """(the run's restart count, whether this start resumes the run), the same on every rank. torchrun
    counts restarts per node: a node whose workers were healthy when another node failed, or a node that
    replaced a lost one, starts its workers with a lower count (0 for the new node, which was started
    without --resume), yet every rank must load the same checkpoint: the highest count and any resume win."""
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if world > 1:
        agreed = torch.tensor([restart_count, int(resume)], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        restart_count, resume = int(agreed[0]), bool(agreed[1])
    return restart_count, resume or restart_count > 0


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


def setup_logging(run_dir: Path, rank: int) -> None:
    """This rank's log file in RUN_DIR/logs/ (and faulthandler's crash stacks); warnings also on rank 0's console."""
    (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_DIR / rank_log_name(rank)
    # A segfault's Python stacks go to this rank's log, not to the console the whole job shares.
    global _fault_log
    _fault_log = open(log_path, "a")  # noqa: SIM115 (held open for the life of the process, for faulthandler)
    faulthandler.enable(file=_fault_log)
    handler = LogFile(log_path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("keel")
    for old in list(root.handlers):  # a second run in one process (benchmarks) logs to its own run only
        root.removeHandler(old)
        old.close()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        root.addHandler(console)
