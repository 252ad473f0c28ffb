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
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from keel.chaos.faults import FaultPlan, parse_fault, random_faults
from keel.monitor.goodput import goodput_of_run
from keel.monitor.redact import redact
from keel.monitor.store import STORE_FILE, read_events, read_steps
from keel.monitor.stragglers import StragglerTracker
from keel.trainer import comm, flops, oom, parallel
from keel.trainer.checkpoint import Checkpointer, manifest_info
from keel.trainer.config import ConfigError, JobConfig, write_resolved_config
from keel.trainer.data import BatchSampler, open_tokens, parse_skip_ranges
from keel.trainer.exits import EXIT_CONFIG, EXIT_OK, EXIT_ROLLBACK_CAP
from keel.trainer.incidents import Incidents
from keel.trainer.launch import parse_train_args, resolve_run_dir
from keel.trainer.model import flops_per_token, model_args
from keel.trainer.monitoring import build_recorder
from keel.trainer.optim import build_optimizer, clip_grads, lr_at, set_lr
from keel.trainer.progress import ProgressLine
from keel.trainer.recovery import StabilityGuard
from keel.trainer.step_metrics import StepReporter
from keel.trainer.watchdog import Watchdog, stalled_dumps

log = logging.getLogger("keel.train")


def init_distributed(startup_timeout_s: float = 600.0) -> tuple[torch.device, int, int]:
    """(device, rank, world size). Reads torchrun's variables, or srun's when torchrun's are absent.
    Collectives may wait `startup_timeout_s` at first (ranks load and build at different speeds)."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"], LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        timeout = timedelta(seconds=startup_timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # After a torchrun restart the rendezvous store still holds the previous group's keys (its
        # workers' addresses); a fresh namespace per restart keeps the new group from reading them.
        store = dist.PrefixStore(f"keel/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None,
                                store=store, rank=rank, world_size=world, timeout=timeout)
    return device, rank, world


def forward_backward(cfg, parts, schedule, layout, inputs, targets, autocast, step_loss) -> torch.Tensor | None:
    """Runs one step's forward and backward over all micro-batches. Returns this rank's mean loss,
    or None on pipeline ranks that do not hold the last stage. `step_loss(logits, targets)` is the
    loss of one micro-batch (the pipeline schedule was built with the same function)."""
    if schedule is not None:
        losses: list[torch.Tensor] = []
        with autocast:
            if layout.pp_rank == 0:  # holds the first stage, which takes the token ids
                schedule.step(inputs, target=targets, losses=losses)
            else:
                schedule.step(target=targets, losses=losses)
        return torch.stack(losses).mean().detach() if layout.is_last_stage_rank else None
    model, m = parts[0], cfg.training.microbatches
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
        if parallel.uses_fsdp(cfg):
            model.set_requires_gradient_sync(i == m - 1)  # reduce-scatter once, after the last micro-batch
        with autocast:
            loss = step_loss(model(x), y) / m
        loss.backward()
        total += loss.detach()
    return total


def train(cfg: JobConfig, device: torch.device, rank: int, world: int, process_start: float | None = None) -> int:
    """Runs the job; returns the exit code (see keel.trainer.exits)."""
    process_start = process_start or time.time()
    run_dir = Path(cfg.run.run_dir)
    _setup_logging(run_dir, rank)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    resuming = cfg.run.resume or restart_count > 0
    oom_note = oom.apply_saved_microbatches(cfg, run_dir) if resuming else None
    watchdog = Watchdog(cfg.watchdog, run_dir, rank)
    bf16, autocast = parallel.mixed_precision(cfg, device)
    if bf16 and device.type != "cuda":
        log.warning("training.dtype=bf16 on CPU: running bf16 autocast on CPU")

    log.info("process group up: rank %d of %d on %s", rank, world, device)
    layout = parallel.build_layout(cfg, device)
    args = model_args(cfg)
    parts = parallel.build_model_parts(cfg, args, layout, device, bf16)
    faults = FaultPlan(fault_plan(cfg, world), rank, run_dir)

    def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return faults.corrupt_loss(parallel.loss_fn(logits, targets))  # the chaos hook point on the loss

    schedule = parallel.build_schedule(cfg, parts, layout, device, step_loss) if layout.pp > 1 else None
    optimizer = build_optimizer(parts, cfg.optim)

    log.info("model built: %d stage(s) on this rank", len(parts))
    source = open_tokens(cfg.data.source, cfg.data.seq_len)
    sampler = BatchSampler(source.tokens, cfg.data.seq_len, cfg.training.global_batch_size, layout.dp_rank, layout.dp, cfg.training.seed,
                           parse_skip_ranges(cfg.data.skip_batches), args.vocab_size, faults.corrupt_batch)
    flop_per_token = flops_per_token(args, cfg.data.seq_len)

    # MFU's denominator: every rank measures (or looks up) its own peak at the same moment; the sum
    # is the peak of all devices together.
    peak, basis = flops.device_peak_flops(device)
    peak_total = _sum_over_ranks(peak, device, world)

    log.info("peak FLOPS: %.3g per device (%s)", peak, basis)
    recorder = build_recorder(cfg, run_dir) if rank == 0 else None
    incidents = Incidents(recorder, cfg.run.run_id)
    attempt = _next_attempt(run_dir, rank, world) if resuming else 0
    last_recorded = _last_recorded_time(run_dir) if rank == 0 and restart_count else None
    if recorder is not None:
        write_resolved_config(cfg, run_dir / "config.toml")
        for key, value in {
            "run_id": cfg.run.run_id, "config": redact(cfg.to_dict()), "world_size": world, "device": str(device),
            "mfu_basis": basis, "peak_flops_total": peak_total, "flops_per_token": flop_per_token,
            "data_version": source.version, "data": source.description, "torch_version": torch.__version__,
        }.items():
            recorder.store.set_meta(key, value)
        recorder.event("run_started", f"{world} processes, pp{layout.pp} dp{layout.dp} tp{layout.tp}", step=0, attempt=attempt, rank=0,
                       data={"process_start": process_start, "restart_count": restart_count})
        if oom_note:
            incidents.oom(oom_note["step"], attempt, oom_note["rank"], oom_note["previous"], oom_note["microbatches"], "coordinated restart")
            oom.mark_reported(run_dir)
    watchdog.on_hang = incidents.hang

    checkpointer = Checkpointer(cfg.checkpoint, run_dir, parts, optimizer, rank, world, manifest_info(cfg, source.version))
    guard = StabilityGuard(cfg.recovery, cfg.spike)
    stage_size = world // layout.pp  # mesh order (pp, dp, tp): each pipeline stage is a block of ranks
    stragglers = StragglerTracker(cfg.stragglers, world, [range(k * stage_size, (k + 1) * stage_size) for k in range(layout.pp)])
    step = 0
    if resuming:
        watchdog.beat("checkpoint_load", 0, attempt)
        restored = checkpointer.load_latest()
        if restored is not None:
            step = restored.step
            sampler.load_state_dict(restored.train_state["sampler"])
            guard.load_state_dict(restored.train_state["guard"])
            incidents.loaded(restored, attempt)
        else:
            incidents.no_checkpoint(attempt, checkpointer.corrupt)
        if restart_count and rank == 0:
            _report_stalls(run_dir, incidents)
        if restart_count:
            incidents.restart(attempt, restart_count, process_start - last_recorded if last_recorded else 0.0, step)

    progress = ProgressLine(cfg.training.steps, every=cfg.metrics.log_every) if rank == 0 else None
    if world > 1:
        comm.warm_up_profiler(device.type == "cuda")
    reporter = StepReporter(device, world, cfg.training.global_batch_size * cfg.data.seq_len, flop_per_token, peak_total, recorder, progress)
    log.info("starting training at step %d (attempt %d)", step + 1, attempt)

    def train_state(at_step: int) -> dict:
        return {"step": at_step, "attempt": attempt, "sampler": sampler.state_dict(),
                "microbatches": cfg.training.microbatches, "guard": guard.state_dict()}

    # Process-group timeouts in two phases: start-up had watchdog.startup_s; once a step has run, a
    # collective that waits past twice the floor is failed by the process group itself. The watchdog
    # normally fires first and leaves stack dumps; this is the backstop.
    tight_timeout_s, timeouts_tight = 2 * cfg.watchdog.floor_s + 60, False
    exit_code = EXIT_OK
    while step < cfg.training.steps:
        step += 1
        watchdog.beat("step", step, attempt)
        faults.begin_step(step)
        t0 = time.perf_counter()
        batch_index = sampler.batch_index
        inputs, targets = sampler.next_batch()
        if sampler.rejected:
            incidents.bad_batches(step, attempt, sampler.rejected, args.vocab_size)
            sampler.rejected = []
        inputs, targets = torch.from_numpy(inputs).to(device, non_blocking=True), torch.from_numpy(targets).to(device, non_blocking=True)
        data_time = time.perf_counter() - t0
        lr = lr_at(step, cfg.optim, cfg.training.steps) * guard.lr_scale(step) * faults.lr_scale()
        set_lr(optimizer, lr)

        sample_comm = world > 1 and (step - 2) % cfg.metrics.comm_sample_every == 0
        try:
            with comm.sampled_step(sample_comm, device.type == "cuda") as exposed_comm:
                faults.at_step_start(parts)  # chaos hook points: the process, the parameters, the checkpoints
                loss = forward_backward(cfg, parts, schedule, layout, inputs, targets, autocast, step_loss)
                faults.corrupt_grads(parts)
                if cfg.parallel.dp > 1 and cfg.parallel.dp_mode == "replicate":
                    faults.before_collective()
                    parallel.all_reduce_replicated_grads(parts, layout)
                loss_finite = loss is None or bool(torch.isfinite(loss))
                faults.before_collective()
                grad_norm = parallel.global_grad_norm(parts, layout, loss_finite).item()
                skipped = not math.isfinite(grad_norm)  # the same verdict on every rank
                if skipped:
                    log.warning("step %d skipped: a loss or gradient is not finite on some rank (global grad norm %s)", step, grad_norm)
                else:
                    clip_grads(parts, cfg.optim.grad_clip, grad_norm)
                    checkpointer.before_update()  # a save in flight must have copied the parameters
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            old = cfg.training.microbatches
            new = oom.halve_microbatch(cfg, world, run_dir, rank, step)  # exits the process when it must restart
            incidents.oom(step, attempt, rank, old, new, "in process")
            sampler.batch_index = batch_index  # run the same step again, with the same data
            step -= 1
            reporter.restart_clock()
            continue
        faults.end_step()
        faults.before_collective()
        row, fault_ranks = reporter.report(step, attempt, lr, grad_norm, loss, data_time, exposed_comm(), len(faults.fired), skipped)
        watchdog.step_finished(row["step_time_s"])
        if not timeouts_tight:
            _set_collective_timeout(layout, tight_timeout_s)
            timeouts_tight = True
        verdict = guard.observe(step, row["loss"], row["grad_norm"], skipped)
        incidents.step(row, fault_ranks, verdict.findings)
        if sample_comm and step > cfg.stragglers.warmup_steps:
            incidents.stragglers(step, attempt, stragglers.update(reporter.busy_s))

        if verdict.action == "stop":
            exit_code = EXIT_ROLLBACK_CAP
            incidents.stopped(step, attempt, verdict.reason, exit_code)
            break
        if verdict.action == "rollback":
            watchdog.beat("checkpoint_load", step, attempt)
            _set_collective_timeout(layout, cfg.watchdog.checkpoint_s + 60)  # rank 0 verifies while the others wait
            restored = checkpointer.load_latest(before_step=verdict.bad_from)
            _set_collective_timeout(layout, tight_timeout_s)
            if restored is None:
                incidents.no_rollback_target(step, attempt, verdict.reason, verdict.bad_from, checkpointer.corrupt)
            else:
                # Skip the bad window: every batch read since the checkpoint, and a margin beyond.
                since = restored.train_state["sampler"]["batch_index"]
                skipped_batches = (since, sampler.batch_index + cfg.recovery.skip_margin if cfg.recovery.skip_data else since)
                sampler.batch_index = skipped_batches[1]
                discarded = checkpointer.discard_after(restored.step)
                guard.rolled_back(restored.step, step)
                attempt += 1
                incidents.rollback(step, attempt, verdict.reason, verdict.bad_from, restored, skipped_batches, discarded)
                step = restored.step
            reporter.restart_clock()
            continue
        if checkpointer.due(step, row["time"]) or (step == cfg.training.steps and checkpointer.enabled):
            watchdog.beat("checkpoint_save", step, attempt)
            checkpointer.save(step, train_state(step), row["time"])
            reporter.restart_clock()
        incidents.saved(checkpointer.poll(), attempt)

    watchdog.beat("checkpoint_save", step, attempt)
    checkpointer.close()
    incidents.saved(checkpointer.poll(), attempt)
    watchdog.stop()
    if recorder is not None:
        progress.finish()
        if exit_code == EXIT_OK:
            recorder.event("run_finished", f"{cfg.training.steps} steps", step=cfg.training.steps, attempt=attempt, rank=0)
        goodput = goodput_of_run(run_dir)
        recorder.store.set_meta("goodput", goodput.to_dict())
        recorder.event("goodput", goodput.summary(), step=step, attempt=attempt, rank=0, data=goodput.to_dict())
        print(goodput.summary(), flush=True)
        if cfg.monitor.prometheus_linger_s > 0:
            log.info("keeping /metrics up for %.0f s (monitor.prometheus_linger_s)", cfg.monitor.prometheus_linger_s)
            time.sleep(cfg.monitor.prometheus_linger_s)
        recorder.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


def fault_plan(cfg: JobConfig, world: int) -> list:
    """The run's faults: the listed ones, and the random ones when chaos.mtbf_steps is set."""
    plan = [parse_fault(spec) for spec in cfg.chaos.faults]
    if cfg.chaos.mtbf_steps > 0:
        plan += random_faults(cfg.chaos.mtbf_steps, cfg.chaos.random_kinds, cfg.training.steps, world, cfg.chaos.random_seed)
        log.info("random faults (mean %g steps apart): %s", cfg.chaos.mtbf_steps, ", ".join(map(str, plan)))
    return plan


def _report_stalls(run_dir: Path, incidents: Incidents) -> None:
    """Reports the processes that faulthandler ended because their GIL was held, unless the attempt
    already reported its hang (the other ranks' watchdogs see the same stall from inside a collective)."""
    events = read_events(run_dir) if (run_dir / STORE_FILE).exists() else None
    reported = set() if events is None else set(events.loc[events.kind == "hang", "attempt"].dropna().astype(int))
    for info in stalled_dumps(run_dir):
        if info["attempt"] not in reported:
            incidents.hang(info)
            reported.add(info["attempt"])


def _next_attempt(run_dir: Path, rank: int, world: int) -> int:
    """One more than any attempt in the run store, so a resumed run's rows never replace earlier ones."""
    value = [0]
    if rank == 0 and (run_dir / STORE_FILE).exists():
        steps, events = read_steps(run_dir), read_events(run_dir)
        attempts = [int(steps["attempt"].max()) if len(steps) else -1, int(events["attempt"].max()) if events["attempt"].notna().any() else -1]
        value = [max(attempts) + 1]
    if world > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


def _last_recorded_time(run_dir: Path) -> float | None:
    """When the run store last heard from the run (the moment a failed group went quiet)."""
    if not (run_dir / STORE_FILE).exists():
        return None
    times = [read_steps(run_dir)["time"].max(), read_events(run_dir)["time"].max()]
    times = [t for t in times if t == t]
    return max(times) if times else None


def _set_collective_timeout(layout: parallel.Layout, seconds: float) -> None:
    """Sets the timeout of the default process group and the mesh groups (a private torch API: if it
    moves, the start-up timeout stays, which is safe, only less tight)."""
    if layout.mesh is None:
        return
    try:
        for group in [None] + [layout.group(d) for d in ("pp", "dp", "tp")]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    except (AttributeError, RuntimeError) as e:
        log.info("could not change process-group timeouts (%s)", e)


def _sum_over_ranks(value: float, device: torch.device, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def _setup_logging(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"rank-{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("keel")
    for old in list(root.handlers):  # a second train() in one process (benchmarks) logs to its own run only
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
        return EXIT_CONFIG
    faulthandler.enable()  # a segfault leaves the Python stacks in the worker's stderr
    device, rank, world = init_distributed(cfg.watchdog.startup_s)
    if not cfg.run.run_dir:
        # Started by torchrun or srun directly: rank 0 names the run, everyone uses that name.
        resolve_run_dir(cfg)
        names = [cfg.run.run_id, cfg.run.run_dir]
        if world > 1:
            dist.broadcast_object_list(names, src=0)
        cfg.run.run_id, cfg.run.run_dir = names
    train(cfg, device, rank, world, process_start)
    # A run that stopped on purpose (the rollback cap) recorded `run_stopped` with its exit code, which
    # `keel train` returns; the worker itself ends cleanly, or torchrun would restart it.
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
