"""In-memory snapshots: this rank's last few states in host memory, so that a rollback restores a step just
before the bad ones in milliseconds, rather than the newest durable checkpoint, which Young's interval puts
up to half an hour back (the idea of Gemini, SOSP 2023, and of the local checkpoints of NVIDIA's
resiliency extension).

A snapshot is taken after a step's update. The parameters and optimizer state are copied into host
buffers kept from snapshot to snapshot: on a GPU into pinned memory on a side stream while the next
step's forward and backward run (the next update waits for the copy only if it is not done:
`before_update`); on a CPU at once, on the step's thread, since the state is in host memory already and
a copy there takes the cores the step runs on whichever thread makes it (a thread's copy of a 5 MB
state, 1 ms of work, kept the next update waiting 3-27 ms among 8 ranks on 2 cores). Beside the tensors a
snapshot keeps what a rollback needs to go on from its step: the train state (data position, guard), the
random generators and the LR scheduler.

The newest two snapshots of each rank are also written to files in host memory (`checkpoint.snapshot_dir`,
/dev/shm: a tmpfs), after the copy (on a GPU by a thread), so that they outlive the worker: a restart after
a crash, a hang or an out-of-memory restores the newest step every rank has there (`SnapshotFiles`), and
goes back to the newest durable checkpoint only when there is none (a node lost with its memory, another
layout). Nothing read back can run code: the tensors are raw bytes, the rest is read with
torch.load(weights_only=True).

How often is measured, not guessed: every rank's snapshot cost is agreed each step (StepReporter), and the
interval is the smallest number of steps that keeps the snapshots under `checkpoint.snapshot_cost` of the
step time. The cost is what a snapshot takes from training. On a GPU: the step's time in `take` and
waiting for the copy, and the processor time the file thread spent (time.thread_time). On a CPU: the
processor time `take` spent, times the training thread's share of waiting for a core (Linux's
schedstat: 1 + time runnable but waiting / time running, over recent steps; 1 on cores of its own, about
4 for 8 ranks on 2 cores): what that work delays the step by on those cores. Not the wall-clock time of
`take` itself: a few milliseconds of work among 8 ranks on 2 cores read 27-66 ms whenever the scheduler
ran another rank meanwhile, and the slowest rank's reading set the interval. Enough snapshots are kept
to reach behind the first bad step a verdict can name.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import math
import os
import random
import shutil
import statistics
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from keel.monitor.free_space import free_space

log = logging.getLogger("keel.checkpoint")

# Agreed step times the interval is measured against: the median of this many recent steps.
_STEP_TIMES = 20


@dataclass
class Snapshot:
    step: int
    tensors: list[torch.Tensor]  # host copies of `live_tensors()` at the step, in that order
    optimizer_keys: list[tuple[int, str]]  # (parameter index, state key) of each optimizer tensor, in order
    optimizer_values: dict[tuple[int, str], object]  # the optimizer state's other values
    param_groups: list[dict]  # the optimizer's settings per group (lr, betas, ...), without the parameters
    train_state: dict
    random_state: dict
    scheduler_state: dict | None


def _thread_schedstat() -> tuple[int, int] | None:
    """(nanoseconds this thread has run, nanoseconds it has waited runnable for a core), from Linux's
    /proc/thread-self/schedstat; None where there is none."""
    try:
        running, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(running), int(waiting)


def _same_objects(refs: list[weakref.ref], tensors: list[torch.Tensor]) -> bool:
    return len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (FSDP2, tensor parallel), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class Snapshots:
    """The last snapshots of this rank's state. Every rank takes them at the same steps (the interval is
    decided from agreed values) and restores the same one, so no collective is needed."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        host_rng: bool,
        cost: float,
        every_steps: int,
        lookback_steps: int,
        files: SnapshotFiles | None = None,
    ):
        self.model, self.optimizer, self.scheduler, self.host_rng = model, optimizer, scheduler, host_rng
        self.files = files  # where the newest snapshots outlive the process; None: memory only
        self.cost, self.fixed_every = cost, every_steps
        self.lookback_steps = lookback_steps  # how far before a verdict's step its first bad step can be
        self.every = every_steps or 1  # measured after the first snapshot unless fixed
        self.kept: deque[Snapshot] = deque()
        self._cost_s = math.nan  # what the newest finished snapshot took from training (last_cost_s)
        self._thread_s = 0.0  # the snapshot thread's processor time on the snapshot in flight (that thread writes it)
        self._step_s = 0.0  # the training thread's time on it: in `take`, and waiting in `before_update`
        self._in_flight: Future | torch.cuda.Event | None = None  # the last work of the snapshot in flight
        self._copying: Future | torch.cuda.Event | None = None
        self._writing: Future | None = None  # the newest snapshot going to `files`
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="keel-snapshot")
        self._cuda = torch.cuda.is_available()
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._step_times: deque[float] = deque(maxlen=_STEP_TIMES)
        self._slowdowns: deque[float] = deque(maxlen=_STEP_TIMES)  # the training thread's wait for a core, per step
        self._schedstat: tuple[int, int] | None = _thread_schedstat()  # at the last `due`
        self._live: tuple[list[weakref.ref], list[torch.Tensor], list[tuple[int, str]]] | None = None  # live_tensors' shards
        self._logged = 0  # the interval last logged

    @property
    def enabled(self) -> bool:
        return self.cost > 0 or self.fixed_every > 0

    @property
    def keep(self) -> int:
        """Snapshots kept: enough that the oldest is before any first bad step a verdict can name, and two at least."""
        return max(2, math.ceil(self.lookback_steps / self.every) + 1)

    def live_tensors(self) -> tuple[list[torch.Tensor], list[tuple[int, str]], dict[tuple[int, str], object]]:
        """(the tensors a snapshot copies: parameters, buffers, then the optimizer's state tensors; the
        (parameter index, key) of each optimizer tensor; the optimizer state's other values).

        A DTensor's local shard costs tens of microseconds to reach (half a snapshot's processor time for
        400 tensors), so the shards of the last call are kept while the same tensor objects are live:
        training updates them in place, and a load that replaces them (a checkpoint's optimizer state)
        changes the objects (and calls `forget_live_tensors`, so that the old ones are not held meanwhile)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        live, keys, values = [*self.model.parameters(), *self.model.buffers()], [], {}
        for index, param in enumerate(params):
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    keys.append((index, key))
                    live.append(value)
                else:
                    values[(index, key)] = copy.deepcopy(value)
        cached = self._live
        if cached is None or cached[2] != keys or not _same_objects(cached[0], live):
            cached = self._live = ([weakref.ref(t) for t in live], [_local(t.detach()) for t in live], keys)
        return list(cached[1]), keys, values

    def forget_live_tensors(self) -> None:
        """After a load that replaced the model's or the optimizer's tensors: the shards kept of the old ones go."""
        self._live = None

    # -- taking -----------------------------------------------------------------------------------

    def due(self, step: int, step_time_s: float, cost_s: float) -> bool:
        """Whether a snapshot is due after `step`. `step_time_s` and `cost_s` (the slowest rank's last_cost_s,
        NaN when none finished) are agreed values, so every rank answers the same."""
        if not self.enabled:
            return False
        if math.isfinite(step_time_s):
            self._step_times.append(step_time_s)
        schedstat = _thread_schedstat()
        if schedstat is not None and self._schedstat is not None and schedstat[0] > self._schedstat[0]:
            running, waiting = (now - before for now, before in zip(schedstat, self._schedstat))
            self._slowdowns.append(1 + waiting / running)
        self._schedstat = schedstat
        if not self.fixed_every and math.isfinite(cost_s) and self._step_times:
            budget = self.cost * statistics.median(self._step_times)
            self.every = max(1, math.ceil(cost_s / budget))
            if not self._logged or not self._logged / 2 <= self.every <= 2 * self._logged:  # the first, then a change of 2x
                self._logged = self.every
                share = 100 * self.cost * cost_s / budget
                log.info("snapshots: every %d steps (a snapshot takes %.1f ms, %.1f%% of a step)", self.every, cost_s * 1e3, share)
        newest = self.kept[-1].step if self.kept else -math.inf
        return step - newest >= self.every

    def take(self, step: int, train_state: dict) -> None:
        """Copies the state after `step`'s update and writes it to `files`: on a GPU it starts the copy
        (`before_update` waits for it) and the thread writes the file; on a CPU both are done on return."""
        self.before_update()
        if self._writing is not None:  # its buffers may be the ones reused now
            self._writing.result()
        self.last_cost_s()  # the previous snapshot's, before its counts start again
        started, processor = time.perf_counter(), time.thread_time()
        tensors, keys, values = self.live_tensors()
        snapshot = self._reuse_or_allocate(tensors)
        snapshot.step, snapshot.optimizer_keys, snapshot.optimizer_values = step, keys, values
        snapshot.param_groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.optimizer.param_groups]
        snapshot.train_state, snapshot.random_state = train_state, self._random_state()
        snapshot.scheduler_state = None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict())
        self.kept.append(snapshot)
        self._thread_s = 0.0
        if self._cuda:  # the copy on a side stream, the file by the thread: the step goes on meanwhile
            self._stream.wait_stream(torch.cuda.current_stream())  # the update is queued before the copy
            with torch.cuda.stream(self._stream):
                for dst, src in zip(snapshot.tensors, tensors):
                    dst.copy_(src, non_blocking=True)
            self._copying = self._stream.record_event()
            if self.files is not None:
                self._writing = self._thread.submit(self._write, snapshot, self._copying)
            self._in_flight = self._writing if self.files is not None else self._copying
        else:  # on the step's own thread: a copy of memory it shares the cores with costs what it costs either way
            torch._foreach_copy_(snapshot.tensors, tensors)  # one call for all: 2 us a tensor less than a loop
            if self.files is not None:
                self.files.write(snapshot)
        self._step_s = time.perf_counter() - started  # the step's own time in here; before_update adds any wait
        if not self._cuda:
            slowdown = statistics.median(self._slowdowns) if self._slowdowns else 1.0
            self._cost_s = (time.thread_time() - processor) * slowdown

    def last_cost_s(self) -> float:
        """What this rank's newest finished snapshot took from training, in seconds (NaN until one finished):
        the step's time in `take` and in waiting for the copy, and the file thread's processor time. Read on
        the training thread."""
        done = self._in_flight is not None and (self._in_flight.done() if isinstance(self._in_flight, Future) else self._in_flight.query())
        if done:
            self._cost_s = self._thread_s + self._step_s
            self._in_flight = None
        return self._cost_s

    def _write(self, snapshot: Snapshot, copied: Future | torch.cuda.Event) -> None:
        if not isinstance(copied, Future):
            copied.synchronize()
        started = time.thread_time()
        self.files.write(snapshot)
        self._thread_s += time.thread_time() - started

    def _reuse_or_allocate(self, tensors: list[torch.Tensor]) -> Snapshot:
        """The buffers of the oldest snapshot when it is no longer kept and its shapes match (allocating host
        memory anew costs more than the copy), else new ones (pinned on a GPU host)."""
        while len(self.kept) >= self.keep:
            oldest = self.kept.popleft()
            if len(self.kept) < self.keep and _same_shapes(oldest.tensors, tensors):
                return oldest
        buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._cuda) for t in tensors]
        return Snapshot(0, buffers, [], {}, [], {}, {}, None)

    def _random_state(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if self._cuda:
            state["cuda"] = torch.cuda.get_rng_state()
        if self.host_rng:  # NumPy's generator as a tensor, so the files load with weights_only=True
            name, keys, position, has_gauss, gauss = np.random.get_state()
            state["host"] = (random.getstate(), (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss))
        return state

    def before_update(self) -> None:
        """Waits until the snapshot in flight has copied the parameters and optimizer state."""
        if self._copying is None:
            return
        waited = time.perf_counter()
        if isinstance(self._copying, Future):
            self._copying.result()
        else:
            self._copying.synchronize()
        self._step_s += time.perf_counter() - waited
        self._copying = None

    # -- restoring --------------------------------------------------------------------------------

    def newest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot of a step before `step`, or None."""
        self.before_update()
        return next((s for s in reversed(self.kept) if s.step < step), None)

    def restore(self, snapshot: Snapshot) -> None:
        """Puts the snapshot's parameters, optimizer state, random generators and scheduler back, and forgets
        the snapshots after it (they hold the abandoned trajectory)."""
        self.before_update()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        n_model = len(snapshot.tensors) - len(snapshot.optimizer_keys)
        live = [_local(p.detach()) for p in self.model.parameters()] + [_local(b) for b in self.model.buffers()]
        with torch.no_grad():
            for dst, src in zip(live, snapshot.tensors[:n_model]):
                dst.copy_(src)
            current = {(i, key): value for i, p in enumerate(params) for key, value in self.optimizer.state.get(p, {}).items()}
            self.optimizer.state.clear()
            for (index, key), saved in zip(snapshot.optimizer_keys, snapshot.tensors[n_model:]):
                self.optimizer.state[params[index]][key] = _into(current.get((index, key)), saved, params[index])
            for (index, key), value in snapshot.optimizer_values.items():
                self.optimizer.state[params[index]][key] = copy.deepcopy(value)
            for group, saved_group in zip(self.optimizer.param_groups, snapshot.param_groups):
                group.update(copy.deepcopy(saved_group))  # a scheduler's LR lives here
        torch.set_rng_state(snapshot.random_state["torch"])
        if "cuda" in snapshot.random_state:
            torch.cuda.set_rng_state(snapshot.random_state["cuda"])
        if "host" in snapshot.random_state:
            python_state, (name, keys, position, has_gauss, gauss) = snapshot.random_state["host"]
            random.setstate(python_state)
            np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        if snapshot.scheduler_state is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler_state))
        self.discard_after(snapshot.step)

    def discard_after(self, step: int) -> None:
        """Forgets the snapshots after `step`, in memory and in the files: a restart must not resume the
        trajectory a rollback abandoned."""
        if self._writing is not None:
            self._writing.result()
        while self.kept and self.kept[-1].step > step:
            self.kept.pop()
        if self.files is not None:
            self.files.remove(after=step)

    def close(self) -> None:
        self.before_update()
        self._thread.shutdown()
        if self.files is not None:
            self.files.remove()


def _into(existing: object, saved: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The optimizer's state tensor holding `saved`: the existing one, copied into (it keeps its device and
    sharding), or, where the state was dropped since (a snapshot taken before the first update was restored
    meanwhile), a new one: beside its parameter, or on the host for a scalar (Adam's step count)."""
    if isinstance(existing, torch.Tensor) and _local(existing).shape == saved.shape:
        _local(existing).copy_(saved)
        return existing
    value = saved.clone() if saved.dim() == 0 else saved.to(_local(param).device, copy=True)
    if isinstance(param, DTensor) and saved.dim() > 0:
        value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
    return value


def _same_shapes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


class SnapshotFiles:
    """This rank's newest snapshots as files in host memory (a tmpfs such as /dev/shm). They outlive the worker,
    not the machine: a restart on the same nodes resumes from them.

    Each snapshot's tensors go byte for byte into one of KEEP slot files, mapped into memory (`_slot`), beside
    a small record of everything else named by its step (torch.save of plain values: read back with
    weights_only=True). A copy into a mapped slot took 1.9 ms of processor time for a 5 MB state in 300
    tensors, torch.save of the same tensors 19-27 ms. The record is renamed into place after its slot is
    written, and removed before its slot is written again, so a record named by step always has its tensors
    whole.

    A tmpfs is memory, and a run killed with SIGKILL cannot remove its folder. So every process using a folder
    holds a shared lock on its ALIVE file, and the first rank of each node, when it starts, removes the
    folders of other runs that nobody holds and nothing has written to for ABANDONED_S (`sweep_abandoned`):
    a run between two worker groups (a restart) holds no lock for a second or two, never for minutes."""

    KEEP = 2  # a rank killed while writing one still has the one before, which its peers have too
    ALIGN = 64  # each tensor starts at a multiple of this many bytes in its slot
    ALIVE = ".alive"
    ABANDONED_S = 600.0

    def __init__(self, folder: Path, rank: int, identity: dict):
        self.folder, self.rank = folder, rank
        self._alive = _hold_shared(folder / self.ALIVE)  # open for this object's life: the folder is in use
        if os.environ.get("LOCAL_RANK", "0") == "0":
            sweep_abandoned(folder.parent, folder, self.ABANDONED_S)
        self.identity = identity  # the model, data, layout and world the files belong to: others are not loaded
        self.failed = False  # a write failed (a full tmpfs): memory only from then on
        self._slots: dict[int, torch.Tensor] = {}  # slot number: its file, mapped (bytes)
        self._slot_of: dict[int, int | None] = {}  # step of a record: the slot its tensors are in (None: unreadable)
        self._views: dict[int, tuple[list, list[torch.Tensor], str]] = {}  # slot: (tensor kinds, their views in it, layout)

    def _path(self, step: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-step{step:08d}.pt"

    def _slot_path(self, slot: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-slot{slot}.bin"

    def steps(self) -> list[int]:
        """The steps this rank has a complete file of, oldest first."""
        prefix = f"rank{self.rank:05d}-step"
        found = self.folder.glob(f"{prefix}*.pt") if self.folder.is_dir() else []
        return sorted(int(p.stem.removeprefix(prefix)) for p in found)

    def _layout(self, tensors: list[torch.Tensor]) -> tuple[list[tuple[int, str, list[int]]], int]:
        """(offset, dtype name, shape) of each tensor in a slot, and the slot's size in bytes."""
        layout, offset = [], 0
        for t in tensors:
            layout.append((offset, str(t.dtype).removeprefix("torch."), list(t.shape)))
            offset += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        return layout, offset

    def _views_in(self, slot: int, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], str]:
        """Views of the slot file, one a tensor, and their layout as JSON; made once for a slot and kept while
        the tensors keep their dtypes and shapes."""
        kinds = [(t.dtype, t.shape) for t in tensors]
        cached = self._views.get(slot)
        if cached is None or cached[0] != kinds:
            layout, size = self._layout(tensors)
            mapped = self._slot(slot, size)
            views = [_tensor_at(mapped, offset, t.dtype, t.shape) for (offset, _, _), t in zip(layout, tensors)]
            cached = self._views[slot] = (kinds, views, json.dumps(layout))
        return cached[1], cached[2]

    def _slot(self, slot: int, size: int) -> torch.Tensor:
        """The slot file, `size` bytes, mapped. Its space is taken when it is made (posix_fallocate): a tmpfs
        too full for it fails here, with an error, rather than in a write into the mapping, with SIGBUS."""
        mapped = self._slots.get(slot)
        if mapped is None or mapped.numel() != size:
            self._slots.pop(slot, None)
            path = self._slot_path(slot)
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            finally:
                os.close(fd)
            mapped = self._slots[slot] = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)
        return mapped

    def write(self, snapshot: Snapshot) -> None:
        if self.failed:
            return
        final = self._path(snapshot.step)
        partial = final.with_name(f".{final.name}.partial")  # renamed when complete: a file named by step is whole
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            recorded = self.steps()
            # Not the slot of the newest record (a restart may have just restored it, and snapshots that step
            # again), and the records whose tensors are in the slot taken go first.
            newest = self._record_slot(recorded[-1]) if recorded else None
            slot = 0 if newest is None else (newest + 1) % self.KEEP
            for step in recorded:
                if self._record_slot(step) in (slot, None):
                    self._path(step).unlink(missing_ok=True)
                    self._slot_of.pop(step, None)
            views, layout = self._views_in(slot, snapshot.tensors)
            torch._foreach_copy_(views, snapshot.tensors)
            record = {
                "identity": self.identity,
                "step": snapshot.step,
                "slot": slot,
                # Lists of hundreds of entries as JSON text: torch.save pickles one object a string, but each
                # element of a list through a Python hook (9 ms of a snapshot's 17 for 400 tensors).
                "layout": layout,
                "optimizer_keys": json.dumps(snapshot.optimizer_keys),
                "optimizer_values": list(snapshot.optimizer_values.items()),
                "param_groups": snapshot.param_groups,
                "train_state": snapshot.train_state,
                "random_state": snapshot.random_state,
                "scheduler_state": snapshot.scheduler_state,
            }
            torch.save(record, partial)
            os.rename(partial, final)
            self._slot_of[snapshot.step] = slot
        except Exception as e:  # noqa: BLE001 (a full tmpfs: OSError, or RuntimeError from torch's writer; a state torch cannot save)
            self.failed = True
            partial.unlink(missing_ok=True)
            log.warning(
                "snapshots: cannot write %s: %s (%s); a restart goes back to the newest checkpoint", final, e, free_space(self.folder)
            )
            return

    def _record_slot(self, step: int) -> int | None:
        """The slot the record of `step` has its tensors in (None: unreadable)."""
        if step not in self._slot_of:
            try:
                self._slot_of[step] = int(torch.load(self._path(step), weights_only=True)["slot"])
            except Exception:  # noqa: BLE001 (unreadable: it goes)
                self._slot_of[step] = None
        return self._slot_of[step]

    def read(self, step: int) -> Snapshot | None:
        """The snapshot of `step`, or None when it cannot be read or belongs to another model, data or layout.
        Its tensors are this process's own copies, not views of the slot a later snapshot writes into."""
        try:
            record = torch.load(self._path(step), weights_only=True)
            if record["identity"] != self.identity:
                return None
            layout = json.loads(record["layout"])
            size = self._layout_size(layout)
            data = torch.from_file(str(self._slot_path(record["slot"])), shared=False, size=max(size, 1), dtype=torch.uint8)
            tensors = [_tensor_at(data, offset, getattr(torch, dtype), shape) for offset, dtype, shape in layout]
        except Exception as e:  # noqa: BLE001 (any unreadable file means: go back to the checkpoint)
            log.warning("snapshots: cannot read %s: %s", self._path(step), e)
            return None
        return Snapshot(
            record["step"], tensors, [tuple(k) for k in json.loads(record["optimizer_keys"])],
            {tuple(k): v for k, v in record["optimizer_values"]}, record["param_groups"], record["train_state"],
            record["random_state"], record["scheduler_state"],
        )  # fmt: skip

    def _layout_size(self, layout: list[tuple[int, str, list[int]]]) -> int:
        if not layout:
            return 0
        offset, dtype, shape = layout[-1]
        return offset + math.prod(shape) * getattr(torch, dtype).itemsize

    def remove(self, after: int | None = None) -> None:
        """Removes this rank's files (after `after` only, when given; its slots then stay, for the next
        snapshots). The folder stays: another rank may be about to write into it (ranks of several nodes share
        one /dev/shm when the nodes share a machine); `keel train` removes it when it exits."""
        for step in self.steps():
            if after is None or step > after:
                self._path(step).unlink(missing_ok=True)
                self._slot_of.pop(step, None)
        if after is None:
            self._slots.clear()
            self._views.clear()
            for slot in range(self.KEEP):
                self._slot_path(slot).unlink(missing_ok=True)


def _hold_shared(path: Path) -> IO[bytes] | None:
    """The file at `path`, made if need be, open and share-locked (flock); None where it cannot be (the write
    that fails later says why)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("ab")
        fcntl.flock(handle, fcntl.LOCK_SH)
    except OSError:
        return None
    return handle


def sweep_abandoned(parent: Path, own: Path, idle_s: float) -> None:
    """Removes the snapshot folders in `parent` (other than `own`) whose ALIVE file nobody holds a lock on and
    in which nothing changed for `idle_s` seconds: what runs killed without a chance to clean up left."""
    removed, freed = 0, 0
    for folder in parent.glob(own.name.rsplit("-", 1)[0] + "-*"):
        if folder == own or not folder.is_dir() or _in_use(folder / SnapshotFiles.ALIVE):
            continue
        try:
            files = [p.stat() for p in folder.iterdir()]
            newest = max([f.st_mtime for f in files] + [folder.stat().st_mtime])
        except OSError:
            continue
        if time.time() - newest >= idle_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed, freed = removed + 1, freed + sum(f.st_blocks * 512 for f in files)
    if removed:
        log.info(
            "snapshots: removed %d folders in %s (%.0f MB) left by runs that ended without removing them", removed, parent, freed / 2**20
        )


def _in_use(alive: Path) -> bool:
    try:
        with alive.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except OSError:  # held (or unreadable: leave it)
        return True
    return False


def _tensor_at(data: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes start at `offset` of `data` (bytes)."""
    numel = math.prod(shape)
    return data[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)


def agree_on_files(files: SnapshotFiles | None, newest_checkpoint: int, world: int, device: torch.device) -> tuple[Snapshot | None, int]:
    """Collective, at a restart: (the snapshot every rank has a file of, of the newest such step, when it is
    newer than the newest checkpoint and every rank can read its own, else None; the newest checkpoint's
    step), the same on every rank. `newest_checkpoint`: rank 0's view (-1: none), the one that counts."""
    mine = (files.steps() if files is not None else [], newest_checkpoint)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    common = set.intersection(*(set(steps) for steps, _ in everyone))
    step, newest_checkpoint = max(common, default=-1), everyone[0][1]
    if step <= newest_checkpoint:
        return None, newest_checkpoint
    snapshot = files.read(step)
    readable = torch.tensor([int(snapshot is not None)], device=device)
    if world > 1:
        dist.all_reduce(readable, op=dist.ReduceOp.MIN)
    return (snapshot if bool(readable) else None), newest_checkpoint
