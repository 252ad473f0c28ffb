"""The GPUs Keel knows, one entry each: dense bf16 tensor-core peak (no sparsity), memory, and the names the
driver reports for it, from the vendors' data sheets. MFU on a GPU is measured against the peak
(keel.trainer.flops); a job's cost and layout are planned with both (keel.trainer.planning.estimate,
keel.trainer.planning.planner). Kept free of torch so that `keel estimate` and `keel plan` start at once.

A GPU is found by its kind as a user writes it ("h100-sxm") or by the exact name the driver reports
("NVIDIA H100 80GB HBM3"), never by a part of a name: an L40 is not an L4. Anything else is unknown, and
every caller says so in one line (`unknown_gpu`) instead of assuming a peak.

Each kind also carries the link its GPUs share inside a node and the network a GPU has across nodes,
as the bus bandwidth a ring collective reaches on them (nccl-tests' "busbw"): 80% of the link's data-sheet
bandwidth a direction, about what NCCL's all-reduce measures on an idle node. `keel plan` uses them unless
--intra-node-gbps/--inter-node-gbps say otherwise.

Adding a GPU: one `Gpu` entry below, with the data sheet's dense bf16 TFLOPS, its memory, its links, and the
name `torch.cuda.get_device_name()` prints on it."""

from __future__ import annotations

from dataclasses import dataclass

LINK_EFFICIENCY = 0.8  # of a link's data-sheet bandwidth a direction: what a ring collective's bus bandwidth reaches


@dataclass(frozen=True)
class Link:
    name: str
    gb_per_s: float  # the data sheet's bandwidth a direction, per GPU

    @property
    def bus_bytes_per_s(self) -> float:
        return LINK_EFFICIENCY * self.gb_per_s * 1e9


NVLINK3 = Link("NVLink 3", 300)  # A100: 600 GB/s both directions
NVLINK4 = Link("NVLink 4", 450)  # H100 SXM, H200, H20: 900 GB/s both directions
NVLINK5 = Link("NVLink 5", 900)  # B200, GB200: 1.8 TB/s both directions
PCIE4 = Link("PCIe 4.0 x16", 32)
PCIE5 = Link("PCIe 5.0 x16", 64)  # H100 PCIe and NVL: NVLink bridges join pairs only, a node's ring crosses PCIe
INFINITY_FABRIC = Link("Infinity Fabric", 448)  # MI300X: 7 links of 64 GB/s a direction
IB_HDR = Link("200 Gb/s InfiniBand HDR", 25)  # a GPU's card in A100-era clusters
IB_NDR = Link("400 Gb/s InfiniBand NDR / RoCE", 50)  # H100 onwards
ETHERNET_100G = Link("100 Gb/s Ethernet", 12.5)  # PCIe cards in cloud instances


@dataclass(frozen=True)
class Gpu:
    peak_bf16_flops: float
    memory_gib: int  # the data sheet's GB, which is what CUDA reports to within 2% (an H100's "80 GB" is 79.6 GiB)
    device_names: tuple[str, ...]  # exactly as torch.cuda.get_device_name() reports them
    intra_node: Link = NVLINK4
    inter_node: Link = IB_NDR


GPUS = {
    "H200": Gpu(989e12, 141, ("NVIDIA H200",)),
    "H100 SXM": Gpu(989e12, 80, ("NVIDIA H100 80GB HBM3",)),
    "H100 NVL": Gpu(835e12, 94, ("NVIDIA H100 NVL",), PCIE5),
    "H100 PCIe": Gpu(756e12, 80, ("NVIDIA H100 PCIe",), PCIE5),
    "H100": Gpu(989e12, 80, ()),  # what people write for the SXM part
    "H20": Gpu(148e12, 96, ("NVIDIA H20",)),
    "B200": Gpu(2250e12, 180, ("NVIDIA B200",), NVLINK5),  # HGX B200: 1,440 GB over 8 GPUs
    "GB200": Gpu(2500e12, 186, ("NVIDIA GB200",), NVLINK5),  # GB200 NVL72: 13.4 TB over 72 GPUs
    "A100": Gpu(312e12, 80, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"), NVLINK3, IB_HDR),
    "A100 PCIe": Gpu(312e12, 80, ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"), PCIE4, IB_HDR),
    "A10G": Gpu(70e12, 24, ("NVIDIA A10G",), PCIE4, ETHERNET_100G),
    "L40S": Gpu(362e12, 48, ("NVIDIA L40S",), PCIE4, ETHERNET_100G),
    "L4": Gpu(121e12, 24, ("NVIDIA L4",), PCIE4, ETHERNET_100G),
    "MI300X": Gpu(1307e12, 192, ("AMD Instinct MI300X",), INFINITY_FABRIC),
    "V100": Gpu(125e12, 32, ("Tesla V100-SXM2-32GB", "Tesla V100-SXM2-16GB"), Link("NVLink 2", 150), Link("100 Gb/s InfiniBand EDR", 12.5)),
}  # V100: fp16 tensor cores (it has no bf16), the peak MFU counts against


def gpu_kind(name: str) -> str | None:
    """The table's key for a GPU kind as a user writes it ("h100-sxm", "H100_SXM", "a100") or as the driver
    names the device ("NVIDIA H100 80GB HBM3"), or None."""
    wanted = " ".join(name.replace("-", " ").replace("_", " ").split()).upper()
    by_kind = next((kind for kind in GPUS if kind.upper() == wanted), None)
    return by_kind or next((kind for kind, gpu in GPUS.items() if name.strip() in gpu.device_names), None)


def unknown_gpu(name: str, fix: str) -> str:
    """The one-line error for a GPU the table does not hold, with the caller's way around it."""
    return f"{name!r}: unknown; known kinds: {', '.join(GPUS)}; {fix}"
