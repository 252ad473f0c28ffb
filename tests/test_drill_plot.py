"""The drill plot shows what a user opens it for: the spike (every step thrown away) and the recovery."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from keel.chaos.report import figure
from keel.chaos.verdict import DrillResult
from keel.monitor.store import RunStore

FAULT, ROLLED_BACK_TO, DETECTED, STEPS = 60, 55, 62, 80


def _losses(steps: range, spike_from: int | None = None) -> dict[int, float]:
    rng = np.random.default_rng(0)
    losses = {s: 2.5 + 3.0 * np.exp(-s / 10) + float(rng.normal(0, 0.2)) for s in steps}
    return {s: (loss + 5.0 if spike_from is not None and s >= spike_from else loss) for s, loss in losses.items()}


def _store(run_dir, attempts: list[dict[int, float]]) -> None:
    with RunStore(run_dir) as store:
        for attempt, losses in enumerate(attempts):
            for step, loss in losses.items():
                store.write_step({"step": step, "attempt": attempt, "loss": loss, "step_time_s": 0.1})


def test_the_spike_drill_plot_draws_every_abandoned_step_in_view(tmp_path):
    # The spike drill's shape: losses of about 8 from the fault on, detected two steps later, rolled back.
    _store(tmp_path / "reference", [_losses(range(1, STEPS + 1))])
    spiked = _losses(range(1, DETECTED + 1), spike_from=FAULT)
    _store(tmp_path / "spike", [spiked, _losses(range(ROLLED_BACK_TO + 1, STEPS + 1))])
    result = DrillResult("spike", ["spike"], "pass", fault_step=FAULT, detected=True, detected_by="spike", detection_step=DETECTED,
                         detection_latency_s=0.2, recovered=True, recovered_step=ROLLED_BACK_TO + 1, time_to_recover_s=0.4,
                         run_dir=str(tmp_path / "spike"))  # fmt: skip
    fig = figure([result], tmp_path / "reference")
    try:
        [ax] = [a for a in fig.axes if a.get_title().startswith("spike")]
        [crosses] = [c for c in ax.collections if c.get_label().startswith("the run: steps thrown away")]
        drawn = {int(x): y for x, y in crosses.get_offsets()}
        thrown_away = {s: loss for s, loss in spiked.items() if s > ROLLED_BACK_TO}
        assert sorted(drawn) == sorted(thrown_away)
        low, high = ax.get_ylim()
        # At their own height: before, the spike was clipped to the top edge, under the in-panel legend.
        assert all(low <= drawn[s] == thrown_away[s] <= high for s in thrown_away), (drawn, (low, high))
        fig.canvas.draw()  # the legend sits outside the panel, never over the spike
        renderer = fig.canvas.get_renderer()
        legend = next(a.get_legend() for a in fig.axes if a.get_legend() is not None)
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    finally:
        plt.close(fig)
