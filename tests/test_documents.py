"""data.mask_eod: the token after each end-of-document id is left out of the loss, on every layout."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import keel, train

from keel.trainer.config import ConfigError, load_config
from keel.trainer.data.blend import open_job_data
from keel.trainer.data.documents import IGNORE_INDEX, eod_to_mask, mask_after_eod
from keel.trainer.data.loader import open_tokens
from keel.trainer.parallel.parallelize import loss_fn

VOCAB = 320


def test_the_target_after_an_end_of_document_id_is_left_out_of_the_loss():
    inputs = np.array([[5, 9, 0, 7], [0, 3, 4, 0]])
    targets = np.array([[9, 0, 7, 8], [3, 4, 0, 6]])
    masked = mask_after_eod(inputs, targets, eod_id=0)
    np.testing.assert_array_equal(masked, [[9, 0, IGNORE_INDEX, 8], [IGNORE_INDEX, 4, 0, IGNORE_INDEX]])
    assert mask_after_eod(inputs, targets, None) is targets
    # The loss is the mean over the positions kept, as torch's cross_entropy computes it.
    logits = torch.randn(2, 4, 10, dtype=torch.float64)
    kept = torch.from_numpy(masked) != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[kept], torch.from_numpy(targets)[kept])
    torch.testing.assert_close(loss_fn(logits, torch.from_numpy(masked)).double(), expected, rtol=1e-6, atol=0)


def test_mask_eod_without_an_end_of_document_id_is_refused_in_one_line():
    cfg = load_config("tiny", ["data.mask_eod=true"])
    with pytest.raises(ConfigError, match="data.mask_eod=true: data.source=builtin records no end-of-document id"):
        eod_to_mask(cfg, open_job_data(cfg))
    proc = keel("train", "--config", "tiny", "--data.mask_eod=true")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A token file of 400 short documents (pieces of the standard library's source of about 600 bytes, cut at
    line ends), with a trained tokenizer's end-of-document id between them: one in about 200 tokens."""
    root = tmp_path_factory.mktemp("docs")
    lines = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text().splitlines(keepends=True)
    pieces, piece = [], ""
    for line in lines:
        piece += line
        if len(piece) > 600:
            pieces.append(piece)
            piece = ""
    for i, text in enumerate(pieces[:400]):
        (root / "texts").mkdir(exist_ok=True)
        (root / "texts" / f"{i:03d}.py").write_text(text)
    out = root / "pieces.bin"
    proc = keel("prepare-data", str(out), str(root / "texts"), "--train-tokenizer", str(VOCAB))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_masked_runs_agree_across_layouts_and_differ_from_unmasked(corpus, tmp_path):
    data = ("--config", "tiny", f"--data.source={corpus}", f"--model.vocab_size={VOCAB}", "--training.steps=6")
    source = open_tokens(str(corpus), 32, VOCAB)
    assert source.eod_id is not None and (np.asarray(source.tokens) == source.eod_id).sum() >= 100
    masked = train(tmp_path / "single", *data, "--data.mask_eod=true")
    loss_parallel = train(tmp_path / "tp2", *data, "--data.mask_eod=true", "--tp=2", "--parallel.loss_parallel=true")
    plain = train(tmp_path / "plain", *data)
    # tests/test_parity.py's tolerance for tp2 with loss parallelism (10x its measured 1.29e-7).
    np.testing.assert_allclose(loss_parallel.loss, masked.loss, rtol=1.3e-6, atol=0)
    assert not np.allclose(masked.loss, plain.loss, rtol=1e-4), "masking changed no loss: no window crossed a document end?"
