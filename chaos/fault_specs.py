"""Fault specs: how a fault is written, and random fault plans. No torch.

A fault is written KIND@step=S[,rank=R][,steps=K][,FIELD=VALUE...] (the kinds are keel.chaos.kinds.KINDS,
the fields FIELDS), on the command line (`--fault nan@step=40,rank=1`), in the config (`chaos.faults`),
drawn at random with a mean time between faults (`chaos.mtbf_steps`), or requested while the run goes
(`keel inject`, which leaves a request in RUN_DIR/control/faults/). Rank defaults to every rank. The
launcher parses every spec before any worker starts, without importing torch; keel.chaos.faults injects them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from keel.chaos.kinds import KINDS
from keel.monitor.detectors import SpikeConfig

TARGETS = ("loss", "grad", "param")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    steps: int = 1  # how many consecutive steps it hits, from `step`
    seconds: int = 3600  # hang, deadlock: how long the rank is stuck
    ms: int = 200  # straggler, late_collective: the delay
    into: str = "loss"  # nan, inf: loss | grad | param
    lr: float = 0.0  # spike: multiply the LR by this (0: no LR surge)
    data: int = 1  # spike: 1 replaces the batches with random bytes, 0 leaves them
    rows: int = 1  # oom: the largest micro-batch (sequences) that fits; a larger one runs out of memory
    real: int = 0  # oom: 1 allocates more than the GPU holds instead of raising

    def __str__(self) -> str:
        """The canonical spec: parse_fault(str(f)) == f."""
        default = Fault(self.kind, self.step)
        extra = [
            f"{f.name}={getattr(self, f.name):g}" if f.name == "lr" else f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in ("kind", "step") and getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"{self.kind}@" + ",".join([f"step={self.step}", *extra])

    def hits(self, step: int, rank: int) -> bool:
        return self.step <= step < self.step + self.steps and self.rank in (None, rank)


FIELDS = tuple(f.name for f in fields(Fault) if f.name != "kind")
_SPEC_HELP = "write KIND@step=S[,rank=R][,steps=K][,FIELD=VALUE]"


def parse_fault(spec: str, default_step: int | None = None) -> Fault:
    """'nan@step=40,rank=1' -> Fault("nan", 40, 1). Raises ValueError, one line naming the problem and the fix."""
    kind, _, where = spec.strip().partition("@")
    if kind not in KINDS:
        raise ValueError(f"chaos.faults: unknown fault '{kind}' in '{spec}'; choose one of {list(KINDS)}")
    values: dict = {}
    for part in filter(None, where.split(",")):
        key, _, value = part.partition("=")
        if key not in FIELDS:
            raise ValueError(f"chaos.faults: unknown field '{key}' in '{spec}'; {_SPEC_HELP}")
        if key not in ("step", "steps") and key not in KINDS[kind].takes:
            takes = ", ".join(["step", "steps", *KINDS[kind].takes])
            raise ValueError(f"chaos.faults: '{key}' does not apply to {kind} in '{spec}'; {kind} takes {takes}")
        try:
            values[key] = value if key == "into" else float(value) if key == "lr" else int(value)
        except ValueError:
            raise ValueError(f"chaos.faults: bad value in '{part}' of '{spec}'; {key} is a number") from None
    if "step" not in values and default_step is None:
        raise ValueError(f"chaos.faults: '{spec}' has no step; {_SPEC_HELP}")
    values.setdefault("step", default_step)
    fault = Fault(kind, **values)
    if fault.step < 1 or fault.steps < 1 or (fault.rank is not None and fault.rank < 0):
        raise ValueError(f"chaos.faults: '{spec}': step and steps start at 1, rank at 0")
    if fault.into not in TARGETS:
        raise ValueError(f"chaos.faults: into={fault.into} in '{spec}'; choose one of {list(TARGETS)}")
    if kind == "spike" and not (fault.data or fault.lr > 0):
        raise ValueError(f"chaos.faults: '{spec}' injects nothing; keep data=1 or give lr=F (an LR surge)")
    if fault.real and not _gpu_available():
        raise ValueError(f"chaos.faults: '{spec}': real=1 over-allocates GPU memory and there is no GPU; drop real=1")
    return fault


def _gpu_available() -> bool:
    # Imported only here: every other spec parses without torch, which costs `keel train` more than the rest of its checks.
    import torch

    return torch.cuda.is_available()


def random_faults(
    mtbf_steps: float, kinds: list[str], steps: int, world: int, seed: int, spike: SpikeConfig, nonfinite_limit: int
) -> list[Fault]:
    """Faults at exponentially distributed intervals (mean `mtbf_steps`), each of a kind drawn from
    `kinds` on a rank drawn from the world, shaped by the run's own detector and recovery settings
    (`spike`, `nonfinite_limit`) so that each takes its recovery path to the end (see _random_fault).
    The same on every rank (seeded)."""
    rng, out, t = np.random.default_rng(seed), [], 0.0
    while True:
        t += rng.exponential(mtbf_steps)
        if math.ceil(t) > steps:
            return list(dict.fromkeys(out))  # two spikes moved to the same step are one
        kind = kinds[int(rng.integers(len(kinds)))]
        rank = int(rng.integers(world))
        out += _random_fault(kind, math.ceil(t), rank, rng, spike, nonfinite_limit)


def _random_fault(kind: str, step: int, rank: int, rng: np.random.Generator, spike: SpikeConfig, nonfinite_limit: int) -> list[Fault]:
    """A drawn fault, made to reach a recovery rather than only a blip: a one-step NaN is only skipped, a
    one-step spike heals, and a damaged checkpoint that nothing loads is replaced unseen."""
    if kind in ("nan", "inf"):
        # Into a drawn target. A parameter stays non-finite until the rollback restores it, so one step
        # suffices; a loss or a gradient is poisoned for as many steps in a row as trigger the rollback.
        into = TARGETS[int(rng.integers(len(TARGETS)))]
        return [Fault(kind, step, rank, steps=1 if into == "param" else nonfinite_limit, into=into)]
    if kind == "spike":
        # Random bytes for `persistence` steps are as many outliers in a row: a confirmed spike. The detector
        # judges nothing before its warm-up and its first baseline, so a spike drawn earlier starts there.
        first_judged = max(spike.warmup_steps, spike.min_baseline + 1)
        return [Fault(kind, max(step, first_judged), steps=spike.persistence)]
    then = [parse_fault(KINDS[kind].then.format(S=step, R=rank))] if KINDS[kind].then else []  # a ckpt_corrupt's crash
    return [Fault(kind, step, rank if "rank" in KINDS[kind].takes else None), *then]
