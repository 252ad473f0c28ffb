"""Peak FLOPS of the device, the basis of MFU: a table for GPUs, a matmul calibration on CPU.

An unknown GPU is never a silent fallback: an MFU against an assumed peak would be a number nobody can
trust, so the run reports none (NaN) and logs one line that names metrics.peak_tflops. Training goes on:
a missing metric is no reason to stop a job.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from keel.trainer.planning.gpus import GPUS, gpu_kind, unknown_gpu

log = logging.getLogger(__name__)


def gpu_peak_flops(device_name: str) -> tuple[float, str]:
    """(peak FLOP/s, basis) for a CUDA device name such as 'NVIDIA H100 80GB HBM3'."""
    kind = gpu_kind(device_name)
    if kind is None:
        basis = "GPU " + unknown_gpu(device_name, "no MFU; set metrics.peak_tflops to its dense bf16 TFLOPS")
        log.error("%s", basis)
        return math.nan, basis
    peak = GPUS[kind].peak_bf16_flops
    return peak, f"table: {kind} dense bf16 {peak / 1e12:.0f} TFLOPS"


def calibrate_cpu_peak(size: int = 512, seconds: float = 0.3) -> float:
    """Best fp32 matmul rate this process reaches, in FLOP/s, with its current thread count.

    Run by every rank at once, so that ranks sharing cores each measure their share of the machine."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # first call pays for allocation and dispatch
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t0))
    return best


def device_peak_flops(device: torch.device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of this process's device, basis): `configured_tflops` when set (metrics.peak_tflops)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12, f"metrics.peak_tflops={configured_tflops:g}"
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    peak = calibrate_cpu_peak()
    return peak, f"cpu matmul calibration: fp32 512x512, {torch.get_num_threads()} thread(s) per process"
