"""Fault plans and the injectors the trainer calls at its hook points.

A fault is addressed as KIND@step=S,rank=R (rank defaults to all ranks), in a plan given on the
command line (`--fault nan@step=40,rank=1`) or in the config (`chaos.faults`). Injectors are plain
functions of the values the trainer hands them; they do not patch torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Faults that corrupt the loss before backward, so the gradients are poisoned as well.
LOSS_FAULTS = {"nan": float("nan"), "inf": float("inf")}
KINDS = tuple(LOSS_FAULTS)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    def __str__(self) -> str:
        return f"{self.kind}@step={self.step}" + ("" if self.rank is None else f",rank={self.rank}")


def parse_fault(spec: str) -> Fault:
    """'nan@step=40,rank=1' -> Fault("nan", 40, 1). Raises ValueError, one line naming the problem."""
    kind, _, where = spec.partition("@")
    if kind not in KINDS:
        raise ValueError(f"chaos.faults: unknown fault '{kind}' in '{spec}'; choose one of {list(KINDS)}")
    fields: dict[str, int] = {}
    for part in filter(None, where.split(",")):
        key, _, value = part.partition("=")
        if key not in ("step", "rank") or not value.isdigit():
            raise ValueError(f"chaos.faults: bad '{part}' in '{spec}'; write KIND@step=S[,rank=R] with whole numbers")
        fields[key] = int(value)
    if "step" not in fields:
        raise ValueError(f"chaos.faults: '{spec}' has no step; write KIND@step=S[,rank=R]")
    return Fault(kind, fields["step"], fields.get("rank"))


class FaultPlan:
    """The faults of one run, as seen by one rank. The trainer calls `begin_step` and the hooks."""

    def __init__(self, specs: list[str], rank: int):
        self.faults = [parse_fault(s) for s in specs]
        self.rank = rank
        self.step = 0
        self.fired: list[Fault] = []  # this step's injected faults, for the trainer to record

    def begin_step(self, step: int) -> None:
        self.step = step
        self.fired = []

    def _due(self, kinds) -> list[Fault]:
        return [f for f in self.faults if f.kind in kinds and f.step == self.step and f.rank in (None, self.rank)]

    def corrupt_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook on each micro-batch's loss before backward: a nan/inf fault multiplies it in."""
        for fault in self._due(LOSS_FAULTS):
            loss = loss * LOSS_FAULTS[fault.kind]
            if fault not in self.fired:
                self.fired.append(fault)
        return loss
