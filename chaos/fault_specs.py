"""Fault specs: the faults there are, how one is written, and random fault plans. No torch.

A fault is written KIND@step=S[,rank=R][,steps=K][,FIELD=VALUE...] (see KINDS and FIELDS), on the
command line (`--fault nan@step=40,rank=1`), in the config (`chaos.faults`), drawn at random with a
mean time between faults (`chaos.mtbf_steps`), or requested while the run goes (`keel inject`, which
leaves a request in RUN_DIR/control/faults/). Rank defaults to every rank. The launcher parses every
spec before any worker starts, without importing torch; keel.chaos.faults injects them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

KINDS = {
    "nan": "NaN into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
    "inf": "Inf into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
    "spike": "a real loss spike: the batches of steps S..S+K-1 replaced by random bytes (data=1) and/or the LR times lr=F",
    "data_corrupt": "token ids out of the vocabulary in the batches of steps S..S+K-1 (a damaged data file)",
    "oom": "torch.OutOfMemoryError at the start of step S, and again each time it runs, while a micro-batch holds more than "
    "`rows` sequences (the most the rank's memory holds; real=1 on a GPU: a real over-allocation)",
    "hang": "the rank sleeps `seconds` before the step's first collective, while the others wait inside it",
    "deadlock": "a thread of the rank holds the GIL for `seconds`: no Python thread of the process runs",
    "crash": "the rank is killed (SIGKILL) at the start of step S",
    "segfault": "the rank reads address 0 (SIGSEGV) at the start of step S",
    "straggler": "the rank sleeps `ms` at the start of each of steps S..S+K-1",
    "late_collective": "the rank waits `ms` before each collective the trainer issues, at steps S..S+K-1",
    "ckpt_corrupt": "bytes flipped in a shard of the newest complete checkpoint, at the start of step S (by rank 0)",
}
# Which fields each kind takes besides step and steps.
_KIND_FIELDS = {
    "nan": ("rank", "into"),
    "inf": ("rank", "into"),
    "spike": ("lr", "data"),
    "data_corrupt": (),
    "oom": ("rank", "rows", "real"),
    "hang": ("rank", "seconds"),
    "deadlock": ("rank", "seconds"),
    "crash": ("rank",),
    "segfault": ("rank",),
    "straggler": ("rank", "ms"),
    "late_collective": ("rank", "ms"),
    "ckpt_corrupt": (),
}
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
        if key not in ("step", "steps") and key not in _KIND_FIELDS[kind]:
            takes = ", ".join(["step", "steps", *_KIND_FIELDS[kind]])
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


def random_faults(mtbf_steps: float, kinds: list[str], steps: int, world: int, seed: int) -> list[Fault]:
    """Faults at exponentially distributed intervals (mean `mtbf_steps`), each of a kind drawn from
    `kinds` on a rank drawn from the world. The same on every rank (seeded)."""
    rng, out, t = np.random.default_rng(seed), [], 0.0
    while True:
        t += rng.exponential(mtbf_steps)
        if math.ceil(t) > steps:
            return out
        kind = kinds[int(rng.integers(len(kinds)))]
        rank = int(rng.integers(world))
        out.append(parse_fault(f"{kind}@step={math.ceil(t)}" + (f",rank={rank}" if "rank" in _KIND_FIELDS[kind] else "")))
