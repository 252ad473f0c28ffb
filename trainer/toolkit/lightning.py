"""Keel for a Lightning `Trainer`: `KeelLightningCallback`, the one line a Lightning user adds.

    trainer = lightning.Trainer(max_steps=1000, callbacks=[KeelLightningCallback()])

Each optimizer step is recorded (the run store, Prometheus, W&B, webhooks, as for `keel train`), judged by
Keel's guard, watched by its hang watchdog and injected with its faults (KEEL_ARGS' --fault, `keel drill`).
Keel's step numbers are the Trainer's `global_step`; a step of several accumulated batches is one step.
Lightning owns the data and the checkpoints, so Keel acts on a verdict only as far as a callback can:

- a step whose gradient is not finite on some rank is skipped on every rank (no update, no moment update);
- a confirmed loss spike, or recovery.nonfinite_limit non-finite steps in a row, stops training cleanly
  (`trainer.should_stop`): Keel's rollback needs the data position, which a callback cannot move.
  `run_stopped` names the checkpoint to resume from and how to step over the bad batches; `exit_code` is
  then EXIT_ROLLBACK_CAP.

Automatic optimization with one optimizer. Every rank runs the callback: the gradient norm and the step's
numbers are agreed by collectives. Needs lightning >= 2.4: `pip install keel[lightning]`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback

from keel.trainer.toolkit.framework import FrameworkRun
from keel.trainer.toolkit.run import KeelUsageError

# ModelCheckpoint's default file name, "{epoch}-{step}", writes the step as `step=N`.
_CHECKPOINT_STEP = re.compile(r"step=(\d+)")


class KeelLightningCallback(Callback):
    """Keel for one `Trainer.fit()`: `run_dir` (default: KEEL_ARGS' --run-dir, else runs/<id>) and `config`
    (a dict of `keel train`'s dotted fields, e.g. {"spike.warmup_steps": 100}), as `open_run` takes them."""

    def __init__(self, run_dir: str | None = None, config: dict[str, Any] | None = None):
        self.run_dir, self.config = run_dir, dict(config or {})
        self.run: FrameworkRun | None = None  # from on_train_start
        self._in_step, self._stepped = False, False
        self._losses: list[torch.Tensor] = []
        self._restore_lr = None  # puts the step's LR back after the update (see on_before_optimizer_step)

    @property
    def exit_code(self) -> int:
        """What `keel train` would exit with: 0, or EXIT_ROLLBACK_CAP after Keel stopped training."""
        return self.run.keel.exit_code if self.run is not None else 0

    def on_train_start(self, trainer, pl_module):
        if not pl_module.automatic_optimization:
            raise KeelUsageError("KeelLightningCallback: manual optimization is not supported; use automatic optimization (one optimizer)")
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise KeelUsageError(
                "KeelLightningCallback: the number of steps is not known (a dataset without a length); set Trainer(max_steps=...)"
            )
        self.run = FrameworkRun(int(steps), pl_module.device, self.run_dir, self.config, resumed=trainer.global_step > 0)
        self.run.start(f"lightning {lightning.__version__}", f"a Lightning Trainer ({type(pl_module).__name__})")
        self._in_step = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._in_step:
            return  # a later batch of an accumulated step
        self.run.begin(trainer.global_step, pl_module)
        self._in_step, self._stepped, self._losses = True, False, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        """After backward, before Lightning's clipping and the update: the gradient faults, the agreed norm, the skip."""
        base = self.run.judge_gradients(pl_module, optimizer)
        self._stepped = True
        if self.run.lr_factor == 1.0:
            return
        groups = optimizer.param_groups

        # Lightning steps its schedulers before on_train_batch_end: the LR goes back as soon as the update is done.
        def restore(*_: Any) -> None:
            handle.remove()
            self._restore_lr = None
            for group, lr in zip(groups, base):
                group["lr"] = lr

        handle = optimizer.register_step_post_hook(restore)
        self._restore_lr = restore

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else None  # None: training_step skipped the batch
        if loss is not None:
            self._losses.append(loss.detach().float())
        if not self._stepped:
            return  # accumulating: the optimizer steps after a later batch
        if self._restore_lr is not None:  # a mixed-precision grad scaler skipped the update, and so the hook
            self._restore_lr()
        self._in_step = False
        # Lightning divides each batch's loss by accumulate_grad_batches: their sum is the step's mean loss.
        step_loss = torch.stack(self._losses).sum() if self._losses else None
        verdict = self.run.end(step_loss, self.run.norm)
        if verdict.action in ("rollback", "stop"):
            dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
            self.run.stopped(verdict, resume_advice(dirs, verdict.bad_from, self.run.keel.step))
            trainer.should_stop = True

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.run is not None:  # a validation between steps makes progress batch by batch
            self.run.between_steps()

    def on_validation_end(self, trainer, pl_module):
        if self.run is not None:  # a validation's time is not the next step's
            self.run.keel.reporter.restart_clock()

    def on_train_end(self, trainer, pl_module):
        self.close()

    def on_exception(self, trainer, pl_module, exception):
        self.close(failed=True)

    def close(self, failed: bool = False) -> None:
        """Closes the run (on_train_end and on_exception do it)."""
        if self.run is not None:
            self.run.close(failed)


def resume_advice(checkpoint_dirs: list[str], bad_from: int, step: int) -> str:
    """What to do after a stop at `step` whose bad steps began at `bad_from`: which checkpoint to resume from
    and how to keep the resumed fit off the batches of the bad steps."""
    saved = [
        (int(m.group(1)), path)
        for folder in checkpoint_dirs
        for path in Path(folder).glob("*.ckpt")
        if (m := _CHECKPOINT_STEP.search(path.name)) and int(m.group(1)) < bad_from
    ]
    if saved:
        path = max(saved)[1]
        where = f'resume from {path}, the newest checkpoint saved before step {bad_from}: trainer.fit(model, ckpt_path="{path}")'
    else:
        where = f"resume from a checkpoint saved before step {bad_from} (ModelCheckpoint(every_n_train_steps=...) saves them): trainer.fit(model, ckpt_path=...)"
    # Lightning has no skip range: a resumable loader (state_dict/load_state_dict, e.g. torchdata's
    # StatefulDataLoader) goes on right after the checkpoint, into the same batches; a plain DataLoader starts
    # the epoch's order over (Lightning warns) and may reach them again.
    return (
        f"{where}, with another seed for the data order or without those samples (Lightning has no skip range: "
        f"a resumed fit may train on the batches of steps {bad_from}-{step} again); keep KEEL_ARGS' --run-dir: "
        "Keel records the resumed run as its next attempt"
    )
