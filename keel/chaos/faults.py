"""Fault plans and the injectors the trainer calls at its hook points.

A fault is addressed as KIND@step=S[,rank=R][,steps=K][,seconds=T][,ms=M] (rank defaults to all ranks), in a
plan given on the command line (`--fault nan@step=40,rank=1`) or in the config (`chaos.faults`).
Injectors are plain functions of the values the trainer hands them; they do not patch torch.

A fault fires once: a step that runs again after a rollback or a restart does not fire it again (a
real transient fault does not come back either). The firing rank leaves a marker in RUN_DIR/chaos/
before it acts, so even a fault that kills the process is not repeated after torchrun restarts it.
Data faults are the exception: `spike` poisons batches, so it fires whenever those batches are read,
and only skipping them gets rid of it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Faults that corrupt the loss before backward, so the gradients are poisoned as well.
LOSS_FAULTS = {"nan": float("nan"), "inf": float("inf")}
# Faults that hit the process at the start of a step, before its first collective.
PROCESS_FAULTS = ("crash", "hang", "oom")
# Faults that slow a rank down for `steps` steps from `step`: it sleeps `ms` milliseconds at each step start.
SLOW_FAULTS = ("straggler",)
# Data faults: `spike` replaces the batches read at steps S..S+K-1 (steps=K, default 1) with random
# bytes, which gives a real loss spike through the ordinary forward and backward.
DATA_FAULTS = ("spike",)
KINDS = (*LOSS_FAULTS, *PROCESS_FAULTS, *SLOW_FAULTS, *DATA_FAULTS)
FIELDS = ("step", "rank", "steps", "seconds", "ms")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    steps: int = 1  # spike: how many consecutive batches are poisoned
    seconds: int = 3600  # hang: how long the rank sleeps
    ms: int = 200  # straggler: how long the rank sleeps at each step

    def __str__(self) -> str:
        text = f"{self.kind}@step={self.step}" + ("" if self.rank is None else f",rank={self.rank}")
        if self.steps != 1:
            text += f",steps={self.steps}"
        if self.kind == "hang":
            text += f",seconds={self.seconds}"
        if self.kind == "straggler":
            text += f",ms={self.ms}"
        return text


def parse_fault(spec: str) -> Fault:
    """'nan@step=40,rank=1' -> Fault("nan", 40, 1). Raises ValueError, one line naming the problem."""
    kind, _, where = spec.partition("@")
    if kind not in KINDS:
        raise ValueError(f"chaos.faults: unknown fault '{kind}' in '{spec}'; choose one of {list(KINDS)}")
    fields: dict[str, int] = {}
    for part in filter(None, where.split(",")):
        key, _, value = part.partition("=")
        if key not in FIELDS or not value.isdigit():
            raise ValueError(f"chaos.faults: bad '{part}' in '{spec}'; write KIND@step=S[,rank=R][,steps=K][,seconds=T][,ms=M] with whole numbers")
        fields[key] = int(value)
    if "step" not in fields:
        raise ValueError(f"chaos.faults: '{spec}' has no step; write KIND@step=S[,rank=R]")
    if fields["step"] < 1 or fields.get("steps", 1) < 1:
        raise ValueError(f"chaos.faults: '{spec}': step and steps start at 1")
    return Fault(kind, **fields)


class FaultPlan:
    """The faults of one run, as seen by one rank. The trainer calls `begin_step` and the hooks."""

    def __init__(self, specs: list[str], rank: int, run_dir: str | Path | None = None):
        self.faults = [parse_fault(s) for s in specs]
        self.rank = rank
        self.markers = Path(run_dir) / "chaos" if run_dir else None
        self.step = 0
        self.fired: list[Fault] = []  # this step's injected faults, for the trainer to record
        self._done: set[Fault] = set()

    def begin_step(self, step: int) -> None:
        self.step = step
        self.fired = []

    def _due(self, kinds) -> list[Fault]:
        return [f for f in self.faults if f.kind in kinds and f.step == self.step and f.rank in (None, self.rank) and not self._has_fired(f)]

    def _marker(self, fault: Fault) -> Path | None:
        return self.markers / f"fired-{fault}-rank{self.rank}" if self.markers else None

    def _has_fired(self, fault: Fault) -> bool:
        marker = self._marker(fault)
        return fault in self._done or (marker is not None and marker.exists())

    def _spend(self, fault: Fault) -> None:
        self._done.add(fault)
        marker = self._marker(fault)
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{time.time()}\n")

    def at_step_start(self) -> None:
        """Hook at the start of a step, before its first collective: crash, hang, oom and straggler."""
        for fault in self.faults:
            if fault.kind == "straggler" and fault.rank in (None, self.rank) and fault.step <= self.step < fault.step + fault.steps:
                time.sleep(fault.ms / 1000)
        for fault in self._due(PROCESS_FAULTS):
            self.fired.append(fault)
            self._spend(fault)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                time.sleep(fault.seconds)  # the other ranks wait inside their next collective
            else:
                raise torch.OutOfMemoryError(f"injected by chaos fault {fault}")

    def corrupt_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook on each micro-batch's loss before backward: a nan/inf fault multiplies it in."""
        for fault in self._due(LOSS_FAULTS):
            loss = loss * LOSS_FAULTS[fault.kind]
            if fault not in self.fired:
                self.fired.append(fault)
        return loss

    def end_step(self) -> None:
        """Marks this step's loss faults as spent, so a rerun of the step after a rollback is clean."""
        for fault in self.fired:
            if fault.kind in LOSS_FAULTS:
                self._spend(fault)

    def poison_batch(self, batch_index: int, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hook on each batch read: a spike fault swaps the batches it names for random bytes.
        `batch_index` counts batches from 0, so step S of a run that skipped nothing reads batch S-1."""
        for fault in self.faults:
            if fault.kind == "spike" and fault.rank in (None, self.rank) and fault.step - 1 <= batch_index < fault.step - 1 + fault.steps:
                rng = np.random.default_rng([fault.step, batch_index])
                tokens = rng.integers(0, 256, size=(inputs.shape[0], inputs.shape[1] + 1))
                if fault not in self.fired:
                    self.fired.append(fault)
                return tokens[:, :-1], tokens[:, 1:]
        return inputs, targets
