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

from dataclasses import dataclass, replace
from functools import cache

from keel.trainer.config import JobConfig, load_config
from keel.trainer.model_args import MODEL_PRESETS, ModelArgs, count_params, flops_per_token, model_args
from keel.trainer.planning.efficiency import CalibrationPoint, curve_efficiency
from keel.trainer.planning.gpus import GPUS, Link
from keel.trainer.planning.planner import (
    ACTIVATION_MODELS,
    Hardware,
    Plan,
    candidates,
    parse_layout,
    plan,
    rank,
    recompute_factor,
    split_layouts,
)

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
    overlaps_tp: bool = False  # tp collectives overlapped with the matmuls (planner.Hardware.overlaps_tp)
    # Whether the layout's schedule, micro-batches, dp mode and checkpointing were published. When not, the
    # prediction is the planner's fastest fitting layout of the published split (pp, dp, cp, tp).
    knobs_published: bool = True
    # Whether the speed is bracketed (speed_bounds, each bound give or take HELD_OUT_TOLERANCE) rather than matched.
    bracketed: bool = False
    framework_has_pipeline: bool = True  # metaseq, which trained OPT, had no pipeline parallelism


def gpt(layers: int, dim: int, heads: int, vocab: int, tied: bool = False) -> ModelArgs:
    """A GPT-3-style shape (multi-head attention, a 4·dim GELU MLP) in Keel's SwiGLU terms: 8/3·dim, rounded up to 128."""
    ffn = -(-8 * dim // 3 // 128) * 128
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=ffn, vocab_size=vocab, tie_embeddings=tied)


LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128_256, rope_theta=500000.0)
MEGATRON = "Megatron-LM README, weak scaling on H100 (Megatron-Core r0.8.0): github.com/NVIDIA/Megatron-LM images/model_table.png"
UNPUBLISHED_KNOBS = (
    "schedule, micro-batches, dp mode and checkpointing unpublished: the planner's fastest fitting layout of the published split"
)
MEGATRON_ASSUMED = (
    f"{UNPUBLISHED_KNOBS}; tp collectives overlapped (--tp-comm-overlap, as the README says); flash "
    "attention, which keeps no attention scores: Korthikanti's activations; untied embeddings"
)
LLAMA3_ASSUMED = f"{UNPUBLISHED_KNOBS}; tp collectives overlapped; Korthikanti's activations"
LLAMA3_WHY = (
    "bracketed, not matched: without recomputation the published split holds 126 layers of micro-batches in "
    "flight at 0.57 GB each by Korthikanti's count, more than an 80 GB GPU; with full recomputation it fits "
    "and runs slower than published; Meta's memory savings are unpublished, so the published MFU must lie "
    "between the planner's fastest fitting layout and its fastest without recomputation"
)
HELD_OUT_TOLERANCE = 0.15
CALIBRATED_TOLERANCE = 0.005  # a calibration point's speed, at its efficiency as efficiency.CURVES keeps it (3 decimals)
HELD_OUT_WHY = (
    "held out: 15%, the published MFUs' own scatter around any smooth curve (Megatron-Core's 16B, 32B and 70B ran at 49%, "
    "46% and 42% of the same GPUs)"
)
MEGATRON_WHY = ("calibration point: matches by construction", HELD_OUT_WHY)
TORCHTITAN = "TorchTitan, benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 on H100, December 2024)"
TORCHTITAN_CURVE = "H100 at 500 W, eager PyTorch (TorchTitan)"
TORCHTITAN_GPU = ("H100 with 96 GB HBM2e at a 500 W limit: peak between the NVL's 835 and the SXM's 989 TFLOP/s (the document's "
                  "footnote); 835 taken")  # fmt: skip


def _megatron(size: str, heads: int, dim: int, layers: int, tp: int, pp: int, batch: int, mfu: float, calibrates: bool):
    dp = 48
    return PublishedRun(
        f"Megatron-Core GPT {size}", MEGATRON, "H100 SXM", gpt(layers, dim, heads, 131_072), 4096, batch,
        f"pp{pp},dp{dp},tp{tp}", mfu, MFU,
        CALIBRATED_TOLERANCE if calibrates else HELD_OUT_TOLERANCE, calibrates=calibrates, activations="korthikanti", overlaps_tp=True, knobs_published=False,
        assumed=MEGATRON_ASSUMED,
        why=MEGATRON_WHY[0 if calibrates else 1],
    )  # fmt: skip


def _torchtitan(
    name: str,
    model: ModelArgs,
    batch: int,
    layout: str,
    tokens_per_s: float,
    memory_gib: float,
    *,
    speed_tolerance: float | None = None,
    memory_tolerance: float = 0.15,
    calibrates: bool = False,
    overlaps_tp: bool = False,
    assumed: str,
    why: str,
) -> PublishedRun:
    """A row of TorchTitan's December 2024 H100 benchmark: 8,192-token sequences, its power-limited GPUs."""
    return PublishedRun(
        f"TorchTitan Llama 3.1 {name}",
        TORCHTITAN,
        "H100 SXM",
        model,
        8192,
        batch,
        layout,
        tokens_per_s,
        TOKENS_PER_S_PER_GPU,
        speed_tolerance,
        memory_gib=memory_gib,
        memory_tolerance=memory_tolerance,
        calibrates=calibrates,
        peak_tflops=835,
        memory_per_gpu_gib=96,
        curve=TORCHTITAN_CURVE,
        activations="torchtitan",
        overlaps_tp=overlaps_tp,
        assumed=f"{TORCHTITAN_GPU}; {assumed}",
        why=why,
    )


def _llama3(gpus: str, dp: int, mfu: float) -> PublishedRun:
    """A row of Llama 3 405B's Table 4 (8,192-token sequences, 16M tokens a step): bracketed (LLAMA3_WHY)."""
    return PublishedRun(
        f"Llama 3 405B, {gpus} GPUs",
        "The Llama 3 Herd of Models (2024), Table 4",
        "H100 SXM",
        MODEL_PRESETS["405b"],
        8192,
        2048,
        f"pp16,dp{dp},tp8",
        mfu,
        MFU,
        None,
        activations="korthikanti",
        overlaps_tp=True,
        knobs_published=False,
        bracketed=True,
        assumed=LLAMA3_ASSUMED,
        why=LLAMA3_WHY,
    )


RUNS: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 192, 0.41, True),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 192, 0.47, False),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 0.49, True),
    _megatron("32B", 56, 7168, 48, 8, 1, 192, 0.46, False),
    _megatron("70B", 64, 8192, 84, 8, 2, 384, 0.42, False),
    _megatron("119B", 80, 10240, 92, 8, 4, 768, 0.43, False),
    _megatron("177B", 96, 12288, 96, 8, 6, 1152, 0.44, False),
    _megatron("314B", 128, 16384, 96, 8, 8, 1536, 0.48, False),
    _megatron("462B", 144, 18432, 112, 8, 16, 3072, 0.47, True),
    _torchtitan(
        "8B, 8 GPUs",
        LLAMA3_8B,
        16,
        "pp1,dp8,tp1,m1,zero3,ac=selective",
        5762,
        82.4,
        speed_tolerance=CALIBRATED_TOLERANCE,
        calibrates=True,
        assumed="FSDP2 without torch.compile, local batch 2 in one micro-batch",
        why="speed: calibration point; memory: 15%, the bound the CPU runs hold (tests/test_plan_check.py)",
    ),
    _torchtitan(
        "8B, 128 GPUs",
        LLAMA3_8B,
        256,
        "pp1,dp128,tp1,m1,zero3,ac=selective",
        5605,
        67.0,
        speed_tolerance=HELD_OUT_TOLERANCE,
        assumed="FSDP2 without torch.compile",
        why="speed: as the held-out Megatron rows; memory: as the 8-GPU row",
    ),
    _torchtitan(
        "70B, 256 GPUs",
        MODEL_PRESETS["70b"],
        512,
        "pp1,dp32,tp8,m1,zero3,sp,ac=full",
        829,
        71.9,
        assumed="trained with Float8 matmuls, which Keel does not model",
        why="speed: not compared, Float8 matmuls ran TorchTitan's 8B 1.28x faster than bf16 (8,532 against 6,667 tokens/s) "
        "and Keel plans bf16; memory: 15%",
    ),
    _torchtitan(
        "405B, 512 GPUs, 1F1B",
        MODEL_PRESETS["405b"],
        256,
        "pp8,dp8,tp8,m8,zero3,sp,ac=full",
        100,
        82.5,
        memory_tolerance=0.20,
        overlaps_tp=True,
        assumed="Float8; async TP; 8 micro-batches of 4 (TorchTitan's default: as many as stages)",
        why="speed: compared with the interleaved row's (the bubble's share), which Float8 changes alike; memory: 20%, "
        "TorchTitan reports the allocator's reserved peak, and 1F1B measured 10 GiB above interleaving where every count "
        "of the activations in flight puts it below: the allocator's cache, not tensors",
    ),
    _torchtitan(
        "405B, 512 GPUs, interleaved",
        MODEL_PRESETS["405b"],
        256,
        "pp8,v2,dp8,tp8,m8,zero3,sp,ac=full",
        128,
        72.7,
        overlaps_tp=True,
        assumed="Float8; async TP; 8 micro-batches of 4; two stages a rank (TorchTitan's defaults)",
        why="speed: compared with the 1F1B row's; memory: 15%",
    ),
    _llama3("8,192", 64, 0.43),
    _llama3("16,384", 128, 0.41),
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
        CALIBRATED_TOLERANCE,
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
        framework_has_pipeline=False,
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
        (run.inter_node or gpu.inter_node).bus_bytes_per_s, efficiency, overlaps_tp=run.overlaps_tp,
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
    activations = ACTIVATION_MODELS[run.activations]
    if run.knobs_published:
        return plan(cfg, hw, activations), hw
    par = cfg.parallel
    fitting = rank([plan(c, hw, activations) for c in split_layouts(cfg, par.pp, par.dp, par.cp, par.tp)])
    return (fitting[0] if fitting else plan(cfg, hw, activations)), hw


def speed_bounds(run: PublishedRun, efficiency: float) -> tuple[float, float]:
    """The run's speed as the planner brackets it on the published split: its fastest layout that fits, and its
    fastest layout without recomputation whether it fits or not (what a partial recomputation lies between)."""
    cfg = job(run)
    hw = hardware(run, cfg.world_size, efficiency)
    par = cfg.parallel
    plans = [plan(c, hw, ACTIVATION_MODELS[run.activations]) for c in split_layouts(cfg, par.pp, par.dp, par.cp, par.tp)]
    fitting = rank(plans)
    unbounded = max((p for p in plans if p.cfg.training.activation_checkpointing != "full"), key=lambda p: p.tokens_per_s)
    return speed(run, fitting[0], hw), speed(run, unbounded, hw)


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


def calibrated_curves() -> dict[str, list[CalibrationPoint]]:
    """The efficiency curves recomputed from the runs marked `calibrates` (efficiency.CURVES keeps them)."""
    found: dict[str, list[CalibrationPoint]] = {}
    for run in (r for r in RUNS if r.calibrates):
        found.setdefault(run.curve, []).append(CalibrationPoint(count_params(run.model)[0], efficiency_for(run), run.name))
    return {name: sorted(points, key=lambda p: p.params) for name, points in found.items()}


def published_mfu(run: PublishedRun) -> float:
    """The run's MFU as Keel counts it (keel.trainer.model_args.flops_per_token), from whichever figure it published."""
    if run.unit == MFU:
        return run.speed
    cfg, peak = job(run), (run.peak_tflops or GPUS[run.gpu].peak_bf16_flops / 1e12) * 1e12
    if run.unit == TOKENS_PER_S_PER_GPU:
        return run.speed * flops_per_token(model_args(cfg), run.seq_len) / peak
    return run.speed * 1e12 / recompute_factor(cfg) / peak


@dataclass(frozen=True)
class SplitRank:
    place: int  # 1: the planner's pick
    splits: int  # the splits that fit
    share_of_best: float  # the published split's speed over the pick's, each split by its fastest layout


def rank_split(run: PublishedRun) -> SplitRank:
    """Where the run's split (pp, dp, cp, tp) ranks among every split of its GPUs that fits and that its
    framework could run (no pipeline where it had none), each split by its fastest layout (schedule,
    micro-batches, dp mode, checkpointing), at its curve's efficiency."""
    cfg = job(run)
    hw = hardware(run, cfg.world_size, efficiency_at(run))
    unsplit = replace(cfg, parallel=replace(cfg.parallel, pp=1, dp=1, tp=1, cp=1))
    fastest: dict[tuple, float] = {}
    for p in rank([plan(c, hw, ACTIVATION_MODELS[run.activations]) for c in candidates(unsplit, hw)]):
        par = p.cfg.parallel
        if par.pp == 1 or run.framework_has_pipeline:
            fastest.setdefault((par.pp, par.dp, par.cp, par.tp), p.tokens_per_s)
    ordered = sorted(fastest, key=lambda k: -fastest[k])
    par = cfg.parallel
    wanted = (par.pp, par.dp, par.cp, par.tp)
    if wanted not in fastest:
        return SplitRank(0, len(ordered), 0.0)
    return SplitRank(ordered.index(wanted) + 1, len(ordered), fastest[wanted] / fastest[ordered[0]])


def efficiency_at(run: PublishedRun) -> float:
    """The compute efficiency the run's curve gives its size."""
    return curve_efficiency(run.curve, count_params(run.model)[0])[0]


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    efficiency: float  # the compute efficiency the prediction assumed (its curve's, at the run's size)
    plan: Plan
    speed: float  # predicted, in run.unit
    memory_gib: float  # predicted, as the run measured it

    @property
    def speed_ratio(self) -> float:
        return self.speed / self.run.speed

    @property
    def memory_ratio(self) -> float | None:
        return None if self.run.memory_gib is None else self.memory_gib / self.run.memory_gib


def compare(run: PublishedRun) -> Comparison:
    """Keel's prediction for a published run on its layout, at the compute efficiency its curve gives its size."""
    efficiency = efficiency_at(run)
    p, hw = predict(run, efficiency)
    reserve = (1 - hw.usable_memory) * hw.memory_bytes if run.memory_on_device else 0.0
    return Comparison(run, efficiency, p, speed(run, p, hw), (p.memory_bytes + reserve) / 2**30)
