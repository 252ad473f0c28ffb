"""Data that must never train silently wrong and files that must never be lost (issue 27, item 8), tried
with what the real tools make: tokenizers as the tokenizers library and transformers' SentencePiece
converter assemble them, token files in nanoGPT's, Megatron-LM's and llm.c's layouts, and the inputs and
outputs `keel prepare-data` is handed by mistake."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import keel
from test_token_sources import CORPUS_FILES, MEGATRON_DOCS, SEQ_LEN, one_line_config_error, write_megatron
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.implementations import SentencePieceBPETokenizer

from keel.trainer.data.loader import open_tokens
from keel.trainer.data.prepare import main as prepare_data_main
from keel.trainer.data.token_files import sidecar_path

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]  # SentencePiece's ids 0, 1, 2; "</s>" is the end of document


def prepared_documents(out: Path, tokenizer_path: Path) -> list[list[int]]:
    """The documents of the token file `out`, each without its end-of-document id."""
    tokens = open_tokens(str(out), SEQ_LEN, Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()).tokens
    eod = json.loads(sidecar_path(out).read_text())["eod_id"]
    documents = np.split(np.asarray(tokens), np.flatnonzero(tokens == eod) + 1)[:-1]  # each ends with the eod
    return [doc[:-1].tolist() for doc in documents]


def prepare(out: Path, inputs: list[Path], *args: str) -> None:
    assert prepare_data_main([str(out), *map(str, inputs), *args]) == 0


# Special-token text inside a document is text.


def test_special_token_text_in_a_document_stays_text(tmp_path: Path):
    docs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    docs[0].write_text("A model card says: generation stops at <|endoftext|> or </s>.\n" * 20)
    docs[1].write_text("Llama prompts start with <s>[INST] and end with </s>.\n" * 20)
    out = tmp_path / "out.bin"
    prepare(out, docs, "--train-tokenizer", "400")
    tokenizer_path = Path(f"{out}.tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokens = np.fromfile(out, dtype="<u2")
    assert (tokens == tokenizer.token_to_id("<|endoftext|>")).sum() == len(docs)  # one end-of-document id each
    assert [tokenizer.decode(doc) for doc in prepared_documents(out, tokenizer_path)] == [d.read_text() for d in docs]


def test_start_and_end_token_text_is_not_the_start_and_end_ids(tmp_path: Path):
    tokenizer_path = tmp_path / "spm.json"
    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator([f.read_text() for f in CORPUS_FILES], vocab_size=500, special_tokens=SPM_SPECIALS, show_progress=False)
    tokenizer.save(str(tokenizer_path))
    doc = tmp_path / "chat.txt"
    doc.write_text("<s>[INST] hello [/INST] hi</s>\n" * 10)
    out = tmp_path / "out.bin"
    prepare(out, [doc], "--tokenizer", str(tokenizer_path))
    tokens = np.fromfile(out, dtype="<u2")
    assert (tokens == tokenizer.token_to_id("<s>")).sum() == 0 and (tokens == tokenizer.token_to_id("</s>")).sum() == 1


def test_padding_and_truncation_in_a_tokenizer_file_do_not_reach_the_data(tmp_path: Path):
    # A tokenizer.json may carry both (transformers' HeliumConverter enables padding): pad ids in the data,
    # or every chunk cut to max_length.
    texts = [tmp_path / "short.txt", tmp_path / "long.txt"]
    texts[0].write_text("short\n")
    texts[1].write_text("a longer document, many words\n" * 50)
    trained = tmp_path / "trained.bin"
    prepare(trained, texts, "--train-tokenizer", "400")
    tokenizer = Tokenizer.from_file(f"{trained}.tokenizer.json")
    tokenizer.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    tokenizer.enable_truncation(max_length=8)
    tokenizer_path = tmp_path / "padded.json"
    tokenizer.save(str(tokenizer_path))
    out = tmp_path / "out.bin"
    prepare(out, texts, "--tokenizer", str(tokenizer_path))
    assert out.read_bytes() == trained.read_bytes()


# Chunked encoding decodes as whole documents do, whatever marks the start of a text.


def _train_spm_bpe(tokenizer: Tokenizer) -> Tokenizer:
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPM_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator([f.read_text() for f in CORPUS_FILES], trainer)
    return tokenizer


def _llama_decoder() -> decoders.Decoder:
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def llama_legacy() -> Tokenizer:
    """As transformers' LlamaConverter writes a legacy Llama / Mistral tokenizer.json: a Prepend("▁")
    normalizer, no pre-tokenizer, and a decoder that strips the one leading space."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")  # to train on words; removed below
    _train_spm_bpe(tokenizer)
    tokenizer.pre_tokenizer = None
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = _llama_decoder()
    return tokenizer


def llama_metaspace() -> Tokenizer:
    """LlamaConverter's non-legacy form: Metaspace(prepend_scheme="first", split=False), no normalizer."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    _train_spm_bpe(tokenizer)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = _llama_decoder()
    return tokenizer


def spm_bpe() -> Tokenizer:
    """The tokenizers library's own SentencePiece BPE: Metaspace(prepend_scheme="always") and its decoder."""
    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator([f.read_text() for f in CORPUS_FILES], vocab_size=500, special_tokens=SPM_SPECIALS, show_progress=False)
    return Tokenizer.from_str(tokenizer.to_str())


def spm_converter() -> Tokenizer:
    """transformers' SpmConverter: a normalizer that strips each text's trailing whitespace, so chunks cut
    after a line end cannot decode as the whole: Keel must encode each document whole."""
    tokenizer = spm_bpe()
    tokenizer.normalizer = normalizers.Sequence([normalizers.Strip(left=False, right=True), normalizers.Replace("  ", "▁")])
    return tokenizer


@pytest.fixture(scope="module")
def long_documents(tmp_path_factory) -> list[Path]:
    """difflib.py and argparse.py with their lines unindented, as prose is: 80 and 90 KB, so 3 chunks each,
    and the lines a chunk starts with start with a word (a space would hide a start-of-text mark)."""
    folder = tmp_path_factory.mktemp("long")
    for f in CORPUS_FILES[-2:]:
        (folder / f.name).write_text("\n".join(line.lstrip() for line in f.read_text().splitlines()) + "\n")
    return [folder / f.name for f in CORPUS_FILES[-2:]]


@pytest.mark.parametrize("make", [llama_legacy, llama_metaspace, spm_bpe, spm_converter])
def test_chunked_documents_decode_as_whole_ones(tmp_path: Path, capsys, long_documents, make):
    tokenizer_path = tmp_path / "tokenizer.json"
    make().save(str(tokenizer_path))
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    out = tmp_path / "out.bin"
    prepare(out, long_documents, "--tokenizer", str(tokenizer_path))
    decoded = [tokenizer.decode(doc) for doc in prepared_documents(out, tokenizer_path)]
    assert decoded == [tokenizer.decode(tokenizer.encode(f.read_text(), add_special_tokens=False).ids) for f in long_documents]
    if make in (llama_legacy, llama_metaspace):  # byte fallback: these give the text back exactly
        assert decoded == [f.read_text() for f in long_documents]
    assert ("each file is encoded whole" in capsys.readouterr().err) == (make is spm_converter)


# Files whose layout Keel cannot prove are refused or read as what they are.


def test_an_int32_megatron_bin_without_its_idx_is_refused(tmp_path: Path):
    # Megatron's builder writes each sequence as np.array(ids, dtype=int32).tobytes(); here without the .idx.
    ids = np.random.default_rng(0).integers(0, 32000, 5000)
    ids.astype("<i4").tofile(tmp_path / "corpus_text_document.bin")
    message = one_line_config_error(lambda: open_tokens(str(tmp_path / "corpus_text_document.bin"), SEQ_LEN, 65536))
    assert "32-bit token ids" in message and ".idx" in message


def test_keel_preflight_refuses_an_int32_bin_before_any_worker(tmp_path: Path):
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 200, 5000).astype("<i4").tofile(path)
    proc = keel("preflight", "--config", "tiny", "--run-dir", str(tmp_path / "run"), f"--data.source={path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "32-bit token ids" in line


def test_a_megatron_dataset_named_by_its_idx_is_read_as_the_dataset(tmp_path: Path):
    write_megatron(tmp_path / "m", MEGATRON_DOCS, "<i4", 4)
    by_idx = open_tokens(str(tmp_path / "m.idx"), SEQ_LEN, 1 << 16)
    assert by_idx.tokens.tolist() == [t for doc in MEGATRON_DOCS for seq in doc for t in seq]
    assert by_idx.version == open_tokens(str(tmp_path / "m"), SEQ_LEN, 1 << 16).version


def write_llmc_shard(path: Path, ids: np.ndarray, magic: int, version: int, dtype: str) -> None:
    """As llm.c's dev/data/data_common.py write_datafile writes a shard (modded-nanogpt reads the same):
    a header of 256 int32, [0] the magic, [1] the version, [2] the token count, then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids)
    path.write_bytes(header.tobytes() + np.array(ids, dtype=dtype).tobytes())


@pytest.mark.parametrize("magic, version, dtype", [(20240520, 1, np.uint16), (20240801, 7, np.uint32)], ids=["gpt-2", "llama-3"])
def test_an_llmc_shard_is_read_without_its_header(tmp_path: Path, magic, version, dtype):
    ids = np.random.default_rng(0).integers(0, 50257, 3000)
    ids[::300] = 50256
    path = tmp_path / "fineweb_train_000001.bin"
    write_llmc_shard(path, ids, magic, version, dtype)
    ts = open_tokens(str(path), SEQ_LEN, 50304)
    assert np.array_equal(ts.tokens, ids) and ts.vocab_size == 50257 and "llm.c" in ts.description


def test_a_truncated_llmc_shard_is_refused(tmp_path: Path):
    path = tmp_path / "shard.bin"
    write_llmc_shard(path, np.arange(3000), 20240520, 1, np.uint16)
    path.write_bytes(path.read_bytes()[:-10])
    assert "damaged" in one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 50304))


@pytest.mark.parametrize(
    "data, expected",
    [
        (gzip.compress(np.arange(5000, dtype="<u2").tobytes()), "gzip-compressed"),
        (b"\x93NUMPY" + bytes(200), "NumPy"),
        (b"plain text, not token ids\n" * 100, "is text"),
    ],
    ids=["gzip", "npy", "text"],
)
def test_a_data_source_that_is_not_token_ids_is_refused(tmp_path: Path, data, expected):
    path = tmp_path / "train.bin"
    path.write_bytes(data)
    assert expected in one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 1 << 16))


@pytest.mark.parametrize(
    "name, data, expected",
    [
        ("notes.txt.gz", gzip.compress(b"some notes\n" * 100)[:-12], "not a whole gzip-compressed stream"),  # truncated
        ("records.jsonl", b'{"body": "a document"}\n{"body": "another"}\n', "no field 'text'"),
        ("train.bin", np.arange(1000, dtype="<u2").tobytes(), "binary"),
    ],
    ids=["truncated-gzip", "jsonl-without-text", "binary"],
)
def test_prepare_data_refuses_inputs_that_are_not_text(tmp_path: Path, capsys, name, data, expected):
    (tmp_path / name).write_bytes(data)
    out = tmp_path / "out.bin"
    assert prepare_data_main([str(out), str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


# prepare-data never writes over a file it did not write, nor over anything without --force.


def test_prepare_data_never_overwrites_a_users_file(tmp_path: Path, capsys):
    notes, other = tmp_path / "notes.txt", tmp_path / "other.txt"
    notes.write_text("my notes\n")
    other.write_text("other text\n")
    for force in ([], ["--force"]):
        assert prepare_data_main([str(notes), str(other), *force]) == 2
        assert "notes.txt" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "other.txt"]


def test_prepare_data_replaces_its_own_token_file_only_with_force(tmp_path: Path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("first version\n")
    out = tmp_path / "out.bin"
    prepare(out, [text])
    text.write_text("second version\n")
    assert prepare_data_main([str(out), str(text)]) == 2
    assert "--force" in capsys.readouterr().err
    prepare(out, [text], "--force")
    assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)) == b"second version\n"


def test_prepare_data_into_a_directory_is_one_line_and_leaves_nothing(tmp_path: Path, capsys):
    (tmp_path / "a.txt").write_text("text\n")
    out = tmp_path / "out"
    out.mkdir()
    assert prepare_data_main([str(out), str(tmp_path / "a.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err and "Errno" not in err
    assert not sidecar_path(out).exists() and list(out.iterdir()) == []


# The tokenizer and vocabulary a job expects are checked against the sidecar's.


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a token file, the tokenizer it was made with, another tokenizer of the same vocabulary size)."""
    folder = tmp_path_factory.mktemp("tokenizers")
    out = folder / "corpus.bin"
    prepare(out, CORPUS_FILES[:2], "--train-tokenizer", "600")
    other = folder / "other.json"
    prepare(folder / "other.bin", CORPUS_FILES[2:4], "--train-tokenizer", "600")
    Path(f"{folder / 'other.bin'}.tokenizer.json").rename(other)
    return out, Path(f"{out}.tokenizer.json"), other


def test_the_tokenizer_a_job_names_must_be_the_one_the_data_was_made_with(two_tokenizers):
    out, made_with, other = two_tokenizers
    ts = open_tokens(str(out), SEQ_LEN, 600, tokenizer=str(made_with))
    assert ts.tokenizer["sha256"] == hashlib.sha256(made_with.read_bytes()).hexdigest()
    message = one_line_config_error(lambda: open_tokens(str(out), SEQ_LEN, 600, tokenizer=str(other)))
    assert "data.tokenizer=" in message and "another tokenizer" in message and "corpus.bin.tokenizer.json" in message


def test_keel_train_refuses_data_made_with_another_tokenizer_before_any_worker(two_tokenizers, tmp_path: Path):
    out, _, other = two_tokenizers
    args = ["--config=tiny", f"--data.source={out}", "--model.vocab_size=600", f"--data.tokenizer={other}"]
    proc = keel("train", f"--run-dir={tmp_path / 'run'}", *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "data.tokenizer=" in proc.stderr and "another tokenizer" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused by the launcher: no worker started


def test_a_file_without_a_sidecar_cannot_prove_its_tokenizer(two_tokenizers, tmp_path: Path):
    path = tmp_path / "nanogpt.bin"
    np.random.default_rng(0).integers(0, 600, 5000).astype(np.uint16).tofile(path)
    message = one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, 600, tokenizer=str(two_tokenizers[1])))
    assert "records no tokenizer" in message


def test_a_model_vocabulary_other_than_the_sidecars_tokenizer_is_refused(two_tokenizers):
    out = two_tokenizers[0]
    assert json.loads(sidecar_path(out).read_text())["vocab_size"] == 600
    message = one_line_config_error(lambda: open_tokens(str(out), SEQ_LEN, 50304))
    assert "tokenizer of 600 tokens" in message and "--model.vocab_size=600" in message


# Errors say what is true.


def test_a_truncated_idx_says_truncated(tmp_path: Path):
    write_megatron(tmp_path / "m", MEGATRON_DOCS, "<u2", 8)
    idx = tmp_path / "m.idx"
    idx.write_bytes(idx.read_bytes()[:20])
    message = one_line_config_error(lambda: open_tokens(str(tmp_path / "m"), SEQ_LEN, 256))
    assert "truncated" in message and "not a Megatron" not in message


def test_an_idx_without_its_bin_says_so(tmp_path: Path):
    write_megatron(tmp_path / "m", MEGATRON_DOCS, "<u2", 8)
    (tmp_path / "m.bin").unlink()
    for source in ("m", "m.idx", "m.bin"):
        message = one_line_config_error(lambda source=source: open_tokens(str(tmp_path / source), SEQ_LEN, 256))
        assert "m.bin is missing beside" in message and "not found" not in message


def test_a_directory_as_data_source_says_so(tmp_path: Path):
    message = one_line_config_error(lambda: open_tokens(str(tmp_path), SEQ_LEN, 256))
    assert "is a directory" in message and "not found" not in message
