"""A start proves its data without reading it whole: a sidecar's size and sampled blocks, or the scan kept
for a file without one (keyed by its fingerprint); `keel verify-data` reads every byte on request. Each
test writes real token files (Keel's writer, nanoGPT's tofile, llm.c's and Megatron's layouts) and shows
what a start sees and what only the full check sees."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import keel
from test_data_defects import write_llmc_shard
from test_token_sources import MEGATRON_DOCS, SEQ_LEN, one_line_config_error, write_megatron

from keel.monitor.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from keel.trainer.checkpoint.manifest import config_record, resume_differences
from keel.trainer.config import load_config
from keel.trainer.data import loader, scan_cache, verify
from keel.trainer.data.loader import open_tokens
from keel.trainer.data.token_files import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, TokenFileWriter, sampled_blocks, sidecar_path
from keel.trainer.data.verify import main as verify_data

VOCAB = 50257
# Tokens enough for a file past the sampled 2 MiB: its sampled blocks leave gaps between them.
TOKENS = SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES * 3 // 4


@pytest.fixture(autouse=True)
def scan_cache_dir(tmp_path: Path, monkeypatch) -> Path:
    """A cache of the test's own (XDG_CACHE_HOME), so no record of another test or of the user's is read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "keel" / "token-scans"


@pytest.fixture
def full_passes(monkeypatch) -> list[int]:
    """The sizes of the arrays read whole (every call of scan_tokens by a start's checks or keel verify-data)."""
    calls: list[int] = []
    real = scan_cache.scan_tokens

    def counted(tokens, on_chunk=None):
        calls.append(len(tokens))
        return real(tokens, on_chunk)

    for module in (scan_cache, verify):  # a start's checks and keel verify-data's
        monkeypatch.setattr(module, "scan_tokens", counted)
    return calls


def random_ids(n: int = TOKENS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def write_keel_file(path: Path, ids: np.ndarray) -> Path:
    with TokenFileWriter(path, VOCAB, {"kind": "huggingface", "file": "gpt2.json", "sha256": "0" * 64}, eod_id=None) as writer:
        writer.write(ids)
        writer.end_document()
        writer.finish()
    return path


def write_nanogpt(path: Path, ids: np.ndarray) -> Path:
    np.asarray(ids, dtype=np.uint16).tofile(path)  # nanoGPT's prepare.py: no sidecar
    return path


def unsampled_offset(size: int) -> int:
    """A byte that no sampled block covers: between the first block and the second."""
    (first, length), (second, _) = sampled_blocks(size)[:2]
    assert first + length < second
    return first + length + (second - first - length) // 2


def flip_byte(path: Path, offset: int, keep_mtime: bool = False) -> None:
    """Changes one byte in place; with keep_mtime, sets the modification time back (as rsync -t or a restore would)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def verify_lines(capsys, *args: str) -> tuple[int, list[str], str]:
    code = verify_data(list(args))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


# Keel token files: the sidecar holds both hashes.


def test_a_sidecar_records_its_sampled_hash_and_the_version_is_the_full_hash(tmp_path: Path, full_passes):
    path = write_keel_file(tmp_path / "train.bin", random_ids())
    sidecar = json.loads(sidecar_path(path).read_text())
    assert len(sidecar["sampled_sha256"]) == 64 and sidecar["sampled_sha256"] != sidecar["sha256"]
    ts = open_tokens(str(path), SEQ_LEN, VOCAB)
    assert ts.version == "sha256:" + sidecar["sha256"][:16]  # the format runs recorded before compare equal
    assert full_passes == []


def test_a_change_outside_the_sampled_blocks_passes_a_start_and_fails_verify_data(tmp_path: Path, capsys, full_passes):
    path = write_keel_file(tmp_path / "train.bin", random_ids())
    version = open_tokens(str(path), SEQ_LEN, VOCAB).version
    flip_byte(path, unsampled_offset(path.stat().st_size))
    # A start reads the sampled blocks only, so it cannot see this byte: the residual risk docs/data.md states.
    assert open_tokens(str(path), SEQ_LEN, VOCAB).version == version and full_passes == []
    code, lines, err = verify_lines(capsys, str(path))
    assert code == EXIT_FAILED and len(lines) == 1, lines
    assert lines[0].startswith(f"failed: data.source={path}: the file's sha256 ") and "is not its sidecar's" in lines[0]
    assert "keel prepare-data" in lines[0] and "MiB" in err  # the fix; progress on stderr


@pytest.mark.parametrize("change", ["first block", "last block", "size"])
def test_a_changed_sampled_block_or_size_is_refused_at_a_start(tmp_path: Path, change, full_passes):
    path = write_keel_file(tmp_path / "train.bin", random_ids())
    size = path.stat().st_size
    if change == "size":
        with open(path, "ab") as f:
            f.write(b"\x00\x00")
    else:
        flip_byte(path, 10 if change == "first block" else size - 10, keep_mtime=True)
    message = one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, VOCAB))
    expected = "but the file has" if change == "size" else "sampled blocks"
    assert f"data.source={path}" in message and expected in message and "keel prepare-data" in message
    assert full_passes == []


def test_a_copied_or_touched_sidecar_file_still_opens(tmp_path: Path, full_passes):
    # The sidecar records no modification time: a copy (cp, rsync without -t) has a new one and is the same data.
    path = write_keel_file(tmp_path / "train.bin", random_ids())
    version = open_tokens(str(path), SEQ_LEN, VOCAB).version
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    assert open_tokens(str(path), SEQ_LEN, VOCAB).version == version and full_passes == []


def test_a_sidecar_written_before_sampled_hashes_is_read_whole_once(tmp_path: Path, full_passes):
    path = write_keel_file(tmp_path / "train.bin", random_ids())
    side = sidecar_path(path)
    fields = json.loads(side.read_text())
    del fields["sampled_sha256"]
    side.write_text(json.dumps(fields))
    for _ in range(2):
        assert open_tokens(str(path), SEQ_LEN, VOCAB).version == "sha256:" + fields["sha256"][:16]
    assert full_passes == [TOKENS]
    flip_byte(path, unsampled_offset(path.stat().st_size))  # its mtime moves: read whole again, and refused
    assert "is not its sidecar's" in one_line_config_error(lambda: open_tokens(str(path), SEQ_LEN, VOCAB))


# Files without a sidecar: read whole once, the scan kept for their fingerprint.


def _nanogpt(tmp_path: Path) -> tuple[str, np.ndarray]:
    ids = random_ids()
    return str(write_nanogpt(tmp_path / "train.bin", ids)), ids


def _llmc(tmp_path: Path) -> tuple[str, np.ndarray]:
    ids = random_ids()
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", ids, 20240520, 1, np.uint16)
    return str(tmp_path / "fineweb_train_000001.bin"), ids


def _megatron(tmp_path: Path) -> tuple[str, np.ndarray]:
    write_megatron(tmp_path / "m", MEGATRON_DOCS * 50, "<i4", 4)
    return str(tmp_path / "m"), np.array([t for doc in MEGATRON_DOCS * 50 for seq in doc for t in seq])


@pytest.mark.parametrize("make", [_nanogpt, _llmc, _megatron], ids=["nanogpt", "llmc", "megatron"])
def test_a_file_without_a_sidecar_is_read_whole_once(tmp_path: Path, scan_cache_dir: Path, make, full_passes, monkeypatch):
    source, ids = make(tmp_path)
    first = open_tokens(source, SEQ_LEN, VOCAB)
    assert full_passes == [len(ids)] and len(list(scan_cache_dir.glob("*.json"))) == 1
    assert first.vocab_size == ids.max() + 1

    # The next start (a restart, a worker, another run) reads the record; Megatron's index is not read whole either.
    def read_whole(*args):
        raise AssertionError("the index was read whole")

    monkeypatch.setattr(loader, "read_index", read_whole)
    again = open_tokens(source, SEQ_LEN, VOCAB)
    assert full_passes == [len(ids)]
    assert (again.version, again.vocab_size, again.description) == (first.version, first.vocab_size, first.description)
    assert np.array_equal(again.tokens, ids)


@pytest.mark.parametrize("change", ["mtime", "sampled block", "size"])
def test_a_file_without_a_sidecar_changed_in_place_is_read_again(tmp_path: Path, change, full_passes):
    source, ids = _nanogpt(tmp_path)
    path = Path(source)
    before = open_tokens(source, SEQ_LEN, VOCAB)
    if change == "mtime":
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    elif change == "sampled block":
        flip_byte(path, path.stat().st_size - 10, keep_mtime=True)
    else:
        write_nanogpt(path, ids[:-1])
    after = open_tokens(source, SEQ_LEN, VOCAB)
    assert len(full_passes) == 2
    assert (after.version == before.version) == (change == "mtime")  # the same bytes, the same version


def test_a_resume_on_data_changed_in_place_is_refused(tmp_path: Path):
    """The version a run records comes from the scan; data rewritten in place (same size, same mtime, other
    ids in a sampled block) gets a new version, which the checkpoint's manifest then refuses."""
    source, ids = _nanogpt(tmp_path)
    cfg = load_config("tiny", [f"data.source={source}", f"model.vocab_size={VOCAB}"])
    saved = config_record(cfg, open_tokens(source, SEQ_LEN, VOCAB).version)
    flip_byte(Path(source), 0, keep_mtime=True)
    now = config_record(cfg, open_tokens(source, SEQ_LEN, VOCAB).version)
    refusals, _ = resume_differences(saved, now)
    assert len(refusals) == 1 and refusals[0].startswith(f"data version: {saved['data_version']} in the checkpoint")


def test_a_change_a_start_cannot_see_is_found_by_verify_data_and_the_record_replaced(tmp_path: Path, capsys, full_passes):
    source, _ = _nanogpt(tmp_path)
    path = Path(source)
    kept = open_tokens(source, SEQ_LEN, VOCAB).version
    flip_byte(path, unsampled_offset(path.stat().st_size), keep_mtime=True)
    assert open_tokens(source, SEQ_LEN, VOCAB).version == kept  # size, mtime and sampled blocks kept: the record is used
    code, lines, _ = verify_lines(capsys, source)
    assert code == EXIT_FAILED and len(lines) == 1
    assert lines[0].startswith(f"failed: data.source={source}: its sha256 is ") and "changed in place" in lines[0]
    assert "refuses to resume a run of the old data" in lines[0]
    passes = len(full_passes)
    now = open_tokens(source, SEQ_LEN, VOCAB).version  # the next start: the record verify-data wrote
    assert now != kept and now.removeprefix("sha256:") in lines[0] and len(full_passes) == passes


def test_an_unwritable_cache_costs_a_full_pass_and_one_log_line(tmp_path: Path, monkeypatch, caplog, full_passes):
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    source, _ = _nanogpt(tmp_path)
    with caplog.at_level(logging.WARNING, logger="keel.data"):
        versions = {open_tokens(source, SEQ_LEN, VOCAB).version for _ in range(2)}
    assert len(versions) == 1 and len(full_passes) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "cannot keep the scan of" in warnings[0] and "reads it whole again" in warnings[0]


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert scan_cache.cache_dir() == Path.home() / ".cache" / "keel" / "token-scans"


# keel verify-data: one line per source, exit 0, 1 or 2.


def test_verify_data_reads_every_source_whole_and_says_ok(tmp_path: Path, capsys):
    keel_file = write_keel_file(tmp_path / "keel.bin", random_ids())
    nanogpt, _ = _nanogpt(tmp_path)
    megatron, _ = _megatron(tmp_path)
    code, lines, _ = verify_lines(capsys, str(keel_file), nanogpt, megatron, "builtin", "--vocab-size", str(VOCAB))
    assert code == EXIT_OK and len(lines) == 4, lines
    sha = json.loads(sidecar_path(keel_file).read_text())["sha256"]
    assert lines[0].startswith(f"ok: {keel_file}: ") and f"sha256 {sha}" in lines[0]
    assert lines[1].startswith(f"ok: {nanogpt}: ") and lines[2].startswith("ok: ") and "Megatron" in lines[2]
    assert lines[3].startswith("ok: builtin: ") and "data version sha256:" in lines[3]


def test_verify_data_checks_the_ids_against_a_vocabulary(tmp_path: Path, capsys):
    nanogpt, ids = _nanogpt(tmp_path)
    code, lines, _ = verify_lines(capsys, nanogpt, "--vocab-size", "256")
    assert code == EXIT_FAILED and lines == [
        f"failed: data.source={nanogpt}: token ids up to {ids.max()} need model.vocab_size >= {ids.max() + 1}; the model has 256 (set --model.vocab_size={ids.max() + 1} or more)"
    ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["missing.bin"], "missing.bin: no such token file or Megatron PREFIX"),
        ([], "the following arguments are required: SOURCE"),
        (["builtin", "--vocab-size", "0"], "--vocab-size 0: a vocabulary holds at least one token"),
    ],
    ids=["missing", "none", "vocab-size"],
)
def test_verify_data_bad_arguments_are_one_line_and_read_nothing(tmp_path: Path, capsys, full_passes, args, expected):
    nanogpt, _ = _nanogpt(tmp_path)
    code, lines, err = verify_lines(capsys, nanogpt, *args) if args else verify_lines(capsys)
    assert code == EXIT_CONFIG and lines == [] and full_passes == []
    assert err.startswith("keel verify-data: ") and err.count("\n") == 1 and expected in err, err


def test_keel_verify_data_is_a_command(tmp_path: Path):
    path = write_keel_file(tmp_path / "train.bin", random_ids(5000))
    ok = keel("verify-data", str(path), timeout=60)
    assert ok.returncode == EXIT_OK and ok.stdout.startswith(f"ok: {path}: "), ok.stderr
    flip_byte(path, 100)
    bad = keel("verify-data", str(path), "builtin", timeout=60)
    assert (
        bad.returncode == EXIT_FAILED
        and bad.stdout.splitlines()[0].startswith("failed: ")
        and bad.stdout.splitlines()[1].startswith("ok: builtin")
    )
