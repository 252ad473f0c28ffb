"""The train loop. Runs in every worker process, started by `keel train` (through torchrun), by
torchrun directly (`torchrun --nproc-per-node 8 -m keel.trainer.train --config small`), or by srun.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from keel.chaos.faults import FaultPlan
from keel.monitor.alerts import Alert
from keel.monitor.recorder import RunRecorder
from keel.monitor.redact import redact
from keel.trainer import comm, flops, parallel
from keel.trainer.config import ConfigError, JobConfig, write_resolved_config
from keel.trainer.data import BatchSampler, open_tokens
from keel.trainer.launch import parse_train_args, resolve_run_dir
from keel.trainer.model import flops_per_token, model_args
from keel.trainer.monitoring import build_recorder
from keel.trainer.optim import build_optimizer, clip_grads, lr_at, set_lr
from keel.trainer.progress import ProgressLine
from keel.trainer.step_metrics import StepReporter

log = logging.getLogger("keel.train")


def init_distributed() -> tuple[torch.device, int, int]:
    """(device, rank, world size). Reads torchrun's variables, or srun's when torchrun's are absent."""
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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
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


def record_step_events(recorder: RunRecorder, cfg: JobConfig, row: dict, fault_ranks: list[int]) -> None:
    """Events and alerts that follow from a step's agreed metrics (rank 0 only)."""
    step, attempt = row["step"], row["attempt"]
    for r in fault_ranks:
        recorder.event("fault_injected", f"fault injected on rank {r} at step {step}", severity="warning", step=step, attempt=attempt, rank=r)
    if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
        values = {"loss": row["loss"], "grad_norm": row["grad_norm"]}
        message = f"non-finite step {step}: loss={row['loss']}, grad_norm={row['grad_norm']}"
        recorder.event("nonfinite", message, severity="critical", step=step, attempt=attempt, data=values)
        recorder.alert(Alert("nonfinite_loss", "critical", message, cfg.run.run_id, step=step, attempt=attempt, values=values))


def train(cfg: JobConfig, device: torch.device, rank: int, world: int) -> None:
    run_dir = Path(cfg.run.run_dir)
    _setup_logging(run_dir, rank)
    bf16 = cfg.training.dtype == "bf16" or (cfg.training.dtype == "auto" and device.type == "cuda")
    if bf16 and device.type != "cuda":
        log.warning("training.dtype=bf16 on CPU: running bf16 autocast on CPU")

    log.info("process group up: rank %d of %d on %s", rank, world, device)
    layout = parallel.build_layout(cfg, device)
    args = model_args(cfg)
    parts = parallel.build_model_parts(cfg, args, layout, device, bf16)
    faults = FaultPlan(cfg.chaos.faults, rank)

    def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return faults.corrupt_loss(parallel.loss_fn(logits, targets))  # the chaos hook point on the loss

    schedule = parallel.build_schedule(cfg, parts, layout, device, step_loss) if layout.pp > 1 else None
    optimizer = build_optimizer(parts, cfg.optim)
    # FSDP applies bf16 itself; everything else gets autocast.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and not parallel.uses_fsdp(cfg) else nullcontext()

    log.info("model built: %d stage(s) on this rank", len(parts))
    source = open_tokens(cfg.data.source, cfg.data.seq_len)
    sampler = BatchSampler(source.tokens, cfg.data.seq_len, cfg.training.global_batch_size, layout.dp_rank, layout.dp, cfg.training.seed)
    flop_per_token = flops_per_token(args, cfg.data.seq_len)

    # MFU's denominator: every rank measures (or looks up) its own peak at the same moment; the sum
    # is the peak of all devices together.
    peak, basis = flops.device_peak_flops(device)
    peak_total = _sum_over_ranks(peak, device, world)

    log.info("peak FLOPS: %.3g per device (%s)", peak, basis)
    recorder = build_recorder(cfg, run_dir) if rank == 0 else None
    if recorder is not None:
        write_resolved_config(cfg, run_dir / "config.toml")
        for key, value in {
            "run_id": cfg.run.run_id, "config": redact(cfg.to_dict()), "world_size": world, "device": str(device),
            "mfu_basis": basis, "peak_flops_total": peak_total, "flops_per_token": flop_per_token,
            "data_version": source.version, "data": source.description, "torch_version": torch.__version__,
        }.items():
            recorder.store.set_meta(key, value)
        recorder.event("run_started", f"{world} processes, pp{layout.pp} dp{layout.dp} tp{layout.tp}", step=0, attempt=0, rank=0)
    progress = ProgressLine(cfg.training.steps, every=cfg.metrics.log_every) if rank == 0 else None
    if world > 1:
        comm.warm_up_profiler(device.type == "cuda")
    reporter = StepReporter(device, world, cfg.training.global_batch_size * cfg.data.seq_len, flop_per_token, peak_total, recorder, progress)
    log.info("starting training")

    attempt = 0
    for step in range(1, cfg.training.steps + 1):
        faults.begin_step(step)
        t0 = time.perf_counter()
        inputs, targets = (torch.from_numpy(t).to(device, non_blocking=True) for t in sampler.next_batch())
        data_time = time.perf_counter() - t0
        lr = lr_at(step, cfg.optim, cfg.training.steps)
        set_lr(optimizer, lr)

        sample_comm = world > 1 and (step - 2) % cfg.metrics.comm_sample_every == 0
        with comm.sampled_step(sample_comm, device.type == "cuda") as exposed_comm:
            loss = forward_backward(cfg, parts, schedule, layout, inputs, targets, autocast, step_loss)
            if cfg.parallel.dp > 1 and cfg.parallel.dp_mode == "replicate":
                parallel.all_reduce_replicated_grads(parts, layout)
            grad_norm = parallel.global_grad_norm(parts, layout).item()
            clip_grads(parts, cfg.optim.grad_clip, grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        row, fault_ranks = reporter.report(step, attempt, lr, grad_norm, loss, data_time, exposed_comm(), len(faults.fired))
        if recorder is not None:
            record_step_events(recorder, cfg, row, fault_ranks)

    if recorder is not None:
        progress.finish()
        recorder.event("run_finished", f"{cfg.training.steps} steps", step=cfg.training.steps, attempt=attempt, rank=0)
        if cfg.monitor.prometheus_linger_s > 0:
            log.info("keeping /metrics up for %.0f s (monitor.prometheus_linger_s)", cfg.monitor.prometheus_linger_s)
            time.sleep(cfg.monitor.prometheus_linger_s)
        recorder.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


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
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    try:
        cfg, _ = parse_train_args(sys.argv[1:] if argv is None else argv, world_size=world)
    except ConfigError as e:
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"keel train: error: {e}", file=sys.stderr)
        return 2
    device, rank, world = init_distributed()
    if not cfg.run.run_dir:
        # Started by torchrun or srun directly: rank 0 names the run, everyone uses that name.
        resolve_run_dir(cfg)
        names = [cfg.run.run_id, cfg.run.run_dir]
        if world > 1:
            dist.broadcast_object_list(names, src=0)
        cfg.run.run_id, cfg.run.run_dir = names
    train(cfg, device, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
