"""`keel plan`: its memory, bubble and communication formulas against the published ones and against worked
examples checked by hand, its choice on the layouts of the field, and its answers to bad input. (Its model
states equal the simulated build's, byte for byte: tests/test_scale.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import keel

from keel.trainer.config import load_config
from keel.trainer.model_args import ModelArgs, count_params, model_args, padded_vocab_size
from keel.trainer.planning.memory_model import (
    activation_bytes,
    busiest_rank_state_bytes,
    korthikanti_activation_bytes,
    logits_bytes,
    rank_model_states,
)
from keel.trainer.planning.plan_command import shape_for_params
from keel.trainer.planning.planner import Hardware, candidates, plan, rank

H100_NODES = dict(gpu="H100", peak_flops=989e12, memory_bytes=80 * 2**30, gpus_per_node=8, intra_node_bytes_per_s=360e9,
                  inter_node_bytes_per_s=40e9)  # fmt: skip
# GPT-3 175B's shape, its 4d two-matrix MLP written as SwiGLU's three matrices of 8/3 d: the same parameters.
GPT3 = {
    "model.dim": 12288,
    "model.n_layers": 96,
    "model.n_heads": 96,
    "model.n_kv_heads": 96,
    "model.ffn_dim": 32768,
    "model.vocab_size": 50257,
}


def _cfg(overrides: dict, **layout) -> object:
    cfg = load_config(None, {"model.preset": "70b", "data.seq_len": 4096, "training.global_batch_size": 1024, **overrides})
    return replace(cfg, parallel=replace(cfg.parallel, **layout)) if layout else cfg


def test_model_states_follow_the_zero_paper():
    """Rajbhandari et al. 2020, figure 1: a 7.5B model on 64 GPUs with mixed-precision Adam (K = 12) holds
    120 GB a GPU replicated and 1.9 GB fully sharded (ZeRO-3); ZeRO-2 keeps the fp16 weights whole,
    2Ψ + 14Ψ/64 = 16.6 GB. Keel keeps the same 16 bytes a parameter (fp32 weights, fp32 gradients, two fp32
    moments), so replicate and zero3 give the paper's figures; zero2 (FSDP2 resharding only after the
    backward) holds every shard plus the bf16 weights gathered whole from forward to backward:
    16Ψ/64 + 2Ψ = 16.9 GB, 1.6% above the paper's ZeRO-2, which does not keep the fp32 weights sharded
    beside the fp16 copy it gathers."""
    shape = shape_for_params(7.5e9)  # 6.7B: the nearest Llama-like shape; the bytes scale with the count
    cfg = load_config(None, {f"model.{k}": v for k, v in shape.items()} | {"training.global_batch_size": 64})
    n = count_params(ModelArgs(**shape), padded_vocab_size(shape["vocab_size"], 1))[0]

    def gb_at_7_5b(mode: str) -> float:
        """The busiest GPU's bytes for this model at dp64, per parameter, times the paper's 7.5B."""
        got = busiest_rank_state_bytes(replace(cfg, parallel=replace(cfg.parallel, dp=64, dp_mode=mode)), gathered_bytes=2)
        return got / n * 7.5e9 / 1e9

    assert gb_at_7_5b("replicate") == pytest.approx(120.0)
    sharded = rank_model_states(ModelArgs(**shape), 1, 64, 1, 0, 0).total_bytes / n * 7.5e9 / 1e9
    assert sharded == pytest.approx(1.9, abs=0.05)  # ZeRO-3 at rest: the paper's 1.9 GB
    assert gb_at_7_5b("zero2") == pytest.approx(sharded + 15.0)  # + the bf16 weights, gathered whole
    assert gb_at_7_5b("zero2") == pytest.approx(16.6, rel=0.02)  # the paper's ZeRO-2


@pytest.mark.parametrize(
    ("t", "sp", "ac", "per_layer"),
    [
        # Korthikanti et al. 2022: bytes per layer and micro-batch at 16 bits, s·b·h times ...
        (1, False, "none", lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h)),  # eq. 1
        (8, False, "none", lambda s, b, h, a: s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))),  # eq. 2, tensor parallel
        (8, True, "none", lambda s, b, h, a: s * b * h / 8 * (34 + 5 * a * s / h)),  # eq. 4, with sequence parallelism
        (8, True, "selective", lambda s, b, h, a: s * b * h * 34 / 8),  # eq. 5, selective recomputation
        (8, True, "full", lambda s, b, h, a: 2 * s * b * h / 8),  # section 5: full recomputation keeps the input
    ],
)
def test_activations_follow_korthikanti(t, sp, ac, per_layer):
    """GPT-3 175B at s = 2048 and one sequence a micro-batch (the paper's table 3 setting), pp1: the layers'
    activations plus the fp32 logits and their gradient (the paper leaves the head out), plus, under full
    recomputation, one layer's whole activations while it is recomputed."""
    overrides = GPT3 | {"data.seq_len": 2048, "training.global_batch_size": 1, "training.activation_checkpointing": ac}
    cfg = _cfg(overrides, tp=t, sequence_parallel=sp, loss_parallel=sp)
    s, b, h, a = 2048, 1, 12288, 96
    logits = 2 * 4 * s * b * padded_vocab_size(50257, t) / (t if sp else 1)
    recomputing = s * b * h * (34 / t + 5 * a * s / (h * t)) if ac == "full" else 0
    assert korthikanti_activation_bytes(cfg, element_bytes=2) == pytest.approx(96 * per_layer(s, b, h, a) + logits + recomputing, rel=1e-9)


@pytest.mark.parametrize(("p", "m", "v", "share"), [(4, 16, 1, 3 / 19), (8, 32, 1, 7 / 39), (8, 32, 2, 7 / 71), (1, 8, 1, 0.0)])
def test_the_bubble_is_narayanans(p, m, v, share):
    """Narayanan et al. 2021: 1F1B idles (p-1)/m of the ideal time, interleaving with v chunks (p-1)/(v·m);
    as a share of the step, (p-1)/(v·m + p-1). A worked example often quoted for 175B on pp4 with 16
    micro-batches: 3/19 = 15.8%."""
    schedule = "Interleaved1F1B" if v > 1 else "1F1B"
    cfg = _cfg(
        {"training.microbatches": m, "training.global_batch_size": m * 2}, pp=p, dp=2, tp=4, pp_schedule=schedule, pp_virtual_stages=v
    )
    assert plan(cfg, Hardware(gpus=p * 8, **H100_NODES)).bubble == pytest.approx(share)


def test_data_parallel_traffic_is_the_ring_all_reduce():
    """A worked example: BERT-Large (340M parameters) on 8 GPUs sends, per GPU and step, 2·(8-1)/8 of its
    gradients in a ring all-reduce: 1.19 GB in fp16, 2.38 GB in fp32 as Keel reduces them. The example
    multiplies the 680 MB by 8 GPUs instead (5.44 GB, 9 ms at 600 GB/s): every GPU sends 1.75x its
    gradients, not 8x. Keel's replicate mode reduces 4-byte gradients; at 600 GB/s that is 4 ms."""
    cfg = load_config(None, {"model.preset": "tiny", "model.dim": 1024, "model.n_layers": 24, "model.n_heads": 16, "model.ffn_dim": 4096,
                             "model.vocab_size": 30522, "data.seq_len": 512, "training.global_batch_size": 8})  # fmt: skip
    cfg = replace(cfg, parallel=replace(cfg.parallel, dp=8, dp_mode="replicate"))
    held = rank_model_states(
        ModelArgs(dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=4096, vocab_size=30522), 1, 1, 1, 0, 0
    ).params
    got = plan(cfg, Hardware(gpus=8, **H100_NODES | {"intra_node_bytes_per_s": 600e9}))
    assert got.comm_bytes["dp"] == pytest.approx(2 * 7 / 8 * held * 4)
    assert got.comm_s["dp"] == pytest.approx(2 * 7 / 8 * held * 4 / 600e9)


def test_a_worked_175b_layout_holds_a_thirty_second_of_the_weights():
    """175B on 64 GPUs as DP2 x TP8 x PP4 (a worked example): each GPU holds 1/8 of the weights of 1/4 of
    the layers, 175B/32 = 5.5B parameters; replicated over dp, 16 bytes each: 87 GB, more than an
    H100 holds, which is why such a layout shards over dp as well (zero3: 43 GB)."""
    cfg = _cfg(GPT3 | {"training.microbatches": 4, "training.global_batch_size": 8}, pp=4, dp=2, tp=8, dp_mode="replicate")
    params = busiest_rank_state_bytes(cfg) / 16
    assert params == pytest.approx(175e9 / 32, rel=0.03)


def test_seventy_billion_does_not_fit_on_one_node():
    """A classic exercise: a 70B model on 8 H100s, which layout? With AdamW in full precision, none: its
    model states alone are 16 bytes x 70.6B = 1.13 TB, 141 GB a GPU. The planner says so and names the
    smallest count that fits."""
    proc = keel("plan", "--config", "70b", "--gpus", "8", "--gpu", "H100")
    assert proc.returncode == 0, proc.stderr
    assert "1,560 layouts, 0 fit" in proc.stdout
    smallest = int(proc.stdout.split("the smallest that fits is ")[1].split(" GPUs")[0].replace(",", ""))
    assert 16 <= smallest and smallest % 8 == 0
    fit = json.loads(keel("plan", "--config", "70b", "--gpus", str(smallest), "--gpu", "H100", "--json").stdout)
    assert fit["fitting"] and fit["fitting"][0]["memory_bytes"]["total"] <= 0.9 * 80 * 2**30


def test_the_pick_keeps_tp_in_a_node_and_fits():
    """70B on 512 H100s (the field's layout is tp8 inside each node): every fitting layout keeps tp within 8
    GPUs, the pick is the fastest, and the ranking is by tokens/s."""
    cfg = _cfg({})
    hw = Hardware(gpus=512, **H100_NODES)
    plans = [plan(c, hw) for c in candidates(cfg, hw)]
    ranked = rank(plans)
    assert ranked and all(p.cfg.parallel.tp <= 8 for p in plans)
    assert all(p.memory_bytes <= 0.9 * hw.memory_bytes for p in ranked)
    assert [p.tokens_per_s for p in ranked] == sorted((p.tokens_per_s for p in ranked), reverse=True)
    assert all(p.cfg.parallel.pp * p.cfg.parallel.dp * p.cfg.parallel.tp == 512 for p in plans)


def test_the_command_explains_its_pick():
    proc = keel("plan", "--config", "70b", "--gpus", "64", "--gpu", "H100", "--top", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("80 layers x 8192 (70.6B parameters) on 64 H100")
    assert lines[1].startswith("assumed: gpu H100: 989 TFLOP/s") and "compute efficiency" in lines[1]  # nothing assumed unseen
    rows = lines[3:6]
    footnote = [line for line in lines[6:-1] if line.startswith("* planned only")]
    assert len(lines) == 3 + len(rows) + len(footnote) + 1 and "is the fastest layout that fits" in lines[-1]
    assert lines[-1].startswith(" ".join(rows[0].split()[:6]).rstrip("*"))  # the sentence names the first row's layout


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--config", "70b", "--gpus", "0", "--gpu", "H100"], "--gpus 0: must be at least 1"),
        (["--config", "70b", "--gpus", "8", "--gpu", "H100", "--seq-len=-5"], "--seq-len -5: must be at least 1"),
        (["--layers", "0", "--dim", "512", "--heads", "8", "--gpus", "8", "--gpu", "H100"], "--layers 0: must be at least 1"),
        (["--params", "0", "--gpus", "8", "--gpu", "H100"], "--params '0': must be more than 0"),
        (["--config", "70b", "--gpus", "8", "--gpu", "T4"], "--gpu 'T4': unknown; known kinds: H200"),
        (["--config", "70b", "--params", "7B", "--gpus", "8", "--gpu", "H100"], "give the model once"),
        (["--layers", "8", "--gpus", "8", "--gpu", "H100"], "--layers needs --dim and --heads too"),
        (
            ["--layers", "8", "--dim", "1000", "--heads", "7", "--gpus", "8", "--gpu", "H100"],
            "model.dim=1000 is not divisible by model.n_heads=7",
        ),
        # 7 heads split over no tp but 1 and 7 (more than a node of 4), 4 layers over no pp of 7, and a global
        # batch of 1,024 over no dp of 7: no layout of 7 GPUs.
        (["--layers", "4", "--dim", "896", "--heads", "7", "--gpus", "7", "--gpu", "H100", "--gpus-per-node", "4"], "--gpus 7: no layout"),
        (["--config", "70b", "--gpus", "8", "--gpu", "H100", "--compute-efficiency", "2"], "--compute-efficiency 2: must be in (0, 1]"),
        (
            ["--config", "70b", "--gpus", "8", "--gpu", "H100", "--compute-efficiency", "45"],
            "--compute-efficiency 45: must be in (0, 1], a fraction of the peak, not TFLOP/s; for 45% write 0.45",
        ),
        (["--params", "0.5", "--gpus", "8", "--gpu", "H100"], "--params 0.5: 0.5 parameters is no model to plan GPUs for; write 0.5B"),
        (["--config", "70b", "--gpus", "8", "--peak-tflops", "-5", "--memory-gib", "80"], "--peak-tflops -5: must be more than 0"),
        (["--config", "70b", "--gpus", "8", "--peak-tflops", "100"], "--gpu is required, or both --peak-tflops and --memory-gib"),
        (
            ["--config", "70b", "--gpu", "H100", "--layout", "pp2,dp4,tp8,bogus"],
            "--layout 'pp2,dp4,tp8,bogus': 'bogus' is not a layout word",
        ),
        (["--config", "70b", "--gpu", "H100", "--layout", "pp2,dp4"], "--layout 'pp2,dp4': give tp too"),
        (
            ["--config", "70b", "--gpu", "H100", "--layout", "pp2,dp4,tp8", "--gpus", "32"],
            "--layout 'pp2,dp4,tp8' takes 64 GPUs but --gpus is 32",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(args, error):
    proc = keel("plan", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keel plan: error: {error}"), proc.stderr


def test_data_parallel_traffic_follows_fsdp2s_gathers_and_each_collective_pays_the_latency():
    """FSDP2 (Keel's zero3) reshards after each forward and backward, so a step of m micro-batches gathers
    every weight 2m times, zero2 m times (it keeps them from a forward to its backward); both reduce-scatter
    the fp32 gradients once. FSDP2 does each block and the root unit apart: (layers + 1) collectives a
    gather. On CPU (hw.overlaps_compute False: gloo's threads share the compute's cores) all of it is
    exposed; tp's 4 all-reduces a block and micro-batch each pay the latency too."""
    held = rank_model_states(model_args(_small(pp=1, dp=1, tp=1)), 1, 1, 1, 0, 0).params
    cpu = Hardware(gpu="cpu", gpus=2, gpus_per_node=2, peak_flops=1e11, memory_bytes=2**34, intra_node_bytes_per_s=1e9,
                   inter_node_bytes_per_s=1e9, collective_latency_s=1e-3, overlaps_compute=False)  # fmt: skip
    for mode, gathers in (("zero3", 2 * 4), ("zero2", 4)):
        got = plan(_small(pp=1, dp=2, tp=1, dp_mode=mode), cpu)
        assert got.comm_bytes["dp"] == pytest.approx(held / 2 * (gathers * 4 + 4))  # fp32 on CPU
        collectives = (4 + 1) * (gathers + 1)  # 4 blocks and the root, each gathered and reduced
        assert got.comm_s["dp"] == pytest.approx(got.comm_bytes["dp"] / 1e9 + collectives * 1e-3)
        assert got.step_s == pytest.approx(got.compute_s + got.comm_s["dp"])  # nothing overlapped
    tp = plan(_small(pp=1, dp=1, tp=2), cpu)
    activation = 256 * 2 * 256 * 4  # seq x rows a micro-batch x d_model, fp32
    assert tp.comm_bytes["tp"] == pytest.approx(4 * 2 * 0.5 * activation * 4 * 4)  # 4 all-reduces, 4 blocks, 4 micro-batches
    assert tp.comm_s["tp"] == pytest.approx(tp.comm_bytes["tp"] / 1e9 + 4 * 4 * 4 * 1e-3)


def _small(**layout):
    cfg = load_config("small", {"data.seq_len": 256, "training.global_batch_size": 8, "training.microbatches": 4})
    return replace(cfg, parallel=replace(cfg.parallel, **layout))


LLAMA3_405B = ["--config", "405b", "--gpu", "H100", "--seq-len", "8192", "--global-batch", "2048"]


def test_a_named_layout_is_scored_and_told_why_it_does_not_fit():
    """Llama 3 405B's split with 16 micro-batches and two stages a rank: accepted, scored, and without
    recomputation over by the activations, named with the GiB; with full recomputation it fits."""
    layout = "pp16,v2,dp128,tp8,m16,zero1,sp"
    over = json.loads(keel("plan", *LLAMA3_405B, "--layout", layout + ",ac=selective", "--json").stdout)
    assert over["gpus"] == 16384 and not over["fits"] and not over["plan"]["runs_in_keel"]  # zero1: planned only
    assert "over by" in over["verdict"] and over["verdict"].endswith("the largest is the activations")
    assert over["plan"]["label"] == "pp16 v2 dp128 zero1 tp8 sp m16 ac=selective"
    fits = json.loads(keel("plan", *LLAMA3_405B, "--layout", layout + ",ac=full", "--json").stdout)
    assert fits["fits"] and fits["verdict"] == "fits"
    assert fits["plan"]["tokens_per_s_per_gpu"] == pytest.approx(fits["plan"]["tokens_per_s"] / 16384)
    text = keel("plan", *LLAMA3_405B, "--layout", layout + ",ac=full").stdout
    assert text.startswith("assumed: gpu H100") and "on 16,384 H100: fits; keel train does not run this layout yet" in text


def test_every_answer_states_its_assumptions_and_an_unlisted_gpu_can_be_planned():
    a100 = json.loads(keel("plan", "--config", "70b", "--gpus", "64", "--gpu", "A100", "--json").stdout)["assumptions"]
    assert a100["intra_node"] == "240 GB/s bus bandwidth (NVLink 3 at 80%)"  # not NVLink 4's 360
    assert a100["inter_node"].startswith("20 GB/s a GPU (200 Gb/s InfiniBand HDR")
    assert a100["usable_memory"].startswith("90% of it") and "calibrated" not in a100["activations"]
    assert "the A100 curve at BLOOM 176B" in a100["compute_efficiency"]
    b200 = json.loads(keel("plan", "--config", "70b", "--gpus", "64", "--gpu", "B200", "--json").stdout)["assumptions"]
    assert b200["gpu"].startswith("B200: 2,250 TFLOP/s dense bf16, 180 GiB") and "no published run on B200" in b200["compute_efficiency"]
    custom = keel("plan", "--params", "30B", "--gpus", "64", "--peak-tflops", "125", "--memory-gib", "32", "--intra-node-gbps", "120",
                  "--inter-node-gbps", "10", "--json")  # fmt: skip
    assert custom.returncode == 0, custom.stderr
    out = json.loads(custom.stdout)
    assert out["gpu"] == "custom" and out["assumptions"]["gpu"] == "custom: 125 TFLOP/s dense bf16, 32 GiB (--peak-tflops/--memory-gib)"
    assert all(p["memory_bytes"]["total"] <= 0.9 * 32 * 2**30 for p in out["fitting"])


def test_zero1_shards_the_optimizer_alone():
    """Megatron's distributed optimizer, DeepSpeed's stage 1: weights and gradients whole on every dp rank,
    AdamW's two moments sharded; its traffic a reduce-scatter of fp32 gradients and an all-gather of the weights."""
    args = model_args(_cfg({}))
    whole = rank_model_states(args, 1, 1, 8, 0, 0)
    zero1 = rank_model_states(args, 1, 4, 8, 0, 0, dp_mode="zero1")
    zero2 = rank_model_states(args, 1, 4, 8, 0, 0, dp_mode="zero2")
    assert zero1.params == whole.params and zero1.param_bytes == whole.param_bytes and zero1.grad_bytes == whole.grad_bytes
    assert zero1.optimizer_bytes == zero2.optimizer_bytes == pytest.approx(whole.optimizer_bytes / 4, rel=1e-3)
    hw = Hardware(gpus=32, **H100_NODES)
    p = plan(_cfg({}, pp=1, dp=4, tp=8, dp_mode="zero1", sequence_parallel=True), hw)
    assert p.comm_bytes["dp"] == pytest.approx(3 / 4 * whole.params * (4 + 2))
    assert not p.runs_in_keel


def test_context_parallelism_splits_the_activations_and_passes_kv_around_the_ring():
    base = _cfg({"data.seq_len": 131072, "training.global_batch_size": 16})
    hw = Hardware(gpus=128, **H100_NODES)
    one = plan(replace(base, parallel=replace(base.parallel, pp=1, dp=4, tp=8, cp=1)), hw)  # the same sequences a rank
    ring = plan(replace(base, parallel=replace(base.parallel, pp=1, dp=4, tp=8, cp=4)), hw)
    args = model_args(base)
    assert ring.activation_bytes < one.activation_bytes / 3  # a quarter of each sequence, the per-sequence terms less
    rows = 16 // 4  # sequences a micro-batch on a dp rank
    kv_chunk = 2 * (131072 // 4) * rows * args.dim * 2 * args.n_kv_heads / args.n_heads / 8  # K and V of a rank's chunk, bf16, a tp shard
    assert ring.comm_bytes["cp"] == pytest.approx(3 * 3 * kv_chunk * args.n_layers)  # 3 passes, 3 other ranks, every layer
    assert ring.comm_s["cp"] > 0 and not ring.runs_in_keel


def test_a_tied_embedding_under_a_pipeline_all_reduces_its_gradient_between_the_ends():
    tied = _cfg({"model.tie_embeddings": True, "training.microbatches": 16}, pp=4, dp=2, tp=8, sequence_parallel=True)
    untied = replace(tied, model=replace(tied.model, tie_embeddings=False))
    hw = Hardware(gpus=64, **H100_NODES)
    args = model_args(tied)
    extra = plan(tied, hw).comm_bytes["pp"] - plan(untied, hw).comm_bytes["pp"]
    assert extra == pytest.approx(padded_vocab_size(args.vocab_size, 8) / 8 * args.dim * 4)


def test_the_loss_holds_twelve_bytes_a_logit_and_fourteen_under_a_pipeline():
    """Measured with torch's profiler on Keel's loss: the fp32 log-softmax and two fp32 gradients, and under a
    pipeline the stage's bf16 output kept too; 1/tp of the vocabulary under the loss parallel."""
    cfg = _cfg({})
    vocab = padded_vocab_size(model_args(cfg).vocab_size, 1)
    assert logits_bytes(cfg, 2) == vocab * 12
    piped = replace(cfg, parallel=replace(cfg.parallel, pp=2))
    assert logits_bytes(piped, 2) == vocab * 14
    split = replace(cfg, parallel=replace(cfg.parallel, tp=8, loss_parallel=True))
    assert logits_bytes(split, 2) == padded_vocab_size(model_args(cfg).vocab_size, 8) / 8 * 12


def test_torchtitans_selective_checkpointing_keeps_less_than_keels():
    cfg = _cfg({"training.activation_checkpointing": "selective", "training.microbatches": 8}, pp=1, dp=8, tp=1)
    keel_kept, titan_kept = activation_bytes(cfg, 2), activation_bytes(cfg, 2, every_second_matmul=True)
    args = model_args(cfg)
    per_token_layer = 2 * (args.n_kv_heads * args.head_dim + args.ffn_dim + args.dim)  # wk, w3 and wo recomputed
    tokens = 4096 * cfg.microbatch_rows
    assert keel_kept - titan_kept == pytest.approx(per_token_layer * tokens * args.n_layers, rel=0.02)


def test_tp_overlap_hides_tensor_parallel_traffic_behind_the_compute():
    cfg = _cfg({"training.microbatches": 8}, pp=1, dp=8, tp=8, sequence_parallel=True)
    exposed = plan(cfg, Hardware(gpus=64, **H100_NODES))
    hidden = plan(cfg, Hardware(gpus=64, overlaps_tp=True, **H100_NODES))
    assert exposed.comm_s["tp"] == hidden.comm_s["tp"] > 0
    assert exposed.step_s - hidden.step_s == pytest.approx(exposed.comm_s["tp"])
