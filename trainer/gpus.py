"""The GPUs Keel knows: dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets, in
FLOP/s. MFU on a GPU is measured against them (keel.trainer.flops) and a job's cost is estimated with
them (keel.trainer.estimate). Kept free of torch so that `keel estimate` starts at once."""

from __future__ import annotations

GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H20": 148e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "MI300X": 1307e12,
}


def gpu_kind(name: str) -> str | None:
    """The table's key for a GPU kind as a user writes it ("h100-sxm", "H100_SXM", "a100"), or None."""
    wanted = " ".join(name.replace("-", " ").replace("_", " ").split()).upper()
    return next((kind for kind in GPU_PEAK_BF16_FLOPS if kind.upper() == wanted), None)
