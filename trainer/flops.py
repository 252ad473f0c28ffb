"""Peak FLOPS of the device, the basis of MFU: a table for GPUs, a matmul calibration on CPU.

An unknown GPU is never a silent fallback: it gets a warning and the basis says what was assumed.
"""

from __future__ import annotations

import time
import warnings

import torch

from keel.trainer.planning.gpus import GPU_PEAK_BF16_FLOPS

UNKNOWN_GPU_ASSUMED = "H100 SXM"


def gpu_peak_flops(device_name: str) -> tuple[float, str]:
    """(peak FLOP/s, basis) for a CUDA device name such as 'NVIDIA H100 80GB HBM3'."""
    for key in sorted(GPU_PEAK_BF16_FLOPS, key=len, reverse=True):
        if all(part in device_name for part in key.split()):
            return GPU_PEAK_BF16_FLOPS[key], f"table: {key} dense bf16 {GPU_PEAK_BF16_FLOPS[key] / 1e12:.0f} TFLOPS"
    peak = GPU_PEAK_BF16_FLOPS[UNKNOWN_GPU_ASSUMED]
    warnings.warn(f"unknown GPU '{device_name}': MFU assumes the {UNKNOWN_GPU_ASSUMED} peak of {peak / 1e12:.0f} TFLOPS", stacklevel=2)
    return peak, f"unknown GPU '{device_name}', assumed {UNKNOWN_GPU_ASSUMED} {peak / 1e12:.0f} TFLOPS"


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
