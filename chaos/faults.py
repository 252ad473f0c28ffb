"""Fault injectors: the hooks the trainer calls to put a drill's (or a person's) faults into a run.

The kinds of fault are declared in keel.chaos.kinds, and how a fault is written in keel.chaos.fault_specs.
A FaultPlan is what the trainer calls, at the hook points it offers (the LR, the step start, the loss,
the gradients, the trainer's own collectives, the global batch); at each, the plan calls the hook that
each due fault's kind names for that point: the functions at the end of this module for Keel's own
kinds. Hooks patch nothing in torch. A plan also takes the requests `keel inject` leaves in
RUN_DIR/control/faults/ while the run goes.

A fault fires once at each of its steps: a step that runs again after a rollback or a restart is
clean (a real transient fault does not come back either). The firing rank leaves a marker in
RUN_DIR/chaos/ before it acts, so even a fault that kills the process is not repeated after torchrun
restarts it, and appends a line to RUN_DIR/chaos/injected.jsonl (what, where, when) for drills to read.
What is not transient has no marker: the batches that `spike` and `data_corrupt` poison (only
skipping them gets rid of them), and `straggler`, `late_collective` and `oom`, properties of a machine for a
span of steps (an out-of-memory fault is a memory that holds `rows` sequences: the step runs out again
whenever it runs with more, so only a smaller micro-batch gets past it). A spike's LR surge is transient:
it fires once, like the rest.

Faults that end the process (crash, segfault, node_loss, and hang and deadlock, which the watchdog ends)
act only after their step's ckpt_corrupt has: sequenced by rank 0's marker, not by timing, so the restart
loads the checkpoint the fault damaged. node_loss kills what a dead machine takes with it: the node's
torchrun agent and every process under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from keel.chaos.fault_specs import Fault, parse_fault
from keel.chaos.kinds import KINDS
from keel.monitor.run_dir import CHAOS_DIR, FAULT_REQUEST_DIR, INJECTED_FILE, MANIFEST, list_checkpoints

NONFINITE = {"nan": float("nan"), "inf": float("inf")}
# How long a fault that ends the process waits for its step's ckpt_corrupt to have fired on rank 0 (it
# waits for rank 0's save in flight, seconds at most): bounded, so a rank 0 that never gets there cannot
# keep the fault from firing.
_SEQUENCE_WAIT_S = 120.0


@dataclass(frozen=True)
class StepStart:
    """What a hook at the step start gets: this rank's model parts, the step's micro-batch in sequences (what
    an oom fault's memory must hold), and a wait for this rank's save in flight."""

    parts: list[torch.nn.Module]
    microbatch_rows: int
    settle_checkpoints: Callable[[], None]


class FaultPlan:
    """The faults of one run, as seen by one rank. The trainer calls `begin_step` and the hook points; at
    each, the plan calls the hook that each due fault's kind names for it (keel.chaos.kinds)."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: str | Path | None = None, snapshot_folder: Path | None = None):
        self.faults = list(faults)
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir else None
        self.snapshot_folder = snapshot_folder  # where the run's snapshot files are (None: none)
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
        folder = self.run_dir / FAULT_REQUEST_DIR if self.run_dir else None
        if folder is None or not folder.is_dir():
            return
        for path in sorted(folder.glob("*.json")):
            if path.name in self._requests_seen:
                continue
            self._requests_seen.add(path.name)
            fault = parse_fault(json.loads(path.read_text())["fault"], default_step=self.step)
            self.faults.append(Fault(**{**vars(fault), "step": max(fault.step, self.step)}))

    def _marker(self, fault: Fault, rank: int | None = None) -> Path | None:
        """The fire-once marker of a fault at this step, left by this rank (or by `rank`)."""
        rank = self.rank if rank is None else rank
        return self.run_dir / CHAOS_DIR / f"{self._marker_stem(fault)}{rank}" if self.run_dir else None

    def _marker_stem(self, fault: Fault) -> str:
        """A marker's name up to its rank, safe as a file name."""
        return re.sub(r"[^A-Za-z0-9_.=,@-]", "_", f"fired-{fault}-at{self.step}-rank")

    def _fired_before(self, fault: Fault, on_any_rank: bool) -> bool:
        """Whether the fault left its marker at this step: on this rank, or on any rank for a fault that ends
        the process (the first rank it kills takes the whole group down, often before the others reach
        their hook; the restart must not crash again on the ranks it did not reach)."""
        if not on_any_rank:
            return self._marker(fault).exists()
        return any((self.run_dir / CHAOS_DIR).glob(glob.escape(self._marker_stem(fault)) + "*"))

    def _due(self, point: str) -> list[Fault]:
        """Faults whose kind has a hook at `point` that hit this rank at this step and have not fired at it
        yet, in the order of KINDS (the kinds that end the step or the process last)."""
        due = []
        for f in self.faults:
            kind = KINDS[f.kind]
            if point in kind.hooks and f.hits(self.step, self.rank) and (f, self.step) not in self._spent:
                # A loss fault fires on every micro-batch of its step: its own marker does not stop it.
                marker = self._marker(f)
                if kind.persistent or f in self._marked_now or marker is None or not self._fired_before(f, kind.ends_process):
                    due.append(f)
        order = list(KINDS)
        return sorted(due, key=lambda f: order.index(f.kind))

    def fire(self, fault: Fault, detail: str = "", marker: bool = True) -> None:
        """Records a fault as its hook makes it act: the fire-once marker (not for poisoned batches), the
        injection log, this step's list. A fault that ends the process is recorded, and so acts, only once
        its step's ckpt_corrupt has fired on rank 0, and is spent at once."""
        if KINDS[fault.kind].ends_process:
            detail = "; ".join(filter(None, [self._after_corruption(), detail]))
            self.spend(fault)
        if fault not in self.fired:
            self.fired.append(fault)
        if marker and not KINDS[fault.kind].persistent and self.run_dir is not None and fault not in self._marked_now:
            self._marked_now.add(fault)
            (self.run_dir / CHAOS_DIR).mkdir(parents=True, exist_ok=True)
            self._marker(fault).write_text(f"{time.time()}\n")
        if (fault, self.step) in self._logged:
            return
        self._logged.add((fault, self.step))
        if self.run_dir is None:
            return
        folder = self.run_dir / CHAOS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        line = {"fault": str(fault), "kind": fault.kind, "rank": self.rank, "step": self.step, "time": time.time(), "detail": detail}
        with open(folder / INJECTED_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())  # written before a crash or segfault takes the process

    def spend(self, fault: Fault) -> None:
        """Done with at this step: it does not act again if its hook point runs again in the step (the step
        start does, after an out-of-memory error). A fault that fired is spent when the step ends."""
        self._spent.add((fault, self.step))

    def _after_corruption(self) -> str:
        """Waits until this step's ckpt_corrupt has fired on rank 0 (its marker is written after the flip):
        the restart that follows a fault ending the process must load the damaged checkpoint. Timing does
        not order them: a crash once beat rank 0, still waiting for its save in flight, and the restarted
        run damaged a checkpoint nobody loaded. Returns a note for the injection log when the wait gave up."""
        markers = [self._marker(f, rank=0) for f in self.faults if f.kind == "ckpt_corrupt" and f.hits(self.step, 0)]
        deadline = time.monotonic() + _SEQUENCE_WAIT_S
        while not all(m is None or m.exists() for m in markers):
            if time.monotonic() > deadline:
                return f"ckpt_corrupt of step {self.step} had not fired after {_SEQUENCE_WAIT_S:.0f} s"
            time.sleep(0.05)
        return ""

    # -- hook points -----------------------------------------------------------------------------
    def lr_scale(self) -> float:
        """Hook on the step's LR, which is multiplied by what each hook returns: hook(plan, fault) -> factor."""
        return math.prod((_hook(f, "lr_scale")(self, f) for f in self._due("lr_scale")), start=1.0)

    def at_step_start(
        self, parts: list[torch.nn.Module], microbatch_rows: int, settle_checkpoints: Callable[[], None] = lambda: None
    ) -> None:
        """Hook at the start of a step, before its first collective, for the faults that hit the process,
        the parameters and the checkpoint folder: hook(plan, fault, StepStart). `settle_checkpoints` waits
        for this rank's save in flight: ckpt_corrupt damages the newest checkpoint as it ends up on disk,
        not the one before it (a background save finishing after the flip would hide the fault from the next load)."""
        start = StepStart(parts, microbatch_rows, settle_checkpoints)
        for fault in self._due("at_step_start"):
            _hook(fault, "at_step_start")(self, fault, start)

    def corrupt_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook on each micro-batch's loss before backward: hook(plan, fault, loss) -> loss. A fault here
        acts on every micro-batch of its step and is spent when the step ends."""
        for fault in self._due("corrupt_loss"):
            loss = _hook(fault, "corrupt_loss")(self, fault, loss)
        return loss

    def corrupt_grads(self, parts: list[torch.nn.Module]) -> None:
        """Hook after backward, before the gradient norm: hook(plan, fault, parts)."""
        for fault in self._due("corrupt_grads"):
            _hook(fault, "corrupt_grads")(self, fault, parts)

    def before_collective(self) -> None:
        """Hook before each collective the trainer issues itself (gradient norm, replicated gradients,
        step metrics): hook(plan, fault). Collectives inside FSDP and the pipeline schedule have no hook
        point without patching torch, so they run at full speed."""
        for fault in self._due("before_collective"):
            _hook(fault, "before_collective")(self, fault)

    def end_step(self) -> None:
        for fault in self.fired:
            self.spend(fault)

    def corrupt_batch(self, batch_index: int, window: np.ndarray, vocab_size: int) -> np.ndarray:
        """Hook on each global batch read, [batch, seq_len + 1] token ids, the same on every rank:
        hook(plan, fault, batch_index, window, vocab_size) -> window, for each fault whose steps read the
        batch, on every rank and at every read (poisoned data stays poisoned). `batch_index` counts from 0,
        so step S of a run that skipped nothing reads batch S-1."""
        for fault in self.faults:
            if "corrupt_batch" in KINDS[fault.kind].hooks and fault.step - 1 <= batch_index < fault.step - 1 + fault.steps:
                window = _hook(fault, "corrupt_batch")(self, fault, batch_index, window, vocab_size)
        return window

    def corrupt_batch_loss(self, batch_index: int, loss: torch.Tensor) -> torch.Tensor:
        """Hook on the loss of batch `batch_index` in a loop whose batches Keel does not read (the loss stands
        for its batch): hook(plan, fault, batch_index, loss) -> loss, for each fault whose steps read the
        batch, at every read, as `corrupt_batch`."""
        for fault in self.faults:
            if "corrupt_batch_loss" in KINDS[fault.kind].hooks and fault.step - 1 <= batch_index < fault.step - 1 + fault.steps:
                loss = _hook(fault, "corrupt_batch_loss")(self, fault, batch_index, loss)
        return loss


def _hook(fault: Fault, point: str) -> Callable:
    """The function the fault's kind names for this hook point, from the kind's module (imported here, in
    the workers: keel.chaos.kinds imports no hook, and so no torch)."""
    kind = KINDS[fault.kind]
    return getattr(importlib.import_module(kind.module), kind.hooks[point])


# -- the kinds' hooks, named in keel.chaos.kinds --------------------------------------------------
def nonfinite_param(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    """nan, inf into=param: into this rank's first parameter, once (it stays until a rollback restores it)."""
    if fault.into == "param":
        plan.fire(fault)
        plan.spend(fault)
        _scale_first_tensor([p for part in start.parts for p in part.parameters()], NONFINITE[fault.kind])


def nonfinite_loss(plan: FaultPlan, fault: Fault, loss: torch.Tensor) -> torch.Tensor:
    """nan, inf into=loss: multiplied into the loss."""
    if fault.into != "loss":
        return loss
    plan.fire(fault)
    return loss * NONFINITE[fault.kind]


def nonfinite_grads(plan: FaultPlan, fault: Fault, parts: list[torch.nn.Module]) -> None:
    """nan, inf into=grad: into this rank's first gradient."""
    if fault.into == "grad":
        plan.fire(fault)
        plan.spend(fault)
        _scale_first_tensor([p.grad for part in parts for p in part.parameters() if p.grad is not None], NONFINITE[fault.kind])


def lr_surge(plan: FaultPlan, fault: Fault) -> float:
    """spike with lr=F: the LR times F (a transient event: it fires once)."""
    if fault.lr <= 0:
        return 1.0
    plan.fire(fault, f"lr x{fault.lr:g}")
    return fault.lr


def random_bytes(plan: FaultPlan, fault: Fault, batch_index: int, window: np.ndarray, vocab_size: int) -> np.ndarray:
    """spike with data=1: the batch replaced by random bytes, the same ones at every read."""
    if not fault.data:
        return window
    plan.fire(fault, f"batch {batch_index} replaced by random bytes", marker=False)
    return np.random.default_rng([fault.step, batch_index]).integers(0, min(256, vocab_size), size=window.shape)


# What a batch of random bytes does to a trained model's loss on text: about ln 256 = 5.5 against 1.5-2.5.
SPIKED_LOSS_FACTOR = 4.0


def spiked_loss(plan: FaultPlan, fault: Fault, batch_index: int, loss: torch.Tensor) -> torch.Tensor:
    """spike with data=1, in a loop whose data Keel does not read: the batch's loss times SPIKED_LOSS_FACTOR."""
    if not fault.data:
        return loss
    plan.fire(fault, f"batch {batch_index}'s loss x{SPIKED_LOSS_FACTOR:g}", marker=False)
    return loss * SPIKED_LOSS_FACTOR


def data_corrupt(plan: FaultPlan, fault: Fault, batch_index: int, window: np.ndarray, vocab_size: int) -> np.ndarray:
    window = window.copy()
    window[:, window.shape[1] // 2] = vocab_size + 7  # what a damaged file or a wrong tokenizer gives
    plan.fire(fault, f"batch {batch_index} holds token ids >= {vocab_size}", marker=False)
    return window


def straggler(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    plan.fire(fault)
    time.sleep(fault.ms / 1000)


def late_collective(plan: FaultPlan, fault: Fault) -> None:
    plan.fire(fault)
    time.sleep(fault.ms / 1000)


def ckpt_corrupt(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    """Rank 0 waits for its save in flight, then damages the newest checkpoint, and removes the records of
    the run's snapshot files: a restart would resume from those, newer, and never read the damaged
    checkpoint (as when a node is lost with its memory). Its marker, written once that is done, is what this
    step's faults that end the process wait for."""
    if plan.rank == 0:
        start.settle_checkpoints()
        flipped = _flip_newest_checkpoint(plan.run_dir)
        plan.fire(fault, f"{flipped}; {_remove_snapshot_records(plan.snapshot_folder)} snapshot records removed")
    plan.spend(fault)


def oom(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    """A memory that holds micro-batches of `rows` sequences. Not spent: the step runs again after an OOM,
    and must run out again if it still does not fit."""
    if start.microbatch_rows <= fault.rows:
        return
    plan.fire(fault, f"micro-batch of {start.microbatch_rows} sequences")
    if fault.real:
        torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
    raise torch.OutOfMemoryError(f"injected by chaos fault {fault}")


def hang(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    plan.fire(fault)
    time.sleep(fault.seconds)  # the other ranks wait inside their next collective, until the watchdog ends it


def deadlock(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    plan.fire(fault)
    _hold_gil(fault.seconds)


def crash(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    plan.fire(fault)
    os.kill(os.getpid(), signal.SIGKILL)


def segfault(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    plan.fire(fault)
    ctypes.string_at(0)


def node_loss(plan: FaultPlan, fault: Fault, start: StepStart) -> None:
    """What a dead machine takes with it: the node's torchrun agent and every process under it."""
    agent, found_by = _node_agent()
    tree = [agent, *_descendants(agent)]
    plan.fire(fault, f"agent {agent} ({found_by}) and the {len(tree) - 1} processes under it")
    _kill_all(tree)


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


def _node_agent() -> tuple[int, str]:
    """This node's torchrun agent: its pid and how it was found. `keel train`'s agent exports its pid as
    KEEL_AGENT_PID; plain torchrun exports none, so then it is the nearest ancestor running torchrun, or
    else the parent."""
    if os.environ.get("KEEL_AGENT_PID"):
        return int(os.environ["KEEL_AGENT_PID"]), "KEEL_AGENT_PID"
    pid = os.getppid()
    while pid > 1:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if any(os.path.basename(a) == b"torchrun" or a == b"torch.distributed.run" for a in argv):
            return pid, "KEEL_AGENT_PID unset: the nearest ancestor running torchrun"
        pid = _parent(pid)
    return os.getppid(), "KEEL_AGENT_PID unset and no ancestor runs torchrun: the parent"


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses, hence the last ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def _descendants(root: int) -> list[int]:
    """Every process under `root` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # ended while we looked
                children.setdefault(_parent(int(entry.name)), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_all(tree: list[int]) -> None:
    """SIGKILL to the agent first (it would restart the workers it sees die), then every process under
    it, this one last: what a machine that dies does to them, with no chance to clean up."""
    me = os.getpid()
    for pid in [p for p in tree if p != me] + [me]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove_snapshot_records(folder: Path | None) -> int:
    """Removes every rank's snapshot records in `folder` (their slots stay, unreadable without them); returns how many."""
    records = list(folder.glob("rank*-step*.pt")) if folder else []
    for record in records:
        record.unlink(missing_ok=True)
    return len(records)


def _flip_newest_checkpoint(run_dir: Path) -> str:
    """Flips 16 bytes in the middle of the largest shard of the newest complete checkpoint."""
    done = list_checkpoints(run_dir)
    if not done:
        return "no complete checkpoint to corrupt"
    newest = done[-1][1]
    shard = max((p for p in newest.iterdir() if p.name != MANIFEST), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        chunk = f.read(16)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return f"flipped {len(chunk)} bytes of {newest.name}/{shard.name}"
