"""The loss-spike detector: tells a loss spike worth a rollback from the noise of an ordinary run.

The trainer feeds it each step's agreed loss and global grad norm; it answers with findings. A loss is
an outlier when it stands far above a robust baseline of recent losses (median and MAD, so the noise
of a small batch or a past spike does not move it). One outlier is only reported: a blip that heals
by itself is no reason to throw work away. A spike is confirmed, once per run of outliers, when the
loss stays up for `persistence` steps; that is what the trainer acts on. Points of a run of outliers
never enter the baseline, so a plateau stays a spike instead of becoming the new normal. A jump in
the grad norm is reported as an early warning only.

A plain object without torch: every rank runs its own copy on the same agreed numbers and reaches the
same verdicts. See docs/stability.md for the thresholds and the measurements behind their defaults.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

# 1.4826 * MAD estimates the standard deviation of normally distributed noise.
_MAD_TO_SIGMA = 1.4826
# A snapshot of the state every this many updates: rewind() replays at most this many from one.
_SNAPSHOT_EVERY = 128


@dataclass
class SpikeConfig:
    enabled: bool = True  # false: no detector at all (no findings, no rollback on spikes)
    window: int = 128  # steps; the baseline is the last `window` finite losses that were not outliers
    # A loss is an outlier when loss > center + sigmas * spread, or loss >= ratio * center. center is
    # the median of the baseline; spread is 1.4826 * its median absolute deviation (the standard
    # deviation, were the noise normal), at least min_rel_spread * center.
    sigmas: float = 6.0  # robust standard deviations above the center
    ratio: float = 2.0  # multiple of the center; catches a doubling even while the spread is wide
    min_rel_spread: float = 0.02  # fraction of the center: the smallest spread (so at least +12% at 6 sigmas)
    # A run of outliers goes on while the loss stays above center + hold * (threshold - center), so a
    # spike whose next steps land a little lower is not split in two; the steps just before its first
    # outlier that were already that high (at most persistence - 1) are counted to it as well.
    hold: float = 0.5  # fraction of the way from center to threshold; 1: only outliers count
    persistence: int = 3  # steps from the first outlier (itself included) that confirm a spike
    warmup_steps: int = 50  # no verdicts before this step (the baseline still fills)
    min_baseline: int = 16  # no verdicts until the baseline holds this many points
    # Grad-norm early warning: the same test on the grad norm, with its own baseline.
    grad_sigmas: float = 6.0  # robust standard deviations of the grad norm above its center
    grad_ratio: float = 4.0  # multiple of the grad norm's center
    history: int = 10000  # updates kept so that rewind() is exact this far back (older: empty baseline)


@dataclass
class Finding:
    # "loss_outlier": the first outlier of a run (reported); "spike_confirmed": the run persisted (acted
    # on); "spike_healed": the run ended before persistence; "grad_norm_spike": early warning.
    kind: str
    step: int  # the step this finding is about (the current step)
    start_step: int  # first step of the run (== step for grad_norm_spike)
    value: float  # loss (or grad norm) at `step`
    baseline: float  # the center the value was compared with
    threshold: float  # the value above which it counted as an outlier (the hold level for spike_healed)

    def message(self) -> str:
        if self.kind == "loss_outlier":
            return (f"loss {self.value:.4g} at step {self.step} is above {self.threshold:.4g} "
                    f"(baseline {self.baseline:.4g}); a spike if it persists")
        if self.kind == "spike_confirmed":
            return (f"loss spike since step {self.start_step}: loss {self.value:.4g} at step {self.step} "
                    f"(baseline {self.baseline:.4g}, outlier above {self.threshold:.4g})")
        if self.kind == "spike_healed":
            return (f"loss back to {self.value:.4g} at step {self.step} (below {self.threshold:.4g}): the outlier "
                    f"from step {self.start_step} healed after {self.step - self.start_step} step(s)")
        return (f"grad norm {self.value:.4g} at step {self.step} is above {self.threshold:.4g} "
                f"(baseline {self.baseline:.4g}): early warning of a loss spike")


CENTER_WINDOW = 128
SPREAD = "mad"


def _robust_stats(values: deque, min_rel_spread: float) -> tuple[float, float]:
    vals = list(values)
    center = statistics.median(vals[-CENTER_WINDOW:])
    if SPREAD == "mad":
        mad = statistics.median(abs(v - center) for v in vals)
    else:
        d = [b - a for a, b in zip(vals, vals[1:])]
        md = statistics.median(d)
        mad = statistics.median(abs(x - md) for x in d) / math.sqrt(2)
    return center, max(_MAD_TO_SIGMA * mad, min_rel_spread * abs(center))


def _threshold(center: float, spread: float, sigmas: float, ratio: float) -> float:
    """The value above which a point is an outlier: center + sigmas * spread, or ratio * center if lower."""
    threshold = center + sigmas * spread
    return min(threshold, ratio * center) if center > 0 else threshold  # no ratio for a loss that can be negative


class SpikeDetector:
    """Findings from a stream of (step, loss, grad_norm); one per step, steps increasing."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self._reset(last_step=None)
        self._journal: deque[tuple[dict, list[tuple[int, float, float]]]] = deque([(self.state_dict(), [])])

    def _reset(self, last_step: int | None) -> None:
        self.last_step = last_step
        self._losses: deque[float] = deque(maxlen=self.cfg.window)  # the baseline
        self._grads: deque[float] = deque(maxlen=self.cfg.window)  # the grad norm's baseline
        # The current run: consecutive (step, loss) above the hold level, kept out of the baseline.
        # Before its first outlier (`outlier_step` None) it holds at most persistence - 1 steps.
        self._run: list[tuple[int, float]] = []
        self._outlier_step: int | None = None
        self._confirmed = False
        self._grad_run = False  # the previous grad norm was an outlier too: warn once per run

    def update(self, step: int, loss: float, grad_norm: float) -> list[Finding]:
        if not self.cfg.enabled:
            return []
        if self.last_step is not None and step <= self.last_step:
            self.rewind(step - 1)  # the step runs again (a restart that did not call rewind)
        if len(self._journal[-1][1]) >= _SNAPSHOT_EVERY:
            self._journal.append((self.state_dict(), []))
            # Drop the oldest snapshot once the next one is `history` updates back: that one suffices.
            while len(self._journal) > 1 and sum(len(u) for _, u in list(self._journal)[1:]) >= self.cfg.history:
                self._journal.popleft()
        self._journal[-1][1].append((step, loss, grad_norm))
        return self._observe(step, loss, grad_norm)

    def _observe(self, step: int, loss: float, grad_norm: float) -> list[Finding]:
        self.last_step = step
        findings: list[Finding] = []
        verdicts = step >= self.cfg.warmup_steps
        if math.isfinite(grad_norm):
            findings += self._observe_grad(step, grad_norm, verdicts and len(self._grads) >= self.cfg.min_baseline)
        if math.isfinite(loss):
            if verdicts and len(self._losses) >= self.cfg.min_baseline:
                findings += self._observe_loss(step, loss)
            else:
                self._losses.append(loss)
        return findings

    def _observe_loss(self, step: int, loss: float) -> list[Finding]:
        cfg = self.cfg
        center, spread = _robust_stats(self._losses, cfg.min_rel_spread)
        threshold = _threshold(center, spread, cfg.sigmas, cfg.ratio)
        outlier = loss > threshold or (center > 0 and loss >= cfg.ratio * center)
        hold_level = center + cfg.hold * (threshold - center)
        if not (outlier or loss > hold_level):
            return self._end_run(step, loss, center, hold_level)
        findings = []
        self._run.append((step, loss))
        if outlier and self._outlier_step is None:
            self._outlier_step = step
            findings.append(Finding("loss_outlier", step, self._run[0][0], loss, center, threshold))
        if self._outlier_step is None:
            if len(self._run) >= cfg.persistence:  # high, but no outlier yet: the oldest is just noise
                self._losses.append(self._run.pop(0)[1])
        elif not self._confirmed and step - self._outlier_step + 1 >= cfg.persistence:
            self._confirmed = True
            findings.append(Finding("spike_confirmed", step, self._run[0][0], loss, center, threshold))
        return findings

    def _end_run(self, step: int, loss: float, center: float, hold_level: float) -> list[Finding]:
        findings = []
        if self._outlier_step is None:
            self._losses.extend(v for _, v in self._run)  # never an outlier: ordinary noise after all
        elif not self._confirmed:
            findings.append(Finding("spike_healed", step, self._run[0][0], loss, center, hold_level))
        self._run, self._outlier_step, self._confirmed = [], None, False
        self._losses.append(loss)
        return findings

    def _observe_grad(self, step: int, grad_norm: float, verdicts: bool) -> list[Finding]:
        if verdicts:
            cfg = self.cfg
            center, spread = _robust_stats(self._grads, cfg.min_rel_spread)
            threshold = _threshold(center, spread, cfg.grad_sigmas, cfg.grad_ratio)
            if grad_norm > threshold or (center > 0 and grad_norm >= cfg.grad_ratio * center):
                warn = not self._grad_run
                self._grad_run = True
                return [Finding("grad_norm_spike", step, step, grad_norm, center, threshold)] if warn else []
        self._grad_run = False
        self._grads.append(grad_norm)
        return []

    def rewind(self, step: int) -> None:
        """Forgets every update after `step`: the state is what it was right after `step` was fed.
        Exact up to `history` updates back; further back the detector starts over with an empty
        baseline (verdicts resume once it holds min_baseline points)."""
        while self._journal and (self._journal[-1][0]["last_step"] or 0) > step:
            self._journal.pop()
        if not self._journal:
            self._reset(last_step=step)
            self._journal.append((self.state_dict(), []))
            return
        snapshot, updates = self._journal[-1]
        self._load(snapshot)
        updates[:] = [u for u in updates if u[0] <= step]
        for update in updates:
            self._observe(*update)

    def state_dict(self) -> dict:
        return {
            "last_step": self.last_step,
            "losses": list(self._losses),
            "grads": list(self._grads),
            "run": [list(item) for item in self._run],
            "outlier_step": self._outlier_step,
            "confirmed": self._confirmed,
            "grad_run": self._grad_run,
        }

    def load_state_dict(self, state: dict) -> None:
        self._load(state)
        self._journal = deque([(self.state_dict(), [])])  # rewind() is exact back to this state

    def _load(self, state: dict) -> None:
        self._reset(state["last_step"])
        self._losses.extend(state["losses"])
        self._grads.extend(state["grads"])
        self._run = [(int(s), float(v)) for s, v in state["run"]]
        self._outlier_step = state["outlier_step"]
        self._confirmed = state["confirmed"]
        self._grad_run = state["grad_run"]
