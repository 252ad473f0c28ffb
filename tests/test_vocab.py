"""The vocabulary is part of the model: each preset's real vocabulary and the parameter count of the
model it is named for, tied embeddings, and the padding for tensor parallelism (Megatron-LM's 64 x tp
here), which must change neither the initial weights nor the loss: a vocabulary of 300 is built with 320
rows at tp1 and 384 at tp2, and the two runs must agree as closely as any other tp2 run does."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import keel, train
from test_config_errors import assert_one_line_error

from keel.monitor.store import read_events, read_steps
from keel.trainer.checkpoint.manifest import config_record, resume_differences
from keel.trainer.config import load_config
from keel.trainer.model import Transformer
from keel.trainer.model_args import MODEL_PRESETS, count_params, flops_per_token, model_args, padded_vocab_size

# Parameters of the released models (their model cards and papers), in the count each is known by.
RELEASED = {"1b": 1.24e9, "7b": 6.74e9, "70b": 70.6e9, "405b": 405.9e9}  # Llama 3.2 1B, 2 7B, 3 70B, 3.1 405B


@pytest.mark.parametrize("preset", RELEASED)
def test_presets_hold_the_parameters_of_the_models_they_are_named_for(preset):
    args = MODEL_PRESETS[preset]
    with torch.device("meta"):
        model = Transformer(args)
    built = sum(p.numel() for p in model.parameters())
    assert built == count_params(args)[0]
    assert abs(built / RELEASED[preset] - 1) < 0.01, f"{preset}: {built / 1e9:.3f} B parameters built"


def test_presets_carry_their_real_vocabularies():
    vocab = {name: (args.vocab_size, args.tie_embeddings) for name, args in MODEL_PRESETS.items()}
    assert vocab == {
        "tiny": (256, False),  # byte-level, on the builtin corpus
        "small": (256, False),
        "1b": (128_256, True),  # Llama 3.2 1B ties its input and output embeddings
        "7b": (32_000, False),
        "70b": (128_256, False),
        "405b": (128_256, False),
    }


@pytest.mark.parametrize(
    ("vocab", "tp", "rows"),
    [(300, 1, 320), (300, 2, 384), (256, 4, 256), (256, 8, 512), (50_257, 1, 50_304), (32_000, 4, 32_000), (32_000, 8, 32_256),
     (128_256, 4, 128_256), (128_256, 8, 128_512)],
)  # fmt: skip
def test_the_vocabulary_is_padded_to_a_multiple_of_64_times_tp(vocab, tp, rows):
    assert padded_vocab_size(vocab, tp) == rows


def test_the_config_sets_the_vocabulary_and_tying():
    cfg = load_config("tiny", ["model.vocab_size=50304", "model.tie_embeddings=true"])
    assert model_args(cfg) == replace(MODEL_PRESETS["tiny"], vocab_size=50_304, tie_embeddings=True, max_seq_len=2048)
    assert model_args(load_config("1b", ["model.tie_embeddings=false"])).tie_embeddings is False


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.vocab_size=0"], ["model.vocab_size=0", "set --model.vocab_size to a positive integer"]),
        (["--model.vocab_size=50k"], ["model.vocab_size='50k'", "expected int"]),
        (["--model.tie_embeddings=yes"], ["model.tie_embeddings='yes'", "expected bool"]),
        (["--model.tie_embeddings=true", "--pp=2"], ["model.tie_embeddings=true", "different stages", "--model.tie_embeddings=false"]),
        (["--config=1b", "--pp=2"], ["model.tie_embeddings=true", "set --pp 1"]),  # the 1b preset ties
    ],
    ids=["vocab-zero", "vocab-not-an-int", "tie-not-a-bool", "tie-across-stages", "1b-across-stages"],
)
def test_bad_vocabulary_settings_are_one_line_before_any_worker(args, expected, tmp_path):
    proc = keel("train", "--config=tiny", "--run-dir", str(tmp_path / "run"), *args, timeout=60)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padding_changes_neither_the_initial_weights_nor_the_loss(tied):
    """Real rows draw exactly what the unpadded matrix draws, padding rows are zero and get no gradient, and
    the logits the loss sees are the unpadded model's."""
    args = replace(MODEL_PRESETS["tiny"], vocab_size=300, tie_embeddings=tied)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    unpadded = Transformer(args)
    unpadded.init_weights(seed=3)
    expected = unpadded(inputs)
    for rows in (320, 384):
        model = Transformer(args, padded_vocab=rows)
        model.init_weights(seed=3)
        for name in ("tok_embeddings.weight", "output.weight"):
            weight = model.get_parameter(name)
            assert torch.equal(weight[:300], unpadded.get_parameter(name)), name
            assert not weight[300:].any(), f"{name}: padding rows are not zero"
        logits = model(inputs)
        assert logits.shape == expected.shape and torch.equal(logits, expected)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        assert not model.tok_embeddings.weight.grad[300:].any() and not model.output.weight.grad[300:].any()
        assert model.real_parameter_count() == count_params(args)[0]
        assert sum(p.numel() for p in model.parameters()) == count_params(args, rows)[0]


def test_flops_count_the_real_vocabulary():
    """MFU counts the model's work: the padded columns a tp run computes are not part of it."""
    args = replace(MODEL_PRESETS["tiny"], vocab_size=300)
    assert flops_per_token(args, 32) == 6 * (count_params(args)[0] - 300 * 64) + 12 * 4 * 64 * 32


def test_a_resume_at_a_tp_that_pads_otherwise_is_refused_with_the_tps_that_fit():
    saved = config_record(load_config("tiny", ["model.vocab_size=300", "parallel.tp=2"]), "sha256:aaaa")
    refusals, _ = resume_differences(saved, config_record(load_config("tiny", ["model.vocab_size=300"]), "sha256:aaaa"))
    assert refusals == [
        "model.vocab_size=300 padded to 384 rows at tp=2 in the checkpoint, to 320 at tp=1 now (64 x tp); resume at tp from [2, 3, 6]"
    ]
    # The same rows at another tp load: 256 pads to 256 at tp1, tp2 and tp4.
    saved = config_record(load_config("tiny", ["parallel.tp=4"]), "sha256:aaaa")
    assert resume_differences(saved, config_record(load_config("tiny"), "sha256:aaaa"))[0] == []


# -- real runs (gloo, CPU) ------------------------------------------------------------------------------

ODD_VOCAB = ["--config=tiny", "--model.vocab_size=300", "--monitor.prometheus=false"]
# tests/test_parity.py's tolerances for its tp2 and dp2-tp2 layouts (10x the differences measured there).
TP2_RTOL = (9.26e-7, 5.93e-6)
DP2_TP2_RTOL = (1.07e-6, 4.47e-6)


def assert_same_run(run, ref, rtol: tuple[float, float], steps: range = range(1, 21)) -> None:
    run, ref = run[run.step.isin(steps)], ref[ref.step.isin(steps)]
    assert list(run.step) == list(ref.step) == list(steps)
    np.testing.assert_allclose(run.loss, ref.loss, rtol=rtol[0], atol=0, err_msg="loss")
    np.testing.assert_allclose(run.grad_norm, ref.grad_norm, rtol=rtol[1], atol=0, err_msg="grad_norm")


@pytest.mark.slow
def test_an_odd_vocabulary_at_tp2_matches_a_single_process(tmp_path):
    """300 tokens: 320 rows on one process, 384 at tp2, the same losses and gradient norms."""
    ref = train(tmp_path / "tp1", *ODD_VOCAB, "--tp=1")
    run = train(tmp_path / "tp2", *ODD_VOCAB, "--tp=2")
    assert_same_run(run, ref, TP2_RTOL)
    assert abs(ref.loss.iloc[0] - np.log(300)) < 0.1  # a fresh model guesses near uniformly over the real 300, not 320
    assert ref.loss.iloc[-1] < ref.loss.iloc[0] - 1.0


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Tied embeddings and an odd vocabulary on one process, and at dp2·tp2 (FSDP over a TP-sharded, tied
    matrix) with a checkpoint every 10 steps."""
    folder = tmp_path_factory.mktemp("tied")
    train(folder / "tp1", *ODD_VOCAB, "--model.tie_embeddings=true", "--tp=1")
    train(folder / "dp2-tp2", *ODD_VOCAB, "--model.tie_embeddings=true", "--dp=2", "--tp=2", "--checkpoint.interval_steps=10")
    return folder / "tp1", folder / "dp2-tp2"


@pytest.mark.slow
def test_tied_embeddings_at_dp2_tp2_match_a_single_process(tied_runs):
    single, sharded = (read_steps(run_dir, effective=True) for run_dir in tied_runs)
    assert_same_run(sharded, single, DP2_TP2_RTOL)
    logs = "".join(p.read_text() for p in (tied_runs[1] / "logs").iterdir())
    tied = replace(MODEL_PRESETS["tiny"], vocab_size=300, tie_embeddings=True)
    padding = (384 - 300) * 64  # one matrix: the head is the embedding
    assert f"pipeline stage 0 built: {count_params(tied)[0]} parameters (+{padding} of vocabulary padding)" in logs


@pytest.mark.slow
def test_a_tied_padded_checkpoint_resumes_where_the_padding_fits_and_is_refused_where_not(tied_runs, tmp_path):
    """The dp2·tp2 run's step-10 checkpoint (384 rows) resumed at dp1·tp2 repeats its steps 11-20; at tp1
    (320 rows) it is refused in one line before any worker starts."""
    run_dir = Path(shutil.copytree(tied_runs[1], tmp_path / "copy"))
    shutil.rmtree(run_dir / "checkpoints" / "step-00000020")
    before = read_steps(run_dir, effective=True)

    proc = keel("train", "--resume", str(run_dir), "--tp", "1", "--dp", "1", timeout=60)
    assert_one_line_error(proc, ["step-00000010", "model.vocab_size=300 padded to 384 rows at tp=2", "resume at tp from [2, 3, 6]"])

    proc = keel("train", "--resume", str(run_dir), "--dp", "1", "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (read_events(run_dir).kind == "layout_changed").sum() == 1
    assert_same_run(read_steps(run_dir, effective=True), before, DP2_TP2_RTOL, steps=range(11, 21))
