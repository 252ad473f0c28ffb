"""`keel estimate`: what a training job costs before it starts, from the compute it needs.

    GPU-seconds = 6 · N · T / (peak FLOP/s per GPU × MFU × goodput)

N parameters trained on T tokens take about 6·N·T floating-point operations: 2·N per token forward (a
multiply and an add per weight) and 4·N backward (the gradients of the activations and of the weights),
the approximation of Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", section 2.1) and of
Hoffmann et al. 2022 (Chinchilla). It leaves out attention's score and value products (12 · layers ·
d_model · seq_len per token, a few percent at 8k context for a 70B model) and any recomputation: MFU
counts only this useful work, so activation checkpointing shows up as a lower MFU, not as more FLOPs.
The peak is the GPU's dense bf16 tensor-core figure (keel.trainer.planning.gpus); MFU is the fraction of it a
job achieves while it trains (40-55% is good for large dense models: MegaScale reports 55% at 12,288 GPUs),
by default the compute efficiency calibrated for the GPU and the model's size (keel.trainer.planning.
efficiency). Goodput is the share of the wall-clock time that trains: failures, restarts, checkpoints and
evaluation take the rest (DEFAULT_GOODPUT).

    keel estimate --params 70B --tokens 15T --gpu H100 --gpus 8192 --price-per-gpu-hour 3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.planning.efficiency import calibrated_efficiency
from keel.trainer.planning.gpus import GPUS, gpu_kind, unknown_gpu

# Llama 3 405B trained for more than 90% of its wall-clock time through 466 interruptions in a 54-day
# snapshot on 16,384 H100s ("The Llama 3 Herd of Models", 2024, section 3.3.4); MegaScale also reports
# more than 90% effective training time at 10,000+ GPUs (Jiang et al. 2024).
DEFAULT_GOODPUT = 0.9
_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class EstimateError(ValueError):
    """Bad input to the estimate: one line that names the flag and the fix."""


@dataclass(frozen=True)
class Estimate:
    params: float
    tokens: float
    flops: float  # 6·N·T
    gpu: str
    peak_flops: float  # per GPU, dense bf16
    mfu: float
    mfu_source: str
    goodput: float
    gpu_hours: float
    gpus: int
    wall_days: float  # on `gpus` GPUs, at that MFU throughout
    price_per_gpu_hour: float | None
    cost: float | None


def parse_count(flag: str, text: str) -> float:
    """A positive count written as 70B, 1.5T, 405e9, 8,000,000 or 7000000000."""
    match = re.fullmatch(r"\s*(-?[0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if match is None:
        raise EstimateError(f"{flag} {text!r}: not a count; write it as 70B, 1.5T, 405e9 or 7000000000")
    value = float(match.group(1).replace(",", "").replace("_", "")) * _SUFFIXES[match.group(2).upper()]
    if not value > 0:
        raise EstimateError(f"{flag} {text!r}: must be more than 0")
    return value


def peak_flops(gpu: str | None, peak_tflops: float | None) -> tuple[str, float]:
    """(the GPU's name, its peak FLOP/s): from --peak-tflops when given, else from the table."""
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise EstimateError(f"--peak-tflops {peak_tflops:g}: must be more than 0 (the GPU's dense bf16 TFLOPS)")
        return gpu or "custom", peak_tflops * 1e12
    if gpu is None:
        raise EstimateError("--gpu is required (or --peak-tflops): one of " + ", ".join(GPUS))
    kind = gpu_kind(gpu)
    if kind is None:
        raise EstimateError("--gpu " + unknown_gpu(gpu, "or give --peak-tflops"))
    return kind, GPUS[kind].peak_bf16_flops


def estimate(
    params: float,
    tokens: float,
    gpu: str,
    peak: float,
    mfu: float,
    gpus: int,
    price: float | None,
    goodput: float = 1.0,
    mfu_source: str = "--mfu",
) -> Estimate:
    if not 0 < mfu <= 1:
        raise EstimateError(
            f"--mfu {mfu:g}: must be in (0, 1], a fraction of the peak (0.45 is 45%); for a TFLOP/s a GPU figure give --tflops-per-gpu"
        )
    if not 0 < goodput <= 1:
        raise EstimateError(f"--goodput {goodput:g}: must be in (0, 1], the share of the wall-clock time that trains (0.9 is 90%)")
    if gpus < 1:
        raise EstimateError(f"--gpus {gpus}: must be at least 1")
    if price is not None and price < 0:
        raise EstimateError(f"--price-per-gpu-hour {price:g}: must be 0 or more")
    flops = 6 * params * tokens
    gpu_hours = flops / (peak * mfu * goodput) / 3600
    cost = None if price is None else gpu_hours * price
    return Estimate(params, tokens, flops, gpu, peak, mfu, mfu_source, goodput, gpu_hours, gpus, gpu_hours / gpus / 24, price, cost)


def chosen_mfu(kind: str | None, peak: float, params: float, mfu: float | None, tflops: float | None) -> tuple[float, str]:
    """(MFU, where it came from): --mfu, --tflops-per-gpu over the peak, or the calibrated efficiency."""
    if mfu is not None and tflops is not None:
        raise EstimateError("--mfu and --tflops-per-gpu say the same thing; give one")
    if tflops is not None:
        if not 0 < tflops * 1e12 <= peak:
            raise EstimateError(f"--tflops-per-gpu {tflops:g}: must be more than 0 and at most the peak, {peak / 1e12:,.0f} TFLOP/s")
        return tflops * 1e12 / peak, f"--tflops-per-gpu {tflops:g}"
    if mfu is not None:
        return mfu, "--mfu"
    efficiency, source = calibrated_efficiency(kind, params)
    return efficiency, f"{source}; with nothing waiting, so a floor on the GPU-hours: keel plan gives a layout's MFU"


def _si(value: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _amount(value: float) -> str:
    """Whole units once they are many, three significant digits below that (a tiny job's 0.0139 hours)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def render(e: Estimate) -> str:
    lines = [
        f"compute   6 x {_si(e.params)} parameters x {_si(e.tokens)} tokens = {e.flops:.3g} FLOPs",
        f"per GPU   {e.gpu}: {e.peak_flops / 1e12:,.0f} TFLOPS dense bf16 x MFU {e.mfu:.0%} = {e.peak_flops * e.mfu / 1e12:,.0f} TFLOPS"
        f" (MFU: {e.mfu_source})",
        f"goodput   {e.goodput:.0%} of the wall-clock time trains" + (" (Llama 3's, --goodput)" if e.goodput == DEFAULT_GOODPUT else ""),
        f"GPU-hours {_amount(e.gpu_hours)} ({_amount(e.gpu_hours / 8766)} GPU-years)",
        f"wall      {_amount(e.wall_days)} days on {e.gpus:,} GPU{'s' if e.gpus > 1 else ''}",
    ]
    if e.cost is not None:
        lines.append(f"cost      ${_amount(e.cost)} at ${e.price_per_gpu_hour:,.2f} per GPU-hour")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", required=True, help="parameters trained: 70B, 8e9, 405000000000")
    p.add_argument("--tokens", required=True, help="tokens seen in training: 15T, 1e12")
    p.add_argument("--gpu", help=f"GPU kind: {', '.join(GPUS)}")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for a kind not in the table")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the job runs on, for the wall-clock days (default 1)")
    p.add_argument("--mfu", type=float, help="model FLOPs utilization while training, a fraction (default: calibrated per GPU and size)")
    p.add_argument("--tflops-per-gpu", type=float, help="or the model TFLOP/s a GPU reaches, as published runs quote it")
    p.add_argument(
        "--goodput", type=float, default=DEFAULT_GOODPUT, help=f"share of the wall-clock time that trains (default {DEFAULT_GOODPUT})"
    )
    p.add_argument("--price-per-gpu-hour", type=float, help="dollars per GPU-hour, for the cost")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    opts = p.parse_args(argv)
    try:
        params, tokens = parse_count("--params", opts.params), parse_count("--tokens", opts.tokens)
        gpu, peak = peak_flops(opts.gpu, opts.peak_tflops)
        mfu, source = chosen_mfu(gpu_kind(gpu), peak, params, opts.mfu, opts.tflops_per_gpu)
        result = estimate(params, tokens, gpu, peak, mfu, opts.gpus, opts.price_per_gpu_hour, opts.goodput, source)
    except EstimateError as e:
        print(f"keel estimate: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(json.dumps(asdict(result), indent=2) if opts.json else render(result))
    return EXIT_OK
