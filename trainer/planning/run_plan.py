"""The planner against a real run: the estimate `keel train --plan` prints before the first step and keeps
in the run, and `keel plan --check RUN_DIR`, which sets it beside what the run measured.

The estimate is keel.trainer.planning.planner's for the run's own layout, on the hardware the run found: the peak
FLOP/s of its devices (MFU's basis: a data sheet, or on CPU a matmul calibration), their memory, and the
bus bandwidth and latency of an all-reduce over all ranks, timed before the first step. On CPU, gloo's
collectives are counted whole (its threads take the cores the compute runs on) and the measured memory is
the allocator's peak on profiled steps (keel.trainer.exposed_comm.allocated_peak_bytes); on GPUs, the
peak of torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.run_dir import CONFIG_FILE, STORE_FILE
from keel.monitor.store import read_meta, read_steps
from keel.trainer.config import ConfigError, JobConfig, load_config
from keel.trainer.parallel.distributed import probe_link
from keel.trainer.planning.gpus import gpu_kind
from keel.trainer.planning.planner import CPU, Hardware, Plan, plan, plan_dict, recompute_factor
from keel.trainer.step_metrics import ALLOCATED_PEAK_META

PLAN_META = "plan"  # the run's meta key: {"hardware": ..., "plan": ...}


def run_hardware(device: torch.device, world: int, peak_flops_total: float) -> Hardware:
    """The hardware a run found; every rank calls it (the link is timed with all of them)."""
    bus_bytes_per_s, latency_s = probe_link(None, world, device) if world > 1 else (0.0, 0.0)  # one process: no link
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind, memory = gpu_kind(name) or name, torch.cuda.get_device_properties(device).total_memory
    else:
        kind, memory = CPU, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
    return Hardware(
        kind, world, local, peak_flops_total / world, memory, bus_bytes_per_s, bus_bytes_per_s,
        collective_latency_s=latency_s, overlaps_compute=device.type == "cuda",
    )  # fmt: skip


def plan_run(cfg: JobConfig, hw: Hardware) -> tuple[Plan, dict]:
    """The plan of cfg's layout on hw, and what the run keeps of it."""
    estimate = plan(cfg, hw)
    return estimate, {"hardware": asdict(hw), "plan": plan_dict(estimate), "cpu_cores": os.cpu_count()}


def shared_cores(hw: Hardware, cores: int | None) -> str | None:
    """A warning when a CPU run's ranks outnumber the machine's cores: the planner gives each rank a device
    of its own, and a rank that waits then lends its core to another instead of idling."""
    if hw.on_gpu or cores is None or hw.gpus_per_node <= cores:
        return None
    return f"note: {hw.gpus_per_node} ranks share {cores} cores here; the planner gives each a device of its own, so its times do not hold"


def keep_plan_of_run(cfg: JobConfig, device: torch.device, world: int, peak_flops_total: float, recorder) -> None:
    """`keel train --plan`: every rank times the link; rank 0 (the one with the recorder) prints the plan and
    keeps it in the run's meta."""
    hw = run_hardware(device, world, peak_flops_total)
    if recorder is None:
        return
    estimate, kept = plan_run(cfg, hw)
    print("\n".join(filter(None, [announce(estimate, hw), shared_cores(hw, kept["cpu_cores"])])), flush=True)
    recorder.store.set_meta(PLAN_META, kept)


def announce(estimate: Plan, hw: Hardware) -> str:
    """The estimate in two lines, for the console before the first step."""
    comm = ", ".join(f"{kind} {estimate.comm_bytes[kind] / 1e6:,.1f} MB" for kind in ("tp", "dp", "pp"))
    link = f"{hw.intra_node_bytes_per_s / 1e9:.3g} GB/s, {hw.collective_latency_s * 1e3:.3g} ms a collective" if hw.gpus > 1 else "none"
    return (
        f"plan: {estimate.label()}: {estimate.memory_bytes / 2**20:,.0f} MiB on the busiest rank (states "
        f"{estimate.state_bytes / 2**20:,.0f}, activations {estimate.activation_bytes / 2**20:,.0f}), bubble {estimate.bubble:.1%}, "
        f"communication {comm} a step\n"
        f"plan: step {estimate.step_s:.3g} s, {estimate.tokens_per_s:,.0f} tokens/s, MFU {estimate.mfu:.0%}, waiting {estimate.wait_share:.0%} "
        f"(link: {link}; compute at {hw.compute_efficiency:.0%} of {hw.peak_flops / 1e12:.3g} TFLOP/s a device)"
    )


# --- keel plan --check ---------------------------------------------------------------------------------

WARMUP_STEPS = 2  # the first steps pay for allocation, the profiler's start and (compiled) the compile


def measured(run_dir: Path) -> dict:
    """What the run measured after its first steps: the medians of tokens/s, step time and the comm share
    (exposed communication and the pipeline's waits, on the profiled steps), and the busiest rank's peak
    memory (None where it was not measured: a single-process CPU run profiles no step)."""
    steps = read_steps(run_dir, effective=True)
    steady = steps[steps.step > WARMUP_STEPS] if (steps.step > WARMUP_STEPS).any() else steps
    meta = read_meta(run_dir)
    if str(meta.get("device", "cpu")).startswith("cuda"):
        memory = int(steps.mem_peak_bytes.max())
    else:
        memory = max((b for b in meta.get(ALLOCATED_PEAK_META) or [] if b is not None), default=None)
    shares = steady.comm_share.dropna()
    return {
        "tokens_per_s": float(steady.tokens_per_s.median()),
        "step_s": float(steady.step_time_s.median()),
        "mfu": float(steady.mfu.median()),
        "comm_share": float(shares.median()) if len(shares) else None,
        "memory_bytes": memory,
    }


def check(run_dir: Path, compute_efficiency: float | None = None) -> dict:
    """Predicted beside measured for a finished run trained with --plan; compute_efficiency replaces the
    one the run planned with."""
    if not (run_dir / STORE_FILE).is_file():
        raise ConfigError(f"{run_dir}: no run store ({STORE_FILE}); pass the run directory of a `keel train --plan`")
    meta = read_meta(run_dir)
    if PLAN_META not in meta:
        raise ConfigError(f"{run_dir}: this run kept no plan; train it with `keel train --plan` (or --metrics.plan=true)")
    hw = Hardware(**meta[PLAN_META]["hardware"])
    if compute_efficiency is not None:
        hw = replace(hw, compute_efficiency=compute_efficiency)
    cfg = load_config(str(run_dir / CONFIG_FILE))
    estimate, got = plan(cfg, hw), measured(run_dir)
    # Where nothing waited, the run computed at MFU / (1 - wait) of the peak (full checkpointing's recompute counted).
    waited = got["comm_share"] if got["comm_share"] is not None else 0.0
    return {
        "layout": estimate.label(),
        "hardware": asdict(hw),
        "predicted": {
            "tokens_per_s": estimate.tokens_per_s,
            "step_s": estimate.step_s,
            "memory_bytes": estimate.memory_bytes,
            "comm_share": estimate.wait_share,
            "bubble": estimate.bubble,
        },
        "measured": got,
        "note": shared_cores(hw, meta[PLAN_META].get("cpu_cores")),
        "achieved_compute_efficiency": got["mfu"] * recompute_factor(cfg) / (1 - waited),
    }


def _error(predicted: float, got: float | None) -> str:
    return "" if got is None or got == 0 else f"{predicted / got - 1:+.0%}"


def report(result: dict) -> str:
    pred, got = result["predicted"], result["measured"]
    mib = 2**-20
    rows = [
        ("tokens/s", f"{pred['tokens_per_s']:,.0f}", f"{got['tokens_per_s']:,.0f}", _error(pred["tokens_per_s"], got["tokens_per_s"])),
        ("step s", f"{pred['step_s']:.3g}", f"{got['step_s']:.3g}", _error(pred["step_s"], got["step_s"])),
        ("memory MiB, busiest rank", f"{pred['memory_bytes'] * mib:,.1f}", "not measured" if got["memory_bytes"] is None
         else f"{got['memory_bytes'] * mib:,.1f}", _error(pred["memory_bytes"], got["memory_bytes"])),
        ("comm share (waits, bubble incl.)", f"{pred['comm_share']:.1%}", "not measured" if got["comm_share"] is None
         else f"{got['comm_share']:.1%}", "" if got["comm_share"] is None else f"{(pred['comm_share'] - got['comm_share']) * 100:+.1f} points"),
        ("bubble", f"{pred['bubble']:.1%}", "in the comm share", ""),
    ]  # fmt: skip
    lines = [f"{result['layout']}: predicted against measured", f"{'':34} {'predicted':>12} {'measured':>18} {'error':>12}"]
    lines += [f"{name:34} {p:>12} {m:>18} {e:>12}" for name, p, m, e in rows]
    lines.append(
        f"where it did not wait, this run computed at {result['achieved_compute_efficiency']:.0%} of the peak "
        f"(planned: {result['hardware']['compute_efficiency']:.0%}); plan with --compute-efficiency "
        f"{result['achieved_compute_efficiency']:.2f} on this machine"
    )
    return "\n".join(lines + ([result["note"]] if result["note"] else []))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel plan --check", description="Set a finished run's plan beside what it measured.")
    p.add_argument("--check", required=True, metavar="RUN_DIR", help="the run directory of a `keel train --plan`")
    p.add_argument("--compute-efficiency", type=float, help="predict with this compute efficiency instead of the run's")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    try:
        if opts.compute_efficiency is not None and not 0 < opts.compute_efficiency <= 1:
            raise ConfigError(f"--compute-efficiency {opts.compute_efficiency:g}: must be in (0, 1], a fraction of the peak")
        result = check(Path(opts.check), opts.compute_efficiency)
    except ConfigError as e:
        print(f"keel plan: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(json.dumps(result, indent=2) if opts.json else report(result))
    return EXIT_OK
