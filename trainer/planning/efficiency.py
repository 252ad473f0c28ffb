"""The compute efficiency the planner and `keel estimate` assume: the share of a GPU's dense bf16 peak a
training step's compute reaches where it waits for nothing (no exposed communication, no pipeline bubble),
per GPU generation and model size, calibrated on published runs.

Each calibration point is a published run (keel.trainer.planning.published, `calibrates=True`) put through
the planner on its own published layout: the efficiency at which the planner's speed equals the published
one (CURVES). Between a curve's points the efficiency follows the logarithm of the parameter count; outside them it
stays at the nearest point's (bigger models multiply bigger matrices, which run nearer the peak, until they
do not). A GPU kind borrows its generation's curve, and says so; one without a curve falls back to
FALLBACK_EFFICIENCY. docs/planning.md has the table; `python bench/plan_published.py` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FALLBACK_EFFICIENCY = 0.40  # a GPU kind nobody has published for, nor its generation
# GPU kind (keel.trainer.planning.gpus) -> the curve it uses: the same tensor cores, the same share of their peak.
GENERATION = {kind: "H100" for kind in ("H100 SXM", "H100", "H100 NVL", "H100 PCIe", "H200", "H20")} | {"A100": "A100", "A100 PCIe": "A100"}


@dataclass(frozen=True)
class CalibrationPoint:
    params: float
    efficiency: float
    source: str  # the published run's name


# Each curve's points, fewest parameters first: (parameters, efficiency, the published run). They are what
# keel.trainer.planning.published.efficiency_for gives the runs marked `calibrates` (to 3 decimals), kept here so
# that `keel plan` and `keel estimate` start at once: tests/test_planner_published.py recomputes them, and
# `python bench/plan_published.py` prints them.
CURVES: dict[str, tuple[CalibrationPoint, ...]] = {
    "H100": (
        CalibrationPoint(1_751_222_272, 0.410, "Megatron-Core GPT 1.7B"),
        CalibrationPoint(16_106_526_720, 0.490, "Megatron-Core GPT 16B"),
        CalibrationPoint(461_444_696_064, 0.507, "Megatron-Core GPT 462B"),
    ),
    "H100 at 500 W, eager PyTorch (TorchTitan)": (CalibrationPoint(8_030_261_248, 0.400, "TorchTitan Llama 3.1 8B, 8 GPUs"),),
    "A100": (CalibrationPoint(176_361_773_056, 0.579, "BLOOM 176B"),),
}


def curve_efficiency(curve: str, params: float) -> tuple[float, str]:
    """(compute efficiency, where it came from) on the named curve for a model of `params` parameters."""
    points = CURVES[curve]
    if params <= points[0].params or params >= points[-1].params:
        nearest = points[0] if params <= points[0].params else points[-1]
        return nearest.efficiency, f"the {curve} curve at {nearest.source}"
    low, high = next((a, b) for a, b in zip(points, points[1:]) if a.params <= params <= b.params)
    at = math.log(params / low.params) / math.log(high.params / low.params)
    return low.efficiency + at * (high.efficiency - low.efficiency), f"the {curve} curve between {low.source} and {high.source}"


def calibrated_efficiency(kind: str | None, params: float) -> tuple[float, str]:
    """(compute efficiency, where it came from) for a model of `params` parameters on `kind` GPUs."""
    curve = GENERATION.get(kind or "")
    if curve is None:
        return FALLBACK_EFFICIENCY, f"no published run on {kind or 'this GPU'}: {FALLBACK_EFFICIENCY:.0%} assumed; set --compute-efficiency"
    return curve_efficiency(curve, params)
