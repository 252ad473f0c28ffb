"""The GPUs Keel knows: dense bf16 tensor-core peaks (no sparsity) and memory, from the vendors' data
sheets. MFU on a GPU is measured against the peaks (keel.trainer.flops); a job's cost and layout are
planned with both (keel.trainer.planning.estimate, keel.trainer.planning.planner). Kept free of torch so that `keel
estimate` and `keel plan` start at once."""

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

# Memory per GPU in GiB: the data sheet's GB, which is what CUDA reports to within 2% (an H100's "80 GB"
# is 79.6 GiB visible).
GPU_MEMORY_GIB = {
    "H200": 141, "H100 SXM": 80, "H100 NVL": 94, "H100 PCIe": 80, "H100": 80, "H20": 96, "B200": 192, "GB200": 186,
    "A100": 80, "A10G": 24, "L40S": 48, "L4": 24, "MI300X": 192,
}  # fmt: skip


def gpu_kind(name: str) -> str | None:
    """The table's key for a GPU kind as a user writes it ("h100-sxm", "H100_SXM", "a100"), or None."""
    wanted = " ".join(name.replace("-", " ").replace("_", " ").split()).upper()
    return next((kind for kind in GPU_PEAK_BF16_FLOPS if kind.upper() == wanted), None)
