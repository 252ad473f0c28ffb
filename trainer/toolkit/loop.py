"""Keel for a plain PyTorch loop: `open_run` and the `LoopRun` handle it returns.

    run = open_run(model, optimizer, scheduler=scheduler, data=sampler, steps=max_iters, tokens_per_step=B * T)
    for step in run.steps():                  # ends a step when the next begins; resumes after a restart
        x, y = batch(sampler.next_indices())
        loss = run.loss(model(x, y))          # the chaos hook on the loss; the loss Keel records
        loss.backward()
        run.clip_grad_norm(1.0)               # the global norm, the same on every rank; NaN on all if any is bad
        run.optimizer_step()                  # optimizer and scheduler, unless the step is skipped
        optimizer.zero_grad(set_to_none=True)
    run.close()

Each step is recorded (the run store, Prometheus, W&B, webhooks, as for `keel train`), judged by the same
guard, watched by the same watchdog and injected with the same faults. A rollback restores the model,
optimizer, scheduler, RNG and data position from Keel's newest verified checkpoint and skips the bad
batches; `steps()` then goes on from the restored step.

Settings: `config` (a dict of `keel train`'s dotted fields, e.g. {"checkpoint.interval_steps": 20}), then
the TOML file named by KEEL_CONFIG, then `keel train`'s flags in KEEL_ARGS (`--run-dir`, `--fault`,
`--section.key=value`), each over the one before: `keel drill` drills a script through KEEL_ARGS, without
a change to its code.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keel.monitor.custom_metrics import check_custom_metric_name
from keel.monitor.run_dir import list_checkpoints
from keel.trainer import exposed_comm, flops
from keel.trainer.checkpoint.checkpointer import manifest_info
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.loader import parse_skip_ranges
from keel.trainer.launch.launcher import loop_layout_flags, parse_train_args, resolve_run_dir
from keel.trainer.parallel.distributed import store_namespaced_per_restart, sum_over_ranks
from keel.trainer.step_metrics import StepNumbers
from keel.trainer.toolkit.data_position import DataPosition
from keel.trainer.toolkit.grads import clip_grads, global_grad_norm
from keel.trainer.toolkit.run import KeelRun, KeelUsageError, own_run_dir

log = logging.getLogger("keel.run")
ENV_ARGS = "KEEL_ARGS"  # `keel train`'s flags, for a run started without a change to its code (keel drill)
ENV_CONFIG = "KEEL_CONFIG"  # a TOML file of `keel train`'s settings


def loop_config(steps: int, world: int, config: dict[str, Any] | None = None) -> JobConfig:
    """The run's settings: `keel train`'s defaults, then `config`, KEEL_CONFIG's file and KEEL_ARGS's flags,
    each over the one before. Raises ConfigError (one line) on a bad field."""
    argv = [f"--training.steps={steps}", *_flags(config or {})]
    if os.environ.get(ENV_CONFIG):
        argv += _flags(_read_table(os.environ[ENV_CONFIG]))
    argv += shlex.split(os.environ.get(ENV_ARGS, ""))
    cfg, _ = parse_train_args([*argv, *loop_layout_flags(world)], world_size=world)
    return cfg


def _read_table(path: str) -> dict[str, Any]:
    """KEEL_CONFIG's TOML file as dotted fields."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{ENV_CONFIG}={path}: cannot read it as TOML ({e})") from None
    return {f"{section}.{key}": value for section, fields in table.items() if isinstance(fields, dict) for key, value in fields.items()}


def _flags(fields: dict[str, Any]) -> list[str]:
    """Dotted fields as `keel train`'s flags (a list joined by ';', as --chaos.faults takes it)."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return ";".join(map(str, value)) if isinstance(value, list) else str(value)

    return [f"--{key}={text(value)}" for key, value in fields.items()]


def open_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    data: DataPosition,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    tokens_per_step: int = 0,
    flops_per_token: float = math.nan,
    run_dir: str | None = None,
    config: dict[str, Any] | None = None,
) -> LoopRun:
    """Opens (or, when its directory holds checkpoints of an earlier start, resumes) the run of a loop of
    `steps` optimizer steps, on every rank (call torch.distributed.init_process_group first under torchrun).
    `tokens_per_step` over all ranks gives tokens/s; with `flops_per_token` too, MFU. Raises ConfigError
    for a bad setting and KeelUsageError for what Keel cannot checkpoint, before any step."""
    keel, owner = new_keel_run(steps, next(model.parameters()).device, run_dir, config)
    try:
        return LoopRun(keel, owner, model, optimizer, scheduler, data, tokens_per_step, flops_per_token)
    except BaseException:
        owner.__exit__(None, None, None)  # refused before any step: the directory is free again
        raise


def new_keel_run(
    steps: int, device: torch.device, run_dir: str | None = None, config: dict[str, Any] | None = None, resume_from_checkpoints: bool = True
) -> tuple[KeelRun, contextlib.AbstractContextManager]:
    """The KeelRun of a loop (or a framework's adapter) on this rank, and the run directory's lock, taken
    (rank 0; release it when the run ends): the settings (`loop_config`), the run's name, agreed by all
    ranks, and, with `resume_from_checkpoints`, a resume when the directory holds checkpoints."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        raise KeelUsageError("open_run: WORLD_SIZE > 1 but no process group; call torch.distributed.init_process_group() first")
    cfg = loop_config(steps, world, {**({"run.run_dir": run_dir} if run_dir else {}), **(config or {})})
    _name_run(cfg, rank, world)
    owner, refused = own_run_dir(cfg.run.run_dir, rank, world)
    if refused:
        raise KeelUsageError(refused)
    owner.__enter__()
    if resume_from_checkpoints:
        cfg.run.resume = cfg.run.resume or bool(list_checkpoints(cfg.run.run_dir))
    keel = KeelRun(cfg, rank, world, device)
    if world > 1 and keel.restart_count and cfg.checkpoint.async_save and not store_namespaced_per_restart():
        # An async save needs a process group of its own, which torch cannot make after a restart of a group
        # started by dist.init_process_group (see store_namespaced_per_restart): save in the loop's thread.
        cfg.checkpoint.async_save = False
        log.warning("checkpoints are saved synchronously after this restart; start the process group with "
                    "keel.trainer.toolkit.init_distributed() to keep them in the background")  # fmt: skip
    return keel, owner


def _name_run(cfg: JobConfig, rank: int, world: int) -> None:
    """Without a run directory, rank 0 names the run (after torchrun's run id, which its restarts keep, so a
    restarted loop finds its checkpoints); every rank uses that name."""
    if cfg.run.run_dir:
        return
    elastic_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic_id and elastic_id != "none":
        cfg.run.run_id = cfg.run.run_id or f"loop-{elastic_id}"
    resolve_run_dir(cfg)
    names = [cfg.run.run_id, cfg.run.run_dir]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    cfg.run.run_id, cfg.run.run_dir = names


class LoopRun:
    """A user loop's handle on its Keel run (see the module docstring). `step` is the step running."""

    def __init__(self, keel: KeelRun, owner, model, optimizer, scheduler, data, tokens_per_step: int, flops_per_token: float):
        self.keel, self._owner = keel, owner  # the run directory's lock (rank 0), released by close()
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        cfg, device, world = keel.cfg, keel.device, keel.world
        self.run_dir, self.rank, self.world = keel.run_dir, keel.rank, world
        keel.attach(model, optimizer, data, manifest_info(cfg, "user loop"), scheduler=scheduler, host_rng=True)
        _check_checkpointable(keel)
        if cfg.data.skip_batches and hasattr(data, "skip_ranges"):
            data.skip_ranges.update(parse_skip_ranges(cfg.data.skip_batches))
        peak_total = math.nan
        if math.isfinite(flops_per_token):
            peak, _ = flops.device_peak_flops(device, cfg.metrics.peak_tflops)
            peak_total = sum_over_ranks(peak, device, world)
        meta = {"flops_per_token": flops_per_token, "peak_flops_total": peak_total, "peak_flops_per_device": peak_total / world}
        keel.record_start(meta, f"{world} processes, a user loop ({type(model).__name__})")
        keel.resume()
        keel.start_steps(tokens_per_step, flops_per_token, peak_total, progress=False)
        self._cuda = device.type == "cuda"
        self._in_step = False

    @property
    def step(self) -> int:
        return self.keel.step

    @property
    def attempt(self) -> int:
        return self.keel.attempt

    def steps(self) -> Iterator[int]:
        """The loop's steps, from the one after the newest checkpoint; a rollback moves back, a stop ends it."""
        keel = self.keel
        while keel.running():
            step = keel.begin_step()
            self._begin(step)
            sampled = (step - 2) % keel.cfg.metrics.comm_sample_every == 0  # per-rank rows kept; communication measured
            with exposed_comm.sampled_step(sampled and self.world > 1, self._cuda) as profiled:
                yield step
            self._end(profiled.comm_seconds(), sampled)

    def _begin(self, step: int) -> None:
        self._in_step = True
        self._losses: list[torch.Tensor] = []
        self._grad_norm: float | None = None
        self._skipped, self._lr, self._custom = False, math.nan, {}
        self._lr_scale = self.keel.lr_scale()
        checkpoints = self.keel.checkpointer
        self.keel.faults.at_step_start([self.model], 0, checkpoints.wait)  # chaos hook points: the process, the parameters, the checkpoints

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of a (micro-)batch, through the chaos hooks (a poisoned batch's loss is a spike); Keel
        records the mean over the step's calls. Call it once per backward."""
        self._require_step("loss")
        faults = self.keel.faults
        loss = faults.corrupt_batch_loss(self.data.batch_index - 1, faults.corrupt_loss(loss))
        self._losses.append(loss.detach())
        return loss

    def clip_grad_norm(self, max_norm: float = 0.0) -> float:
        """After backward: the global gradient norm, the same on every rank (NaN on every rank when any
        rank's loss or gradient is not finite: the step is then skipped), and the gradients clipped to
        `max_norm` (0: not clipped). Replaces torch.nn.utils.clip_grad_norm_."""
        self._require_step("clip_grad_norm")
        faults = self.keel.faults
        faults.corrupt_grads([self.model])
        faults.before_collective()
        loss_finite = all(bool(torch.isfinite(x).all()) for x in self._losses)
        norm = global_grad_norm(self.model.parameters(), self.world, loss_finite)
        self._grad_norm, self._skipped = norm, not math.isfinite(norm)
        if not self._skipped:
            clip_grads(self.model.parameters(), max_norm, norm)
        return norm

    def optimizer_step(self) -> bool:
        """The optimizer's step (at the step's LR times Keel's factor, see KeelRun.lr_scale) unless the step
        is skipped, then the scheduler's; returns whether the parameters were updated."""
        self._require_step("optimizer_step")
        if self._grad_norm is None:
            self.clip_grad_norm(0.0)
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        self._lr = base[0] * self._lr_scale
        if not self._skipped:
            self.keel.checkpointer.before_update()  # a save in flight must have copied the parameters
            for group, lr in zip(groups, base):
                group["lr"] = lr * self._lr_scale
            self.optimizer.step()
            for group, lr in zip(groups, base):
                group["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.step()
        return not self._skipped

    def log(self, **metrics: float) -> None:
        """The step's own metrics (rank 0's values are recorded; the dashboard draws each)."""
        self._require_step("log")
        for name, value in metrics.items():
            check_custom_metric_name(name)
            self._custom[name] = float(value)

    def note(self, message: str, **data: Any) -> None:
        """An event of the loop's own at this step (rank 0's is recorded): the dashboard marks it among Keel's."""
        self.keel.incidents.note(message, self.step, self.keel.attempt, data)

    def _end(self, comm_time: float | None, sampled: bool) -> None:
        if self._grad_norm is None:
            raise KeelUsageError(
                f"step {self.step}: it ended without run.optimizer_step() (or run.clip_grad_norm()); call it after backward"
            )
        self._in_step = False
        loss = torch.stack(self._losses).mean() if self._losses else None
        numbers = StepNumbers(
            self.step, self.keel.attempt, self._lr, self._grad_norm, loss, math.nan, comm_time=comm_time,
            faults_fired=len(self.keel.faults.fired), skipped=self._skipped, sampled=sampled, custom=self._custom,
        )  # fmt: skip
        self.keel.end_step(numbers)

    def _require_step(self, call: str) -> None:
        if not self._in_step:
            raise KeelUsageError(f"run.{call}() outside a step; call it inside `for step in run.steps():`")

    def close(self) -> int:
        """Waits for the checkpoint in flight and closes the run's record; returns the exit code Keel's
        trainer would (0, or EXIT_ROLLBACK_CAP after a stop). Leaves the process group to the loop."""
        self.keel.finish()
        self._owner.__exit__(None, None, None)
        return self.keel.exit_code


def _check_checkpointable(keel: KeelRun) -> None:
    """Builds the checkpoint's state once, so a model or optimizer Keel cannot save is refused at open."""
    try:
        keel.checkpointer.check_saveable()
    except Exception as e:  # any failure of torch's state-dict code means the same thing here
        raise KeelUsageError(
            f"open_run: Keel cannot checkpoint this model and optimizer ({type(e).__name__}: {e}); "
            "pass the model the optimizer was built on (DDP or FSDP2-wrapped is fine)"
        ) from None
