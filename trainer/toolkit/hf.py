"""Keel for a Hugging Face `Trainer`: `KeelCallback`, the one line a Trainer user adds.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[KeelCallback()])

Each optimizer step is recorded (the run store, Prometheus, W&B, webhooks, as for `keel train`), judged by
Keel's guard, watched by its hang watchdog and injected with its faults (KEEL_ARGS' --fault, `keel drill`).
Keel's step numbers are the Trainer's `global_step`. The Trainer owns the data and the checkpoints, so Keel
acts on a verdict only as far as a callback can:

- a step whose gradient is not finite on some rank is skipped on every rank (no update, no moment update);
- a confirmed loss spike, or recovery.nonfinite_limit non-finite steps in a row, stops training cleanly:
  Keel's rollback needs the data position, which a callback cannot move. `run_stopped` names the checkpoint
  to resume from and how to step over the bad batches; `exit_code` is then EXIT_ROLLBACK_CAP.

The loss Keel records is the one the Trainer logs (averaged over ranks), so the callback makes the
Trainer log every step (a warning says so when `logging_steps` asked for less). Every rank runs the
callback: the gradient norm and the step's numbers are agreed by collectives. Needs transformers >= 4.46
(`on_pre_optimizer_step`): `pip install keel[hf]`.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import TrainerCallback

from keel.trainer.toolkit.framework import FrameworkRun

log = logging.getLogger("keel.hf")

# The Trainer saves its checkpoints as OUTPUT_DIR/checkpoint-<global_step> (transformers' PREFIX_CHECKPOINT_DIR).
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class KeelCallback(TrainerCallback):
    """Keel for one `Trainer.train()`: `run_dir` (default: KEEL_ARGS' --run-dir, else runs/<id>) and `config`
    (a dict of `keel train`'s dotted fields, e.g. {"spike.warmup_steps": 100}), as `open_run` takes them."""

    def __init__(self, run_dir: str | None = None, config: dict[str, Any] | None = None):
        self.run_dir, self.config = run_dir, dict(config or {})
        self.run: FrameworkRun | None = None  # from on_train_begin
        self._base_lrs: list[float] = []

    @property
    def exit_code(self) -> int:
        """What `keel train` would exit with: 0, or EXIT_ROLLBACK_CAP after Keel stopped training."""
        return self.run.keel.exit_code if self.run is not None else 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        device = next(model.parameters()).device
        self.run = FrameworkRun(state.max_steps, device, self.run_dir, self.config, resumed=state.global_step > 0)
        if args.logging_strategy != "steps" or state.logging_steps != 1:
            asked = f"logging_strategy={getattr(args.logging_strategy, 'value', args.logging_strategy)}, logging_steps={args.logging_steps}"
            log.warning(
                "keel: the Trainer logs every step now (%s asked for less): Keel records each step from the loss the Trainer "
                "logs; set logging_steps=1 to silence this",
                asked,
            )
        self.run.start(f"transformers {transformers.__version__}", f"a Hugging Face Trainer ({type(model).__name__})")

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.run.begin(state.global_step, model)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        """After the Trainer's clipping, before the optimizer: the gradient faults, the agreed norm, the skip."""
        self._base_lrs = self.run.judge_gradients(model, optimizer)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        for group, lr in zip(optimizer.param_groups, self._base_lrs):  # before the scheduler reads or sets them
            group["lr"] = lr

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True  # on_log then has this step's loss

    def on_log(self, args, state, control, logs=None, **kwargs):
        run = self.run
        if run is None or "loss" not in (logs or {}) or run.keel.step != state.global_step:
            return  # not a training step's log (evaluation, the summary at the end)
        # The Trainer's norm is taken before its clipping (the one a spike shows in); Keel's after it and after
        # the faults, agreed by all ranks, decides the skip.
        norm = float(logs.get("grad_norm", run.norm)) if math.isfinite(run.norm) else run.norm
        verdict = run.end(torch.tensor(float(logs["loss"])), norm)
        if verdict.action in ("rollback", "stop"):
            run.stopped(verdict, resume_advice(args.output_dir, verdict.bad_from, run.keel.step))
            control.should_training_stop = True
            control.should_save = False  # not a checkpoint of the spiked weights

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.run is not None:  # an evaluation between steps makes progress batch by batch
            self.run.between_steps()

    def on_evaluate(self, args, state, control, **kwargs):
        if self.run is not None:  # an evaluation's time is not the next step's
            self.run.keel.reporter.restart_clock()

    def on_save(self, args, state, control, **kwargs):
        if self.run is not None:  # nor a save's
            self.run.keel.reporter.restart_clock()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, failed: bool = False) -> None:
        """Closes the run (the Trainer's on_train_end does it). After train() raised in a process that lives
        on (a notebook), call it with failed=True."""
        if self.run is not None:
            self.run.close(failed)


def resume_advice(output_dir: str, bad_from: int, step: int) -> str:
    """What to do after a stop at `step` whose bad steps began at `bad_from`: which checkpoint to resume from
    and how to keep the resumed Trainer off the batches of the bad steps."""
    saved = [
        int(m.group(1))
        for p in Path(output_dir).glob("checkpoint-*")
        if (m := _CHECKPOINT.fullmatch(p.name)) and int(m.group(1)) < bad_from
    ]
    if saved:
        path = Path(output_dir) / f"checkpoint-{max(saved)}"
        where = f'resume from {path}, the newest checkpoint saved before step {bad_from}: trainer.train(resume_from_checkpoint="{path}")'
    else:
        where = f"no checkpoint in {output_dir} was saved before step {bad_from}: train again from the start (save_steps saves more often)"
    # A resumed Trainer replays the epoch's sample order (its sampler is seeded by data_seed, else seed) and skips
    # only the batches its checkpoint had trained on: the batches of the bad steps would come next again.
    return (
        f"{where}, with another TrainingArguments.data_seed (a resumed Trainer reads the epoch in the same order "
        f"and would train on the batches of steps {bad_from}-{step} again) or without those samples; "
        "keep KEEL_ARGS' --run-dir: Keel records the resumed run as its next attempt"
    )
