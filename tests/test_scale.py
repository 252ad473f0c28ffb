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

from keel.trainer.launch.launcher import parse_train_args
from keel.trainer.model_args import MODEL_PRESETS, model_args, padded_vocab_size
from keel.trainer.planning.memory_model import rank_model_states
from keel.trainer.planning.simulate import simulate_rank

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

# The seed table's layouts: (preset, pp, dp, tp, microbatches, global batch), and the layers each end rank holds.
LAYOUTS = {
    "7b dp8": (("7b", 1, 8, 1, 4, 32), (32, 32)),
    "70b dp64 tp8 (512 GPUs)": (("70b", 1, 64, 8, 4, 256), (80, 80)),
    # 126 layers on 8 stages: the first and the last stage hold one fewer (they also hold the embedding and the head).
    "405b dp256 tp8 pp8 (16,384 GPUs)": (("405b", 8, 256, 8, 8, 2048), (15, 15)),
}
# Where the planner's count could slip: a tied head, interleaved stages, a replicated dp, 80 layers on 3
# stages, and a vocabulary that dp3 splits unevenly (16,064 rows a tp rank: 5,355, 5,355, 5,354).
OTHER_LAYOUTS = {
    "1b tied dp4 tp2": ["--model.preset=1b", "--pp=1", "--dp=4", "--tp=2", "--training.microbatches=1", "--training.global_batch_size=8"],
    "7b pp4 interleaved dp2 tp2": ["--model.preset=7b", "--pp=4", "--dp=2", "--tp=2", "--parallel.pp_schedule=Interleaved1F1B",
                                   "--parallel.pp_virtual_stages=2", "--training.microbatches=8", "--training.global_batch_size=16"],
    "70b pp3 dp2 replicate tp8": ["--model.preset=70b", "--pp=3", "--dp=2", "--tp=8", "--parallel.dp_mode=replicate",
                                  "--training.microbatches=3", "--training.global_batch_size=6"],
    "70b pp2 dp3 tp8": ["--model.preset=70b", "--pp=2", "--dp=3", "--tp=8", "--training.microbatches=2", "--training.global_batch_size=6"],
}  # fmt: skip


def _flags(preset: str, pp: int, dp: int, tp: int, microbatches: int, batch: int) -> list[str]:
    return [f"--model.preset={preset}", f"--pp={pp}", f"--dp={dp}", f"--tp={tp}", f"--training.microbatches={microbatches}",
            f"--training.global_batch_size={batch}"]  # fmt: skip


@pytest.fixture(scope="module")
def simulated() -> dict[str, list[dict]]:
    """The first and the last rank of each layout, simulated in one process of their own (simulate_rank makes
    the default process group, one layout after another)."""
    code = (
        "import json, sys; from dataclasses import asdict; from keel.trainer.launch.launcher import parse_train_args;"
        "from keel.trainer.planning.simulate import simulate_rank\n"
        "for flags in json.loads(sys.argv[1]):\n"
        "    cfg, _ = parse_train_args(flags)\n"
        "    print(json.dumps([asdict(simulate_rank(cfg, r)) for r in (0, cfg.world_size - 1)]))"
    )
    flags = {name: _flags(*layout) for name, (layout, _) in LAYOUTS.items()} | OTHER_LAYOUTS
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(flags.values()))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(flags, map(json.loads, proc.stdout.splitlines()[-len(flags) :])))


def analytic_params(preset: str, pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, n_layers: int | None = None) -> int:
    """A rank's parameter elements as the planner counts them from the model's shape (keel.trainer.planning.memory_model)."""
    args = MODEL_PRESETS[preset] if n_layers is None else replace(MODEL_PRESETS[preset], n_layers=n_layers)
    return rank_model_states(args, pp, dp, tp, pp_rank, dp_rank).params


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_simulated_rank_holds_the_analytic_shards(name, simulated):
    (preset, pp, dp, tp, _, _), layers = LAYOUTS[name]
    first, last = simulated[name]
    assert (first["pp_rank"], first["dp_rank"], first["tp_rank"]) == (0, 0, 0)
    assert (last["pp_rank"], last["dp_rank"], last["tp_rank"]) == (pp - 1, dp - 1, tp - 1)
    for rank, held in zip((first, last), layers):
        assert rank["layers"] == held
        planned = rank_model_states(MODEL_PRESETS[preset], pp, dp, tp, rank["pp_rank"], rank["dp_rank"])
        # The planner's count equals what the built rank holds, byte for byte: fp32 weights and gradients,
        # AdamW's two fp32 moments, all sharded alike.
        assert (rank["layers"], rank["params"]) == (planned.layers, planned.params), rank
        assert (rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"]) == (
            planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes)  # fmt: skip
        assert rank["param_bytes"] == rank["grad_bytes"] == 4 * rank["params"] and rank["optimizer_bytes"] == 8 * rank["params"]


@pytest.mark.parametrize("name", OTHER_LAYOUTS)
def test_the_planners_count_is_what_a_built_rank_holds(name, simulated):
    cfg, _ = parse_train_args(OTHER_LAYOUTS[name])
    par = cfg.parallel
    for rank in simulated[name]:
        planned = rank_model_states(model_args(cfg), par.pp, par.dp, par.tp, rank["pp_rank"], rank["dp_rank"], par.pp_virtual_stages,
                                    par.dp_mode)  # fmt: skip
        built = (rank["layers"], rank["params"], rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"])
        assert built == (planned.layers, planned.params, planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes), name


def test_keel_simulate_prints_the_first_and_the_last_rank():
    proc = keel("simulate", *_flags("7b", 1, 8, 1, 4, 32), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0,0,0", "32"), ("7", "0,7,0", "32")]
    expected = f"{analytic_params('7b', 1, 8, 1, 0, 0):,}"
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
