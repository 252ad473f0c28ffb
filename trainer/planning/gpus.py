"""The GPUs Keel knows, one entry each: dense bf16 tensor-core peak (no sparsity), memory, and the names the
driver reports for it, from the vendors' data sheets. MFU on a GPU is measured against the peak
(keel.trainer.flops); a job's cost and layout are planned with both (keel.trainer.planning.estimate,
keel.trainer.planning.planner). Kept free of torch so that `keel estimate` and `keel plan` start at once.

A GPU is found by its kind as a user writes it ("h100-sxm") or by the exact name the driver reports
("NVIDIA H100 80GB HBM3"), never by a part of a name: an L40 is not an L4. Anything else is unknown, and
every caller says so in one line (`unknown_gpu`) instead of assuming a peak.

Adding a GPU: one `Gpu` entry below, with the data sheet's dense bf16 TFLOPS, its memory, and the name
`torch.cuda.get_device_name()` prints on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    peak_bf16_flops: float
    memory_gib: int  # the data sheet's GB, which is what CUDA reports to within 2% (an H100's "80 GB" is 79.6 GiB)
    device_names: tuple[str, ...]  # exactly as torch.cuda.get_device_name() reports them


GPUS = {
    "H200": Gpu(989e12, 141, ("NVIDIA H200",)),
    "H100 SXM": Gpu(989e12, 80, ("NVIDIA H100 80GB HBM3",)),
    "H100 NVL": Gpu(835e12, 94, ("NVIDIA H100 NVL",)),
    "H100 PCIe": Gpu(756e12, 80, ("NVIDIA H100 PCIe",)),
    "H100": Gpu(989e12, 80, ()),  # what people write for the SXM part
    "H20": Gpu(148e12, 96, ("NVIDIA H20",)),
    "B200": Gpu(2250e12, 192, ("NVIDIA B200",)),
    "GB200": Gpu(2500e12, 186, ("NVIDIA GB200",)),
    "A100": Gpu(312e12, 80, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")),
    "A10G": Gpu(70e12, 24, ("NVIDIA A10G",)),
    "L40S": Gpu(362e12, 48, ("NVIDIA L40S",)),
    "L4": Gpu(121e12, 24, ("NVIDIA L4",)),
    "MI300X": Gpu(1307e12, 192, ("AMD Instinct MI300X",)),
}


def gpu_kind(name: str) -> str | None:
    """The table's key for a GPU kind as a user writes it ("h100-sxm", "H100_SXM", "a100") or as the driver
    names the device ("NVIDIA H100 80GB HBM3"), or None."""
    wanted = " ".join(name.replace("-", " ").replace("_", " ").split()).upper()
    by_kind = next((kind for kind in GPUS if kind.upper() == wanted), None)
    return by_kind or next((kind for kind, gpu in GPUS.items() if name.strip() in gpu.device_names), None)


def unknown_gpu(name: str, fix: str) -> str:
    """The one-line error for a GPU the table does not hold, with the caller's way around it."""
    return f"{name!r}: unknown; known kinds: {', '.join(GPUS)}; {fix}"
