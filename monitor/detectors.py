"""The loss-spike detector: tells a loss spike worth a rollback from the noise of an ordinary run.

The trainer feeds it each step's agreed loss and global grad norm; it answers with findings. A loss is
an outlier when it stands far above a robust baseline of recent losses, so neither the noise of a
small batch nor the fall of the loss early in training moves it much. One outlier is only reported:
a blip that heals by itself is no reason to throw work away. A spike is confirmed, once per run of
outliers, when the loss stays up for `persistence` steps; that is what the trainer acts on. Points of
a run of outliers never enter the baseline, so a plateau stays a spike instead of becoming the new
normal. A grad norm that stays high is reported as an early warning only.

A plain object without torch: every rank runs its own copy on the same agreed numbers and reaches the
same verdicts. docs/stability.md explains each threshold and the measurements behind its default.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from keel.monitor.config_fields import at_least

# 1.4826 * MAD estimates the standard deviation of normally distributed noise.
_MAD_TO_SIGMA = 1.4826
# A snapshot of the state every this many updates: rewind() replays at most this many from one.
_SNAPSHOT_EVERY = 128


@dataclass
class SpikeConfig:
    enabled: bool = True  # false: no detector at all (no findings, no rollback on spikes)
    window: int = 128  # steps; the baseline is the last `window` finite losses that were not outliers
    # A loss is an outlier when loss > center + sigmas * spread, or loss >= ratio * center. center is
    # the median of the newest center_window points of the baseline; spread is the noise's robust
    # standard deviation over the whole baseline (from the median absolute deviation of step-to-step
    # differences), at least min_rel_spread * center.
    center_window: int = 32  # steps; short enough to follow the fast fall of the loss early in training
    sigmas: float = 6.0  # robust standard deviations above the center
    ratio: float = 2.0  # multiple of the center; flags a doubling even while the spread is wide
    min_rel_spread: float = 0.02  # fraction of the center: the smallest spread (6 sigmas >= +12% then)
    # A run of outliers starts at an outlier, together with the steps just before it that were already
    # above the hold level, center + hold * (threshold - center) (at most persistence - 1 of them).
    hold: float = 0.5  # fraction of the way from the center to the threshold; 1: only outliers count
    # The run is a confirmed spike once `persistence` of its steps, from the first outlier on, were above
    # the hold level. Before that it ends (healed) after `persistence` steps in a row below the hold
    # level; once confirmed, after `persistence` steps in a row at or below the center.
    persistence: int = 3  # steps
    warmup_steps: int = 50  # no verdicts before this step (the baseline still fills)
    min_baseline: int = 16  # no verdicts until the baseline holds this many points
    # Grad-norm early warning: the same test on the grad norm, with its own baseline; it warns when
    # grad_persistence grad norms in a row are outliers (1: every single jump warns).
    grad_sigmas: float = 12.0  # robust standard deviations of the grad norm above its center
    grad_ratio: float = 4.0  # multiple of the grad norm's center
    grad_persistence: int = 2  # grad-norm outliers in a row that make a warning
    history: int = 10000  # updates; rewind() is exact this far back (further: from an empty baseline)

    def validate(self) -> None:
        """Raises ValueError, one line naming the field and the fix, for settings the detector cannot work with."""
        at_least("spike.window", self.window, 2)
        at_least("spike.min_baseline", self.min_baseline, 2)
        if self.min_baseline > self.window:
            raise ValueError(
                f"spike.min_baseline={self.min_baseline} is larger than spike.window={self.window}; lower it or widen the window"
            )
        at_least("spike.persistence", self.persistence, 1)
        at_least("spike.grad_persistence", self.grad_persistence, 1)
        at_least("spike.min_rel_spread", self.min_rel_spread, 0)
        at_least("spike.history", self.history, 0)
        if not 1 <= self.center_window <= self.window:
            raise ValueError(f"spike.center_window={self.center_window}: must be between 1 and spike.window={self.window}")
        if not 0 <= self.hold <= 1:
            raise ValueError(f"spike.hold={self.hold}: must be in [0, 1] (a fraction of the way from the center to the threshold)")
        at_least("spike.warmup_steps", self.warmup_steps, 0)
        for name in ("sigmas", "grad_sigmas"):
            if not getattr(self, name) > 0:
                raise ValueError(f"spike.{name}={getattr(self, name)}: must be positive")
        for name in ("ratio", "grad_ratio"):
            if not getattr(self, name) > 1:
                raise ValueError(f"spike.{name}={getattr(self, name)}: must be above 1 (a multiple of the baseline)")


@dataclass
class Finding:
    # "loss_outlier": the first outlier of a run (reported); "spike_confirmed": the run persisted (acted
    # on); "spike_healed": the run ended before persistence; "grad_norm_spike": early warning.
    kind: str
    step: int  # the step this finding is about (the current step)
    start_step: int  # first step of the run (for grad_norm_spike: of the run of grad-norm outliers)
    value: float  # loss (or grad norm) at `step`
    baseline: float  # the center the value was compared with
    threshold: float  # the value above which it counted as an outlier (the hold level for spike_healed)

    def message(self) -> str:
        if self.kind == "loss_outlier":
            return (
                f"loss {self.value:.4g} at step {self.step} is above {self.threshold:.4g} "
                f"(baseline {self.baseline:.4g}); a spike if it persists"
            )
        if self.kind == "spike_confirmed":
            return (
                f"loss spike since step {self.start_step}: loss {self.value:.4g} at step {self.step} "
                f"(baseline {self.baseline:.4g}, outlier above {self.threshold:.4g})"
            )
        if self.kind == "spike_healed":
            return (
                f"loss back below {self.threshold:.4g} (baseline {self.baseline:.4g}), {self.value:.4g} at step "
                f"{self.step}: the outlier run from step {self.start_step} healed"
            )
        return (
            f"grad norm {self.value:.4g} at step {self.step} is above {self.threshold:.4g} "
            f"(baseline {self.baseline:.4g}) since step {self.start_step}: early warning of a loss spike"
        )


def _robust_stats(values: deque[float], center_window: int, min_rel_spread: float) -> tuple[float, float]:
    """(center, spread) of a baseline: the median of its newest `center_window` points, and the noise's
    standard deviation estimated from the step-to-step differences of all of them. Early in training
    the loss falls fast: the median of a whole window then lags far above the loss, and deviations from
    it would count the fall as noise; the differences do not see the fall."""
    vals = list(values)
    center = statistics.median(vals[-center_window:])
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    mid = statistics.median(diffs)
    # A difference of two independent noisy points has sqrt(2) times their standard deviation.
    spread = _MAD_TO_SIGMA * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)
    return center, max(spread, min_rel_spread * abs(center))


def _threshold(center: float, spread: float, sigmas: float, ratio: float) -> float:
    """The value above which a point is an outlier: center + sigmas * spread, or ratio * center if lower."""
    threshold = center + sigmas * spread
    return min(threshold, ratio * center) if center > 0 else threshold  # no ratio for a center <= 0


class SpikeDetector:
    """Findings from a stream of (step, loss, grad_norm), one update per step, steps increasing."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self._reset(last_step=None)
        # For rewind(): snapshots of the state, each with the updates fed after it, oldest first.
        self._journal: deque[tuple[dict, list[tuple[int, float, float]]]] = deque([(self.state_dict(), [])])

    def _reset(self, last_step: int | None) -> None:
        self.last_step = last_step
        self._losses: deque[float] = deque(maxlen=self.cfg.window)  # the baseline
        self._grads: deque[float] = deque(maxlen=self.cfg.window)  # the grad norm's baseline
        # Steps above the hold level with no outlier yet (at most persistence - 1), out of the baseline
        # until it is clear whether they begin a run of outliers.
        self._pending: list[tuple[int, float]] = []
        self._start: int | None = None  # first step of the current run of outliers; None: no run
        self._high = 0  # the run's steps above the hold level, from its first outlier on
        self._back = 0  # steps in a row the run has been back (see _observe_loss)
        self._confirmed = False  # the run was confirmed as a spike
        self._grad_start = 0  # first step of the current run of grad-norm outliers ...
        self._grad_count = 0  # ... and its length (0: no run)

    def update(self, step: int, loss: float, grad_norm: float) -> list[Finding]:
        """Findings of this step. A non-finite loss or grad norm is ignored (the non-finite guard's job)."""
        if not self.cfg.enabled:
            return []
        if self.last_step is not None and step <= self.last_step:
            self.rewind(step - 1)  # the step runs again: a restart that did not call rewind()
        if len(self._journal[-1][1]) >= _SNAPSHOT_EVERY:
            self._journal.append((self.state_dict(), []))
            # The oldest snapshot goes once the next one is `history` updates back: that one suffices.
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
        center, spread = _robust_stats(self._losses, cfg.center_window, cfg.min_rel_spread)
        threshold = _threshold(center, spread, cfg.sigmas, cfg.ratio)
        outlier = loss > threshold or (center > 0 and loss >= cfg.ratio * center)
        hold_level = center + cfg.hold * (threshold - center)
        high = outlier or loss > hold_level
        findings = []
        if self._start is None:
            if not outlier:
                if not high:
                    self._losses.extend(v for _, v in self._pending)  # never an outlier: ordinary noise
                    self._pending = []
                    self._losses.append(loss)
                else:
                    self._pending.append((step, loss))
                    if len(self._pending) >= cfg.persistence:  # high for a while, no outlier: the oldest was noise
                        self._losses.append(self._pending.pop(0)[1])
                return []
            # The run starts with the high steps just before this outlier; they stay out of the baseline.
            self._start = self._pending[0][0] if self._pending else step
            self._pending = []
            self._high, self._back, self._confirmed = 0, 0, False
            findings.append(Finding("loss_outlier", step, self._start, loss, center, threshold))
        elif not high:
            # One low step amid a noisy spike must not end it (a healed run and a new one, or a second
            # confirmation of the same plateau): a run ends after `persistence` steps in a row below
            # the hold level, a confirmed one only after as many at or below the center (the tail of a
            # decaying spike is no new spike).
            self._losses.append(loss)
            back = loss <= center if self._confirmed else True
            self._back = self._back + 1 if back else 0
            if self._back < cfg.persistence:
                return []
            start, self._start = self._start, None
            return [] if self._confirmed else [Finding("spike_healed", step, start, loss, center, hold_level)]
        self._back = 0
        self._high += 1
        if not self._confirmed and self._high >= cfg.persistence:
            self._confirmed = True
            findings.append(Finding("spike_confirmed", step, self._start, loss, center, threshold))
        return findings

    def _observe_grad(self, step: int, grad_norm: float, verdicts: bool) -> list[Finding]:
        if verdicts:
            cfg = self.cfg
            center, spread = _robust_stats(self._grads, cfg.window, cfg.min_rel_spread)
            threshold = _threshold(center, spread, cfg.grad_sigmas, cfg.grad_ratio)
            if grad_norm > threshold or (center > 0 and grad_norm >= cfg.grad_ratio * center):
                if self._grad_count == 0:
                    self._grad_start = step
                self._grad_count += 1
                if self._grad_count == cfg.grad_persistence:  # once per run
                    return [Finding("grad_norm_spike", step, self._grad_start, grad_norm, center, threshold)]
                return []
        self._grad_count = 0
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
            "pending": [list(item) for item in self._pending],
            "start": self._start,
            "high": self._high,
            "back": self._back,
            "confirmed": self._confirmed,
            "grad_start": self._grad_start,
            "grad_count": self._grad_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self._load(state)
        self._journal = deque([(self.state_dict(), [])])  # rewind() is exact back to this state

    def _load(self, state: dict) -> None:
        self._reset(state["last_step"])
        self._losses.extend(state["losses"])
        self._grads.extend(state["grads"])
        self._pending = [(int(s), float(v)) for s, v in state["pending"]]
        self._start = state["start"]
        self._high = state["high"]
        self._back = state["back"]
        self._confirmed = state["confirmed"]
        self._grad_start = state["grad_start"]
        self._grad_count = state["grad_count"]
