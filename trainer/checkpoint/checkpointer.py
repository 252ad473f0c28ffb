"""Checkpoints: DCP sharded saves written in the background, made atomic and verifiable by a manifest.

A save is written by every rank into checkpoints/.tmp-step-XXXXXXXX with torch.distributed.checkpoint
(async_save: the state is copied aside in the background while the next step computes, and the
optimizer waits for the copy only if it is not done yet). When DCP reports the whole save
complete, rank 0 hashes every file, writes manifest.json (step, sha256 per file, the model's shape,
the data and the parallel layout (keel.trainer.checkpoint.manifest), the code version, the trainer's own state) and
renames the folder to step-XXXXXXXX. A folder without that name was never finished and is never loaded.
Loading verifies the hashes; a corrupt checkpoint is renamed *.corrupt, reported, and the next older one
is tried. A resume also refuses a checkpoint of another model or data.

The model is any module (Keel's trainer passes its pipeline parts as one `WholeModel`; a user's loop its
own model, DDP or FSDP2), with its optimizer; a user's loop adds its LR scheduler and the host's random
generators (Python's, NumPy's), pickled into the checkpoint as bytes (DCP stores a non-tensor as an object).
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import logging
import os
import pickle
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from keel.monitor.checkpoints import verify
from keel.monitor.free_space import free_bytes, free_space
from keel.monitor.hashing import sha256_file
from keel.monitor.run_dir import CHECKPOINT_DIR, MANIFEST, checkpoint_name, list_checkpoints
from keel.trainer.checkpoint.manifest import config_record, vet_resume
from keel.trainer.checkpoint.snapshots import Snapshot, SnapshotFiles, Snapshots, agree_on_files
from keel.trainer.config import CheckpointConfig, JobConfig

log = logging.getLogger("keel.checkpoint")

# Optimizer state and param-group settings keyed by parameter name ("param_groups.layers.3...lr"). The
# nested form keys groups by position, and pipeline stages have different groups under the same
# position: DCP would keep one stage's and hand it to every rank.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Less free space than this where a save failed: the disk is full, whatever error the writer raised.
_FULL_BYTES = 1 << 20


def _free_name(path: Path, suffix: str) -> Path:
    """path + suffix, or + suffix-2, -3, ... when that exists (the same step can go bad twice)."""
    candidate, n = path.with_name(path.name + suffix), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{suffix}-{n}")
    return candidate


class WholeModel(nn.Module):
    """This rank's model parts seen as one module, so state-dict keys are the single model's names
    (layers.7.attention.wq.weight), whatever the pipeline split: checkpoints do not depend on the layout."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({k: v for part in parts for k, v in part.layers.items()})
        for name in ("tok_embeddings", "norm", "output"):
            for part in parts:
                if getattr(part, name, None) is not None:
                    setattr(self, name, getattr(part, name))


@dataclass
class SaveResult:
    """A finished (or failed) save, for rank 0 to record."""

    step: int
    path: Path
    blocking_s: float
    total_s: float
    error: str | None = None
    removed: list[str] = field(default_factory=list)


@dataclass
class Restored:
    step: int
    path: Path
    train_state: dict
    load_s: float
    corrupt: list[str]  # what was wrong with each newer checkpoint that was passed over
    layout_change: str | None = None  # a resume at another parallel layout: what changed
    in_memory: bool = False  # restored from an in-memory snapshot (keel.trainer.checkpoint.snapshots), not from `path`

    @property
    def label(self) -> str:
        """What was restored, as events name it."""
        return f"the in-memory snapshot of step {self.step}" if self.in_memory else self.path.name


class Checkpointer:
    """Saves and loads this rank's share of the model and optimizer. Every method is called by all
    ranks at the same step (the decisions come from agreed values), except `poll`, which only rank 0 uses."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        world: int,
        manifest_info: dict,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        host_rng: bool = False,
        snapshot_lookback_steps: int = 0,
    ):
        self.cfg, self.rank, self.world = cfg, rank, world
        if world == 1:
            # One process saves and loads without a process group on purpose; DCP warns about it on every
            # call, an async save from DCP's own upload thread, later: no catch_warnings block around our
            # calls would cover that. So the filter comes with the checkpointer, not the import, and
            # matches DCP's message from DCP only.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized", module=r"torch\.distributed\.checkpoint"
            )
        self.dir = Path(run_dir) / CHECKPOINT_DIR
        self.model, self.optimizer, self.scheduler, self.host_rng = model, optimizer, scheduler, host_rng
        self.manifest_info = manifest_info  # this run's model, data, layout and code, as a manifest records them
        # A save in flight runs its own collectives from DCP's thread; a group of its own keeps them
        # from interleaving with the training collectives.
        self.group = dist.new_group(backend="gloo") if world > 1 and cfg.async_save else None
        # One staging thread, and one stager that keeps its CPU buffers from save to save (allocating
        # them anew made every save block four times longer).
        self._stage_thread = ThreadPoolExecutor(1, thread_name_prefix="keel-ckpt-stage")
        cuda = torch.cuda.is_available()
        self.stager = (
            DefaultStager(
                StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda)
            )
            if cfg.async_save
            else None
        )
        self.staging: Future | None = None  # staging, then DCP's upload future
        self.blocking_s = 0.0  # how long training waited for the save in flight
        self._finalized = threading.Event()
        self._finalized.set()
        self._results: list[SaveResult] = []
        self._lock = threading.Lock()
        # The state on disk (saved, or just loaded), and when: an agreed time, the same on every rank (a save is a
        # collective), so None until the first step's agreed time after a start or a load.
        self.saved_step, self.saved_time = 0, None
        self.failed_in_row = 0  # saves that failed since the last one that succeeded (every rank counts those it saw)
        self.last_error = ""  # the cause of the last failed save, in one line (rank 0)
        self.corrupt: list[str] = []
        # Rollbacks and restarts restore from memory when they can: see keel.trainer.checkpoint.snapshots.
        folder = cfg.snapshot_folder(run_dir)
        self.files = None if folder is None else SnapshotFiles(folder, rank, {**manifest_info, "world": world})
        self.snapshots = Snapshots(
            model, optimizer, scheduler, host_rng, cfg.snapshot_cost, cfg.snapshot_every_steps, snapshot_lookback_steps, self.files
        )

    @property
    def enabled(self) -> bool:
        return self.cfg.interval_steps > 0 or self.cfg.interval_minutes > 0

    # -- saving ---------------------------------------------------------------------------------

    def maybe_save(
        self, step: int, now: float, last_step: bool, train_state: Callable[[], dict], before_save: Callable[[], None] = lambda: None
    ) -> bool:
        """Saves the state after `step` when a save is due: interval_steps or interval_minutes after the
        state on disk, and after the run's last step whenever checkpointing is on. `now` must be the same
        on every rank (an agreed time). When saving, calls `before_save()`, then `train_state()` for the
        manifest. Returns whether a save started."""
        by_steps = self.cfg.interval_steps > 0 and step - self.saved_step >= self.cfg.interval_steps
        if self.saved_time is None:
            self.saved_time = now
        by_time = self.cfg.interval_minutes > 0 and now - self.saved_time >= 60 * self.cfg.interval_minutes
        # The interval does not apply to a step already on disk (the checkpoint just restored).
        if not ((step > self.saved_step and (by_steps or by_time)) or (last_step and self.enabled)):
            return False
        before_save()
        self.save(step, train_state(), now)
        return True

    def check_saveable(self) -> None:
        """Builds the state a save writes, without writing it: torch's error, at once, for a model or optimizer
        that cannot be saved, rather than at the first save."""
        self._state()

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        rng = {f"rank{self.rank}": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng[f"cuda_rank{self.rank}"] = torch.cuda.get_rng_state()
        if self.host_rng:
            rng[f"host_rank{self.rank}"] = pickle.dumps((random.getstate(), np.random.get_state()))
        state = {"model": model_sd, "optim": optim_sd, "rng": rng}
        if self.scheduler is not None:
            state["lr_scheduler"] = pickle.dumps(self.scheduler.state_dict())
        return state

    def save(self, step: int, train_state: dict, now: float) -> float:
        """Starts saving the state after `step`; returns how long this call blocked (seconds).

        With async_save the state is staged (copied aside) by a background thread while the next
        step's forward and backward run; `before_update` waits for the copy before the optimizer may
        change what is being copied. The files are then written by DCP's own thread."""
        started = time.perf_counter()
        self.wait()
        tmp = self.dir / f".tmp-{checkpoint_name(step)}"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # left by a run that died mid-save
        if self.world > 1:
            dist.barrier()
        state = self._state()
        self.saved_step, self.saved_time = step, now
        self._finalized.clear()
        if self.cfg.async_save:

            def stage_and_start() -> Future:
                return dcp.async_save(state, checkpoint_id=tmp, process_group=self.group, async_stager=self.stager)

            self.staging = self._stage_thread.submit(stage_and_start)
            self.blocking_s = time.perf_counter() - started
            self.staging.add_done_callback(lambda f: self._staged(f, step, tmp, train_state, started))
        else:
            done: Future = Future()
            try:
                dcp.save(state, checkpoint_id=tmp)
                done.set_result(None)
            except (Exception, CheckpointException) as e:  # recorded by _finish; training goes on
                done.set_exception(e)
            self.blocking_s = time.perf_counter() - started
            self._finish(done, step, tmp, train_state, started)
        return self.blocking_s

    def before_update(self) -> None:
        """Called before the optimizer changes the parameters: waits until a save or a snapshot in flight has copied them."""
        self.snapshots.before_update()
        if self.staging is not None and not self.staging.done():
            started = time.perf_counter()
            wait_for([self.staging])
            self.blocking_s += time.perf_counter() - started

    def _staged(self, staging: Future, step: int, tmp: Path, train_state: dict, started: float) -> None:
        if staging.exception() is not None:
            self._finish(staging, step, tmp, train_state, started)
        else:
            staging.result().add_done_callback(lambda upload: self._finish(upload, step, tmp, train_state, started))

    def _finish(self, future: Future, step: int, tmp: Path, train_state: dict, started: float) -> None:
        """Runs when this rank's part of a save is complete. On rank 0 that means the whole save is
        (DCP's coordinator writes the metadata after every rank reported its files): seal it. A save that
        failed is counted in `failed_in_row` (on every rank that saw it fail) and training goes on."""
        try:
            if self.rank != 0:
                self.failed_in_row = 0 if future.exception() is None else self.failed_in_row + 1
                return
            final = self.dir / checkpoint_name(step)
            error = None if future.exception() is None else save_error(future.exception(), tmp)
            removed: list[str] = []
            if error is None:
                try:
                    self._seal(step, tmp, final, train_state)
                    removed = self._apply_retention()
                    self.failed_in_row = 0
                except OSError as e:
                    error = save_error(e, tmp)
            if error is not None:
                self.last_error = error
                shutil.rmtree(tmp, ignore_errors=True)  # never loadable, and it holds the space a retry needs
                self.failed_in_row += 1
            with self._lock:
                self._results.append(SaveResult(step, final, self.blocking_s, time.perf_counter() - started, error, removed))
        finally:
            self._finalized.set()

    def _seal(self, step: int, tmp: Path, final: Path, train_state: dict) -> None:
        missing = missing_shards(tmp)
        if missing:
            raise FileNotFoundError(f"{tmp}: shards {', '.join(missing)} named by the checkpoint's metadata are missing")
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"step": step, "time": time.time(), **self.manifest_info, "train_state": train_state, "files": files}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a step saved again after a rollback or restart replaces the old save
            shutil.rmtree(final)
        os.rename(tmp, final)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    def _apply_retention(self) -> list[str]:
        """Keeps the newest `keep` checkpoints and the newest one at least `keep_lookback_steps` older
        than the newest, so a spike found late can still roll back past several recent saves. The oldest
        one younger than that is kept too, until it is that old: otherwise each save would be removed
        before it grew old enough (whenever `keep` saves span fewer steps), and none would ever be kept."""
        found = list_checkpoints(self.dir.parent)
        if not found:
            return []
        keep = {p for _, p in found[-self.cfg.keep :]}
        newest = found[-1][0]
        older = [p for s, p in found if s <= newest - self.cfg.keep_lookback_steps]
        younger = [p for s, p in found if s > newest - self.cfg.keep_lookback_steps]
        if older:
            keep.add(older[-1])
        if younger:
            keep.add(younger[0])
        removed = []
        for _, p in found:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    def poll(self) -> list[SaveResult]:
        """Saves that finished since the last call (rank 0)."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def wait(self) -> None:
        """Blocks until this rank's save in flight is written (and sealed, on rank 0), or failed: a failed
        save is recorded (`_finish`, `poll`), never raised, and the next save tries again."""
        if self.staging is not None:
            wait_for([self.staging])
            if self.staging.exception() is None:
                wait_for([self.staging.result()])
            self.staging = None
        self._finalized.wait()

    def close(self) -> None:
        self.wait()
        self.snapshots.close()
        self._stage_thread.shutdown()
        if self.stager is not None:
            self.stager.close()

    # -- loading --------------------------------------------------------------------------------

    def _remove_partial_saves(self) -> None:
        """The temporary folders of saves that never completed (their processes killed mid-save): none is
        in flight when a run starts, and none could ever be loaded."""
        for partial in self.dir.glob(".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
            log.info("removed %s, a save that never completed", partial.name)

    def resume_latest(self, device: torch.device) -> Restored | None:
        """At a restart or resume: the newest state there is, from the snapshot files every rank has (a restart
        on the same nodes: keel.trainer.checkpoint.snapshots) when they are newer than the newest checkpoint,
        else from that checkpoint (load_latest). Collective."""
        started = time.perf_counter()
        newest = -1
        if self.rank == 0:
            self._remove_partial_saves()
            found = list_checkpoints(self.dir.parent)
            newest = found[-1][0] if found else -1
        snapshot = None
        if self.snapshots.enabled:
            snapshot, newest = agree_on_files(self.files, newest, self.world, device)
        if snapshot is None:
            return self.load_latest(resuming=True)
        self.saved_step, self.saved_time = max(newest, 0), None  # rank 0's newest, agreed: a save is a collective
        return self._restore_snapshot(snapshot, started)

    def load_latest(self, before_step: int | None = None, resuming: bool = False) -> Restored | None:
        """Loads the newest checkpoint that verifies (and, with `before_step`, was saved before that step).
        Collective: rank 0 chooses, every rank loads the same one. None when there is none. When
        `resuming`, a checkpoint of another model or data is not loaded: every rank reads the same
        manifest and raises the same ConfigError."""
        self.wait()
        started = time.perf_counter()
        choice: list = [None, []]
        if self.rank == 0:
            choice = self._choose(before_step)
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        step, corrupt = choice
        self.corrupt = corrupt  # what was wrong with each checkpoint passed over, also when none was good
        if step is None:
            return None
        path = self.dir / checkpoint_name(step)
        manifest = json.loads((path / MANIFEST).read_text())
        layout_change = vet_resume(manifest, path, self.manifest_info) if resuming else None
        state = self._state()
        # A resume on more ranks than saved the checkpoint: a rank it has no generator state for keeps its own.
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state["rng"] = {key: value for key, value in state["rng"].items() if f"rng.{key}" in saved}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)
        self.snapshots.forget_live_tensors()
        if f"rank{self.rank}" in state["rng"]:
            torch.set_rng_state(state["rng"][f"rank{self.rank}"])
        if f"cuda_rank{self.rank}" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"][f"cuda_rank{self.rank}"])
        if f"host_rank{self.rank}" in state["rng"]:
            python_state, numpy_state = pickle.loads(state["rng"][f"host_rank{self.rank}"])
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(pickle.loads(state["lr_scheduler"]))
        self.saved_step, self.saved_time = step, None
        if self.world > 1:
            dist.barrier()
        return Restored(step, path, manifest["train_state"], time.perf_counter() - started, corrupt, layout_change)

    def restore_before(self, before_step: int) -> Restored | None:
        """For a rollback: restores the newest state saved before `before_step`, from an in-memory snapshot
        when one is that old (every rank keeps the same ones), else from the newest good checkpoint
        (load_latest). None when there is neither."""
        started = time.perf_counter()
        snapshot = self.snapshots.newest_before(before_step)
        if snapshot is None:
            return self.load_latest(before_step=before_step)
        self.saved_step = min(self.saved_step, snapshot.step)  # the saves after it are discarded (discard_after)
        return self._restore_snapshot(snapshot, started)

    def _restore_snapshot(self, snapshot: Snapshot, started: float) -> Restored:
        self.snapshots.restore(snapshot)
        self.corrupt = []
        path = self.dir / checkpoint_name(snapshot.step)  # where a checkpoint of that step would be; not read
        return Restored(snapshot.step, path, snapshot.train_state, time.perf_counter() - started, [], in_memory=True)

    def _choose(self, before_step: int | None) -> list:
        corrupt = []
        for step, path in reversed(list_checkpoints(self.dir.parent)):
            if before_step is not None and step >= before_step:
                continue
            problem = verify(path)
            if problem is None:
                return [step, corrupt]
            log.error("checkpoint %s", problem)
            corrupt.append(problem)
            os.rename(path, _free_name(path, ".corrupt"))  # kept for a person to look at, never loaded
        return [None, corrupt]

    def discard_after(self, step: int) -> list[str]:
        """Deletes the checkpoints saved after `step` (rank 0): after a rollback they hold the abandoned
        trajectory, and a restart must not resume into it. On every rank: the snapshots after `step` too."""
        self.snapshots.discard_after(step)
        removed = []
        if self.rank == 0:
            for s, p in list_checkpoints(self.dir.parent):
                if s > step:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        return removed


def save_error(error: BaseException, folder: Path) -> str:
    """A failed save's cause in one line: the first failing rank's own error out of DCP's wrapper (whose text
    is a traceback per rank), and the space left where the save was written. A full disk shows as ENOSPC or,
    from torch's own writer, as an "unexpected pos" RuntimeError: named as what it is either way."""
    where = ""
    while isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items())
        where = f" on rank {rank}"
    text = (str(error).strip().splitlines() or [""])[0]
    free, existing = free_bytes(folder)
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or free < _FULL_BYTES
    cause = "disk full: " if full else ""
    return f"{cause}{type(error).__name__}{where}: {text} ({free_space(existing)})"


def missing_shards(folder: Path) -> list[str]:
    """The shard files DCP's metadata in `folder` names that are not there. A save with one missing must
    not be sealed: a rank that wrote elsewhere (another run directory, say) would otherwise leave a
    checkpoint whose manifest verifies and which cannot load."""
    named = {item.relative_path for item in FileSystemReader(folder).read_metadata().storage_data.values()}
    return sorted(named - {p.name for p in folder.iterdir()})


def manifest_info(cfg: JobConfig, data_version: str) -> dict:
    """What a checkpoint records about where it came from: the model, the data and the layout that a
    resume is checked against (keel.trainer.checkpoint.manifest), and the code."""
    try:
        keel_version = importlib.metadata.version("keel")
    except importlib.metadata.PackageNotFoundError:
        keel_version = "unknown"
    return {**config_record(cfg, data_version), "code_version": f"keel {keel_version}, torch {torch.__version__}"}
