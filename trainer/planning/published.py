"""Training runs whose layouts, memory and speed were published, as the planner sees them: each run's model,
batch and layout in Keel's words, what it reported, and how near Keel's prediction must come.

They serve twice. A few calibrate the compute efficiency the planner assumes (keel.trainer.planning.
efficiency, `calibrates=True`); every other run is held out and checks the planner's memory and speed
against what was measured on real clusters (tests/test_planner_published.py; the table, with sources and
why each tolerance, is in docs/planning.md; `python bench/plan_published.py` prints it).

Where a run did not publish a knob, the row takes its framework's default and says so in `assumed`.
GPT-style models (GELU MLP of 4·dim, learned or ALiBi positions) are given a SwiGLU width of 8/3·dim, which
keeps the parameter count, the FLOPs and the MLP's kept activations (two 4·dim tensors against four of
8/3·dim) within 2% of theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from keel.trainer.config import JobConfig, load_config
from keel.trainer.model_args import MODEL_PRESETS, ModelArgs, count_params, flops_per_token, model_args
from keel.trainer.planning.gpus import GPUS, Link
from keel.trainer.planning.planner import ACTIVATION_MODELS, Hardware, Plan, candidates, parse_layout, plan, rank, recompute_factor

MFU = "MFU"
TOKENS_PER_S_PER_GPU = "tokens/s a GPU"
HARDWARE_TFLOPS = "TFLOP/s a GPU, recomputation counted"  # Megatron-LM's formula of 2021-22 counts the recomputed forward
UNITS = (MFU, TOKENS_PER_S_PER_GPU, HARDWARE_TFLOPS)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str  # where the figures were published
    gpu: str  # a keel.trainer.planning.gpus kind
    model: ModelArgs
    seq_len: int
    global_batch: int  # sequences a step
    layout: str  # in `keel plan --layout` words
    speed: float  # as published, in `unit`
    unit: str
    speed_tolerance: float | None  # relative: Keel's prediction within speed·(1 ± this); None: not comparable (FP8)
    memory_gib: float | None = None  # the busiest GPU's memory, as published (GiB; a "GB" figure converted)
    memory_tolerance: float = 0.15
    # Whether memory_gib is what the GPU showed in use (nvidia-smi: the CUDA context, NCCL's buffers and the
    # allocator's cache on top of the tensors) rather than the allocator's peak: then the planner's reserve
    # for those, 1 - planner.USABLE_MEMORY of the GPU, is added to its prediction.
    memory_on_device: bool = False
    calibrates: bool = False  # one of the points keel.trainer.planning.efficiency is calibrated on
    peak_tflops: float | None = None  # over the GPU table's, where the run's GPUs differ from the data sheet
    memory_per_gpu_gib: float | None = None  # likewise
    inter_node: Link | None = None  # likewise: the network a GPU has across nodes
    assumed: str = ""  # the knobs the publication left out, and what the row takes for them
    why: str = ""  # why these tolerances
    gpus_per_node: int = 8
    curve: str = "H100"  # the keel.trainer.planning.efficiency curve it calibrates or is predicted with
    activations: str = "keel"  # a planner.ACTIVATION_MODELS key: how the run's framework keeps activations


def gpt(layers: int, dim: int, heads: int, vocab: int, tied: bool = False) -> ModelArgs:
    """A GPT-3-style shape (multi-head attention, a 4·dim GELU MLP) in Keel's SwiGLU terms: 8/3·dim, rounded up to 128."""
    ffn = -(-8 * dim // 3 // 128) * 128
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=ffn, vocab_size=vocab, tie_embeddings=tied)


LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128_256, rope_theta=500000.0)
MEGATRON = "Megatron-LM README, weak scaling on H100 (Megatron-Core r0.8.0): github.com/NVIDIA/Megatron-LM images/model_table.png"
MEGATRON_ASSUMED = ("micro-batch 1, no interleaving, distributed optimizer (zero1), sequence parallelism (Megatron-Core's "
                    "defaults with --overlap-param-gather and --tp-comm-overlap); flash attention, which keeps no attention "
                    "scores and recomputes nothing: Korthikanti's selective accounting (ac=selective); untied embeddings")  # fmt: skip
MEGATRON_WHY = ("calibration point: matches by construction" , "held out: 15%, the spread of the calibration points around "
                "their curve plus the bubble's share, which the table's unpublished interleaving would move")  # fmt: skip
TORCHTITAN = "TorchTitan, benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 on H100, December 2024)"
SAC_WHY = (
    "25% over at most: TorchTitan's selective checkpointing recomputes every second matmul, whose output Keel's "
    "selective keeps (a third of the layer's kept bytes)"
)
TORCHTITAN_CURVE = "H100 at 500 W, eager PyTorch (TorchTitan)"
TORCHTITAN_GPU = ("H100 with 96 GB HBM2e at a 500 W limit: peak between the NVL's 835 and the SXM's 989 TFLOP/s (the document's "
                  "footnote); 835 taken")  # fmt: skip


def _megatron(size: str, heads: int, dim: int, layers: int, tp: int, pp: int, batch: int, mfu: float, calibrates: bool):
    dp = 48
    return PublishedRun(
        f"Megatron-Core GPT {size}", MEGATRON, "H100 SXM", gpt(layers, dim, heads, 131_072), 4096, batch,
        f"pp{pp},dp{dp},tp{tp},m{batch // dp},zero1,ac=selective" + (",sp" if tp > 1 else ""), mfu, MFU,
        0.001 if calibrates else 0.15, calibrates=calibrates, activations="korthikanti", assumed=MEGATRON_ASSUMED,
        why=MEGATRON_WHY[0 if calibrates else 1],
    )  # fmt: skip


RUNS: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 192, 0.41, True),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 192, 0.47, True),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 0.49, True),
    _megatron("32B", 56, 7168, 48, 8, 1, 192, 0.46, True),
    _megatron("70B", 64, 8192, 84, 8, 2, 384, 0.42, False),
    _megatron("119B", 80, 10240, 92, 8, 4, 768, 0.43, False),
    _megatron("177B", 96, 12288, 96, 8, 6, 1152, 0.44, False),
    _megatron("314B", 128, 16384, 96, 8, 8, 1536, 0.48, False),
    _megatron("462B", 144, 18432, 112, 8, 16, 3072, 0.47, False),
    PublishedRun(
        "TorchTitan Llama 3.1 8B, 8 GPUs",
        TORCHTITAN,
        "H100 SXM",
        LLAMA3_8B,
        8192,
        16,
        "pp1,dp8,tp1,m1,zero3,ac=selective",
        5762,
        TOKENS_PER_S_PER_GPU,
        0.001,
        memory_gib=82.4,
        memory_tolerance=0.25,
        calibrates=True,
        peak_tflops=835,
        curve=TORCHTITAN_CURVE,
        memory_per_gpu_gib=96,
        assumed=f"{TORCHTITAN_GPU}; FSDP2 without torch.compile, local batch 2 in one micro-batch",
        why=f"speed: calibration point; memory: {SAC_WHY}",
    ),
    PublishedRun(
        "TorchTitan Llama 3.1 8B, 128 GPUs",
        TORCHTITAN,
        "H100 SXM",
        LLAMA3_8B,
        8192,
        256,
        "pp1,dp128,tp1,m1,zero3,ac=selective",
        5605,
        TOKENS_PER_S_PER_GPU,
        0.15,
        memory_gib=67.0,
        memory_tolerance=0.25,
        peak_tflops=835,
        curve=TORCHTITAN_CURVE,
        memory_per_gpu_gib=96,
        assumed=f"{TORCHTITAN_GPU}; FSDP2 without torch.compile",
        why=f"speed: as the held-out Megatron rows; memory: {SAC_WHY}",
    ),
    PublishedRun(
        "TorchTitan Llama 3.1 70B, 256 GPUs",
        TORCHTITAN,
        "H100 SXM",
        MODEL_PRESETS["70b"],
        8192,
        512,
        "pp1,dp32,tp8,m1,zero3,sp,ac=full",
        829,
        TOKENS_PER_S_PER_GPU,
        None,
        memory_gib=71.9,
        peak_tflops=835,
        curve=TORCHTITAN_CURVE,
        memory_per_gpu_gib=96,
        assumed=f"{TORCHTITAN_GPU}; trained with Float8 matmuls, which Keel does not model",
        why="speed: not compared, Float8 matmuls ran TorchTitan's 8B 1.28x faster than bf16 (8,532 against 6,667 "
        "tokens/s) and Keel plans bf16; memory: 15%",
    ),  # fmt: skip
    PublishedRun(
        "TorchTitan Llama 3.1 405B, 512 GPUs, 1F1B",
        TORCHTITAN,
        "H100 SXM",
        MODEL_PRESETS["405b"],
        8192,
        256,
        "pp8,dp8,tp8,m8,zero3,sp,ac=full",
        100,
        TOKENS_PER_S_PER_GPU,
        None,
        memory_gib=82.5,
        memory_tolerance=0.20,
        peak_tflops=835,
        curve=TORCHTITAN_CURVE,
        memory_per_gpu_gib=96,
        assumed=f"{TORCHTITAN_GPU}; Float8; 8 micro-batches of 4 (TorchTitan's default: as many as stages)",
        why="as the 70B row; the two schedules' speeds are compared with each other (the bubble's share), which Float8 changes alike",
    ),  # fmt: skip
    PublishedRun(
        "TorchTitan Llama 3.1 405B, 512 GPUs, interleaved",
        TORCHTITAN,
        "H100 SXM",
        MODEL_PRESETS["405b"],
        8192,
        256,
        "pp8,v2,dp8,tp8,m8,zero3,sp,ac=full",
        128,
        TOKENS_PER_S_PER_GPU,
        None,
        memory_gib=72.7,
        peak_tflops=835,
        curve=TORCHTITAN_CURVE,
        memory_per_gpu_gib=96,
        assumed=f"{TORCHTITAN_GPU}; Float8; 8 micro-batches of 4; two stages a rank (TorchTitan's defaults)",
        why="as the 70B row; the two schedules' speeds are compared with each other",
    ),  # fmt: skip
    PublishedRun(
        "Llama 3 405B, 8,192 GPUs",
        "The Llama 3 Herd of Models (2024), Table 4",
        "H100 SXM",
        MODEL_PRESETS["405b"],
        8192,
        2048,
        "pp16,v2,dp64,tp8,m32,zero1,sp,ac=selective",
        0.43,
        MFU,
        0.15,
        activations="korthikanti",
        assumed="micro-batch 1; two stages a rank; zero1",
        why="as the held-out Megatron rows",
    ),  # fmt: skip
    PublishedRun(
        "Llama 3 405B, 16,384 GPUs",
        "The Llama 3 Herd of Models (2024), Table 4",
        "H100 SXM",
        MODEL_PRESETS["405b"],
        8192,
        2048,
        "pp16,v2,dp128,tp8,m16,zero1,sp,ac=selective",
        0.41,
        MFU,
        0.15,
        activations="korthikanti",
        assumed="micro-batch 1; two stages a rank; zero1",
        why="as the held-out Megatron rows",
    ),  # fmt: skip
    PublishedRun(
        "BLOOM 176B",
        "BigScience, BLOOM (2022) and its training notes (bigscience.notion.site)",
        "A100",
        gpt(70, 14336, 112, 250_680, tied=True),
        2048,
        2048,
        "pp12,dp8,tp4,m128,zero1,ac=full",
        150,
        HARDWARE_TFLOPS,
        0.001,
        memory_gib=60e9 / 2**30,
        calibrates=True,
        activations="korthikanti",
        curve="A100",
        inter_node=Link("4 x 100 Gb/s Omni-Path a node", 50 / 8),
        memory_on_device=True,
        assumed="micro-batch 2 (so 128 a step on each dp rank), full recomputation, ZeRO-1, no sequence "
        "parallelism (Megatron-DeepSpeed had none), 60 GB read as 10^9 bytes and as the GPU showed it in use",
        why="speed: calibration point; memory: 15%, against the tensors plus the planner's reserve (planner.USABLE_MEMORY)",
    ),  # fmt: skip
    PublishedRun(
        "OPT 175B",
        "Zhang et al., OPT (2022), section 2.4",
        "A100",
        gpt(96, 12288, 96, 50_272, tied=True),
        2048,
        992,
        "pp1,dp124,tp8,m1,zero3,ac=full",
        147,
        HARDWARE_TFLOPS,
        0.15,
        activations="korthikanti",
        curve="A100",
        assumed="FSDP with Megatron tensor parallelism, 8 sequences a GPU in one micro-batch, full recomputation counted as "
        "Megatron's formula counts it",
        why="as the held-out Megatron rows",
    ),  # fmt: skip
)


def job(run: PublishedRun) -> JobConfig:
    """The run's job on its published layout, as `keel plan --layout` builds it."""
    shape = {f"model.{k}": getattr(run.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                                          "tie_embeddings")}  # fmt: skip
    base = load_config(
        None, shape | {"data.seq_len": run.seq_len, "training.global_batch_size": run.global_batch, "training.dtype": "bf16"}
    )
    return parse_layout(run.layout, base)


def hardware(run: PublishedRun, gpus: int, efficiency: float) -> Hardware:
    gpu = GPUS[run.gpu]
    return Hardware(
        run.gpu, gpus, run.gpus_per_node, (run.peak_tflops or gpu.peak_bf16_flops / 1e12) * 1e12,
        (run.memory_per_gpu_gib or gpu.memory_gib) * 2**30, gpu.intra_node.bus_bytes_per_s,
        (run.inter_node or gpu.inter_node).bus_bytes_per_s, efficiency,
    )  # fmt: skip


def speed(run: PublishedRun, p: Plan, hw: Hardware) -> float:
    """The plan's speed in the unit the run published."""
    if run.unit == MFU:
        return p.mfu
    if run.unit == TOKENS_PER_S_PER_GPU:
        return p.tokens_per_s_per_gpu
    return p.mfu * hw.peak_flops * recompute_factor(p.cfg) / 1e12


def predict(run: PublishedRun, efficiency: float) -> tuple[Plan, Hardware]:
    cfg = job(run)
    hw = hardware(run, cfg.world_size, efficiency)
    return plan(cfg, hw, ACTIVATION_MODELS[run.activations]), hw


@cache
def efficiency_for(run: PublishedRun) -> float:
    """The compute efficiency at which the planner predicts the run's published speed on its own layout
    (the speed grows with the efficiency, so a bisection finds it)."""
    low, high = 0.01, 1.0
    if speed(run, *predict(run, high)) < run.speed:
        raise ValueError(f"{run.name}: even a compute efficiency of 1 predicts less than the published {run.speed:g} {run.unit}")
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if speed(run, *predict(run, mid)) < run.speed else (low, mid)
    return (low + high) / 2


def published_mfu(run: PublishedRun) -> float:
    """The run's MFU as Keel counts it (keel.trainer.model_args.flops_per_token), from whichever figure it published."""
    if run.unit == MFU:
        return run.speed
    cfg, peak = job(run), (run.peak_tflops or GPUS[run.gpu].peak_bf16_flops / 1e12) * 1e12
    if run.unit == TOKENS_PER_S_PER_GPU:
        return run.speed * flops_per_token(model_args(cfg), run.seq_len) / peak
    return run.speed * 1e12 / recompute_factor(cfg) / peak


def layout_rank(run: PublishedRun, efficiency: float) -> tuple[int, int]:
    """Where the run's degrees (pp, dp, cp, tp) rank among every split of its GPUs that fits, each split by
    its fastest variant (schedule, micro-batches, dp mode, checkpointing), 1 being the planner's pick; and
    how many splits fit."""
    cfg = job(run)
    hw = hardware(run, cfg.world_size, efficiency)
    best: dict[tuple, float] = {}
    for p in rank(
        [
            plan(c, hw, ACTIVATION_MODELS[run.activations])
            for c in candidates(replace(cfg, parallel=replace(cfg.parallel, pp=1, dp=1, tp=1, cp=1)), hw)
        ]
    ):
        par = p.cfg.parallel
        best.setdefault((par.pp, par.dp, par.cp, par.tp), p.tokens_per_s)
    ordered = sorted(best, key=lambda k: -best[k])
    par = cfg.parallel
    wanted = (par.pp, par.dp, par.cp, par.tp)
    return (ordered.index(wanted) + 1 if wanted in ordered else math.inf), len(ordered)


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    efficiency: float  # the compute efficiency the prediction assumed (its curve's, at the run's size)
    plan: Plan
    speed: float  # predicted, in run.unit
    memory_gib: float  # predicted, as the run measured it
    rank: int  # of the run's degrees among the splits that fit (layout_rank)
    splits: int

    @property
    def speed_ratio(self) -> float:
        return self.speed / self.run.speed

    @property
    def memory_ratio(self) -> float | None:
        return None if self.run.memory_gib is None else self.memory_gib / self.run.memory_gib


def compare(run: PublishedRun, with_rank: bool = True) -> Comparison:
    """Keel's prediction for a published run on its layout, at the compute efficiency its curve gives its size."""
    from keel.trainer.planning.efficiency import curve_efficiency  # noqa: PLC0415 - the curves are calibrated on these runs

    efficiency = curve_efficiency(run.curve, count_params(run.model)[0])[0]
    p, hw = predict(run, efficiency)
    reserve = (1 - hw.usable_memory) * hw.memory_bytes if run.memory_on_device else 0.0
    place, splits = layout_rank(run, efficiency) if with_rank else (0, 0)
    return Comparison(run, efficiency, p, speed(run, p, hw), (p.memory_bytes + reserve) / 2**30, place, splits)
