"""Large layouts without the hardware: a rank of a 7B, 70B or 405B job simulated in one process (a fake process
group, the model on the meta device) holds exactly the shards an analytic count gives, and a real rank builds its
shards without ever holding its whole pipeline stage."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO, keel

from keel.trainer.launch import parse_train_args
from keel.trainer.model_args import MODEL_PRESETS, padded_vocab_size
from keel.trainer.simulate import simulate_rank

# The seed table's layouts: (preset, pp, dp, tp, microbatches, global batch), and the layers each end rank holds.
LAYOUTS = {
    "7b dp8": (("7b", 1, 8, 1, 4, 32), (32, 32)),
    "70b dp64 tp8 (512 GPUs)": (("70b", 1, 64, 8, 4, 256), (80, 80)),
    # 126 layers on 8 stages: the first and the last stage hold one fewer (they also hold the embedding and the head).
    "405b dp256 tp8 pp8 (16,384 GPUs)": (("405b", 8, 256, 8, 8, 2048), (15, 15)),
}


def _flags(preset: str, pp: int, dp: int, tp: int, microbatches: int, batch: int) -> list[str]:
    return [f"--model.preset={preset}", f"--pp={pp}", f"--dp={dp}", f"--tp={tp}", f"--training.microbatches={microbatches}",
            f"--training.global_batch_size={batch}"]  # fmt: skip


@pytest.fixture(scope="module")
def simulated() -> dict[str, list[dict]]:
    """The first and the last rank of each layout, simulated in one process of their own (simulate_rank makes
    the default process group, one layout after another)."""
    code = (
        "import json, sys; from dataclasses import asdict; from keel.trainer.launch import parse_train_args;"
        "from keel.trainer.simulate import simulate_rank\n"
        "for flags in json.loads(sys.argv[1]):\n"
        "    cfg, _ = parse_train_args(flags)\n"
        "    print(json.dumps([asdict(simulate_rank(cfg, r)) for r in (0, cfg.world_size - 1)]))"
    )
    flags = [_flags(*layout) for layout, _ in LAYOUTS.values()]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(flags)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(LAYOUTS, map(json.loads, proc.stdout.splitlines()[-len(LAYOUTS) :])))


def _chunk(rows: int, parts: int, index: int) -> int:
    """Rows of torch.chunk(rows, parts)[index]: what FSDP2 gives each dp rank of a dimension 0 (the last ones may get fewer, or none)."""
    per = -(-rows // parts)
    return max(0, min(per, rows - index * per))


def analytic_params(preset: str, pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, layers: int) -> int:
    """A rank's parameter elements, counted from the model's shape: Megatron's split over tp (q, k, v, gate and up
    by output row, attention out and down by input column, embedding and head by vocabulary row, norms whole),
    then FSDP's split of each tensor's first dimension over dp."""
    a = MODEL_PRESETS[preset]
    d, kv, ffn, vocab = a.dim, a.n_kv_heads * a.head_dim, a.ffn_dim, padded_vocab_size(a.vocab_size, tp)
    block = [(d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), (ffn // tp, d), (ffn // tp, d), (d, ffn // tp), (d, 1), (d, 1)]
    shapes = block * layers
    if pp_rank == 0:
        shapes.append((vocab // tp, d))
    if pp_rank == pp - 1:
        shapes += [(d, 1), (vocab // tp, d)]
    return sum(_chunk(rows, dp, dp_rank) * cols for rows, cols in shapes)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_simulated_rank_holds_the_analytic_shards(name, simulated):
    (preset, pp, dp, tp, _, _), layers = LAYOUTS[name]
    first, last = simulated[name]
    assert (first["pp_rank"], first["dp_rank"], first["tp_rank"]) == (0, 0, 0)
    assert (last["pp_rank"], last["dp_rank"], last["tp_rank"]) == (pp - 1, dp - 1, tp - 1)
    for rank, held in zip((first, last), layers):
        assert rank["layers"] == held
        assert rank["params"] == analytic_params(preset, pp, dp, tp, rank["pp_rank"], rank["dp_rank"], held), rank
        # fp32 weights and gradients, and AdamW's two fp32 moments: 16 bytes a parameter, all sharded alike.
        assert rank["param_bytes"] == rank["grad_bytes"] == 4 * rank["params"]
        assert rank["optimizer_bytes"] == 8 * rank["params"]


def test_keel_simulate_prints_the_first_and_the_last_rank():
    proc = keel("simulate", *_flags("7b", 1, 8, 1, 4, 32), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0,0,0", "32"), ("7", "0,7,0", "32")]
    expected = f"{analytic_params('7b', 1, 8, 1, 0, 0, 32):,}"
    assert rows[0][3] == expected, proc.stdout


def test_a_rank_outside_the_layout_is_refused():
    cfg, _ = parse_train_args(_flags("7b", 1, 8, 1, 4, 32))
    with pytest.raises(ValueError, match=r"^rank=8: the layout has ranks 0 to 7$"):
        simulate_rank(cfg, 8)


def test_a_rank_builds_its_shards_without_its_whole_stage():
    """7b's shape with 2 layers (2.5 GiB whole, untied), as rank 0 of dp4 tp2, measured by bench/build_memory.py's
    own build: the shards are an eighth, and the largest whole parameter made while initializing is the embedding."""
    bench = runpy.run_path(str(REPO / "bench" / "build_memory.py"))
    got = bench["build_peak"]("7b", 2, 4, 2)
    args = replace(MODEL_PRESETS["7b"], n_layers=2)
    whole = 4 * analytic_params("7b", 1, 1, 1, 0, 0, args.n_layers)
    largest = 4 * padded_vocab_size(args.vocab_size, 2) * args.dim  # the embedding (and the head), made whole one at a time
    assert got["shards"] == 4 * analytic_params("7b", 1, 4, 2, 0, 0, args.n_layers)  # about an eighth of the whole
    target = got["shards"] + largest + bench["ALLOWANCE"]
    assert got["peak"] <= target, f"peak {got['peak'] / 2**30:.2f} GiB, whole stage {whole / 2**30:.2f} GiB"
