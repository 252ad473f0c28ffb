"""The loss-spike detector on loss series recorded from Keel's own runs (tests/data/loss_series/README.md
has the commands). Spikes are injected by multiplying the recorded loss, so every spike sits on the real
noise of a real run: warm-up, the fast early fall of the loss, and the cosine LR decay included. Real
spikes come from runs with Keel's `spike` fault (random-byte batches, LR surges) and from runs whose LR
is too high. The defaults were tuned on the four CLEAN series; the HELD_OUT ones measure them."""

from __future__ import annotations

import copy
import csv
import json
import math
from dataclasses import dataclass
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
# Held-out runs, recorded after the defaults were chosen and never used to choose them: another model
# preset, another corpus (Vim's documentation), batches of 4 and 32, other LR schedules.
HELD_OUT = (
    "heldout_seed5_small_vimdoc_lr1e-3_gbs4",  # the small preset; cosine decay to 0
    "heldout_seed6_tiny_vimdoc_lr3e-3_gbs32",  # 300 steps of warm-up; cosine decay to half the peak
    "heldout_seed7_tiny_seq64_lr2e-3_gbs4_const",  # sequences of 64 bytes; constant LR after 10 steps
)
# A held-out run again with Keel's `spike` fault (batches of random bytes, LR surges), and the run it
# repeats: the same batches, the same numbers up to the first fault.
FAULT_RUNS = {f"{name}_faults": name for name in HELD_OUT[1:]}
# A spike counts as found when it is confirmed within 10 steps of its first step.
FOLLOW = 11

Row = tuple[int, float, float]  # step, loss, grad_norm
# A spike as factors of the clean run's loss, one per step from its first step.
Profile = tuple[float, ...]


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


def injected(shape: str, peak: float) -> Profile:
    """A spike made by multiplying the loss."""
    return tuple(factor(shape, peak, k) for k in range(FOLLOW))


def recorded(fault_run: str, first: int) -> Profile:
    """The real spike of `fault_run` from step `first` on: its loss over the loss of the clean run it
    repeats, which read the same batches."""
    rows, clean = series(fault_run)[first - 1 :], series(FAULT_RUNS[fault_run])[first - 1 :]
    return tuple(r[1] / c[1] for r, c in zip(rows[:FOLLOW], clean))


# The scans below feed the loss alone (a NaN grad norm is ignored): the loss verdicts never read the grad
# norm (test_loss_verdicts_do_not_read_the_grad_norm), and its statistics are half the cost of a step.
@lru_cache
def loss_states(name: str) -> tuple[dict, ...]:
    """A default detector's state after each step of the series' losses: index s, after steps 1..s."""
    detector = SpikeDetector(SpikeConfig())
    states = [detector.state_dict()]
    for step, loss, _ in series(name):
        detector.update(step, loss, math.nan)
        states.append(detector.state_dict())
    return tuple(states)


def confirmation(name: str, first: int, profile: Profile) -> tuple[int, int] | None:
    """(step, start_step) of the confirmation of the spike `profile` put at step `first` of the series,
    both counted from `first`; None when it is not confirmed while the profile lasts."""
    detector = SpikeDetector(SpikeConfig())
    detector.load_state_dict(loss_states(name)[first - 1])
    for (step, loss, _), loss_factor in zip(series(name)[first - 1 :], profile):
        for f in detector.update(step, loss * loss_factor, math.nan):
            if f.kind == "spike_confirmed":
                return f.step - first, f.start_step - first
    return None


@dataclass(frozen=True)
class Scan:
    """The spike put at each step from the detector's warm-up on, leaving room for the whole profile."""

    outcomes: tuple[tuple[int, int] | None, ...]  # confirmation() of each start

    @property
    def missed(self) -> float:
        return sum(o is None for o in self.outcomes) / len(self.outcomes)

    @property
    def late(self) -> float:
        """The share of starts confirmed with a start_step after the spike's first step."""
        return sum(o is not None and o[1] > 0 for o in self.outcomes) / len(self.outcomes)

    def latency(self, quantile: float) -> int:
        """Steps from the spike's first step to its confirmation, at this quantile of the confirmed."""
        latencies = sorted(o[0] for o in self.outcomes if o is not None)
        return latencies[math.ceil(quantile * len(latencies)) - 1]


@lru_cache
def scan(name: str, profile: Profile) -> Scan:
    starts = range(SpikeConfig().warmup_steps, len(series(name)) - len(profile) + 2)
    return Scan(tuple(confirmation(name, first, profile) for first in starts))


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


@pytest.mark.parametrize(
    ("name", "reported"),
    [
        (HELD_OUT[0], [("loss_outlier", 1098), ("spike_healed", 1098)]),  # a hard batch: 2.0x for one step
        (HELD_OUT[1], []),
        (HELD_OUT[2], [("loss_outlier", 1559), ("spike_healed", 1559)]),  # a hard batch: 2.1x for one step
    ],
)
def test_held_out_clean_runs_confirm_nothing(name, reported):
    findings = feed(SpikeDetector(SpikeConfig()), series(name))
    assert [(f.kind, f.start_step) for f in findings] == reported, "\n".join(f"{f.kind}: {f.message()}" for f in findings)


# A spike put at every start of each held-out run (1941 starts), measured as in docs/stability.md
# ("Held-out runs"), for the runs in HELD_OUT's order: the share of starts missed (not confirmed within
# 10 steps) and late (confirmed with a start_step after the spike's first step), in percent rounded up,
# and the 90th percentile of the latency (steps from the spike's first step to its confirmation).
INJECTED = {
    ("decay20", 2.0): [(4.9, 10.3, 4), (0, 0, 2), (1.2, 2.5, 3)],
    ("plateau", 2.0): [(0.5, 12.2, 4), (0, 0, 2), (0.1, 2.3, 3)],
    ("decay20", 3.0): [(0, 0.2, 2), (0, 0, 2), (0, 0, 2)],
    # The sensitivity below 2x.
    ("plateau", 1.8): [(7.8, 26.3, 6), (0, 0, 2), (1.9, 13.9, 5)],
    ("plateau", 1.6): [(41.3, 26.2, 8), (0, 0.3, 2), (20.6, 30.4, 8)],
    ("plateau", 1.4): [(83.2, 10.7, 9), (11.1, 19.6, 6), (80.1, 11.5, 9)],
    ("plateau", 1.2): [(98.8, 1.1, 10), (92.2, 2.4, 8), (99.1, 0.7, 9)],
}
# The same for the real spikes of the fault runs, each put at every start by its loss over the clean
# run's (fault run, the spike's first step: one step after an LR surge's first step).
RECORDED = {
    ("heldout_seed6_tiny_vimdoc_lr3e-3_gbs32_faults", 401): [(92.8, 1.0, 5), (21.1, 0.3, 3), (89.7, 0.9, 5)],  # LR x10 for a step
    ("heldout_seed6_tiny_vimdoc_lr3e-3_gbs32_faults", 1001): [(72.7, 26.2, 8), (0.7, 76.3, 6), (58.2, 40.0, 8)],  # LR x10 for 5 steps
    ("heldout_seed6_tiny_vimdoc_lr3e-3_gbs32_faults", 1601): [(13.5, 6.7, 4), (0, 0, 2), (3.6, 1.7, 3)],  # LR x30 for a step
    ("heldout_seed7_tiny_seq64_lr2e-3_gbs4_const_faults", 1601): [(0, 0.3, 2), (0, 0, 2), (0, 0, 2)],  # LR x100 for a step
}


def check_scan(result: Scan, missed: float, late: float, latency_p90: int) -> None:
    assert 100 * result.missed <= missed
    assert 100 * result.late <= late
    assert result.latency(0.9) <= latency_p90


@pytest.mark.parametrize("name", HELD_OUT)
@pytest.mark.parametrize(("shape", "peak"), [*INJECTED])
def test_injected_spike_at_every_start_of_held_out_runs(shape, peak, name):
    check_scan(scan(name, injected(shape, peak)), *INJECTED[shape, peak][HELD_OUT.index(name)])


@pytest.mark.parametrize("name", HELD_OUT)
@pytest.mark.parametrize(("fault_run", "first"), [*RECORDED])
def test_real_spike_at_every_start_of_held_out_runs(fault_run, first, name):
    check_scan(scan(name, recorded(fault_run, first)), *RECORDED[fault_run, first][HELD_OUT.index(name)])


@pytest.mark.parametrize(
    ("fault_run", "expected"),
    [
        (
            "heldout_seed6_tiny_vimdoc_lr3e-3_gbs32_faults",
            [
                # LR x10 at step 400: the loss 1.46x at 401, back to 1.1x by 408.
                ("loss_outlier", 401, 401),
                ("grad_norm_spike", 401, 402),
                ("spike_confirmed", 401, 403),
                # LR x3 at steps 700..704: the loss up to 1.10x, nothing found. LR x10 at steps
                # 1000..1004: the loss 1.21x at 1001, rising to 1.64x at 1005; found a step late.
                ("grad_norm_spike", 1001, 1002),
                ("loss_outlier", 1002, 1002),
                ("spike_confirmed", 1002, 1004),
                # Random bytes at step 1300: 8.2x for one step, which heals.
                ("loss_outlier", 1300, 1300),
                ("spike_healed", 1300, 1303),
                # LR x30 at step 1600: 1.9-2.0x for three steps.
                ("loss_outlier", 1601, 1601),
                ("grad_norm_spike", 1601, 1602),
                ("spike_confirmed", 1601, 1603),
            ],
        ),
        (
            "heldout_seed7_tiny_seq64_lr2e-3_gbs4_const_faults",
            [
                # Random bytes at step 300: 3.7x for one step, which heals; at steps 550..552: 4.3-5.3x.
                ("loss_outlier", 300, 300),
                ("spike_healed", 300, 303),
                ("loss_outlier", 550, 550),
                ("grad_norm_spike", 550, 551),
                ("spike_confirmed", 550, 552),
                # LR x10 at step 800 (the loss up to 1.10x) and at 1300..1304 (up to 1.29x): nothing
                # found. LR x30 at step 1050: 1.6x at 1051, 1.1-1.3x from 1060 on.
                ("loss_outlier", 1051, 1051),
                ("grad_norm_spike", 1051, 1052),
                ("spike_confirmed", 1051, 1053),
                # LR x100 at step 1600: 2.9x; at steps 1800..1802: 2.6-3.2x.
                ("loss_outlier", 1601, 1601),
                ("grad_norm_spike", 1601, 1602),
                ("spike_confirmed", 1601, 1603),
                ("loss_outlier", 1801, 1801),
                ("grad_norm_spike", 1801, 1802),
                ("spike_confirmed", 1801, 1803),
            ],
        ),
    ],
)
def test_real_spikes_from_data_and_lr_faults_on_held_out_runs(fault_run, expected):
    findings = feed(SpikeDetector(SpikeConfig()), series(fault_run))
    assert [(f.kind, f.start_step, f.step) for f in findings] == expected, [f.message() for f in findings]


@pytest.mark.parametrize("fault_run", [*FAULT_RUNS])
def test_loss_verdicts_do_not_read_the_grad_norm(fault_run):
    rows = series(fault_run)
    findings = [f for f in feed(SpikeDetector(SpikeConfig()), rows) if f.kind != "grad_norm_spike"]
    assert findings == feed(SpikeDetector(SpikeConfig()), [(s, loss, math.nan) for s, loss, _ in rows])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # A hard batch at step 563: the grad norm 4600x its center, the loss 1.45x for one step.
        (
            "unstable_seed8_small_seq128_lr1e-1_gbs4",
            [("grad_norm_spike", 135, 136), ("grad_norm_spike", 562, 563), ("loss_outlier", 563, 563), ("spike_healed", 563, 566)],
        ),
        # The loss stays near 3.0, no spike; the grad norm warns ten times (4-41x its center).
        ("unstable_seed8_tiny_lr1e-1", [("grad_norm_spike", s - 1, s) for s in (210, 921, 953, 970, 1152, 1619, 1781, 1875, 1940, 1971)]),
        # The loss drifts up by a quarter while the LR climbs past 3e-2: no spike.
        (
            "unstable_seed8_tiny_lr1e-1_warmup1500_noclip",
            [
                ("loss_outlier", 64, 64),
                ("spike_healed", 64, 67),
                ("grad_norm_spike", 782, 783),
                ("grad_norm_spike", 1258, 1259),
                ("grad_norm_spike", 1781, 1782),
            ],
        ),
    ],
)
def test_runs_whose_lr_is_too_high(name, expected):
    """LR 1e-1, 33-100x the tuning runs': no spike is confirmed, a real blip is reported and heals, and
    the grad norm warns now and then."""
    findings = feed(SpikeDetector(SpikeConfig()), series(name))
    assert [(f.kind, f.start_step, f.step) for f in findings] == expected, [f.message() for f in findings]


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
