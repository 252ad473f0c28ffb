"""Fault injectors: the faults a drill (or a person) puts into a run, and the hooks the trainer calls.

A fault is written KIND@step=S[,rank=R][,steps=K][,FIELD=VALUE...] (see KINDS and FIELDS), on the
command line (`--fault nan@step=40,rank=1`), in the config (`chaos.faults`), drawn at random with a
mean time between faults (`chaos.mtbf_steps`), or requested while the run goes (`keel inject`, which
leaves a request in RUN_DIR/control/faults/). Rank defaults to every rank. Injectors act only through
the hooks the trainer offers (the loss, the gradients, the parameters, the batch, the LR, the step
start, the trainer's own collectives); they patch nothing in torch.

A fault fires once at each of its steps: a step that runs again after a rollback or a restart is
clean (a real transient fault does not come back either). The firing rank leaves a marker in
RUN_DIR/chaos/ before it acts, so even a fault that kills the process is not repeated after torchrun
restarts it, and appends a line to RUN_DIR/chaos/injected.jsonl (what, where, when) for drills to read.
What is not transient has no marker: the batches that `spike` and `data_corrupt` poison (only
skipping them gets rid of them), and `straggler` and `slow_comm`, properties of a machine for a span
of steps. A spike's LR surge is transient: it fires once, like the rest.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

KINDS = {
    "nan": "NaN into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
    "inf": "Inf into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
    "spike": "a real loss spike: the batches of steps S..S+K-1 replaced by random bytes (data=1) and/or the LR times lr=F",
    "data_corrupt": "token ids out of the vocabulary in the batches of steps S..S+K-1 (a damaged data file)",
    "oom": "torch.OutOfMemoryError at the start of step S (real=1 on a GPU: a real over-allocation)",
    "hang": "the rank sleeps `seconds` before the step's first collective, while the others wait inside it",
    "deadlock": "a thread of the rank holds the GIL for `seconds`: no Python thread of the process runs",
    "crash": "the rank is killed (SIGKILL) at the start of step S",
    "segfault": "the rank reads address 0 (SIGSEGV) at the start of step S",
    "straggler": "the rank sleeps `ms` at the start of each of steps S..S+K-1",
    "slow_comm": "the rank waits `ms` before each collective the trainer issues, at steps S..S+K-1",
    "ckpt_corrupt": "bytes flipped in a shard of the newest complete checkpoint, at the start of step S (by rank 0)",
}
# Which fields each kind takes besides step and steps.
_KIND_FIELDS = {
    "nan": ("rank", "into"), "inf": ("rank", "into"), "spike": ("lr", "data"), "data_corrupt": (),
    "oom": ("rank", "real"), "hang": ("rank", "seconds"), "deadlock": ("rank", "seconds"), "crash": ("rank",),
    "segfault": ("rank",), "straggler": ("rank", "ms"), "slow_comm": ("rank", "ms"), "ckpt_corrupt": (),
}
NONFINITE = {"nan": float("nan"), "inf": float("inf")}
TARGETS = ("loss", "grad", "param")
# Faults tied to a machine: no fire-once marker (see the module docstring; data faults never look one up).
_PERSISTENT = ("data_corrupt", "straggler", "slow_comm")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    steps: int = 1  # how many consecutive steps it hits, from `step`
    seconds: int = 3600  # hang, deadlock: how long the rank is stuck
    ms: int = 200  # straggler, slow_comm: the delay
    into: str = "loss"  # nan, inf: loss | grad | param
    lr: float = 0.0  # spike: multiply the LR by this (0: no LR surge)
    data: int = 1  # spike: 1 replaces the batches with random bytes, 0 leaves them
    real: int = 0  # oom: 1 allocates more than the GPU holds instead of raising

    def __str__(self) -> str:
        """The canonical spec: parse_fault(str(f)) == f."""
        default = Fault(self.kind, self.step)
        extra = [f"{f.name}={getattr(self, f.name):g}" if f.name == "lr" else f"{f.name}={getattr(self, f.name)}"
                 for f in fields(self) if f.name not in ("kind", "step") and getattr(self, f.name) != getattr(default, f.name)]
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
    if fault.real and not torch.cuda.is_available():
        raise ValueError(f"chaos.faults: '{spec}': real=1 over-allocates GPU memory and there is no GPU; drop real=1")
    return fault


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


class FaultPlan:
    """The faults of one run, as seen by one rank. The trainer calls `begin_step` and the hooks."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: str | Path | None = None):
        self.faults = list(faults)
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir else None
        self.step = 0
        self.fired: list[Fault] = []  # this step's injected faults, for the trainer to record
        self._spent: set[tuple[Fault, int]] = set()
        self._marked_now: set[Fault] = set()  # faults that left their marker at this step
        self._logged: set[tuple[Fault, int]] = set()
        self._requests_seen: set[str] = set()

    # -- bookkeeping -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.fired = []
        self._marked_now = set()
        self._take_requests()

    def _take_requests(self) -> None:
        """Faults asked for by `keel inject` while the run goes; a request for a step already past fires now."""
        folder = self.run_dir / "control" / "faults" if self.run_dir else None
        if folder is None or not folder.is_dir():
            return
        for path in sorted(folder.glob("*.json")):
            if path.name in self._requests_seen:
                continue
            self._requests_seen.add(path.name)
            fault = parse_fault(json.loads(path.read_text())["fault"], default_step=self.step)
            self.faults.append(Fault(**{**vars(fault), "step": max(fault.step, self.step)}))

    def _marker(self, fault: Fault) -> Path | None:
        name = re.sub(r"[^A-Za-z0-9_.=,@-]", "_", f"fired-{fault}-at{self.step}-rank{self.rank}")
        return self.run_dir / "chaos" / name if self.run_dir else None

    def _due(self, *kinds: str) -> list[Fault]:
        """Faults of these kinds that hit this rank at this step and have not fired at it yet."""
        due = []
        for f in self.faults:
            if f.kind in kinds and f.hits(self.step, self.rank) and (f, self.step) not in self._spent:
                # A loss fault fires on every micro-batch of its step: its own marker does not stop it.
                marker = self._marker(f)
                if f.kind in _PERSISTENT or f in self._marked_now or marker is None or not marker.exists():
                    due.append(f)
        return due

    def _fire(self, fault: Fault, detail: str = "", marker: bool = True) -> None:
        """Records a fault as it acts: the fire-once marker (not for poisoned batches), the injection
        log, this step's list."""
        if fault not in self.fired:
            self.fired.append(fault)
        if marker and fault.kind not in _PERSISTENT and self.run_dir is not None and fault not in self._marked_now:
            self._marked_now.add(fault)
            (self.run_dir / "chaos").mkdir(parents=True, exist_ok=True)
            self._marker(fault).write_text(f"{time.time()}\n")
        if (fault, self.step) in self._logged:
            return
        self._logged.add((fault, self.step))
        if self.run_dir is None:
            return
        folder = self.run_dir / "chaos"
        folder.mkdir(parents=True, exist_ok=True)
        line = {"fault": str(fault), "kind": fault.kind, "rank": self.rank, "step": self.step, "time": time.time(), "detail": detail}
        with open(folder / "injected.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())  # written before a crash or segfault takes the process

    def _spend(self, fault: Fault) -> None:
        self._spent.add((fault, self.step))

    # -- hooks -----------------------------------------------------------------------------------
    def lr_scale(self) -> float:
        """Hook on the step's LR: a spike with lr=F multiplies it by F."""
        scale = 1.0
        for fault in self._due("spike"):
            if fault.lr > 0:
                scale *= fault.lr
                self._fire(fault, f"lr x{fault.lr:g}")
        return scale

    def at_step_start(self, parts: list[torch.nn.Module]) -> None:
        """Hook at the start of a step, before its first collective: the faults that hit the process,
        the parameters and the checkpoint folder."""
        for fault in self._due("straggler"):
            self._fire(fault)
            time.sleep(fault.ms / 1000)
        for fault in self._due("nan", "inf"):
            if fault.into == "param":
                self._fire(fault)
                self._spend(fault)
                _scale_first_tensor([p for part in parts for p in part.parameters()], NONFINITE[fault.kind])
        for fault in self._due("ckpt_corrupt"):
            if self.rank == 0:
                self._fire(fault, _flip_newest_checkpoint(self.run_dir / "checkpoints"))
            self._spend(fault)
        for fault in self._due("oom", "crash", "segfault", "hang", "deadlock"):
            self._fire(fault)
            self._spend(fault)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "segfault":
                ctypes.string_at(0)
            elif fault.kind == "hang":
                time.sleep(fault.seconds)  # the other ranks wait inside their next collective
            elif fault.kind == "deadlock":
                _hold_gil(fault.seconds)
            elif fault.real:
                torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
            else:
                raise torch.OutOfMemoryError(f"injected by chaos fault {fault}")

    def corrupt_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook on each micro-batch's loss before backward: nan/inf into=loss multiplies it in (every
        micro-batch of the step; the fault is spent when the step ends)."""
        for fault in self._due("nan", "inf"):
            if fault.into == "loss":
                loss = loss * NONFINITE[fault.kind]
                self._fire(fault)
        return loss

    def corrupt_grads(self, parts: list[torch.nn.Module]) -> None:
        """Hook after backward, before the gradient norm: nan/inf into=grad."""
        for fault in self._due("nan", "inf"):
            if fault.into == "grad":
                self._fire(fault)
                self._spend(fault)
                _scale_first_tensor([p.grad for part in parts for p in part.parameters() if p.grad is not None], NONFINITE[fault.kind])

    def before_collective(self) -> None:
        """Hook before each collective the trainer issues itself (gradient norm, replicated gradients,
        step metrics): slow_comm delays it. Collectives inside FSDP and the pipeline schedule have no
        hook point without patching torch, so they run at full speed."""
        for fault in self._due("slow_comm"):
            self._fire(fault)
            time.sleep(fault.ms / 1000)

    def end_step(self) -> None:
        for fault in self.fired:
            self._spend(fault)

    def corrupt_batch(self, batch_index: int, window: np.ndarray, vocab_size: int) -> np.ndarray:
        """Hook on each global batch read, [batch, seq_len + 1] token ids, the same on every rank.
        `batch_index` counts from 0, so step S of a run that skipped nothing reads batch S-1."""
        for fault in self.faults:
            if fault.step - 1 <= batch_index < fault.step - 1 + fault.steps:
                if fault.kind == "spike" and fault.data:
                    rng = np.random.default_rng([fault.step, batch_index])
                    window = rng.integers(0, min(256, vocab_size), size=window.shape)
                    self._fire(fault, f"batch {batch_index} replaced by random bytes", marker=False)
                elif fault.kind == "data_corrupt":
                    window = window.copy()
                    window[:, window.shape[1] // 2] = vocab_size + 7  # what a damaged file or a wrong tokenizer gives
                    self._fire(fault, f"batch {batch_index} holds token ids >= {vocab_size}", marker=False)
        return window


def _scale_first_tensor(tensors: list[torch.Tensor], value: float) -> None:
    """Multiplies the first tensor of this rank by NaN or Inf (a sharded DTensor: its local shard)."""
    if tensors:
        with torch.no_grad():
            t = tensors[0]
            (t.to_local() if hasattr(t, "to_local") else t).mul_(value)


def _hold_gil(seconds: int) -> None:
    """A thread enters a C sleep without releasing the GIL (ctypes.PyDLL keeps it), so the training
    thread and every other Python thread, the hang watchdog's too, stop until it returns."""
    holder = threading.Thread(target=ctypes.PyDLL(None).sleep, args=(seconds,), name="keel-chaos-gil-holder", daemon=True)
    holder.start()
    holder.join()


def _flip_newest_checkpoint(folder: Path) -> str:
    """Flips 16 bytes in the middle of the largest shard of the newest complete checkpoint."""
    done = sorted(p for p in folder.glob("step-*") if re.fullmatch(r"step-\d+", p.name)) if folder.is_dir() else []
    if not done:
        return "no complete checkpoint to corrupt"
    shard = max((p for p in done[-1].iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        chunk = f.read(16)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return f"flipped {len(chunk)} bytes of {done[-1].name}/{shard.name}"
