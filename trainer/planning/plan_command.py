"""`keel plan`: which layout to train a model on G GPUs, or how a named one fares, before any GPU is asked for.

    keel plan --config 70b --gpus 512 --gpu H100            # every layout that fits, fastest first
    keel plan --config 405b --gpu H100 --layout pp16,dp128,tp8,m16,v2,zero1,ac=full   # one layout, scored

Every answer states what it assumed: the GPU's peak and memory, the share of it a layout may fill, the links,
the compute efficiency (keel.trainer.planning.efficiency, from published runs) and the activation accounting.
The model behind it: keel.trainer.planning.planner; conventions and sources: docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.config import ConfigError, JobConfig, load_config, validate_layout
from keel.trainer.model_args import LLAMA3_VOCAB, MODEL_PRESETS, ModelArgs, count_params, model_args
from keel.trainer.planning.efficiency import calibrated_efficiency
from keel.trainer.planning.estimate import EstimateError, parse_count
from keel.trainer.planning.gpus import GPUS, gpu_kind, unknown_gpu
from keel.trainer.planning.memory_model import MODEL_STATE_BYTES_PER_PARAM
from keel.trainer.planning.planner import (
    ACTIVATION_MODELS,
    LAYOUT_WORDS,
    USABLE_MEMORY,
    ActivationModel,
    Hardware,
    Plan,
    candidates,
    parse_layout,
    plan,
    plan_dict,
    rank,
)

DEFAULT_SEQ_LEN, DEFAULT_GLOBAL_BATCH = 4096, 1024  # 4M tokens a step, Llama 2's batch
FEWEST_PARAMS = 1e6  # below this a --params is a slip (0.5 meant 0.5B), not a model anyone plans GPUs for


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
                 "vocab_size": opts.vocab or LLAMA3_VOCAB, "tie_embeddings": opts.tied}  # fmt: skip
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


def hardware(opts, cfg: JobConfig, gpus: int) -> tuple[Hardware, dict]:
    """The hardware to plan on, from the GPU table with the flags over it, and what was assumed, with where
    each figure came from."""
    kind = gpu_kind(opts.gpu) if opts.gpu else None
    if opts.gpu and kind is None:
        raise ConfigError("--gpu " + unknown_gpu(opts.gpu, "or give --peak-tflops and --memory-gib for any other"))
    if kind is None and (opts.peak_tflops is None or opts.memory_gib is None):
        raise ConfigError("--gpu is required, or both --peak-tflops and --memory-gib for a GPU the table does not hold")
    gpu = GPUS[kind] if kind else None
    peak = opts.peak_tflops * 1e12 if opts.peak_tflops is not None else gpu.peak_bf16_flops
    memory = opts.memory_gib * 2**30 if opts.memory_gib is not None else gpu.memory_gib * 2**30
    intra = opts.intra_node_gbps * 1e9 if opts.intra_node_gbps else gpu.intra_node.bus_bytes_per_s if gpu else None
    inter = opts.inter_node_gbps * 1e9 if opts.inter_node_gbps else gpu.inter_node.bus_bytes_per_s if gpu else None
    if intra is None or inter is None:
        raise ConfigError("--intra-node-gbps and --inter-node-gbps are required for a GPU the table does not hold (GB/s a GPU)")
    efficiency, source = (
        (opts.compute_efficiency, "--compute-efficiency")
        if opts.compute_efficiency
        else calibrated_efficiency(kind, count_params(model_args(cfg))[0])
    )
    name = kind or "custom"
    hw = Hardware(name, gpus, opts.gpus_per_node, peak, memory, intra, inter, efficiency, overlaps_tp=opts.tp_overlap)
    assumed = {
        "gpu": f"{name}: {peak / 1e12:,.0f} TFLOP/s dense bf16, {memory / 2**30:.0f} GiB"
        + (" (--peak-tflops/--memory-gib)" if kind is None or opts.peak_tflops or opts.memory_gib else " (data sheet)"),
        "usable_memory": f"{USABLE_MEMORY:.0%} of it (the rest: CUDA context, NCCL buffers, fragmentation)",
        "intra_node": f"{intra / 1e9:,.0f} GB/s bus bandwidth" + ("" if opts.intra_node_gbps else f" ({gpu.intra_node.name} at 80%)"),
        "inter_node": f"{inter / 1e9:,.0f} GB/s a GPU" + ("" if opts.inter_node_gbps else f" ({gpu.inter_node.name} at 80%)"),
        "compute_efficiency": f"{efficiency:.0%} of the peak where nothing waits ({source})",
        "activations": f"{opts.activations} (--activations)",
        "tp_collectives": "overlapped with the matmuls (--tp-overlap)"
        if opts.tp_overlap
        else "exposed, as keel train runs them (--tp-overlap)",
    }
    return hw, assumed


def overflow(p: Plan, hw: Hardware) -> str:
    """Why a plan does not fit: what it needs, term by term, beside what the GPU offers."""
    usable = hw.usable_memory * hw.memory_bytes
    over = (p.memory_bytes - usable) / 2**30
    terms = {"model states (weights, gradients, AdamW, FSDP's gathered copy)": p.state_bytes, "activations": p.activation_bytes}
    largest = max(terms, key=terms.get)
    return (
        f"does not fit: {p.memory_bytes / 2**30:.1f} GiB against {usable / 2**30:.1f} usable "
        f"({hw.usable_memory:.0%} of {hw.memory_bytes / 2**30:.0f}): over by {over:.1f} GiB; "
        + ", ".join(f"{name} {value / 2**30:.1f} GiB" for name, value in terms.items())
        + f"; the largest is the {largest.split(' (')[0]}"
    )


def smallest_fitting(cfg: JobConfig, hw: Hardware, activations: ActivationModel, most_gpus: int = 32768) -> tuple[int, Plan] | None:
    """The fewest GPUs, in whole nodes, on which some layout fits, with the fastest plan there: doubling the
    node count until one fits (counts with many factors, where most layouts exist), then node by node
    between the last two. None up to `most_gpus`."""
    states = MODEL_STATE_BYTES_PER_PARAM * count_params(model_args(cfg))[0]

    def best_at(gpus: int) -> Plan | None:
        if states / gpus > hw.usable_memory * hw.memory_bytes:  # the model states alone, spread over every GPU
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
    if par.cp > 1:
        why.append(f"cp{par.cp} splits each {best.cfg.data.seq_len:,}-token sequence")
    if tr.activation_checkpointing != "none":
        why.append(f"{tr.activation_checkpointing} checkpointing makes the activations fit")
    return (
        f"{best.label()} is the fastest layout that fits: {best.memory_bytes / 2**30:.1f} of {hw.memory_bytes / 2**30:.0f} GiB, "
        f"{best.tokens_per_s_per_gpu:,.0f} tokens/s a GPU at {best.mfu:.0%} MFU; " + ", ".join(why) + "."
    )


PLANNED_ONLY = "*"  # marks a layout keel train does not run yet (context parallelism, zero1, a tied embedding under a pipeline)


def _row(p: Plan) -> str:
    gib = [x / 2**30 for x in (p.state_bytes, p.activation_bytes, p.memory_bytes)]
    gb = [p.comm_bytes[k] / 1e9 for k in ("tp", "dp", "pp")]
    label = p.label() + ("" if p.runs_in_keel else PLANNED_ONLY)
    return (f"{label:<48} {gib[0]:>7.1f} {gib[1]:>6.1f} {gib[2]:>6.1f} {p.bubble:>6.1%} {gb[0]:>7.1f} {gb[1]:>7.1f} {gb[2]:>6.2f}"
            f" {p.step_s:>7.2f} {p.mfu:>5.0%} {p.tokens_per_s:>11,.0f} {p.tokens_per_s_per_gpu:>8,.0f}")  # fmt: skip


HEADER = (f"{'layout':<48} {'states':>7} {'activ.':>6} {'GiB':>6} {'bubble':>6} {'tp GB':>7} {'dp GB':>7} {'pp GB':>6}"
          f" {'step s':>7} {'MFU':>5} {'tokens/s':>11} {'/GPU':>8}")  # fmt: skip


def _parser():
    p = argparse.ArgumentParser(prog="keel plan", description=__doc__.split("\n\n")[0])
    model = p.add_argument_group("the model (one of)")
    model.add_argument("--config", help="a preset (tiny, small, 1b, 7b, 70b, 405b) or a TOML config")
    model.add_argument("--params", help="a parameter count (70B, 8e9): a Llama-like shape of that size")
    model.add_argument("--layers", type=int, help="a shape: layers, with --dim and --heads")
    model.add_argument("--dim", type=int, help="d_model")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key-value heads (default: --heads)")
    model.add_argument("--ffn", type=int, help="feed-forward width (default: SwiGLU's 8/3·dim, rounded up to 256)")
    model.add_argument("--vocab", type=int, help=f"vocabulary (default {LLAMA3_VOCAB:,}, Llama 3's)")
    model.add_argument("--tied", action="store_true", help="the head shares the embedding's matrix")
    p.add_argument("--gpus", type=int, help="GPUs to plan on (with --layout: their product when left out)")
    p.add_argument("--gpu", help="GPU kind (keel estimate --help lists them)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s a GPU, for a kind the table does not hold (or over it)")
    p.add_argument("--memory-gib", type=float, help="GiB a GPU, for a kind the table does not hold (or over it)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, help=f"tokens a sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--global-batch", type=int, help=f"sequences a step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--layout", help=f"score this layout alone: {LAYOUT_WORDS}")
    p.add_argument("--intra-node-gbps", type=float, help="collective bus bandwidth in a node, GB/s (default: the GPU's link at 80%%)")
    p.add_argument("--inter-node-gbps", type=float, help="... across nodes, a GPU, GB/s (default: the GPU's network card at 80%%)")
    p.add_argument(
        "--compute-efficiency", type=float, help="MFU where nothing waits, a fraction (default: calibrated per GPU and model width)"
    )
    p.add_argument(
        "--activations",
        choices=ACTIVATION_MODELS,
        default="keel",
        help="keel: what Keel's block keeps (default); korthikanti: Korthikanti et al.'s GPT formulas (Megatron), attention "
        "scores kept but under selective; torchtitan: Keel's block under TorchTitan's selective op checkpointing",
    )
    p.add_argument(
        "--tp-overlap",
        action="store_true",
        help="tp collectives overlapped with the matmuls (Megatron-Core's --tp-comm-overlap, TorchTitan's async TP); keel train does not",
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
        text, opts.params = opts.params, parse_count("--params", opts.params)
        if opts.params < FEWEST_PARAMS:
            raise ConfigError(
                f"--params {text}: {opts.params:g} parameters is no model to plan GPUs for; write 0.5B or 500M for half a billion"
            )
    if opts.layers is not None and (opts.dim is None or opts.heads is None):
        raise ConfigError("--layers needs --dim and --heads too (--kv-heads, --ffn and --vocab are optional)")
    if opts.gpus is None and opts.layout is None:
        raise ConfigError("--gpus is required (or --layout, whose degrees multiply to the GPU count)")
    for flag in ("gpus", "gpus_per_node", "seq_len", "global_batch", "layers", "dim", "heads", "kv_heads", "ffn", "vocab", "top"):
        value = getattr(opts, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    for flag, unit in (("intra_node_gbps", "GB/s"), ("inter_node_gbps", "GB/s"), ("peak_tflops", "TFLOP/s"), ("memory_gib", "GiB")):
        value = getattr(opts, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {value:g}: must be more than 0 ({unit})")
    efficiency = opts.compute_efficiency
    if efficiency is not None and not 0 < efficiency <= 1:
        hint = f"; for {efficiency:g}% write {efficiency / 100:g}" if 1 < efficiency <= 100 else ""
        raise ConfigError(f"--compute-efficiency {efficiency:g}: must be in (0, 1], a fraction of the peak, not TFLOP/s{hint}")


def _answer(opts) -> tuple[JobConfig, Hardware, dict, list[Plan], JobConfig | None]:
    """The job, the hardware, what was assumed, the plans and the named layout (or None)."""
    _check_flags(opts)
    cfg = base_config(opts)
    named = parse_layout(opts.layout, cfg) if opts.layout else None
    gpus = named.world_size if named else opts.gpus
    if named and opts.gpus is not None and opts.gpus != gpus:
        raise ConfigError(f"--layout {opts.layout!r} takes {gpus} GPUs but --gpus is {opts.gpus}; leave --gpus out or match it")
    hw, assumed = hardware(opts, cfg, gpus)
    layouts = [named] if named else candidates(cfg, hw)
    if not layouts:
        args = model_args(cfg)
        raise ConfigError(
            f"--gpus {hw.gpus}: no layout of {hw.gpus} GPUs splits this model (tp must divide heads {args.n_heads}, kv heads "
            f"{args.n_kv_heads}, dim and ffn and fit in a node of {hw.gpus_per_node}; pp at most {args.n_layers} layers; dp must "
            f"divide the global batch {cfg.training.global_batch_size}); try a GPU count with more factors"
        )
    activations = ACTIVATION_MODELS[opts.activations]
    return cfg, hw, assumed, [plan(c, hw, activations) for c in layouts], named


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    try:
        cfg, hw, assumed, plans, named = _answer(opts)
    except (ConfigError, EstimateError) as e:
        print(f"keel plan: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if named:
        return _print_named(plans[0], hw, assumed, opts.json)
    fitting = rank(plans)
    fallback = None if fitting else smallest_fitting(cfg, hw, ACTIVATION_MODELS[opts.activations])
    if opts.json:
        out = {
            "gpus": hw.gpus,
            "gpu": hw.gpu,
            "assumptions": assumed,
            "layouts": len(plans),
            "fitting": [plan_dict(p) for p in fitting[: opts.top]],
        }
        if fallback:
            out["smallest_fitting"] = {"gpus": fallback[0], "plan": plan_dict(fallback[1])}
        print(json.dumps(out, indent=2))
        return EXIT_OK
    args = model_args(cfg)
    print(f"{args.n_layers} layers x {args.dim} ({model_params_text(args)}) on {hw.gpus:,} {hw.gpu} ({hw.memory_bytes / 2**30:.0f} GiB), "
          f"{cfg.training.global_batch_size:,} x {cfg.data.seq_len:,} tokens a step: {len(plans):,} layouts, {len(fitting):,} fit")  # fmt: skip
    print(assumptions_text(assumed))
    if not fitting:
        smallest = f"the smallest that fits is {fallback[0]:,} GPUs: {fallback[1].label()}" if fallback else "nor on up to 32,768 GPUs"
        print(f"nothing fits in {USABLE_MEMORY:.0%} of {hw.memory_bytes / 2**30:.0f} GiB a GPU; {smallest}")
        return EXIT_OK
    print(HEADER)
    for p in fitting[: opts.top]:
        print(_row(p))
    if any(not p.runs_in_keel for p in fitting[: opts.top]):
        print(f"{PLANNED_ONLY} planned only: keel train does not run context parallelism, zero1 or a tied embedding under a pipeline yet")
    print(explain(fitting[0], hw))
    return EXIT_OK


def _print_named(p: Plan, hw: Hardware, assumed: dict, as_json: bool) -> int:
    verdict = "fits" if p.fits else overflow(p, hw)
    if as_json:
        print(
            json.dumps(
                {"gpus": hw.gpus, "gpu": hw.gpu, "assumptions": assumed, "plan": plan_dict(p), "fits": p.fits, "verdict": verdict}, indent=2
            )
        )
        return EXIT_OK
    print(assumptions_text(assumed))
    print(HEADER)
    print(_row(p))
    print(
        f"{p.label()} on {hw.gpus:,} {hw.gpu}: {verdict}"
        + ("" if p.runs_in_keel else "; keel train does not run this layout yet (planned only)")
    )
    return EXIT_OK


def assumptions_text(assumed: dict) -> str:
    return "assumed: " + "; ".join(f"{key.replace('_', ' ')} {value}" for key, value in assumed.items())


def model_params_text(args: ModelArgs) -> str:
    total = count_params(args)[0]
    return f"{total / 1e9:.1f}B parameters" if total >= 1e9 else f"{total / 1e6:.0f}M parameters"
