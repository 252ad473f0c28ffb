"""Training on the data users have: a BPE tokenizer trained here on the builtin corpus, a GPT-2 token file
as nanoGPT's prepare.py writes it, and a uint32 file of a vocabulary wider than 16 bits. Every source keeps
what bytes give: the loss falls, the parallel layouts reproduce the single process, a resume is exact."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import keel, train
from test_parity import MEASURED, tolerance
from test_token_sources import write_uint32_file

from keel.monitor.store import read_steps
from keel.trainer.data.loader import open_tokens

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

BPE_VOCAB = 2048  # the same 2,048 rows at tp1 and tp2; tests/test_vocab.py pads an odd vocabulary differently
CHECKPOINTED = ["--checkpoint.interval_steps=4", "--checkpoint.async_save=false"]  # step 8's save is complete before a crash at 11
LAYOUTS = {"dp2-tp2": ["--pp=1", "--dp=2", "--tp=2"], "pp2": ["--pp=2", "--dp=1", "--tp=1"]}
TOLERANCE_OF = {"dp2-tp2": "pp2-dp2-tp2", "pp2": "pp2-1F1B"}  # the byte-level layout with the same splits


@pytest.fixture(scope="session")
def bpe_corpus(tmp_path_factory):
    """The builtin corpus (4 MiB of the standard library's source) encoded by a BPE tokenizer of
    BPE_VOCAB tokens that `keel prepare-data --train-tokenizer` trains on it first."""
    folder = tmp_path_factory.mktemp("bpe")
    text = folder / "builtin.py"
    text.write_bytes(open_tokens("builtin", 1, 256).tokens.tobytes())
    proc = keel("prepare-data", str(folder / "corpus.bin"), str(text), f"--train-tokenizer={BPE_VOCAB}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "corpus.bin"


def _bpe(corpus) -> list[str]:
    return ["--config=tiny", f"--data.source={corpus}", f"--model.vocab_size={BPE_VOCAB}", *CHECKPOINTED]


@pytest.fixture(scope="session")
def bpe_single(bpe_corpus, tmp_path_factory):
    return train(tmp_path_factory.mktemp("bpe-single") / "run", *_bpe(bpe_corpus), "--pp=1", "--dp=1", "--tp=1")


def test_bpe_tokens_are_what_the_model_learns(bpe_corpus, bpe_single):
    assert open_tokens(str(bpe_corpus), 64, BPE_VOCAB).vocab_size == BPE_VOCAB
    assert list(bpe_single.step) == list(range(1, 21))
    # A random model starts near a uniform guess over the real vocabulary, and 20 steps learn from there
    # (7.65 to 6.70 nats measured with 2,048 tokens; the bytes' 1-nat drop is a different scale).
    assert abs(bpe_single.loss.iloc[0] - np.log(BPE_VOCAB)) < 0.5
    assert bpe_single.loss.iloc[-1] < bpe_single.loss.iloc[0] - 0.5


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_matches_the_single_process_on_bpe_tokens(name, bpe_corpus, bpe_single, tmp_path):
    run = train(tmp_path / "run", *_bpe(bpe_corpus), *LAYOUTS[name])
    assert list(run.step) == list(bpe_single.step)
    loss_rtol, grad_rtol = (tolerance(m) for m in MEASURED[TOLERANCE_OF[name]])
    np.testing.assert_allclose(run.loss, bpe_single.loss, rtol=loss_rtol, atol=0, err_msg=f"{name}: loss")
    np.testing.assert_allclose(run.grad_norm, bpe_single.grad_norm, rtol=grad_rtol, atol=0, err_msg=f"{name}: grad_norm")


def test_a_run_on_bpe_tokens_resumes_exactly(bpe_corpus, bpe_single, tmp_path):
    """One process, where the run is cheapest: what a resume must bring back of a token file (the sampler's
    position in it) does not depend on the layout, which tests/test_combinations.py resumes across."""
    run_dir = tmp_path / "run"
    args = [f"--run-dir={run_dir}", *_bpe(bpe_corpus), "--pp=1", "--dp=1", "--tp=1"]
    crashed = keel("train", *args, "--fault=crash@step=11", "--max-restarts=0")
    assert crashed.returncode != 0 and list(read_steps(run_dir).step) == list(range(1, 11))
    resumed = keel("train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = read_steps(run_dir, effective=True)
    assert list(run.step) == list(range(1, 21)) and (run[run.step > 8].attempt == 1).all()
    np.testing.assert_array_equal(run.loss, bpe_single.loss)
    np.testing.assert_array_equal(run.grad_norm, bpe_single.grad_norm)


def _short(source, vocab: int) -> list[str]:
    return ["--config=tiny", "--pp=1", "--dp=1", "--tp=1", "--steps=3", f"--data.source={source}",
            f"--model.vocab_size={vocab}", "--checkpoint.interval_steps=0", "--checkpoint.interval_minutes=0"]  # fmt: skip


def test_a_nanogpt_gpt2_token_file_trains_with_its_vocabulary(tmp_path):
    """uint16 ids up to GPT-2's end-of-text 50256, written with ndarray.tofile as nanoGPT's prepare.py
    does (no sidecar), trained with nanoGPT's padded vocabulary of 50304."""
    ids = np.random.default_rng(0).integers(0, 50257, 20_000).astype(np.uint16)
    ids[::500] = 50256
    ids.tofile(tmp_path / "train.bin")
    run = train(tmp_path / "run", *_short(tmp_path / "train.bin", 50304))
    assert list(run.step) == [1, 2, 3] and abs(run.loss.iloc[0] - np.log(50304)) < 1


def test_a_uint32_file_with_ids_above_65535_trains(tmp_path):
    ids = np.random.default_rng(0).integers(0, 70_000, 20_000)
    assert ids.max() > 65_535
    source = tmp_path / "wide.bin"
    write_uint32_file(source, ids, 70_000)
    run = train(tmp_path / "run", *_short(source, 70_000))
    assert list(run.step) == [1, 2, 3] and abs(run.loss.iloc[0] - np.log(70_000)) < 1
