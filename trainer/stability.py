"""What to do after each step: go on, roll back, or stop. Decided from the step's agreed values
(loss and grad norm are the same numbers on every rank), so every rank reaches the same verdict
without another collective.

Non-finite steps are skipped by the train loop (no update); `nonfinite_limit` of them in a row ask
for a rollback. A loss spike confirmed by the detector asks for one too. Rollbacks that do not get
the run past the step that triggered the last one are counted; at `max_rollbacks` the run stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.monitor.detectors import Finding, SpikeConfig, SpikeDetector
from keel.trainer.config import RecoveryConfig


@dataclass
class Verdict:
    action: str = "continue"  # continue | rollback | stop
    reason: str = ""
    bad_from: int = 0  # the first bad step: a rollback restores a checkpoint saved before it
    findings: list[Finding] = field(default_factory=list)


class StabilityGuard:
    def __init__(self, cfg: RecoveryConfig, spike: SpikeConfig):
        self.cfg = cfg
        self.detector = SpikeDetector(spike) if spike.enabled else None
        self.nonfinite_in_row = 0
        self.rollbacks_without_progress = 0
        self.last_trigger_step = 0
        self.lr_factor_until = 0  # steps up to this one run at lr * cfg.lr_factor

    def lr_scale(self, step: int) -> float:
        return self.cfg.lr_factor if step <= self.lr_factor_until else 1.0

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool) -> Verdict:
        if step > self.last_trigger_step:
            self.rollbacks_without_progress = 0
        verdict = Verdict()
        if skipped:
            self.nonfinite_in_row += 1
            if self.nonfinite_in_row >= self.cfg.nonfinite_limit:
                verdict = Verdict("rollback", f"{self.nonfinite_in_row} non-finite steps in a row", step - self.nonfinite_in_row + 1)
        else:
            self.nonfinite_in_row = 0
            findings = self.detector.update(step, loss, grad_norm) if self.detector else []
            verdict.findings = findings
            for f in findings:
                if f.kind == "spike_confirmed":
                    verdict = Verdict("rollback", f"loss spike confirmed: {f.message()}", f.start_step, findings)
        if verdict.action == "rollback":
            if not self.cfg.rollback:
                verdict.action = "continue"  # alert only: recovery.rollback is off
            elif self.rollbacks_without_progress >= self.cfg.max_rollbacks:
                verdict.action = "stop"
                verdict.reason += f"; {self.rollbacks_without_progress} rollbacks without progress (recovery.max_rollbacks)"
        return verdict

    def rolled_back(self, to_step: int, trigger_step: int) -> None:
        """Called after the state of `to_step` was restored because of a verdict at `trigger_step`."""
        self.rollbacks_without_progress += 1
        self.last_trigger_step = max(self.last_trigger_step, trigger_step)
        self.nonfinite_in_row = 0
        self.lr_factor_until = to_step + self.cfg.lr_factor_steps
        if self.detector:
            self.detector.rewind(to_step)

    def state_dict(self) -> dict:
        return {
            "rollbacks_without_progress": self.rollbacks_without_progress,
            "last_trigger_step": self.last_trigger_step,
            "lr_factor_until": self.lr_factor_until,
            "detector": self.detector.state_dict() if self.detector else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks_without_progress = state["rollbacks_without_progress"]
        self.last_trigger_step = state["last_trigger_step"]
        self.lr_factor_until = state["lr_factor_until"]
        self.nonfinite_in_row = 0
        if self.detector and state["detector"] is not None:
            self.detector.load_state_dict(state["detector"])
