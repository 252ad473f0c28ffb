"""What Keel's callbacks for training frameworks share (keel.trainer.toolkit.hf, .lightning): one
`FrameworkRun` per `fit`/`train`, driven from the framework's hooks.

A framework owns the loop, the data and the checkpoints, so its KeelRun attaches no checkpointer: Keel
records each step, judges it, skips a step whose gradient is not finite on some rank (on every rank), and
where Keel's own loop would roll back it stops training cleanly, recording what the user does next.
Keel's step numbers are the framework's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from keel.monitor.exits import EXIT_FAILED, EXIT_ROLLBACK_CAP
from keel.trainer.stability import Verdict
from keel.trainer.step_metrics import StepNumbers
from keel.trainer.toolkit.grads import global_grad_norm
from keel.trainer.toolkit.loop import new_keel_run

# Between two steps a framework evaluates and saves its own checkpoints, for as long as a save may take:
# the watchdog gives that time the allowance of a checkpoint save (watchdog.checkpoint_s).
_BETWEEN_STEPS = "checkpoint_save"


class FrameworkRun:
    """One framework run's KeelRun and the state of the step in progress."""

    def __init__(self, steps: int, device: torch.device, run_dir: str | None, config: dict[str, Any], resumed: bool):
        # The framework saves its own checkpoints: Keel saves none. A run resumed from one of them (its step
        # count above 0 already) goes on in the same Keel run as its next attempt.
        config = {"checkpoint.interval_steps": 0, "checkpoint.interval_minutes": 0, "run.resume": resumed, **config}
        self.keel, self._owner = new_keel_run(steps, device, run_dir, config, resume_from_checkpoints=False)
        self.lr_factor, self.norm, self.lr, self.skipped = 1.0, math.nan, math.nan, False

    def start(self, framework: str, description: str) -> None:
        keel = self.keel
        keel.record_start({"framework": framework}, f"{keel.world} processes, {description}")
        keel.resume()  # no checkpointer: writes the run's config
        keel.start_steps(0, math.nan, math.nan, progress=False)  # the framework prints its own progress

    def begin(self, done_steps: int, module: nn.Module) -> None:
        """The step after the framework's `done_steps`: the watchdog's beat, the step-start faults, the LR factor."""
        keel = self.keel
        keel.follow_step(done_steps + 1)
        keel.begin_step()
        keel.faults.at_step_start([module], 0)
        self.lr_factor = keel.lr_scale()  # once per step: an LR surge fires here
        self.norm, self.lr, self.skipped = math.nan, math.nan, False

    def judge_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        """After backward, before the update: the gradient faults, the norm all ranks agree on (NaN on every
        rank when any rank's is), the skip, and the step's LR times Keel's factor. Returns the LRs to put back
        after the update."""
        faults = self.keel.faults
        faults.corrupt_grads([module])
        faults.before_collective()
        self.norm = global_grad_norm(module.parameters(), self.keel.world)
        self.skipped = not math.isfinite(self.norm)
        if self.skipped:
            # A true skip: torch's optimizers (AdamW's too) pass over a parameter whose .grad is None, so neither
            # it nor its moments nor its step count change; setting 0 instead would still decay the weights
            # and move the moments. The framework still steps its LR scheduler, as Keel's own loop does.
            for p in module.parameters():
                p.grad = None
        base = [group["lr"] for group in optimizer.param_groups]
        self.lr = base[0] * self.lr_factor
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * self.lr_factor
        return base

    def end(self, loss: torch.Tensor | None, grad_norm: float) -> Verdict:
        """Records and judges the step (this rank's `loss`; Keel averages over ranks). A rollback or stop
        verdict is the caller's to act on: stop training, then `stopped`."""
        keel = self.keel
        numbers = StepNumbers(
            keel.step, keel.attempt, self.lr, grad_norm, loss, math.nan, faults_fired=len(keel.faults.fired), skipped=self.skipped
        )
        _, verdict = keel.end_step(numbers)
        self.between_steps()
        return verdict

    def stopped(self, verdict: Verdict, advice: str) -> None:
        """Records the stop with what the user does next (a framework cannot restore a data position from a callback)."""
        keel = self.keel
        keel.exit_code = EXIT_ROLLBACK_CAP
        keel.incidents.stopped(keel.step, keel.attempt, f"{verdict.reason}; {advice}", keel.exit_code)

    def between_steps(self) -> None:
        """The framework evaluates or saves between steps: progress, allowed a save's time."""
        self.keel.watchdog.beat(_BETWEEN_STEPS, self.keel.step, self.keel.attempt)

    def close(self, failed: bool = False) -> None:
        """Closes the run's record and stops the watchdog, which would otherwise end a process that lives on
        (a notebook) once a step's allowance has passed; releases the run directory."""
        if self._owner is None:
            return
        if failed and self.keel.exit_code == 0:
            self.keel.exit_code = EXIT_FAILED
        self.keel.finish()
        self._owner.__exit__(None, None, None)
        self._owner = None
