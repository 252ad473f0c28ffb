"""`keel plan`: which pp x dp x tp layout to train a model on G GPUs, before any GPU is asked for.

Every layout Keel can run is enumerated (pp, dp, tp, virtual stages, dp mode, micro-batches, activation
checkpointing, sequence parallelism) and kept to what `keel train` accepts (config.validate_layout). For
each, with the shapes the trainer builds:
- memory per GPU of the busiest rank: model states counted exactly and what FSDP2 holds beside them at
  the peak (memory_model.busiest_rank_state_bytes), the activations Keel's block keeps (memory_model.
  activation_bytes; or Korthikanti et al. 2022's formulas, --activations korthikanti);
- the pipeline bubble as a share of the step, (p-1)/(v·m + p-1) (Narayanan et al. 2021);
- communication per GPU per step by kind, with ring collectives' per-GPU traffic, and its time on the
  link it crosses (its bandwidth, and its latency once per collective): tp inside a node, dp and pp inside a
  node while the group fits in one;
- step time, MFU and tokens/s.
The layouts that fit are ranked by tokens/s. Conventions and sources: docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.config import ConfigError, JobConfig, divisors, load_config, validate_layout
from keel.trainer.model_args import LLAMA3_VOCAB, MODEL_PRESETS, ModelArgs, count_params, flops_per_token, model_args
from keel.trainer.planning.estimate import EstimateError, parse_count
from keel.trainer.planning.gpus import GPUS, gpu_kind, unknown_gpu
from keel.trainer.planning.memory_model import (
    MODEL_STATE_BYTES_PER_PARAM,
    activation_bytes,
    busiest_rank_state_bytes,
    korthikanti_activation_bytes,
    rank_model_states,
)

BF16 = 2  # bytes: activations, TP and PP traffic, FSDP's all-gathers (its MixedPrecisionPolicy)
FP32 = 4  # bytes: gradients reduced in fp32
USABLE_MEMORY = 0.9  # of the GPU's memory: the rest goes to the CUDA context, NCCL buffers and fragmentation
# The fraction of the peak a step's compute reaches when no communication is exposed and no pipeline stage
# idles: kernels below peak, elementwise ops, the optimizer, launches. Calibrated on TorchTitan's Llama 3 8B
# on 8 H100s with FSDP alone, where nothing else costs: 39% MFU compiled (33% eager). --compute-efficiency
# sets it from a run of your own: the MFU it measured where it waited for nothing.
COMPUTE_EFFICIENCY = 0.40
CPU = "cpu"  # Hardware.gpu of a CPU run (keel train --plan on CPU)
ActivationModel = Callable[[JobConfig, int], int]  # (the layout, bytes an element) -> a rank's activation bytes
ACTIVATION_MODELS: dict[str, ActivationModel] = {"keel": activation_bytes, "korthikanti": korthikanti_activation_bytes}


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
    # What a collective costs before its first byte. Left at 0 for GPUs, where NCCL's few microseconds
    # vanish beside the bytes; on CPU gloo's milliseconds count (`keel train --plan` measures them).
    collective_latency_s: float = 0.0
    # Whether data-parallel collectives run beside the compute (NCCL on its own stream); on CPU gloo's
    # threads take the cores the compute runs on, and the collectives are counted whole.
    overlaps_compute: bool = True

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
    def wait_share(self) -> float:
        """The share of the step a GPU does not compute: exposed communication and the pipeline's idle slots.
        What Keel's comm_share measures (the pipeline's idle time is spent waiting in its receives)."""
        return 1 - self.compute_s / self.step_s

    def label(self) -> str:
        par, tr = self.cfg.parallel, self.cfg.training
        pipeline = f" v{par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else ""
        sp = " sp" if par.sequence_parallel else ""
        return f"pp{par.pp}{pipeline} dp{par.dp} {par.dp_mode} tp{par.tp}{sp} m{tr.microbatches} ac={tr.activation_checkpointing}"


def candidates(base: JobConfig, hw: Hardware) -> list[JobConfig]:
    """Every layout of hw.gpus GPUs that keel train accepts for base's model and batch, tp inside a node."""
    args, batch = model_args(base), base.training.global_batch_size
    found = []
    for tp in (t for t in divisors(hw.gpus) if t <= hw.gpus_per_node):
        for pp in (p for p in divisors(hw.gpus // tp) if p <= args.n_layers):
            dp = hw.gpus // (tp * pp)
            for cfg in _variants(base, pp, dp, tp, batch):
                try:
                    validate_layout(cfg)
                except ConfigError:
                    continue
                found.append(cfg)
    return found


def _variants(base: JobConfig, pp: int, dp: int, tp: int, batch: int):
    """The knobs around one pp x dp x tp: virtual stages, dp mode, micro-batches, checkpointing, SP."""
    schedules = [("1F1B", 1)] + ([("Interleaved1F1B", v) for v in (2, 4)] if pp > 1 else [])
    modes = ["zero3", "zero2", "replicate"] if dp > 1 else ["zero3"]
    per_rank = batch // dp if batch % dp == 0 else 0
    for schedule, v in schedules:
        for m in (k for k in divisors(per_rank) if (pp == 1 and k <= 8) or (pp > 1 and k >= pp * v and k <= 8 * pp * v)):
            for mode in modes:
                for ac in ("none", "selective", "full"):
                    for sp in (False, True) if tp > 1 else (False,):
                        par = replace(base.parallel, pp=pp, dp=dp, tp=tp, pp_schedule=schedule, pp_virtual_stages=v, dp_mode=mode,
                                      sequence_parallel=sp, loss_parallel=sp)  # fmt: skip
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
    compute_s = model_flops * recompute_factor(cfg) / hw.gpus / (hw.peak_flops * hw.compute_efficiency)

    comm, calls = _comm_bytes(cfg, e), _collectives(cfg)
    links = _links(cfg, hw)
    comm_s = {kind: comm[kind] / links[kind] + calls[kind] * hw.collective_latency_s if comm[kind] else 0.0 for kind in comm}
    bubble = (par.pp - 1) / (v * m + par.pp - 1)
    busy = (compute_s + comm_s["tp"]) / (1 - bubble)  # the pipeline's idle slots stretch compute and tp alike
    exposed_dp = max(0.0, comm_s["dp"] - compute_s) if hw.overlaps_compute else comm_s["dp"]  # FSDP overlaps on GPUs
    step_s = busy + exposed_dp + comm_s["pp"]
    return Plan(
        cfg, states, kept, states + kept <= USABLE_MEMORY * hw.memory_bytes, bubble, comm, comm_s, compute_s, step_s,
        model_flops / (hw.gpus * hw.peak_flops * step_s), tokens / step_s,
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
    t, dp, pp, m = par.tp, par.dp, par.pp, tr.microbatches
    activation = cfg.data.seq_len * cfg.microbatch_rows * args.dim * e  # one micro-batch's hidden states
    # TP: all-reduces of the activations (sequence parallelism's reduce-scatter and all-gather pairs: the same bytes).
    per_block = _tp_all_reduces_per_block(cfg) * 2 * (t - 1) / t * activation
    tp_bytes = per_block * args.n_layers / pp * m if t > 1 else 0.0
    # DP over this rank's unsharded parameters (its pp stage, its tp shard); gradients reduced in fp32.
    held = rank_model_states(args, pp, 1, t, 0, 0, par.pp_virtual_stages).params
    if dp == 1:
        dp_bytes = 0.0
    elif par.dp_mode == "replicate":
        dp_bytes = 2 * (dp - 1) / dp * held * FP32  # gradients all-reduced
    else:
        dp_bytes = (dp - 1) / dp * held * (_gathers(cfg) * e + FP32)  # the gathers, one reduce-scatter
    # PP: each micro-batch's activations forward and their gradient back, at each of the v stage boundaries
    # a rank owns; each tp rank sends its own copy (its sequence slice under sequence parallelism).
    pp_bytes = 2 * m * par.pp_virtual_stages * activation / (t if par.sequence_parallel else 1) if pp > 1 else 0.0
    return {"tp": tp_bytes, "dp": dp_bytes, "pp": pp_bytes}


def _gathers(cfg: JobConfig) -> int:
    """How often FSDP2 gathers each weight in a step. zero3 reshards after each forward and backward, so it
    gathers twice per micro-batch (an upper bound under a pipeline, whose schedule keeps a stage gathered
    from its first backward on); zero2 keeps the weights from a forward to its backward: once per micro-batch,
    once per step under a pipeline."""
    m, pp = cfg.training.microbatches, cfg.parallel.pp
    return 2 * m if cfg.parallel.dp_mode == "zero3" else 1 if pp > 1 else m


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
    dp = 0 if par.dp == 1 else 1 if par.dp_mode == "replicate" else units * (_gathers(cfg) + 1)
    return {"tp": int(per_block * layers * m) if par.tp > 1 else 0, "dp": int(dp),
            "pp": 2 * m * par.pp_virtual_stages if par.pp > 1 else 0}  # fmt: skip


def _links(cfg: JobConfig, hw: Hardware) -> dict[str, float]:
    """The bandwidth each kind of traffic gets. Ranks are laid out pp-major, tp-minor (keel.trainer.parallel.parallelize),
    so a tp group is tp consecutive GPUs, a dp group spans dp·tp of them and pp neighbours are dp·tp apart."""
    par = cfg.parallel
    intra, inter = hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s
    return {
        "tp": intra,
        "dp": intra if par.dp * par.tp <= hw.gpus_per_node else inter,
        "pp": intra if par.pp * par.dp * par.tp <= hw.gpus_per_node else inter,
    }


def rank(plans: list[Plan]) -> list[Plan]:
    """The plans that fit, fastest first (ties: less memory)."""
    return sorted((p for p in plans if p.fits), key=lambda p: (-p.tokens_per_s, p.memory_bytes))


# --- the command ----------------------------------------------------------------------------------------

DEFAULT_SEQ_LEN, DEFAULT_GLOBAL_BATCH = 4096, 1024  # 4M tokens a step, Llama 2's batch


def shape_for_params(params: float) -> dict[str, int]:
    """A Llama-like shape of about `params` parameters: head_dim 128, d_model = 128·layers (7B: 4096 x 32),
    SwiGLU's ffn = 8/3·d_model rounded up to 256, 8 kv heads where the heads split into 8, Llama 3's
    vocabulary. The layer count whose exact parameter count is nearest wins, among 1 to 7 layers and then
    multiples of 8 (so that the heads split over tp up to 8)."""

    def shape(layers: int) -> dict[str, int]:
        d = 128 * layers
        return {"n_layers": layers, "dim": d, "n_heads": layers, "n_kv_heads": 8 if layers % 8 == 0 else layers,
                "ffn_dim": -(-8 * d // 3 // 256) * 256, "vocab_size": LLAMA3_VOCAB}  # fmt: skip

    layers = [*range(1, 8), *range(8, 257, 8)]
    return min((shape(n) for n in layers), key=lambda f: abs(count_params(ModelArgs(**f))[0] - params))


def base_config(opts) -> JobConfig:
    """The job to plan: a config (a TOML file or preset, whose batch and sequence length stand unless the
    flags set them), a parameter count, or a shape."""
    overrides: dict = {}
    if opts.config and opts.config in MODEL_PRESETS and not opts.config.endswith(".toml"):
        source, overrides["model.preset"] = None, opts.config
    else:
        source = opts.config
    if opts.params is not None:
        overrides |= {f"model.{k}": v for k, v in shape_for_params(opts.params).items()}
    elif opts.layers is not None:
        heads = opts.heads
        ffn = opts.ffn or -(-8 * opts.dim // 3 // 256) * 256
        shape = {"n_layers": opts.layers, "dim": opts.dim, "n_heads": heads, "n_kv_heads": opts.kv_heads or heads, "ffn_dim": ffn,
                 "vocab_size": opts.vocab or LLAMA3_VOCAB}  # fmt: skip
        overrides |= {f"model.{k}": v for k, v in shape.items()}
    from_file = source is not None and source.endswith(".toml")
    overrides["data.seq_len"] = opts.seq_len or (None if from_file else DEFAULT_SEQ_LEN)
    overrides["training.global_batch_size"] = opts.global_batch or (None if from_file else DEFAULT_GLOBAL_BATCH)
    overrides["training.dtype"] = "bf16"
    cfg = load_config(source, {k: v for k, v in overrides.items() if v is not None})
    for section in (cfg.model, cfg.data, cfg.training):
        section.validate()
    one_gpu = replace(cfg, parallel=replace(cfg.parallel, pp=1, dp=1, tp=1), training=replace(cfg.training, microbatches=1))
    validate_layout(one_gpu)  # the model's own shape (dim by heads, heads by kv heads) before any layout
    return cfg


def hardware(opts, gpus: int | None = None) -> Hardware:
    kind = gpu_kind(opts.gpu)
    if kind is None:
        raise ConfigError("--gpu " + unknown_gpu(opts.gpu, "or plan with a known kind of the same peak and memory"))
    gpu = GPUS[kind]
    return Hardware(kind, gpus or opts.gpus, opts.gpus_per_node, gpu.peak_bf16_flops, gpu.memory_gib * 2**30,
                    opts.intra_node_gbps * 1e9, opts.inter_node_gbps * 1e9, opts.compute_efficiency)  # fmt: skip


def smallest_fitting(
    cfg: JobConfig, hw: Hardware, activations: ActivationModel = activation_bytes, most_gpus: int = 32768
) -> tuple[int, Plan] | None:
    """The fewest GPUs, in whole nodes, on which some layout fits, with the fastest plan there: doubling the
    node count until one fits (counts with many factors, where most layouts exist), then node by node
    between the last two. None up to `most_gpus`."""
    states = MODEL_STATE_BYTES_PER_PARAM * count_params(model_args(cfg))[0]

    def best_at(gpus: int) -> Plan | None:
        if states / gpus > USABLE_MEMORY * hw.memory_bytes:  # the model states alone, spread over every GPU
            return None
        bigger = replace(hw, gpus=gpus)
        fitting = rank([plan(c, bigger, activations) for c in candidates(cfg, bigger)])
        return fitting[0] if fitting else None

    node = hw.gpus_per_node
    low, high = max(1, hw.gpus // node), max(1, hw.gpus // node)
    while (found := best_at(high * node)) is None or high * node <= hw.gpus:
        low, high = high, 2 * high
        if high * node > most_gpus:
            return None
    for nodes in range(low + 1, high):
        if nodes * node > hw.gpus and (smaller := best_at(nodes * node)) is not None:
            return nodes * node, smaller
    return high * node, found


def explain(best: Plan, hw: Hardware) -> str:
    """Why this layout, in one sentence."""
    par, tr = best.cfg.parallel, best.cfg.training
    why = [f"tp{par.tp} keeps tensor parallelism inside a node" if par.tp > 1 else "no tensor parallelism is needed"]
    if par.pp > 1:
        why.append(f"pp{par.pp} with {tr.microbatches} micro-batches leaves a {best.bubble:.1%} bubble")
    if tr.activation_checkpointing != "none":
        why.append(f"{tr.activation_checkpointing} checkpointing makes the activations fit")
    return (
        f"{best.label()} is the fastest layout that fits: {best.memory_bytes / 2**30:.1f} of {hw.memory_bytes / 2**30:.0f} GiB, "
        f"{best.tokens_per_s:,.0f} tokens/s at {best.mfu:.0%} MFU; " + ", ".join(why) + "."
    )


def _row(p: Plan) -> str:
    gib = [x / 2**30 for x in (p.state_bytes, p.activation_bytes, p.memory_bytes)]
    gb = [p.comm_bytes[k] / 1e9 for k in ("tp", "dp", "pp")]
    return (f"{p.label():<44} {gib[0]:>7.1f} {gib[1]:>6.1f} {gib[2]:>6.1f} {p.bubble:>6.1%} {gb[0]:>7.1f} {gb[1]:>7.1f} {gb[2]:>6.2f}"
            f" {p.step_s:>7.2f} {p.mfu:>5.0%} {p.tokens_per_s:>10,.0f}")  # fmt: skip


HEADER = (f"{'layout':<44} {'states':>7} {'activ.':>6} {'GiB':>6} {'bubble':>6} {'tp GB':>7} {'dp GB':>7} {'pp GB':>6}"
          f" {'step s':>7} {'MFU':>5} {'tokens/s':>10}")  # fmt: skip


def plan_dict(p: Plan) -> dict:
    par, tr = p.cfg.parallel, p.cfg.training
    return {
        "layout": {"pp": par.pp, "dp": par.dp, "tp": par.tp, "pp_schedule": par.pp_schedule, "pp_virtual_stages": par.pp_virtual_stages,
                   "dp_mode": par.dp_mode, "sequence_parallel": par.sequence_parallel, "microbatches": tr.microbatches,
                   "activation_checkpointing": tr.activation_checkpointing},
        "memory_bytes": {"states": p.state_bytes, "activations": p.activation_bytes, "total": p.memory_bytes},
        "bubble": p.bubble, "comm_bytes": p.comm_bytes, "comm_s": p.comm_s, "compute_s": p.compute_s, "step_s": p.step_s,
        "wait_share": p.wait_share, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s,
    }  # fmt: skip


def _parser():
    p = argparse.ArgumentParser(prog="keel plan", description=__doc__.split("\n\n")[0])
    model = p.add_argument_group("the model (one of)")
    model.add_argument("--config", help="a preset (tiny, small, 1b, 7b, 70b, 405b) or a TOML config")
    model.add_argument("--params", help="a parameter count (70B, 8e9): a Llama-like shape of that size")
    for flag in ("--layers", "--dim", "--heads", "--kv-heads", "--ffn", "--vocab"):
        model.add_argument(flag, type=int, help="the model's shape" if flag == "--layers" else argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", required=True, help="GPU kind (keel estimate --help lists them)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, help=f"tokens a sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--global-batch", type=int, help=f"sequences a step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--intra-node-gbps", type=float, default=360.0, help="collective bus bandwidth in a node, GB/s (default 360: NVLink 4)")
    p.add_argument("--inter-node-gbps", type=float, default=40.0, help="... across nodes, per GPU, GB/s (default 40: 400 Gb/s)")
    p.add_argument(
        "--compute-efficiency",
        type=float,
        default=COMPUTE_EFFICIENCY,
        help=f"MFU when nothing waits (default {COMPUTE_EFFICIENCY}: TorchTitan's Llama 3 8B on 8 H100s)",
    )
    p.add_argument(
        "--activations",
        choices=ACTIVATION_MODELS,
        default="keel",
        help="keel: what Keel's block keeps (default); korthikanti: Korthikanti et al.'s GPT formulas, attention scores kept",
    )
    p.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    p.add_argument("--json", action="store_true")
    return p


def _check_flags(opts) -> None:
    """One line per bad flag, before anything is planned."""
    chosen = [
        name for name, given in (("--config", opts.config), ("--params", opts.params), ("--layers", opts.layers)) if given is not None
    ]
    if len(chosen) != 1:
        raise ConfigError(f"give the model once: --config, --params or --layers/--dim/--heads (got {' '.join(chosen) or 'none'})")
    if opts.params is not None:
        opts.params = parse_count("--params", opts.params)
    if opts.layers is not None and (opts.dim is None or opts.heads is None):
        raise ConfigError("--layers needs --dim and --heads too (--kv-heads, --ffn and --vocab are optional)")
    for flag in ("gpus", "gpus_per_node", "seq_len", "global_batch", "layers", "dim", "heads", "kv_heads", "ffn", "vocab", "top"):
        value = getattr(opts, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    for flag in ("intra_node_gbps", "inter_node_gbps"):
        if not getattr(opts, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(opts, flag):g}: must be more than 0 (GB/s)")
    if not 0 < opts.compute_efficiency <= 1:
        raise ConfigError(f"--compute-efficiency {opts.compute_efficiency:g}: must be in (0, 1], a fraction of the peak")


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    try:
        _check_flags(opts)
        hw, cfg = hardware(opts), base_config(opts)
        layouts = candidates(cfg, hw)
        if not layouts:
            args = model_args(cfg)
            raise ConfigError(
                f"--gpus {hw.gpus}: no layout of {hw.gpus} GPUs splits this model (tp must divide heads {args.n_heads}, kv heads "
                f"{args.n_kv_heads}, dim and ffn and fit in a node of {hw.gpus_per_node}; pp at most {args.n_layers} layers; dp must "
                f"divide the global batch {cfg.training.global_batch_size}); try a GPU count with more factors"
            )
    except (ConfigError, EstimateError) as e:
        print(f"keel plan: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    activations = ACTIVATION_MODELS[opts.activations]
    plans = [plan(c, hw, activations) for c in layouts]
    fitting = rank(plans)
    fallback = None if fitting else smallest_fitting(cfg, hw, activations)
    if opts.json:
        out = {"gpus": hw.gpus, "gpu": hw.gpu, "layouts": len(plans), "fitting": [plan_dict(p) for p in fitting[: opts.top]]}
        if fallback:
            out["smallest_fitting"] = {"gpus": fallback[0], "plan": plan_dict(fallback[1])}
        print(json.dumps(out, indent=2))
        return EXIT_OK
    args = model_args(cfg)
    print(f"{args.n_layers} layers x {args.dim} ({model_params_text(args)}) on {hw.gpus:,} {hw.gpu} ({hw.memory_bytes / 2**30:.0f} GiB), "
          f"{cfg.training.global_batch_size:,} x {cfg.data.seq_len:,} tokens a step: {len(plans):,} layouts, {len(fitting):,} fit")  # fmt: skip
    if not fitting:
        smallest = f"the smallest that fits is {fallback[0]:,} GPUs: {fallback[1].label()}" if fallback else "nor on up to 32,768 GPUs"
        print(f"nothing fits in {USABLE_MEMORY:.0%} of {hw.memory_bytes / 2**30:.0f} GiB a GPU; {smallest}")
        return EXIT_OK
    print(HEADER)
    for p in fitting[: opts.top]:
        print(_row(p))
    print(explain(fitting[0], hw))
    return EXIT_OK


def model_params_text(args) -> str:
    return f"{count_params(args)[0] / 1e9:.1f}B parameters"
