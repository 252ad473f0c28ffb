"""The planner's model: the memory, bubble, communication and speed of a pp x dp x cp x tp layout on G GPUs,
before any GPU is asked for (the command: keel.trainer.planning.plan_command).

Every layout is enumerated (pp, dp, tp, context parallelism on long sequences, virtual stages, dp mode,
micro-batches, activation checkpointing, sequence parallelism) and kept to what splits the model and the
batch (config.validate_layout; torch's pipeline schedules' own rules). Context parallelism, zero1 and a
tied embedding under a pipeline are planned though keel train does not run them yet (Plan.runs_in_keel).
For each, with the shapes the trainer builds:
- memory per GPU of the busiest rank: model states counted exactly and what FSDP2 holds beside them at
  the peak (memory_model.busiest_rank_state_bytes), the activations Keel's block keeps (memory_model.
  activation_bytes; or Korthikanti et al. 2022's formulas, --activations korthikanti);
- the pipeline bubble as a share of the step, (p-1)/(v·m + p-1) (Narayanan et al. 2021);
- communication per GPU per step by kind, with ring collectives' per-GPU traffic, and its time on the
  link it crosses (its bandwidth, and its latency once per collective): tp inside a node, cp, dp and pp
  inside a node while the group fits in one;
- step time, MFU and tokens/s.
The layouts that fit are ranked by tokens/s. Conventions and sources: docs/planning.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from keel.trainer.config import ConfigError, JobConfig, divisors, validate_layout, validate_runnable
from keel.trainer.model_args import flops_per_token, model_args, padded_vocab_size
from keel.trainer.planning.memory_model import (
    activation_bytes,
    busiest_rank_state_bytes,
    korthikanti_activation_bytes,
    rank_model_states,
    torchtitan_activation_bytes,
)

BF16 = 2  # bytes: activations, TP and PP traffic, FSDP's all-gathers (its MixedPrecisionPolicy)
FP32 = 4  # bytes: gradients reduced in fp32
USABLE_MEMORY = 0.9  # of the GPU's memory: the rest goes to the CUDA context, NCCL buffers and fragmentation
# The fraction of the peak a step's compute reaches when no communication is exposed and no pipeline stage
# idles, where nothing tells better: keel.trainer.planning.efficiency calibrates it per GPU kind and model
# width from published runs; a CPU run measures its own.
COMPUTE_EFFICIENCY = 0.40
CPU = "cpu"  # Hardware.gpu of a CPU run (keel train --plan on CPU)
ActivationModel = Callable[[JobConfig, int], int]  # (the layout, bytes an element) -> a rank's activation bytes
ACTIVATION_MODELS: dict[str, ActivationModel] = {
    "keel": activation_bytes,
    "korthikanti": korthikanti_activation_bytes,
    "torchtitan": torchtitan_activation_bytes,
}


@dataclass(frozen=True)
class Hardware:
    gpu: str
    gpus: int
    gpus_per_node: int
    peak_flops: float  # dense bf16, per GPU
    memory_bytes: float
    intra_node_bytes_per_s: float  # achieved bus bandwidth of a collective inside a node (NVLink), per GPU
    inter_node_bytes_per_s: float  # ... across nodes (the GPU's network card)
    compute_efficiency: float = COMPUTE_EFFICIENCY
    usable_memory: float = USABLE_MEMORY  # of memory_bytes: what a layout may fill
    # What a collective costs before its first byte. Left at 0 for GPUs, where NCCL's few microseconds
    # vanish beside the bytes; on CPU gloo's milliseconds count (`keel train --plan` measures them).
    collective_latency_s: float = 0.0
    # Whether data-parallel collectives run beside the compute (NCCL on its own stream); on CPU gloo's
    # threads take the cores the compute runs on, and the collectives are counted whole.
    overlaps_compute: bool = True
    # Whether tp collectives run beside the matmuls they feed (Megatron-Core's --tp-comm-overlap, TorchTitan's
    # async TP): then only what outlasts the compute is exposed. keel train's tensor parallelism does not.
    overlaps_tp: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.gpu != CPU


@dataclass(frozen=True)
class Plan:
    cfg: JobConfig  # the layout, as `keel train` would run it
    state_bytes: int  # parameters, gradients, AdamW state and FSDP's gathered copies, busiest rank
    activation_bytes: int
    fits: bool
    bubble: float  # share of the step the busiest pipeline rank idles
    comm_bytes: dict[str, float]  # per GPU per step: tp, dp, pp
    comm_s: dict[str, float]  # their time on their link, with each collective's latency
    compute_s: float
    step_s: float
    mfu: float
    tokens_per_s: float

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def gpus(self) -> int:
        return self.cfg.world_size

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """What published runs quote (TorchTitan's TPS/GPU, Megatron's tokens/s/GPU)."""
        return self.tokens_per_s / self.gpus

    @property
    def runs_in_keel(self) -> bool:
        """Whether keel train runs this layout today (context parallelism, zero1 and a tied embedding under
        a pipeline are planned only)."""
        try:
            validate_runnable(self.cfg)
        except ConfigError:
            return False
        return True

    @property
    def wait_share(self) -> float:
        """The share of the step a GPU does not compute: exposed communication and the pipeline's idle slots.
        What Keel's comm_share measures (the pipeline's idle time is spent waiting in its receives)."""
        return 1 - self.compute_s / self.step_s

    def label(self) -> str:
        return layout_label(self.cfg)


def layout_label(cfg: JobConfig) -> str:
    """A layout in the words `keel plan --layout` reads back: pp8 v2 dp16 zero2 tp8 sp m32 ac=full."""
    par, tr = cfg.parallel, cfg.training
    pipeline = f" v{par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else ""
    cp = f" cp{par.cp}" if par.cp > 1 else ""
    sp = " sp" if par.sequence_parallel else ""
    return f"pp{par.pp}{pipeline} dp{par.dp} {par.dp_mode}{cp} tp{par.tp}{sp} m{tr.microbatches} ac={tr.activation_checkpointing}"


LAYOUT_WORDS = "pp8,dp16,tp8 with any of: cp2 v2 m32 zero1|zero2|zero3|replicate ac=none|selective|full sp"


def parse_layout(text: str, base: JobConfig) -> JobConfig:
    """--layout pp16,dp128,tp8,m16,v2,zero1,ac=full: base's job on that layout; pp, dp and tp are required."""
    par, tr = base.parallel, base.training
    given: dict = {}
    for word in (w.strip() for w in text.replace(" ", ",").split(",") if w.strip()):
        key = next((k for k in ("pp", "dp", "tp", "cp", "v", "m") if word.startswith(k) and word[len(k) :].isdigit()), None)
        if key:
            given[key] = int(word[len(key) :])
        elif word in ("zero1", "zero2", "zero3", "replicate"):
            given["mode"] = word
        elif word.startswith("ac=") and word[3:] in ("none", "selective", "full"):
            given["ac"] = word[3:]
        elif word == "sp":
            given["sp"] = True
        else:
            raise ConfigError(f"--layout {text!r}: {word!r} is not a layout word; write {LAYOUT_WORDS}")
    missing = [k for k in ("pp", "dp", "tp") if k not in given]
    if missing:
        raise ConfigError(f"--layout {text!r}: give {', '.join(missing)} too; write {LAYOUT_WORDS}")
    if min(v for k, v in given.items() if k in ("pp", "dp", "tp", "cp", "v", "m")) < 1:
        raise ConfigError(f"--layout {text!r}: every degree must be at least 1")
    v, pp = given.get("v", 1), given["pp"]
    par = replace(par, pp=pp, dp=given["dp"], tp=given["tp"], cp=given.get("cp", 1), pp_virtual_stages=v,
                  pp_schedule="Interleaved1F1B" if v > 1 else "1F1B", dp_mode=given.get("mode", "zero3"),
                  sequence_parallel=given.get("sp", False), loss_parallel=given.get("sp", False))  # fmt: skip
    per_rank = base.training.global_batch_size // par.dp
    # Left out, m is one sequence a micro-batch (Megatron's and TorchTitan's usual micro-batch size).
    tr = replace(tr, microbatches=given.get("m", max(1, per_rank)), activation_checkpointing=given.get("ac", "none"))
    cfg = replace(base, parallel=par, training=tr)
    if base.training.global_batch_size % par.dp or per_rank % tr.microbatches:
        raise ConfigError(
            f"--layout {text!r}: the global batch of {base.training.global_batch_size} sequences does not split into dp{par.dp} x "
            f"m{tr.microbatches}; change --global-batch or m"
        )
    validate_layout(cfg)
    return cfg


def candidates(base: JobConfig, hw: Hardware) -> list[JobConfig]:
    """Every layout of hw.gpus GPUs that splits base's model and batch, tp inside a node."""
    args = model_args(base)
    found = []
    for tp in (t for t in divisors(hw.gpus) if t <= hw.gpus_per_node):
        for cp in context_parallel_degrees(base.data.seq_len, hw.gpus // tp):
            for pp in (p for p in divisors(hw.gpus // (tp * cp)) if p <= args.n_layers):
                found += split_layouts(base, pp, hw.gpus // (tp * cp * pp), cp, tp)
    return found


def split_layouts(base: JobConfig, pp: int, dp: int, cp: int, tp: int) -> list[JobConfig]:
    """The layouts of one pp x dp x cp x tp split that keel's rules accept (config.validate_layout)."""
    found = []
    for cfg in _variants(base, pp, dp, cp, tp, base.training.global_batch_size):
        try:
            validate_layout(cfg)
        except ConfigError:
            continue
        found.append(cfg)
    return found


LONG_SEQUENCE = 8192  # tokens a rank keeps of a sequence at the least: context parallelism splits only longer ones


def context_parallel_degrees(seq_len: int, gpus: int) -> list[int]:
    """cp = 1, and powers of two that leave each rank LONG_SEQUENCE tokens or more (Llama 3's 128k-token
    training: cp 16, 8k tokens a rank)."""
    return [c for c in (2**k for k in range(12)) if c == 1 or (gpus % c == 0 and seq_len // c >= LONG_SEQUENCE)]


def microbatch_counts(per_rank: int, pp: int, v: int) -> list[int]:
    """Micro-batch counts to try: 1 to 8 without a pipeline; under one, from pp·v to 8·pp·v, and those of one,
    two and four rows a micro-batch, which real runs use (Llama 3 405B: 16 micro-batches on pp 16; BLOOM:
    128 on pp 12). The schedule's own rules come after (config.validate_layout)."""
    counts = divisors(per_rank)
    if pp == 1:
        return [k for k in counts if k <= 8]
    smallest_rows = {per_rank // rows for rows in (1, 2, 4) if per_rank % rows == 0}
    return [k for k in counts if pp * v <= k <= 8 * pp * v or k in smallest_rows]


def _variants(base: JobConfig, pp: int, dp: int, cp: int, tp: int, batch: int):
    """The knobs around one pp x dp x cp x tp: virtual stages, dp mode, micro-batches, checkpointing, SP."""
    schedules = [("1F1B", 1)] + ([("Interleaved1F1B", v) for v in (2, 4)] if pp > 1 else [])
    modes = ["zero3", "zero2", "zero1", "replicate"] if dp * cp > 1 else ["zero3"]
    per_rank = batch // dp if batch % dp == 0 else 0
    for schedule, v in schedules:
        for m in microbatch_counts(per_rank, pp, v) if per_rank else []:
            for mode in modes:
                for ac in ("none", "selective", "full"):
                    for sp in (False, True) if tp > 1 else (False,):
                        par = replace(base.parallel, pp=pp, dp=dp, cp=cp, tp=tp, pp_schedule=schedule, pp_virtual_stages=v,
                                      dp_mode=mode, sequence_parallel=sp, loss_parallel=sp)  # fmt: skip
                        training = replace(base.training, microbatches=m, activation_checkpointing=ac)
                        yield replace(base, parallel=par, training=training)


def element_bytes(cfg: JobConfig, hw: Hardware) -> int:
    """Bytes of an activation, of a gathered weight, of a tp or pp message: bf16 where the job trains in
    it (training.dtype, whose `auto` is bf16 on GPUs), else fp32."""
    return BF16 if cfg.training.bf16(hw.on_gpu) else FP32


def plan(cfg: JobConfig, hw: Hardware, activations: ActivationModel = activation_bytes) -> Plan:
    """The memory, bubble, communication and time of cfg's layout on hw, its activations counted by
    `activations` (Keel's block, or Korthikanti's formulas: ACTIVATION_MODELS)."""
    par, tr, args = cfg.parallel, cfg.training, model_args(cfg)
    e, v, m = element_bytes(cfg, hw), par.pp_virtual_stages, tr.microbatches
    states, kept = busiest_rank_state_bytes(cfg, gathered_bytes=e), activations(cfg, e)
    tokens = tr.global_batch_size * cfg.data.seq_len
    model_flops = flops_per_token(args, cfg.data.seq_len) * tokens
    compute_s = model_flops * recompute_factor(cfg) / cfg.world_size / (hw.peak_flops * hw.compute_efficiency)

    comm, calls = _comm_bytes(cfg, e), _collectives(cfg)
    links = _links(cfg, hw)
    comm_s = {kind: comm[kind] / links[kind] + calls[kind] * hw.collective_latency_s if comm[kind] else 0.0 for kind in comm}
    bubble = (par.pp - 1) / (v * m + par.pp - 1)
    # Ring attention passes each K and V chunk while attention computes on the one before (on GPUs).
    attention_s = compute_s * 12 * args.n_layers * args.dim * cfg.data.seq_len / flops_per_token(args, cfg.data.seq_len)
    exposed_cp = max(0.0, comm_s["cp"] - attention_s) if hw.overlaps_compute else comm_s["cp"]
    exposed_tp = max(0.0, comm_s["tp"] - compute_s) if hw.overlaps_tp else comm_s["tp"]
    busy = (compute_s + exposed_tp + exposed_cp) / (1 - bubble)  # the pipeline's idle slots stretch compute, tp and cp alike
    exposed_dp = max(0.0, comm_s["dp"] - compute_s) if hw.overlaps_compute else comm_s["dp"]  # FSDP overlaps on GPUs
    step_s = busy + exposed_dp + comm_s["pp"]
    return Plan(
        cfg, states, kept, states + kept <= hw.usable_memory * hw.memory_bytes, bubble, comm, comm_s, compute_s, step_s,
        model_flops / (cfg.world_size * hw.peak_flops * step_s), tokens / step_s,
    )  # fmt: skip


def recompute_factor(cfg: JobConfig) -> float:
    """The FLOPs a step runs per model FLOP. Full checkpointing runs each block's forward twice: 8 of every 6
    FLOPs of the blocks (the head is not recomputed, a few percent left out). Selective recomputes
    elementwise ops only."""
    return 4 / 3 if cfg.training.activation_checkpointing == "full" else 1.0


def _comm_bytes(cfg: JobConfig, e: int) -> dict[str, float]:
    """Bytes one GPU sends per step, by kind, with e bytes an activation or gathered weight. A ring
    all-reduce of X bytes over n ranks sends 2(n-1)/n·X per rank, an all-gather or a reduce-scatter (n-1)/n·X."""
    par, tr, args = cfg.parallel, cfg.training, model_args(cfg)
    t, pp, m, c = par.tp, par.pp, tr.microbatches, par.cp
    activation = cfg.data.seq_len // c * cfg.microbatch_rows * args.dim * e  # one micro-batch's hidden states on a rank
    # TP: all-reduces of the activations (sequence parallelism's reduce-scatter and all-gather pairs: the same bytes).
    per_block = _tp_all_reduces_per_block(cfg) * 2 * (t - 1) / t * activation
    tp_bytes = per_block * args.n_layers / pp * m if t > 1 else 0.0
    # CP: ring attention passes the other ranks' K and V chunks forward, and again with their gradients backward.
    kv_chunk = 2 * activation * args.n_kv_heads / args.n_heads / t
    cp_bytes = _ring_passes(cfg) * (c - 1) * kv_chunk * args.n_layers / pp * m if c > 1 else 0.0
    # DP (with the cp ranks, which hold the same weights) over this rank's unsharded parameters (its pp stage,
    # its tp shard); gradients reduced in fp32.
    n = par.dp * c
    held = rank_model_states(args, pp, 1, t, 0, 0, par.pp_virtual_stages).params
    if n == 1:
        dp_bytes = 0.0
    elif par.dp_mode == "replicate":
        dp_bytes = 2 * (n - 1) / n * held * FP32  # gradients all-reduced
    elif par.dp_mode == "zero1":
        dp_bytes = (n - 1) / n * held * (FP32 + e)  # gradients reduce-scattered, the updated weights all-gathered
    else:
        dp_bytes = (n - 1) / n * held * (_gathers(cfg) * e + FP32)  # the gathers, one reduce-scatter
    # PP: each micro-batch's activations forward and their gradient back, at each of the v stage boundaries
    # a rank owns; each tp rank sends its own copy (its sequence slice under sequence parallelism). A tied
    # embedding's gradient is all-reduced between the first stage and the last.
    pp_bytes = 2 * m * par.pp_virtual_stages * activation / (t if par.sequence_parallel else 1) if pp > 1 else 0.0
    if pp > 1 and args.tie_embeddings:
        pp_bytes += padded_vocab_size(args.vocab_size, t) / t * args.dim * FP32
    return {"tp": tp_bytes, "cp": cp_bytes, "dp": dp_bytes, "pp": pp_bytes}


def _ring_passes(cfg: JobConfig) -> int:
    """Times ring attention passes K and V around the ring in a block: the forward's, the backward's (K and
    V again, then their gradients), one more forward recomputed under full checkpointing."""
    return 3 + (1 if cfg.training.activation_checkpointing == "full" else 0)


def _gathers(cfg: JobConfig) -> int:
    """How often FSDP2 gathers each weight in a step. zero3 reshards after each forward and backward, so it
    gathers twice per micro-batch. Under a pipeline torch's schedule keeps a stage gathered after each
    backward but zero3 still reshards it after each forward: every backward gathers again, and so do the
    forwards before the first backward (min(m, pp) on the first rank). zero2 keeps the weights from a forward
    to its backward: once per micro-batch, once per step under a pipeline."""
    m, pp = cfg.training.microbatches, cfg.parallel.pp
    if cfg.parallel.dp_mode == "zero3":
        return 2 * m if pp == 1 else m + min(m, pp)
    return 1 if pp > 1 else m


def _tp_all_reduces_per_block(cfg: JobConfig) -> int:
    """Two forward (after attention and after the MLP), two backward (their inputs' gradients, Megatron's
    `f`); full checkpointing repeats the forward's two."""
    return 4 + (2 if cfg.training.activation_checkpointing == "full" else 0)


def _collectives(cfg: JobConfig) -> dict[str, int]:
    """Collectives one GPU takes part in per step, by kind: each pays the link's latency once."""
    par, tr, args = cfg.parallel, cfg.training, model_args(cfg)
    layers, m = args.n_layers / par.pp, tr.microbatches
    per_block = _tp_all_reduces_per_block(cfg) * (2 if par.sequence_parallel else 1)  # SP: a reduce-scatter and an all-gather each
    units = layers + 1  # FSDP2 gathers and reduces block by block, and the root unit
    sharded = {"replicate": 1, "zero1": 2}.get(par.dp_mode, units * (_gathers(cfg) + 1))  # zero1: one bucket each way
    return {"tp": int(per_block * layers * m) if par.tp > 1 else 0, "cp": int(_ring_passes(cfg) * (par.cp - 1) * layers * m),
            "dp": 0 if par.dp * par.cp == 1 else sharded, "pp": 2 * m * par.pp_virtual_stages if par.pp > 1 else 0}  # fmt: skip


def _links(cfg: JobConfig, hw: Hardware) -> dict[str, float]:
    """The bandwidth each kind of traffic gets. Ranks are laid out pp-major, then dp, cp, tp-minor
    (keel.trainer.parallel.parallelize; TorchTitan's order), so a tp group is tp consecutive GPUs, a cp group
    spans cp·tp of them, a dp group dp·cp·tp, and pp neighbours are dp·cp·tp apart."""
    par = cfg.parallel
    intra, inter = hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s
    inside = par.cp * par.tp
    return {
        "tp": intra,
        "cp": intra if inside <= hw.gpus_per_node else inter,
        "dp": intra if par.dp * inside <= hw.gpus_per_node else inter,
        "pp": intra if par.pp * par.dp * inside <= hw.gpus_per_node else inter,
    }


def rank(plans: list[Plan]) -> list[Plan]:
    """The plans that fit, fastest first (ties: less memory)."""
    return sorted((p for p in plans if p.fits), key=lambda p: (-p.tokens_per_s, p.memory_bytes))


def plan_dict(p: Plan) -> dict:
    par, tr = p.cfg.parallel, p.cfg.training
    return {
        "layout": {"pp": par.pp, "dp": par.dp, "cp": par.cp, "tp": par.tp, "pp_schedule": par.pp_schedule,
                   "pp_virtual_stages": par.pp_virtual_stages, "dp_mode": par.dp_mode, "sequence_parallel": par.sequence_parallel,
                   "microbatches": tr.microbatches, "activation_checkpointing": tr.activation_checkpointing},
        "label": p.label(), "runs_in_keel": p.runs_in_keel,
        "memory_bytes": {"states": p.state_bytes, "activations": p.activation_bytes, "total": p.memory_bytes},
        "bubble": p.bubble, "comm_bytes": p.comm_bytes, "comm_s": p.comm_s, "compute_s": p.compute_s, "step_s": p.step_s,
        "wait_share": p.wait_share, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
    }  # fmt: skip
