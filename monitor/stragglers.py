"""Straggler detection: which rank holds the others up, from each rank's busy time per sampled step.

A rank's busy time is its step time minus its communication time: a slow rank makes the others wait in
collectives, so their step times match its own and only the time outside communication tells them apart.
A rank's score is the fastest peer's median busy time over the window divided by its own (1.0 = on
par, 0.5 = twice as slow); peers are the ranks that do the same work (the same pipeline stage). Medians, so that one slow sample (a GC pause, a page fault) flags nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from keel.monitor.config_fields import at_least


@dataclass
class StragglerConfig:
    window: int = 5  # the last this many measured samples of each rank make its median
    threshold: float = 0.75  # a rank whose score falls below this is flagged
    min_samples: int = 3  # a rank gets no score before it has this many samples
    warmup_steps: int = 10  # steps not sampled: their one-time costs (allocation, first collectives) differ by rank
    # A flagged rank is reported again when its score falls below this fraction of the score it was
    # reported with: "twice as slow as when we told you" is news, the same slowness every step is not.
    escalation: float = 0.5

    def validate(self) -> None:
        """Raises ValueError, one line naming the field and the fix, for settings the tracker cannot work with."""
        at_least("stragglers.window", self.window, 1)
        if not 1 <= self.min_samples <= self.window:
            # Otherwise no rank would ever get a score, and the tracker would silently flag nothing.
            raise ValueError(f"stragglers.min_samples={self.min_samples}: must be between 1 and stragglers.window={self.window}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"stragglers.threshold={self.threshold}: must be in (0, 1]; 0.75 flags a rank 33% slower than the fastest")
        at_least("stragglers.warmup_steps", self.warmup_steps, 0)
        if not 0 < self.escalation < 1:
            raise ValueError(
                f"stragglers.escalation={self.escalation}: must be in (0, 1); 0.5 reports a flagged rank again once twice as slow"
            )


class StragglerTracker:
    """Scores per rank, fed one busy time per rank for each step where communication was measured."""

    def __init__(self, cfg: StragglerConfig, world: int, peers: Sequence[Sequence[int]] | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.world = world
        # Ranks compared with each other: those doing the same work. Pipeline stages differ in their
        # layers (the first embeds, the last computes the loss), so a rank is measured against the
        # fastest rank of its own stage, not of the whole job. Default: all ranks are peers.
        groups = peers or [range(world)]
        self._peers = {r: list(group) for group in groups for r in group}
        self._samples = [deque(maxlen=cfg.window) for _ in range(world)]
        self._flagged: dict[int, float] = {}  # rank -> the score it was last reported with

    def update(self, busy_s: Sequence[float]) -> list[tuple[int, float]]:
        """Add one step's busy times (NaN where a rank was not measured); returns the ranks newly below threshold.

        A flagged rank is reported again after its score has come back to the threshold or above, or
        when it has fallen below `escalation` times the score it was last reported with.
        """
        if len(busy_s) != self.world:
            raise ValueError(f"expected {self.world} busy times, one per rank, got {len(busy_s)}")
        for samples, busy in zip(self._samples, busy_s):
            # Not positive: the communication measured took the whole step, which says nothing about speed.
            if math.isfinite(busy) and busy > 0:
                samples.append(float(busy))
        newly = []
        for rank, score in enumerate(self.scores()):
            if math.isnan(score):
                continue
            if score >= self.cfg.threshold:
                self._flagged.pop(rank, None)
            elif rank not in self._flagged or score < self.cfg.escalation * self._flagged[rank]:
                self._flagged[rank] = score
                newly.append((rank, score))
        return newly

    def scores(self) -> list[float]:
        """The current score of each rank; NaN for a rank with fewer than min_samples samples."""
        medians = [statistics.median(s) if len(s) >= self.cfg.min_samples else math.nan for s in self._samples]
        scores = []
        for rank, median in enumerate(medians):
            fastest = min((medians[p] for p in self._peers[rank] if not math.isnan(medians[p])), default=math.nan)
            scores.append(fastest / median)
        return scores
