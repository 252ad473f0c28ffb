"""Token sources beyond bytes: files encoded with a real tokenizer, nanoGPT's GPT-2 .bin, uint32 files and
Megatron-LM's indexed datasets; the model's vocabulary checked against each; bad input refused in one line;
and the sampler's guarantees on every source."""

from __future__ import annotations

import hashlib
import json
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from conftest import keel
from tokenizers import Tokenizer, models

from keel.trainer.config import ConfigError
from keel.trainer.data.loader import BatchSampler, open_tokens
from keel.trainer.data.megatron_index import read_index
from keel.trainer.data.prepare import main as prepare_data_main
from keel.trainer.data.token_files import TokenFileWriter, sidecar_path

SEQ_LEN = 16
GPT2_EOT = 50256  # GPT-2's <|endoftext|>: its largest id
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few stdlib modules: about 300 KB of text, enough for a BPE tokenizer of a few thousand tokens.
CORPUS_FILES = [STDLIB / name for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "difflib.py", "argparse.py")]


def one_line_config_error(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory) -> Path:
    """The corpus files encoded with a BPE tokenizer of 3000 tokens trained on them by `keel prepare-data`."""
    out = tmp_path_factory.mktemp("bpe") / "corpus.bin"
    assert prepare_data_main([str(out), *map(str, CORPUS_FILES), "--train-tokenizer", "3000"]) == 0
    return out


def test_trained_tokenizer_round_trips_the_documents_joined_by_eod(bpe_corpus: Path):
    tokenizer_path = Path(f"{bpe_corpus}.tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    sidecar = json.loads(sidecar_path(bpe_corpus).read_text())
    assert tokenizer.get_vocab_size() == sidecar["vocab_size"] == 3000
    assert sidecar["dtype"] == "uint16" and sidecar["documents"] == len(CORPUS_FILES)
    eod = sidecar["eod_id"]
    assert eod == tokenizer.token_to_id("<|endoftext|>")

    ts = open_tokens(str(bpe_corpus), SEQ_LEN, 3000)
    assert (ts.dtype, ts.vocab_size, ts.eod_id) == ("uint16", 3000, eod)
    assert len(ts.tokens) == sidecar["tokens"] and int(ts.tokens[-1]) == eod
    documents = np.split(np.asarray(ts.tokens), np.flatnonzero(ts.tokens == eod) + 1)[:-1]  # each ends with eod
    assert [tokenizer.decode(doc[:-1].tolist()) for doc in documents] == [f.read_text() for f in CORPUS_FILES]
    # The sidecar names its tokenizer by content.
    assert sidecar["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()


def test_a_named_tokenizer_encodes_the_same_as_the_trained_one(bpe_corpus: Path, tmp_path: Path, capsys):
    out = tmp_path / "again.bin"
    code = prepare_data_main([str(out), *map(str, CORPUS_FILES), "--tokenizer", f"{bpe_corpus}.tokenizer.json"])
    assert code == 0 and "tok/s" in capsys.readouterr().err  # the progress line
    assert out.read_bytes() == bpe_corpus.read_bytes()


def test_nanogpt_gpt2_bin_opens_with_the_gpt2_vocabulary_and_is_refused_with_bytes(tmp_path: Path):
    # As nanoGPT's data/openwebtext/prepare.py writes it: GPT-2 ids as np.uint16, tofile, no sidecar.
    ids = np.random.default_rng(0).integers(0, GPT2_EOT, size=5000)
    ids[::100] = GPT2_EOT
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    ts = open_tokens(str(path), SEQ_LEN, 50304)
    assert (ts.dtype, ts.vocab_size, ts.eod_id) == ("uint16", GPT2_EOT + 1, None)
    assert np.array_equal(ts.tokens, ids)
    message = one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 256))
    assert "50256" in message and "model.vocab_size >= 50257" in message and "the model has 256" in message


def test_keel_train_refuses_a_gpt2_bin_for_a_byte_model_before_any_worker(tmp_path: Path):
    path = tmp_path / "train.bin"
    np.full(1000, GPT2_EOT, dtype=np.uint16).tofile(path)
    proc = keel("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), f"--data.source={path}")
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "model.vocab_size >= 50257" in line and "the model has 256" in line and "--model.vocab_size=" in line
    assert not (tmp_path / "run").exists()


def write_uint32_file(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    with TokenFileWriter(path, vocab_size, {"kind": "test"}, eod_id=None) as writer:
        writer.write(ids)
        writer.end_document()
        writer.finish()


def test_uint32_file_round_trips_ids_above_65535(tmp_path: Path):
    ids = np.random.default_rng(1).integers(0, 100_000, size=4000)
    ids[7] = 99_999
    path = tmp_path / "wide.bin"
    write_uint32_file(path, ids, 100_000)
    assert json.loads(sidecar_path(path).read_text())["dtype"] == "uint32" and path.stat().st_size == 4 * len(ids)
    ts = open_tokens(str(path), SEQ_LEN, 100_000)
    assert ts.dtype == "uint32" and np.array_equal(ts.tokens, ids)
    message = one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 65536))
    assert "model.vocab_size >= 100000" in message and "the model has 65536" in message


# Megatron's documents here: lists of sequences (sentences), each a list of ids.
MEGATRON_DOCS = [[[5, 6, 7, 8], [9, 10]], [[11] * 30], [[12, 13], [14, 15, 16], list(range(40, 60))]]


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype: str, code: int) -> None:
    """PREFIX.bin and PREFIX.idx as the MMIDIDX specification lays them out (see keel.trainer.data.megatron_index)."""
    sequences = [seq for doc in documents for seq in doc]
    itemsize = np.dtype(dtype).itemsize
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * itemsize
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    np.concatenate(sequences).astype(dtype).tofile(f"{prefix}.bin")
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(sequences))
    header += struct.pack("<Q", len(doc_index))
    Path(f"{prefix}.idx").write_bytes(header + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())


@pytest.mark.parametrize("dtype, code", [("<u2", 8), ("<i4", 4)], ids=["uint16", "int32"])
@pytest.mark.parametrize("name", ["prefix", "bin"])
def test_megatron_dataset_reads_back_its_documents(tmp_path: Path, dtype, code, name):
    prefix = tmp_path / "corpus_text_document"
    write_megatron(prefix, MEGATRON_DOCS, dtype, code)
    ts = open_tokens(str(prefix) + (".bin" if name == "bin" else ""), SEQ_LEN, 256)
    assert ts.tokens.dtype == np.dtype(dtype) and ts.vocab_size == 60 and "Megatron" in ts.description
    index = read_index(str(prefix), Path(f"{prefix}.idx"), Path(f"{prefix}.bin").stat().st_size)
    for d, doc in enumerate(MEGATRON_DOCS):
        assert index.document(ts.tokens, d).tolist() == [t for seq in doc for t in seq]
    assert ts.tokens.tolist() == [t for doc in MEGATRON_DOCS for seq in doc for t in seq]


def sampler_rows(tokens: np.ndarray, batch_index: int, dp_rank: int, dp_size: int, seed: int) -> np.ndarray:
    sampler = BatchSampler(tokens, SEQ_LEN, 8, dp_rank, dp_size, seed)
    sampler.skip_to(batch_index)
    return sampler.next_batch()[0]


@pytest.mark.parametrize("source", ["uint32", "megatron"])
def test_sampler_is_a_pure_function_of_seed_batch_and_rank(tmp_path: Path, source):
    if source == "uint32":
        path = tmp_path / "wide.bin"
        write_uint32_file(path, np.random.default_rng(2).integers(0, 1 << 20, size=3000), 1 << 20)
        ts = open_tokens(str(path), SEQ_LEN, 1 << 20)
    else:
        write_megatron(tmp_path / "m", MEGATRON_DOCS * 20, "<i4", 4)
        ts = open_tokens(str(tmp_path / "m"), SEQ_LEN, 256)
    reader = BatchSampler(ts.tokens, SEQ_LEN, 8, 0, 1, seed=4)
    read_in_order = [reader.next_batch()[0] for _ in range(4)]
    for batch_index, batch in enumerate(read_in_order):
        # Reached by skipping, on a fresh sampler, or as dp shards: always the same rows.
        assert np.array_equal(sampler_rows(ts.tokens, batch_index, 0, 1, seed=4), batch)
        shards = [sampler_rows(ts.tokens, batch_index, rank, 2, seed=4) for rank in range(2)]
        assert np.array_equal(np.concatenate(shards), batch)
    resumed = BatchSampler(ts.tokens, SEQ_LEN, 8, 0, 1, seed=0)
    resumed.load_state_dict({"seed": 4, "batch_index": 2})
    assert np.array_equal(resumed.next_batch()[0], read_in_order[2])
    assert not np.array_equal(sampler_rows(ts.tokens, 0, 0, 1, seed=5), read_in_order[0])


def _resize(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


def _change_a_token(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))


def _say_uint32(path: Path) -> None:
    side = sidecar_path(path)
    side.write_text(json.dumps({**json.loads(side.read_text()), "dtype": "uint32"}))


@pytest.mark.parametrize(
    "damage, expected",
    [(_resize, "but the file has"), (_change_a_token, "sha256"), (_say_uint32, "uint32 tokens")],
    ids=["size", "hash", "dtype"],
)
def test_a_sidecar_that_does_not_match_its_file_is_one_line(tmp_path: Path, damage, expected):
    path = tmp_path / "corpus.bin"
    (tmp_path / "a.txt").write_text("some text for a token file\n" * 10)
    assert prepare_data_main([str(path), str(tmp_path / "a.txt")]) == 0
    damage(path)
    message = one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 256))
    assert f"data.source={path}" in message and expected in message and "keel prepare-data" in message


def test_a_damaged_megatron_index_is_one_line(tmp_path: Path):
    write_megatron(tmp_path / "m", MEGATRON_DOCS, "<u2", 8)
    idx = tmp_path / "m.idx"
    idx.write_bytes(b"NOTMAGIC!" + idx.read_bytes()[9:])
    message = one_line_config_error(lambda: open_tokens(str(tmp_path / "m"), SEQ_LEN, 256))
    assert "MMIDIDX" in message


def _text(tmp_path: Path) -> str:
    (tmp_path / "doc.txt").write_text("hello world\n")
    return str(tmp_path / "doc.txt")


def _no_text(tmp_path: Path) -> str:
    (tmp_path / "empty.txt").write_text("")
    return str(tmp_path / "empty.txt")


def _no_eod_tokenizer(tmp_path: Path) -> str:
    path = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    return str(path)


@pytest.mark.parametrize(
    "args, expected",
    [
        (lambda tmp: [_text(tmp), "--tokenizer", str(tmp / "missing.json")], ["missing.json", "not found"]),
        (lambda tmp: [_text(tmp), "--tokenizer", _text(tmp)], ["cannot load it", "tokenizer.json"]),
        (lambda tmp: [_no_text(tmp), "--train-tokenizer", "1000"], ["hold no text"]),
        (lambda tmp: [_text(tmp), "--train-tokenizer", "100"], ["at least 257"]),
        (lambda tmp: [_text(tmp), "--tokenizer", _no_eod_tokenizer(tmp)], ["--eod TOKEN"]),
    ],
    ids=["tokenizer-missing", "tokenizer-unloadable", "train-without-text", "train-too-small", "no-eod-token"],
)
def test_bad_prepare_data_input_is_one_stderr_line(tmp_path: Path, capsys, args, expected):
    out = tmp_path / "out.bin"
    assert prepare_data_main([str(out), *args(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel prepare-data: ") and err.count("\n") == 1, err
    assert all(text in err for text in expected), err
    assert not out.exists() and not Path(f"{out}.tmp").exists()
