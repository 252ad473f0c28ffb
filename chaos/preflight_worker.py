"""The checks of `keel preflight`, run in every worker process that keel.chaos.preflight starts with torchrun.

Every check gathers its per-rank numbers to all ranks and decides from them, so all ranks hold the
same verdicts (one rank deciding alone would leave the others waiting in the next collective), and
the local rank 0 of each node writes the rows for its launcher after every check: a worker that dies
mid-way still leaves the rows before it. The model, the pipeline schedule, the optimizer and the step
are the trainer's own (keel.trainer.parallel.parallelize, optim, step.forward_backward), at the job's layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections import Counter
from contextlib import suppress
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from keel.chaos.preflight import Check, parse_preflight_args
from keel.monitor.exits import EXIT_FAILED, EXIT_OK
from keel.monitor.run_dir import CHECKPOINT_DIR
from keel.trainer.config import JobConfig
from keel.trainer.data.blend import open_job_data
from keel.trainer.data.loader import BatchSampler
from keel.trainer.launch.launcher import parse_train_args
from keel.trainer.model_args import model_args
from keel.trainer.optim import build_optimizer, clip_grads
from keel.trainer.parallel import parallelize
from keel.trainer.parallel.distributed import PROBE_BYTES, init_distributed, probe_link
from keel.trainer.planning.memory_model import activation_bytes, busiest_rank_state_bytes
from keel.trainer.step import forward_backward
from keel.trainer.step_metrics import gather_rows

DISK_BYTES, DISK_CHUNK = 64 * 2**20, 8 * 2**20
JOIN_KEY = "keel-preflight/joined"


class Report:
    """The rows so far, rewritten after each check on the node's local rank 0 (`path` None elsewhere)."""

    def __init__(self, path: Path | None, rank: int):
        self.path, self.rank, self.checks = path, rank, []

    def add(self, check: Check) -> None:
        self.checks.append(check)
        if self.rank == 0:  # progress for the person waiting; the launcher prints the table at the end
            print(f"keel preflight: {check.name}: {check.result}", file=sys.stderr, flush=True)
        self._write(complete=False)

    def finish(self) -> None:
        self._write(complete=True)

    def _write(self, complete: bool) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"complete": complete, "checks": [asdict(c) for c in self.checks]}))
        os.replace(tmp, self.path)  # the launcher never reads half a file


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def _gather_objects(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --- a. every rank reachable ---------------------------------------------------------------------


def wait_for_ranks(rank: int, world: int, timeout_s: float) -> list[int]:
    """The ranks that did not announce themselves within `timeout_s`, on rank 0 ([] elsewhere). Each rank
    sets a key in torchrun's store before joining the process group, so a rank that never gets there
    (a dead GPU, a hung import) is named, where the group's own init would only time out."""
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store.set(f"{JOIN_KEY}/{rank}", "1")
    if rank != 0:
        return []
    keys = [f"{JOIN_KEY}/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
        return []
    except dist.DistStoreError:
        return [r for r, key in enumerate(keys) if not store.check([key])]


def missing_ranks_check(missing: list[int], world: int, timeout_s: float) -> Check:
    return Check(
        "ranks reachable",
        "fail",
        f"rank(s) {missing} did not start within {timeout_s:g} s (--timeout); {world - len(missing)} of {world} did",
        {"missing": missing},
    )


def reachable(device: torch.device, rank: int, world: int, started: float) -> Check:
    """Every rank's (rank, host, pid, device) over the whole group: the group formed and carries a collective."""
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": _device_name(device), "wait_s": time.time() - started}
    ranks = _gather_objects(me, world)
    hosts = Counter((r["host"], r["device"]) for r in ranks)
    where = ", ".join(f"{host} ({n}x {dev})" for (host, dev), n in hosts.items())
    wait_s = max(r["wait_s"] for r in ranks)  # the rank that started first waited for the last one
    return Check(
        "ranks reachable",
        "pass",
        f"{len(ranks)}/{world} ranks in the group within {wait_s:.1f} s of starting: {where}",
        {"ranks": ranks, "wait_s": wait_s},
    )


# --- b. collective bandwidth per mesh dim ----------------------------------------------------------


def bandwidth(dim: str, layout: parallelize.Layout, device: torch.device, min_gbps: float) -> Check:
    """Timed all-reduces on this dim's process groups: 8 MiB for bandwidth, 4 bytes for latency. The
    slowest group sets the number, as it sets the pace of a step."""
    n = getattr(layout, dim)
    bus_bytes_per_s, small_s = probe_link(layout.group(dim), n, device)
    bus_gbps = bus_bytes_per_s / 1e9
    ok = bus_gbps >= min_gbps
    floor = f" (minimum {min_gbps:g})" if min_gbps > 0 else ""
    detail = f"bus {bus_gbps:.3g} GB/s{floor} (8 MiB all-reduce over {n} ranks), latency {small_s * 1e3:.3g} ms"
    return Check(
        f"bandwidth {dim}", "pass" if ok else "fail", detail, {"ranks": n, "bytes": PROBE_BYTES, "bus_gbps": bus_gbps, "latency_s": small_s}
    )


# --- c. checkpoint disk ----------------------------------------------------------------------------


def disk_speed(folder: Path) -> dict:
    """Writes DISK_BYTES into `folder` with an fsync, reads them back from the disk (not the page cache)
    and removes the file and any folder made for it. {"write_mbps", "read_mbps"} or {"error"}."""
    made = []  # folders that did not exist, deepest first: removed again, so a run dir that does not exist yet stays so
    probe = folder
    while not probe.exists() and probe != probe.parent:
        made.append(probe)
        probe = probe.parent
    path = folder / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        chunk = os.urandom(DISK_CHUNK)  # random bytes: a compressing or deduplicating file system cannot shortcut them
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(DISK_BYTES // DISK_CHUNK):
                f.write(chunk)
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        buf = bytearray(DISK_CHUNK)
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # drop the cached pages, so the read hits the disk
            t0 = time.perf_counter()
            while f.readinto(buf):
                pass
            read_s = time.perf_counter() - t0
        return {"write_mbps": DISK_BYTES / 1e6 / write_s, "read_mbps": DISK_BYTES / 1e6 / read_s}
    except OSError as e:
        if not probe.is_dir():
            return {
                "error": f"'{probe}' is a file, not a directory, so checkpoints cannot be saved in {folder}; move it or pass another --run-dir"
            }
        return {"error": f"cannot write a file in {folder} ({e.strerror}), so checkpoints cannot be saved there; pass another --run-dir"}
    finally:
        with suppress(OSError):  # gone already, or never made (its folder is a file)
            path.unlink()
        for d in made:
            try:
                d.rmdir()
            except OSError:  # not empty: something else wrote there meanwhile, so it stays
                break


def checkpoint_disk(run_dir: str, world: int, local_rank: int) -> Check:
    """One writer per node (each node writes its own shards at a save); the slowest node is reported."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    mine = {"host": socket.gethostname(), **disk_speed(folder)} if local_rank == 0 else None
    nodes = [r for r in _gather_objects(mine, world) if r is not None]
    errors = [f"{r['host']}: {r['error']}" for r in nodes if "error" in r]
    if errors:
        return Check("checkpoint disk", "fail", "; ".join(errors), {"nodes": nodes})
    write, read = min(r["write_mbps"] for r in nodes), min(r["read_mbps"] for r in nodes)
    where = f"{len(nodes)} nodes, slowest: " if len(nodes) > 1 else ""
    return Check(
        "checkpoint disk",
        "pass",
        f"{folder}: {where}write {write:.0f} MB/s (fsync), read {read:.0f} MB/s, 64 MiB",
        {"folder": str(folder), "nodes": nodes, "write_mbps": write, "read_mbps": read},
    )


# --- d. memory -------------------------------------------------------------------------------------


def free_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for this rank, where the number comes from)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return available_kib * 1024 // local_ranks, f"MemAvailable / {local_ranks} local ranks"


def memory(cfg: JobConfig, device: torch.device, world: int, limit: int | None) -> Check:
    # The planner's memory model (keel plan), in the dtype this job trains in on this device.
    element = 2 if cfg.training.bf16(on_gpu=device.type == "cuda") else 4
    states, activations = busiest_rank_state_bytes(cfg, gathered_bytes=element), activation_bytes(cfg, element_bytes=element)
    need = states + activations
    free, basis = (limit, "--memory-limit-bytes") if limit is not None else free_memory(device)
    lowest = int(gather_rows([float(free)], device, world).min())
    ok = need <= lowest
    detail = (
        f"need {_human(need)} per rank (estimate: states {_human(states)} + activations {_human(activations)}), "
        f"{'free' if ok else 'but only'} {_human(lowest)} ({basis}{', lowest rank' if world > 1 else ''})"
    )
    return Check(
        "memory",
        "pass" if ok else "fail",
        detail,
        {"need_bytes": need, "state_bytes": states, "activation_bytes": activations, "free_bytes": lowest, "basis": basis},
    )


# --- e. tiny overfit -------------------------------------------------------------------------------


def _agreed_loss(loss: torch.Tensor | None, device: torch.device, world: int) -> float:
    """The step's loss on every rank: the mean over the ranks that hold the last pipeline stage."""
    has, values = gather_rows([0.0 if loss is None else 1.0, 0.0 if loss is None else loss.item()], device, world).T
    return float(values[has > 0].mean())


def overfit(cfg: JobConfig, layout: parallelize.Layout, device: torch.device, world: int, steps: int) -> Check:
    """The real model at the job's layout trains `steps` steps on the job's first batch, at the job's LR held
    constant (no warmup: a warmup sized for a long run would leave nothing to see in a few steps). A
    model, a sharding or a pipeline that does not learn cannot memorize one batch."""
    bf16, autocast = parallelize.mixed_precision(cfg, device)
    parts = parallelize.build_model_parts(cfg, model_args(cfg), layout, device, bf16)
    schedule = parallelize.build_schedule(cfg, parts, layout, device, parallelize.loss_fn) if layout.pp > 1 else None
    optimizer = build_optimizer(parts, cfg.optim)
    data = open_job_data(cfg)
    sampler = BatchSampler(
        data.tokens, cfg.data.seq_len, cfg.training.global_batch_size, layout.dp_rank, layout.dp, cfg.training.seed, weights=data.weights
    )
    inputs, targets = (torch.from_numpy(a).to(device) for a in sampler.next_batch())
    t0, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        loss = forward_backward(cfg, parts, schedule, layout, inputs, targets, autocast, parallelize.loss_fn)
        if cfg.parallel.dp > 1 and cfg.parallel.dp_mode == "replicate":
            parallelize.all_reduce_replicated_grads(parts, layout)
        grad_norm = parallelize.global_grad_norm(parts, layout, loss is None or bool(torch.isfinite(loss))).item()
        losses.append(_agreed_loss(loss, device, world))
        if not math.isfinite(grad_norm):  # the same verdict on every rank: the norm is all-reduced
            return Check("overfit", "fail", f"a loss or gradient is not finite at step {step} (loss {losses[-1]:.4g})", {"losses": losses})
        clip_grads(parts, cfg.optim.grad_clip, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    first, last = losses[0], losses[-1]
    ok = last < 0.5 * first
    detail = f"loss {first:.3f} -> {last:.3f} in {steps} steps on one batch ({'below' if ok else 'not below'} half, {time.perf_counter() - t0:.1f} s)"
    return Check("overfit", "pass" if ok else "fail", detail, {"losses": losses, "first": first, "last": last, "lr": cfg.optim.lr})


def run_checks(cfg: JobConfig, opts: argparse.Namespace, local_rank: int, report: Report, started: float) -> None:
    device, rank, world = init_distributed(opts.timeout)
    report.add(reachable(device, rank, world, started))
    layout = parallelize.build_layout(cfg, device)
    for dim in ("pp", "dp", "tp"):
        if getattr(layout, dim) > 1:
            report.add(bandwidth(dim, layout, device, opts.min_bandwidth_gbps))
    report.add(checkpoint_disk(cfg.run.run_dir, world, local_rank))
    mem = memory(cfg, device, world, opts.memory_limit_bytes)
    report.add(mem)
    if mem.passed:
        report.add(overfit(cfg, layout, device, world, opts.overfit_steps))
    else:  # the overfit holds the job's memory: where that does not fit, it would only die of it
        report.add(Check("overfit", "skip", "not run: the job does not fit in memory"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    opts, train_argv = parse_preflight_args(sys.argv[1:] if argv is None else argv)
    rank, world, local_rank = (int(os.environ.get(name, default)) for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    cfg, _ = parse_train_args(train_argv, world_size=world)  # the launcher validated it already
    report = Report(Path(opts.results) if opts.results and local_rank == 0 else None, rank)
    missing = wait_for_ranks(rank, world, opts.timeout) if world > 1 else []
    if missing:
        report.add(missing_ranks_check(missing, world, opts.timeout))
        report.finish()
        return EXIT_FAILED  # torchrun then stops the ranks that are waiting for the missing ones
    run_checks(cfg, opts, local_rank, report, started)
    report.finish()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
