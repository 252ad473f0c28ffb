"""`keel prepare-data` on corpora as they come: JSON Lines, Parquet, saved Hugging Face datasets, gzip, zstd,
bzip2 and xz streams, each written here by its own library, encoded as bytes or with a Hugging Face,
SentencePiece or tiktoken tokenizer made here by its own library, run through the `keel` command's entry.
Every token file is read back with open_tokens and decoded by the tokenizer's library into the documents
written; what cannot be read as text is one line on stderr and exit code 2; memory stays flat."""

from __future__ import annotations

import base64
import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import re
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import tiktoken
import zstandard
from conftest import train
from test_token_sources import CORPUS_FILES, SEQ_LEN
from tiktoken._educational import bpe_train
from tokenizers import Tokenizer

from keel.cli import main as keel_main
from keel.monitor.exits import EXIT_CONFIG
from keel.monitor.store import read_data_sources
from keel.trainer.config import ConfigError
from keel.trainer.data import tiktoken_tokenizer
from keel.trainer.data.loader import open_tokens
from keel.trainer.data.text_inputs import CHUNK_BYTES
from keel.trainer.data.token_files import sidecar_path

# What a corpus holds: a document longer than a chunk (cut in several), special-token text, characters
# outside ASCII, leading spaces and tabs, an empty document, one without a last line end.
LONG = CORPUS_FILES[4].read_text()  # difflib.py, about 80 KB
DOCUMENTS = [
    LONG,
    "A model card says: generation stops at <|endoftext|> or </s>; Llama prompts start with <s>[INST].\n",
    "ünïcödé, 数字 and 🚀\n\n  an indented line\twith a tab\n",
    "",
    "a last line without its end",
]
SPM_VOCAB = 1000
TIKTOKEN_RANKS = 300
datasets.disable_progress_bars()  # save_to_disk's, on stderr


def prepare(*args: object) -> int:
    return keel_main(["prepare-data", *map(str, args)])


def documents_of(out: Path, vocab_size: int, tokenizer: Path | None = None) -> list[list[int]]:
    """The documents of the token file `out`, opened as training opens it, each without its end-of-document id."""
    tokens = np.asarray(open_tokens(str(out), SEQ_LEN, vocab_size, str(tokenizer) if tokenizer else None).tokens)
    eod = json.loads(sidecar_path(out).read_text())["eod_id"]
    assert eod is not None and tokens[-1] == eod
    return [doc[:-1].tolist() for doc in np.split(tokens, np.flatnonzero(tokens == eod) + 1)[:-1]]


# Each format, written by its own library: (folder, documents) -> the input to name.


def write_text_files(folder: Path, docs: list[str]) -> Path:
    (folder / "texts").mkdir()
    for i, doc in enumerate(docs):
        (folder / "texts" / f"{i:03}.txt").write_text(doc)
    return folder / "texts"


def json_lines(docs: list[str]) -> bytes:
    return "".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(docs)).encode()


def write_jsonl(folder: Path, docs: list[str]) -> Path:
    (folder / "corpus.jsonl").write_bytes(json_lines(docs))
    return folder / "corpus.jsonl"


def write_jsonl_gz(folder: Path, docs: list[str]) -> Path:
    (folder / "corpus.jsonl.gz").write_bytes(gzip.compress(json_lines(docs)))
    return folder / "corpus.jsonl.gz"


def write_jsonl_zst(folder: Path, docs: list[str]) -> Path:
    # Two frames, as a streaming compressor or `cat a.zst b.zst` writes them: both are read.
    half = len(docs) // 2
    frames = [zstandard.ZstdCompressor().compress(json_lines(part)) for part in (docs[:half], docs[half:])]
    (folder / "corpus.jsonl.zst").write_bytes(b"".join(frames))
    return folder / "corpus.jsonl.zst"


def write_text_bz2_xz(folder: Path, docs: list[str]) -> Path:
    (folder / "texts").mkdir()
    for i, doc in enumerate(docs):
        compress, suffix = (bz2.compress, "bz2") if i % 2 else (lzma.compress, "xz")
        (folder / "texts" / f"{i:03}.txt.{suffix}").write_bytes(compress(doc.encode()))
    return folder / "texts"


def write_parquet(folder: Path, docs: list[str]) -> Path:
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), folder / "corpus.parquet", row_group_size=2)
    return folder / "corpus.parquet"


def write_dataset(folder: Path, docs: list[str]) -> Path:
    datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}).save_to_disk(folder / "dataset", num_shards=min(2, len(docs)))
    return folder / "dataset"


FORMATS = {
    "text": write_text_files,
    "jsonl": write_jsonl,
    "jsonl.gz": write_jsonl_gz,
    "jsonl.zst": write_jsonl_zst,
    "text.bz2-xz": write_text_bz2_xz,
    "parquet": write_parquet,
    "dataset": write_dataset,
}


# The tokenizers, each made by its own library.


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A SentencePiece model that gives text back exactly (identity normalization, whitespace kept, byte
    fallback) and adds a dummy prefix, as Llama 2's does."""
    path = tmp_path_factory.mktemp("spm") / "corpus.model"
    lines = "".join(f.read_text() for f in CORPUS_FILES).splitlines()
    with open(path, "wb") as model:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=SPM_VOCAB,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            byte_fallback=True,
            minloglevel=2,
        )
    return path


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> Path:
    """Ranks trained by tiktoken's own BPE trainer with cl100k_base's pattern, in the .tiktoken format."""
    pattern = tiktoken_tokenizer.public_encodings()["cl100k_base"].pattern
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints every merge
        ranks = bpe_train(CORPUS_FILES[2].read_text()[:8000], TIKTOKEN_RANKS, pattern)
    path = tmp_path_factory.mktemp("tiktoken") / "corpus.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])))
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == ranks  # the library reads the file as written
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained by `keel prepare-data --train-tokenizer` on JSON Lines records."""
    folder = tmp_path_factory.mktemp("hf")
    assert prepare(folder / "corpus.bin", write_jsonl(folder, DOCUMENTS), "--train-tokenizer", 400) == 0
    return folder / "corpus.bin.tokenizer.json"


# Every format, as bytes: the documents' text, never the file's syntax.


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_its_documents_text_as_bytes(tmp_path: Path, capsys, fmt):
    out = tmp_path / "out.bin"
    assert prepare(out, FORMATS[fmt](tmp_path, DOCUMENTS)) == 0, capsys.readouterr().err
    tokens = open_tokens(str(out), SEQ_LEN, 256).tokens
    assert bytes(np.asarray(tokens).astype(np.uint8)) == "".join(DOCUMENTS).encode()
    sidecar = json.loads(sidecar_path(out).read_text())
    assert sidecar["documents"] == len(DOCUMENTS) and sidecar["tokenizer"] == {"kind": "bytes"}


# Every tokenizer kind, on formats that between them cover all.


@pytest.mark.parametrize("fmt", ["parquet", "text", "jsonl.zst"])
def test_sentencepiece_documents_decode_to_the_documents(tmp_path: Path, capsys, spm_model: Path, fmt):
    out = tmp_path / "out.bin"
    assert prepare(out, FORMATS[fmt](tmp_path, DOCUMENTS), "--tokenizer", spm_model) == 0
    assert "encoded whole" not in capsys.readouterr().err  # chunked: the dummy prefix left off later chunks
    processor = spm.SentencePieceProcessor(model_file=str(spm_model))
    assert [processor.decode(doc) for doc in documents_of(out, SPM_VOCAB, spm_model)] == DOCUMENTS
    sidecar = json.loads(sidecar_path(out).read_text())
    assert sidecar["eod_id"] == processor.eos_id() and sidecar["vocab_size"] == processor.get_piece_size() == SPM_VOCAB
    assert sidecar["tokenizer"]["kind"] == "sentencepiece" and sidecar["tokenizer"]["file"] == spm_model.name


def _spm_with_defaults(path: Path, **options) -> spm.SentencePieceProcessor:
    """A model of SentencePiece's default normalization: nmt_nfkc, which turns a line end into a space, and
    remove_extra_whitespaces, which trims every text it is given and collapses runs of spaces."""
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(LONG.splitlines()), model_writer=f, vocab_size=300, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_file=str(path))


def test_a_sentencepiece_model_that_trims_each_text_keeps_its_dummy_prefix_on_every_chunk(tmp_path: Path, capsys):
    """The line end at a cut becomes one space in the whole document and the next chunk's dummy prefix in
    pieces: chunked, each document decodes as the library's own encoding of it whole."""
    processor = _spm_with_defaults(tmp_path / "trims.model")
    out = tmp_path / "out.bin"
    assert prepare(out, write_parquet(tmp_path, DOCUMENTS), "--tokenizer", tmp_path / "trims.model") == 0
    assert "encoded whole" not in capsys.readouterr().err
    decoded = [processor.decode(doc) for doc in documents_of(out, 300)]
    assert decoded == [processor.decode(processor.encode(doc)) for doc in DOCUMENTS] and decoded[0] != LONG


def test_a_sentencepiece_model_whose_chunks_cannot_decode_as_the_whole_encodes_documents_whole(tmp_path: Path, capsys):
    """Trimming without a dummy prefix loses the space a cut line end stands for: each document is encoded
    whole, exactly as the library encodes it."""
    processor = _spm_with_defaults(tmp_path / "trims.model", add_dummy_prefix=False)
    out = tmp_path / "out.bin"
    assert prepare(out, write_jsonl_gz(tmp_path, DOCUMENTS), "--tokenizer", tmp_path / "trims.model") == 0
    assert "encoded whole" in capsys.readouterr().err
    assert documents_of(out, 300) == [processor.encode(doc) for doc in DOCUMENTS]


@pytest.mark.parametrize("fmt", ["dataset", "jsonl.gz"])
def test_tiktoken_documents_decode_to_the_documents(tmp_path: Path, tiktoken_file: Path, fmt):
    out = tmp_path / "out.bin"
    assert prepare(out, FORMATS[fmt](tmp_path, DOCUMENTS), "--tokenizer", tiktoken_file) == 0
    sidecar = json.loads(sidecar_path(out).read_text())
    # <|endoftext|> is the one special token, after the largest rank; the vocabulary holds it.
    assert sidecar["eod_id"] == TIKTOKEN_RANKS and sidecar["vocab_size"] == TIKTOKEN_RANKS + 1
    assert sidecar["tokenizer"]["kind"] == "tiktoken" and sidecar["tokenizer"]["pattern"] == "cl100k_base"
    pattern = tiktoken_tokenizer.public_encodings()["cl100k_base"].pattern
    encoding = tiktoken.Encoding(
        "corpus", pat_str=pattern, mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(tiktoken_file)), special_tokens={}
    )
    documents = documents_of(out, TIKTOKEN_RANKS + 1, tiktoken_file)
    assert [encoding.decode(doc) for doc in documents] == DOCUMENTS
    # Text is text: "<|endoftext|>" in a document is encoded as its characters (encode_ordinary).
    assert documents[1] == encoding.encode_ordinary(DOCUMENTS[1])


def test_a_public_encodings_rank_file_gets_its_pattern_and_special_tokens(tmp_path: Path, tiktoken_file: Path, monkeypatch):
    """A copy of a public encoding's rank file is known by its sha256 (tiktoken's expected_hash): its own
    special tokens and end of document. Checked on a stand-in entry whose hash is the small file's, since
    the public files are downloads."""
    real = tiktoken_tokenizer.public_encodings()
    sha256 = hashlib.sha256(tiktoken_file.read_bytes()).hexdigest()
    known = tiktoken_tokenizer.PublicEncoding("small_base", real["r50k_base"].pattern, {"<|endoftext|>": 350, "<|fim|>": 351}, sha256)
    monkeypatch.setattr(tiktoken_tokenizer, "public_encodings", lambda: {**real, "small_base": known})
    tokenizer = tiktoken_tokenizer.TiktokenTokenizer(tiktoken_file, None, None)
    assert (tokenizer.eod_id, tokenizer.vocab_size, tokenizer.identity["pattern"]) == (350, 352, "small_base")
    with pytest.raises(ValueError, match=re.escape("special tokens are <|endoftext|>, <|fim|>")):
        tiktoken_tokenizer.TiktokenTokenizer(tiktoken_file, "<|other|>", None)


@pytest.mark.parametrize("fmt", ["jsonl.gz", "text"])
def test_huggingface_documents_decode_to_the_documents(tmp_path: Path, hf_tokenizer: Path, fmt):
    out = tmp_path / "out.bin"
    assert prepare(out, FORMATS[fmt](tmp_path, DOCUMENTS), "--tokenizer", hf_tokenizer) == 0
    tokenizer = Tokenizer.from_file(str(hf_tokenizer))
    assert [tokenizer.decode(doc) for doc in documents_of(out, 400, hf_tokenizer)] == DOCUMENTS


def test_the_tokenizer_check_of_a_job_holds_for_every_kind(tmp_path: Path, spm_model: Path, tiktoken_file: Path):
    """data.tokenizer names the file the data must have been made with, whatever its kind."""
    inputs = write_parquet(tmp_path, DOCUMENTS)
    made = {}
    for name, tokenizer, vocab in (("spm", spm_model, SPM_VOCAB), ("tiktoken", tiktoken_file, TIKTOKEN_RANKS + 1)):
        made[name] = tmp_path / f"{name}.bin"
        assert prepare(made[name], inputs, "--tokenizer", tokenizer) == 0
        assert open_tokens(str(made[name]), SEQ_LEN, vocab, tokenizer=str(tokenizer)).tokenizer["file"] == tokenizer.name
    with pytest.raises(ConfigError, match="another tokenizer"):
        open_tokens(str(made["spm"]), SEQ_LEN, SPM_VOCAB, tokenizer=str(tiktoken_file))


def test_a_dataset_dict_reads_train_unless_a_split_is_named(tmp_path: Path, capsys):
    splits = {"train": DOCUMENTS[1:3], "validation": DOCUMENTS[3:]}
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": docs}) for name, docs in splits.items()}).save_to_disk(tmp_path / "dd")
    capsys.readouterr()
    for split, expected in ((None, "train"), ("validation", "validation")):
        out = tmp_path / f"{expected}.bin"
        assert prepare(out, tmp_path / "dd", *(["--split", split] if split else [])) == 0
        assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)) == "".join(splits[expected]).encode()
        assert ("reading 'train'" in capsys.readouterr().err) == (split is None)


def test_a_directory_mixes_formats_each_read_by_its_own(tmp_path: Path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_dataset(folder, DOCUMENTS[1:2])  # a saved dataset below: one input, not its files
    write_jsonl_zst(folder, DOCUMENTS[2:4])
    (folder / "notes.txt").write_text(DOCUMENTS[4])
    out = tmp_path / "out.bin"
    assert prepare(out, folder) == 0
    # Sorted: corpus.jsonl.zst (two records), dataset/ (one row), notes.txt (a file).
    assert json.loads(sidecar_path(out).read_text())["documents"] == 4
    assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)).decode() == DOCUMENTS[2] + DOCUMENTS[3] + DOCUMENTS[1] + DOCUMENTS[4]


# What cannot be read as text: one line, exit code 2, nothing written.


def _records(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _dataset_dict_without_train(tmp: Path) -> Path:
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp / "dd")
    return tmp / "dd"


def _truncated(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / name).write_bytes(data[: len(data) // 2])
    return tmp / name


REFUSALS = {
    "binary": (
        lambda tmp: _write(tmp / "ids.bin", np.arange(1000, dtype="<u2").tobytes()),
        ["ids.bin: is binary (a zero byte at offset 0)"],
    ),
    "npy": (lambda tmp: _write(tmp / "a.txt", b"\x93NUMPY" + bytes(100)), ["a.txt: is a NumPy .npy array"]),
    "zip": (lambda tmp: _write(tmp / "a.zip", b"PK\x03\x04" + bytes(100)), ["a.zip: is a zip archive", "unzip it first"]),
    "not-utf8": (
        lambda tmp: _write(tmp / "latin1.txt", "ok\ncafé\n".encode("latin-1")),
        ["latin1.txt: is not UTF-8 text (byte 0xe9 at offset 6)", "iconv"],
    ),
    "jsonl-missing-field": (
        lambda tmp: _records(tmp / "r.jsonl", ['{"text": "a"}', '{"body": "b"}']),
        ["r.jsonl:2: the record has no field 'text' (its fields: body)", "--text-field"],
    ),
    "jsonl-not-a-string": (lambda tmp: _records(tmp / "r.jsonl", ['{"text": 3}']), ["r.jsonl:1: field 'text' is int, not a string"]),
    "json-array": (
        lambda tmp: _write(tmp / "r.json", b'[\n{"text": "a"}\n]\n'),
        ["r.json:1: is not a JSON record", "one JSON object per line"],
    ),
    "parquet-no-column": (
        lambda tmp: _parquet(tmp, {"body": ["a"]}),
        ["t.parquet: has no column 'text' (its columns: body)", "--text-field"],
    ),
    "parquet-not-strings": (lambda tmp: _parquet(tmp, {"text": [1, 2]}), ["t.parquet: column 'text' holds int64, not strings"]),
    "parquet-null": (lambda tmp: _parquet(tmp, {"text": ["a", None]}), ["t.parquet: row 1: column 'text' is null"]),
    "dataset-dict-without-split": (_dataset_dict_without_train, ["is a DatasetDict of the splits ['test']", "--split NAME"]),
    "truncated-gz": (
        lambda tmp: _truncated(tmp, "a.txt.gz", gzip.compress(LONG.encode())),
        ["a.txt.gz: is not a whole gzip-compressed stream"],
    ),
    "truncated-zst": (
        lambda tmp: _truncated(tmp, "a.jsonl.zst", zstandard.ZstdCompressor().compress(LONG.encode())),
        ["a.jsonl.zst: is not a whole zstd-compressed stream"],
    ),
    "gz-without-magic": (lambda tmp: _write(tmp / "a.txt.gz", b"plain text\n"), ["a.txt.gz: is named .gz but is not gzip-compressed"]),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _parquet(tmp: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), tmp / "t.parquet")
    return tmp / "t.parquet"


@pytest.mark.parametrize("name", REFUSALS)
def test_an_input_that_cannot_be_read_as_text_is_one_line(tmp_path: Path, capsys, name):
    make, expected = REFUSALS[name]
    inputs = tmp_path / "in"
    inputs.mkdir()
    before = make(inputs)
    capsys.readouterr()
    out = tmp_path / "out.bin"
    assert prepare(out, before) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("keel prepare-data: ") and err.count("\n") == 1, err
    assert all(text in err for text in expected), err
    assert list(tmp_path.iterdir()) == [inputs]  # no token file, sidecar or temporary file


@pytest.mark.parametrize(
    "args, expected",
    [
        (lambda spm_model, tiktoken_file: ["--tokenizer", spm_model, "--eod", "▁the"], "not a control symbol"),
        (lambda spm_model, tiktoken_file: ["--tokenizer", tiktoken_file, "--tiktoken-pattern", "p99k"], "name one of gpt2, r50k_base"),
        (lambda spm_model, tiktoken_file: ["--tokenizer", spm_model, "--tiktoken-pattern", "o200k_base"], "applies to a tiktoken BPE file"),
        (lambda spm_model, tiktoken_file: ["--tokenizer", spm_model.with_suffix(".tiktoken")], "not found"),
    ],
    ids=["spm-eod-not-control", "tiktoken-unknown-pattern", "pattern-without-tiktoken", "missing"],
)
def test_a_tokenizer_option_that_cannot_be_used_is_one_line(tmp_path: Path, capsys, spm_model, tiktoken_file, args, expected):
    (tmp_path / "a.txt").write_text("some text\n")
    assert prepare(tmp_path / "out.bin", tmp_path / "a.txt", *args(spm_model, tiktoken_file)) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("keel prepare-data: ") and err.count("\n") == 1 and expected in err, err


# Memory: flat, whatever the input's size.


def _peak_bytes(out: Path, source: Path) -> int:
    """The peak of the memory Python allocates (tracemalloc: every object, NumPy arrays included) while
    `keel prepare-data` turns `source` into bytes; what C libraries hold outside Python's allocator (zlib's
    window) is not counted, and is fixed in size."""
    tracemalloc.start()
    try:
        assert prepare(out, source) == 0
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "suffix, compress", [("gz", lambda data: gzip.compress(data, compresslevel=1)), ("zst", zstandard.compress)], ids=["gzip", "zstd"]
)
def test_a_large_compressed_json_lines_input_is_streamed_in_flat_memory(tmp_path: Path, suffix, compress):
    """The same records, 2 MB and 16 MB of them: the peak must not grow with the input (a file, a whole
    decompressed stream or the ids held at once would add megabytes), and stays far below the input. The
    records repeat, so 16 KiB of zstd stand for megabytes of text: what one decompress call returns at once."""
    line = (json.dumps({"text": CORPUS_FILES[1].read_text()[:3000]}) + "\n").encode()
    peaks = {}
    for megabytes in (2, 16):
        source = tmp_path / f"{megabytes}.jsonl.{suffix}"
        source.write_bytes(compress(line * (megabytes * 10**6 // len(line))))
        peaks[megabytes] = _peak_bytes(tmp_path / f"{megabytes}.bin", source)
    assert peaks[16] < peaks[2] + 2 * 2**20, peaks
    assert peaks[16] < 16 * 10**6 / 4, peaks
    assert CHUNK_BYTES < peaks[2]  # what is measured holds at least a chunk of text


# Training on it.


@pytest.mark.slow
def test_a_parquet_corpus_encoded_by_sentencepiece_trains(tmp_path: Path, spm_model: Path):
    corpus = [f.read_text() for f in CORPUS_FILES]
    out = tmp_path / "corpus.bin"
    assert prepare(out, write_parquet(tmp_path, corpus), "--tokenizer", spm_model) == 0
    args = ["--config=tiny", "--pp=1", "--dp=1", "--tp=1", "--steps=3", f"--data.source={out}", f"--data.tokenizer={spm_model}"]
    run = train(
        tmp_path / "run", *args, f"--model.vocab_size={SPM_VOCAB}", "--checkpoint.interval_steps=0", "--checkpoint.interval_minutes=0"
    )
    assert list(run.step) == [1, 2, 3] and abs(run.loss.iloc[0] - np.log(SPM_VOCAB)) < 1


@pytest.mark.slow
def test_every_format_trains_in_one_blend_and_tiktoken_ids_train(tmp_path: Path, tiktoken_file: Path):
    """Keel trains on what every format gives: one run on a blend of each format's token file (bytes), every
    source read (its tokens in the store); and one on ids of a tiktoken rank file, named as the job's tokenizer."""
    weights_and_sources = []
    for fmt, write in FORMATS.items():
        out = tmp_path / f"{fmt}.bin"
        folder = tmp_path / fmt
        folder.mkdir()
        assert prepare(out, write(folder, DOCUMENTS)) == 0
        weights_and_sources += ["1", str(out)]
    quiet = ["--config=tiny", "--pp=1", "--dp=1", "--tp=1", "--steps=6", "--checkpoint.interval_steps=0", "--checkpoint.interval_minutes=0"]
    run = train(tmp_path / "blend", *quiet, f"--data.sources={';'.join(weights_and_sources)}")
    assert list(run.step) == list(range(1, 7)) and run.loss.iloc[-1] < run.loss.iloc[0]
    read = read_data_sources(tmp_path / "blend")
    assert len(read) == len(FORMATS) and (read.tokens > 0).all(), read

    out = tmp_path / "tiktoken.bin"
    assert prepare(out, write_jsonl_gz(tmp_path, DOCUMENTS), "--tokenizer", tiktoken_file) == 0
    vocab = json.loads(sidecar_path(out).read_text())["vocab_size"]
    run = train(tmp_path / "tiktoken", *quiet, f"--data.source={out}", f"--data.tokenizer={tiktoken_file}", f"--model.vocab_size={vocab}")
    assert list(run.step) == list(range(1, 7)) and abs(run.loss.iloc[0] - np.log(vocab)) < 1
