"""What users and the trainer rely on from keel.trainer.data.loader: the corpus, the sampler's determinism, token files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from keel.trainer.config import ConfigError
from keel.trainer.data.loader import BatchSampler, open_tokens, write_token_file
from keel.trainer.data.prepare import main as prepare_data_main

SEQ_LEN = 16


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return open_tokens("builtin", SEQ_LEN, 256).tokens


def test_builtin_corpus_is_bytes_and_stable():
    a = open_tokens("builtin", SEQ_LEN, 256)
    b = open_tokens("builtin", SEQ_LEN, 256)
    assert len(a.tokens) > 100_000
    assert a.tokens.dtype == np.uint8 and int(a.tokens.max()) < 256
    assert a.version == b.version and a.version.startswith("sha256:") and len(a.version) == len("sha256:") + 16
    assert a.description.startswith("builtin:")
    assert (a.dtype, a.vocab_size, a.eod_id) == ("uint8", 256, None)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_shards_concatenate_to_the_single_process_batch(tokens, dp_size):
    single = BatchSampler(tokens, SEQ_LEN, 8, dp_rank=0, dp_size=1, seed=3)
    shards = [BatchSampler(tokens, SEQ_LEN, 8, dp_rank=r, dp_size=dp_size, seed=3) for r in range(dp_size)]
    for _ in range(3):
        x, y = single.next_batch()
        parts = [s.next_batch() for s in shards]
        assert all(px.shape == (8 // dp_size, SEQ_LEN) for px, _ in parts)
        assert np.array_equal(np.concatenate([px for px, _ in parts]), x)
        assert np.array_equal(np.concatenate([py for _, py in parts]), y)


def test_global_batch_must_divide_over_dp(tokens):
    with pytest.raises(ValueError):
        BatchSampler(tokens, SEQ_LEN, 6, dp_rank=0, dp_size=4, seed=0)


def test_same_seed_and_index_give_the_same_batch(tokens):
    x1, _ = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=7).next_batch()
    x2, _ = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=7).next_batch()
    x3, _ = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=8).next_batch()
    assert np.array_equal(x1, x2)
    assert not np.array_equal(x1, x3)


def test_targets_are_inputs_shifted_by_one(tokens):
    s = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=0)
    x, y = s.next_batch()
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (4, SEQ_LEN)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert s.batch_index == 1


def test_skip_lands_on_the_same_batch_as_reading(tokens):
    skipped = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=0)
    skipped.next_batch()
    skipped.skip_to(4)
    assert skipped.batch_index == 4
    fresh = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=0)
    for _ in range(4):
        fresh.next_batch()
    assert np.array_equal(skipped.next_batch()[0], fresh.next_batch()[0])


def test_rewind_reads_the_same_batch_and_rejected_batches_are_taken_once(tokens):
    def poison_batch_1(batch_index, window, vocab_size):
        return window + vocab_size if batch_index == 1 else window

    s = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=0, vocab_size=256, transform=poison_batch_1)
    first, _ = s.next_batch()
    s.rewind_to(0)
    assert np.array_equal(s.next_batch()[0], first)
    s.next_batch()  # batch 1 is passed over, batch 2 is read
    assert s.batch_index == 3
    assert s.take_rejected() == [1] and s.take_rejected() == []


def test_state_dict_resume_gives_the_identical_next_batch(tokens):
    s = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=5)
    for _ in range(3):
        s.next_batch()
    state = s.state_dict()
    assert state == {"seed": 5, "batch_index": 3}
    resumed = BatchSampler(tokens, SEQ_LEN, 4, 0, 1, seed=0)
    resumed.load_state_dict(state)
    x, y = s.next_batch()
    rx, ry = resumed.next_batch()
    assert np.array_equal(x, rx) and np.array_equal(y, ry)


def test_token_file_round_trip(tmp_path: Path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes("héllo world\n".encode())
    b.write_bytes(b"second file\n")
    out = tmp_path / "train.bin"
    sidecar = write_token_file(out, [a, b])
    expected = a.read_bytes() + b.read_bytes()
    assert sidecar.tokens == len(expected) and out.stat().st_size == 2 * sidecar.tokens
    assert (sidecar.dtype, sidecar.vocab_size, sidecar.eod_id, sidecar.documents) == ("uint16", 256, None, 2)
    ts = open_tokens(str(out), seq_len=4, vocab_size=256)
    assert ts.tokens.dtype == np.uint16 and ts.vocab_size == 256
    assert bytes(ts.tokens.astype(np.uint8)) == expected
    assert ts.version == "sha256:" + sidecar.sha256[:16] == open_tokens(str(out), 4, 256).version
    assert ts.description.startswith(f"{out}: ")


def test_prepare_data_walks_directories_in_sorted_order(tmp_path: Path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"bbb")
    (src / "a.txt").write_bytes(b"aaa")
    (src / "sub" / "c.txt").write_bytes(b"ccc")
    out = tmp_path / "out.bin"
    assert prepare_data_main([str(out), str(src)]) == 0
    captured = capsys.readouterr()
    assert "wrote 9 tokens" in captured.out
    assert "9 tokens" in captured.err and "tok/s" in captured.err  # the progress line
    assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)) == b"aaabbbccc"


def test_prepare_data_missing_input_is_one_stderr_line(tmp_path: Path, capsys):
    assert prepare_data_main([str(tmp_path / "out.bin"), str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.txt" in err
    assert not (tmp_path / "out.bin").exists()


def _raw(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "tokens.bin"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda tmp: str(tmp / "missing.bin"), "data.source"),
        (lambda tmp: _raw(tmp, b""), "data.source"),
        (lambda tmp: _raw(tmp, b"abc"), "data.source"),  # odd size: not uint16
        (lambda tmp: _raw(tmp, np.array([1, 2, 300], dtype="<u2").tobytes()), "data.source"),  # id >= 256
        (lambda tmp: _raw(tmp, np.arange(8, dtype="<u2").tobytes()), "data.seq_len"),  # too short
    ],
    ids=["missing", "empty", "odd-size", "id-out-of-vocab", "too-short"],
)
def test_bad_token_files_raise_config_error(tmp_path: Path, make, field):
    with pytest.raises(ConfigError) as info:
        open_tokens(make(tmp_path), seq_len=SEQ_LEN, vocab_size=256)
    message = str(info.value)
    assert field in message and "data.source" in message and "\n" not in message


def test_missing_file_message_names_the_fix(tmp_path: Path):
    with pytest.raises(ConfigError, match="keel prepare-data"):
        open_tokens(str(tmp_path / "missing.bin"), seq_len=SEQ_LEN, vocab_size=256)
