"""The loss-spike detector on loss series recorded from Keel's own runs (tests/data/loss_series/README.md
has the commands). Spikes are injected by multiplying the recorded loss, so every spike sits on the real
noise of a real run: warm-up, the fast early fall of the loss, and the cosine LR decay included."""

from __future__ import annotations

import copy
import csv
import json
import math
from functools import lru_cache
from pathlib import Path

import pytest

from keel.monitor.detectors import Finding, SpikeConfig, SpikeDetector

DATA = Path(__file__).parent / "data" / "loss_series"
# Clean runs of 2000 steps: 100 steps of LR warm-up, then cosine decay to a tenth of the peak.
CLEAN = ("seed1_lr3e-3_gbs8", "seed2_lr1e-3_gbs16", "seed3_lr1e-3_gbs8", "seed4_lr3e-3_gbs16")
# The run of seed1_lr3e-3_gbs8 again, with random-byte batches at step 600 and at steps 1200..1207.
CHAOS = "seed1_lr3e-3_gbs8_chaos-spikes"
# Where spikes start: just after the LR warm-up (the loss still falls fast), mid-run, and late in the
# decay (the LR at 13% of its peak).
POSITIONS = {"early": 110, "middle": 1000, "late": 1800}
PERSISTENCE = SpikeConfig().persistence

Row = tuple[int, float, float]  # step, loss, grad_norm


@lru_cache
def series(name: str) -> tuple[Row, ...]:
    with open(DATA / f"{name}.csv", newline="") as f:
        return tuple((int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(f))


def feed(detector: SpikeDetector, rows) -> list[Finding]:
    return [finding for step, loss, grad_norm in rows for finding in detector.update(step, loss, grad_norm)]


def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


@lru_cache
def _fed_before(name: str, step: int) -> SpikeDetector:
    detector = SpikeDetector(SpikeConfig())
    assert feed(detector, series(name)[: step - 1]) == []
    return detector


def fed_before(name: str, step: int) -> SpikeDetector:
    """A default detector that has seen the clean series up to step - 1 (a copy: tests may change it)."""
    return copy.deepcopy(_fed_before(name, step))


def factor(shape: str, peak: float, k: int) -> float:
    """The multiplier of the loss k steps into a spike: "plateau" stays at peak; "decayN" jumps to peak
    and falls back linearly to 1 over N steps."""
    if shape == "plateau":
        return peak
    length = int(shape.removeprefix("decay"))
    return 1 + (peak - 1) * max(0.0, 1 - k / length)


def spiked(rows, start: int, shape: str, peak: float, end: int | None = None) -> list[Row]:
    """rows from `start` on (to `end`, excluded), the loss multiplied by the spike's factor."""
    return [(s, loss * factor(shape, peak, s - start), g) for s, loss, g in rows if s >= start and (end is None or s < end)]


@pytest.mark.parametrize("name", [*CLEAN])
def test_clean_runs_raise_nothing(name):
    rows = series(name)
    assert len(rows) >= 2000 and [r[0] for r in rows] == list(range(1, len(rows) + 1))
    findings = feed(SpikeDetector(SpikeConfig()), rows)
    assert findings == [], "\n".join(f"{f.kind}: {f.message()}" for f in findings)


@pytest.mark.parametrize("shape", ["decay20", "decay60", "plateau"])
@pytest.mark.parametrize("peak", [2.0, 3.0, 10.0])
@pytest.mark.parametrize("where", [*POSITIONS])
@pytest.mark.parametrize("name", [*CLEAN])
def test_injected_spike_is_confirmed_within_10_steps(name, where, peak, shape):
    start = POSITIONS[where]
    findings = feed(fed_before(name, start), spiked(series(name), start, shape, peak, end=start + 150))
    confirmed = [f for f in findings if f.kind == "spike_confirmed"]
    trail = "\n".join(f"{f.kind}: {f.message()}" for f in findings)
    assert confirmed, f"never confirmed:\n{trail}"
    assert confirmed[0].start_step == start, trail
    assert confirmed[0].step - start <= 10, trail
    # Reported first, from the same start; confirmed once, not again each step while it lasts.
    assert findings[0].kind == "loss_outlier" and findings[0].start_step == start, trail
    assert len(confirmed) == 1, trail


@pytest.mark.parametrize("peak", [2.0, 3.0, 10.0])
@pytest.mark.parametrize("length", range(1, PERSISTENCE))
@pytest.mark.parametrize("name", [*CLEAN])
def test_short_blip_is_reported_and_heals(name, length, peak):
    start = POSITIONS["middle"]
    findings = feed(
        fed_before(name, start),
        spiked(series(name), start, "plateau", peak, end=start + length)
        + [r for r in series(name) if start + length <= r[0] < start + 100],
    )
    assert kinds(findings) == ["loss_outlier", "spike_healed"], [f.message() for f in findings]
    assert [f.start_step for f in findings] == [start, start]
    assert findings[1].step == start + length - 1 + PERSISTENCE  # back below the hold level for `persistence` steps


def test_outliers_stay_out_of_the_baseline():
    """A plateau at 3x for almost five windows stays one confirmed spike, and none of its points enters
    the baseline: when the loss comes back, the baseline is the level from before the plateau, so a new
    3x spike ten steps later is a spike again (had the plateau entered the baseline, it would be 3x too)."""
    rows = series(CLEAN[0])
    first, back, second = 500, 1100, 1110
    detector = fed_before(CLEAN[0], first)
    plateau = spiked(rows, first, "plateau", 3.0, end=back)
    findings = feed(detector, plateau)
    assert [(f.kind, f.start_step) for f in findings] == [("loss_outlier", first), ("spike_confirmed", first)]
    assert set(detector.state_dict()["losses"]).isdisjoint(loss for _, loss, _ in plateau)
    findings = feed(detector, [r for r in rows if back <= r[0] < second] + spiked(rows, second, "plateau", 3.0, end=second + 30))
    assert [(f.kind, f.start_step) for f in findings] == [("loss_outlier", second), ("spike_confirmed", second)]


def test_warmup_is_exempt():
    cfg = SpikeConfig()
    rows = series(CLEAN[0])
    jump = [
        (s, loss * (5.0 if 30 <= s < cfg.warmup_steps else 1.0), g * (5.0 if 30 <= s < cfg.warmup_steps else 1.0))
        for s, loss, g in rows[:300]
    ]
    assert feed(SpikeDetector(cfg), jump) == []


def test_real_spikes_from_chaos_faults():
    """Keel's `spike` fault (random-byte batches): one poisoned batch heals, eight are a spike."""
    findings = feed(SpikeDetector(SpikeConfig()), series(CHAOS))
    assert [(f.kind, f.start_step) for f in findings] == [
        ("loss_outlier", 600),
        ("spike_healed", 600),
        ("loss_outlier", 1200),
        ("grad_norm_spike", 1200),
        ("spike_confirmed", 1200),
    ], [f.message() for f in findings]
    assert findings[-1].step == 1202


def test_grad_norm_jump_is_an_early_warning_only():
    start = POSITIONS["middle"]
    rows = [(s, loss, g * (10.0 if start <= s < start + 5 else 1.0)) for s, loss, g in series(CLEAN[0]) if start <= s < start + 100]
    findings = feed(fed_before(CLEAN[0], start), rows)
    assert [(f.kind, f.step, f.start_step) for f in findings] == [("grad_norm_spike", start + 1, start)]
    assert "grad norm" in findings[0].message()


def test_single_grad_norm_jump_warns_only_with_grad_persistence_1():
    """Clean runs have single-step grad-norm jumps of up to 15x (hard batches); by default a warning
    needs two outliers in a row. grad_persistence = 1 warns on every single one, these included."""
    start = POSITIONS["middle"]
    rows = [(s, loss, g * (10.0 if s == start else 1.0)) for s, loss, g in series(CLEAN[0]) if s < start + 50]
    assert feed(SpikeDetector(SpikeConfig()), rows) == []
    findings = feed(SpikeDetector(SpikeConfig(grad_persistence=1)), rows)
    assert ("grad_norm_spike", start, start) in [(f.kind, f.step, f.start_step) for f in findings]
    assert set(kinds(findings)) == {"grad_norm_spike"}


def _spiky_run() -> list[Row]:
    """A clean run with a confirmed spike at 1200 and a blip at 1300, so states cut anywhere differ."""
    rows = series(CLEAN[1])
    return (
        [r for r in rows if r[0] < 1200]
        + spiked(rows, 1200, "plateau", 3.0, end=1260)
        + [r for r in rows if 1260 <= r[0] < 1300]
        + spiked(rows, 1300, "plateau", 4.0, end=1301)
        + [r for r in rows if r[0] >= 1301]
    )


def _other_data(after: int) -> list[Row]:
    """What a rerun after a rollback feeds: other batches (another run's losses), with a spike of its own."""
    rows = [r for r in series(CLEAN[3]) if r[0] > after]
    return rows[:40] + spiked(rows, rows[40][0], "decay20", 3.0, end=rows[0][0] + 300)


@pytest.mark.parametrize("to_step", [1195, 1201, 1203, 1262, 1302, 900, 300])
def test_rewind_then_other_data_gives_the_verdicts_of_a_fresh_detector(to_step):
    run = _spiky_run()
    detector = SpikeDetector(SpikeConfig())
    feed(detector, [r for r in run if r[0] <= 1500])
    detector.rewind(to_step)
    fresh = SpikeDetector(SpikeConfig())
    feed(fresh, [r for r in run if r[0] <= to_step])
    assert detector.state_dict() == fresh.state_dict()
    other = _other_data(to_step)
    assert feed(detector, other) == feed(fresh, other)


def test_a_repeated_step_rewinds_by_itself():
    run = _spiky_run()
    detector, rewound = SpikeDetector(SpikeConfig()), SpikeDetector(SpikeConfig())
    for d in (detector, rewound):
        feed(d, [r for r in run if r[0] <= 1400])
    rewound.rewind(1150)
    other = _other_data(1150)
    assert feed(detector, other) == feed(rewound, other)


def test_rewind_beyond_history_starts_over():
    cfg = SpikeConfig(history=300)
    run = _spiky_run()
    detector = SpikeDetector(cfg)
    feed(detector, [r for r in run if r[0] <= 1500])
    detector.rewind(1000)  # 500 updates back: more than `history`
    other = _other_data(1000)
    assert feed(detector, other) == feed(SpikeDetector(cfg), other)


@pytest.mark.parametrize("cut", [40, 1000, 1200, 1201, 1202, 1230, 1262, 1300, 1301])
def test_state_dict_round_trip_through_json(cut):
    run = _spiky_run()
    detector = SpikeDetector(SpikeConfig())
    feed(detector, [r for r in run if r[0] <= cut])
    restored = SpikeDetector(SpikeConfig())
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    rest = [r for r in run if r[0] > cut]
    assert feed(restored, rest) == feed(detector, rest)
    assert restored.state_dict() == detector.state_dict()


def test_non_finite_steps_are_ignored():
    """A step whose loss and grad norm are NaN or Inf (the non-finite guard skips it) changes nothing,
    not even inside a spike."""
    start = POSITIONS["middle"]
    rows = spiked(series(CLEAN[0]), start, "plateau", 3.0, end=start + 20)
    holes = [(s, math.nan, math.inf) if s % 3 == 0 else (s, loss, g) for s, loss, g in rows]
    with_holes, without = fed_before(CLEAN[0], start), fed_before(CLEAN[0], start)
    found = feed(with_holes, holes)
    assert found == feed(without, [r for r in holes if r[0] % 3])
    assert kinds(found) == ["loss_outlier", "spike_confirmed"]
    assert {**with_holes.state_dict(), "last_step": None} == {**without.state_dict(), "last_step": None}


def test_disabled_detector_finds_nothing():
    rows = [r for r in series(CLEAN[0]) if r[0] < 1000] + spiked(series(CLEAN[0]), 1000, "plateau", 10.0)
    assert feed(SpikeDetector(SpikeConfig(enabled=False)), rows) == []


def test_messages_are_one_line():
    findings = feed(SpikeDetector(SpikeConfig()), series(CHAOS))
    for f in findings:
        assert "\n" not in f.message() and str(f.step) in f.message()
