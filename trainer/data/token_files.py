"""Keel's token files on disk: a flat array of token ids (nanoGPT's .bin layout) and a JSON sidecar that says
what the ids mean.

`OUT.bin` holds little-endian uint16 ids when the vocabulary fits in 16 bits, uint32 otherwise. `OUT.bin.json`
holds the dtype, the vocabulary size, the tokenizer's identity (sha256 of its file), the end-of-document id,
the token and document counts, the sha256 of the token bytes and the sha256 of a few sampled blocks of them
(`Fingerprint`): a start checks the size and the sampled blocks, a few MiB whatever the file's size, and
`keel verify-data` the whole hash. A .bin without a sidecar is a plain nanoGPT file: uint16, its vocabulary
only known from its largest id.

`foreign_format` names the files that must never be read as token ids nor as text (compressed files,
archives, NumPy arrays, Megatron indexes): keel.trainer.data.loader and `keel prepare-data` refuse them.

Everything here reads and writes in bounded chunks, so a corpus larger than memory costs no more memory
than a small one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from keel.trainer.config import ConfigError

SIDECAR_FORMAT = "keel-tokens/1"
FILE_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCAN_CHUNK = 64 * 1024 * 1024  # tokens per pass when hashing a file, so memory stays flat
BYTE_CHUNK = 16 * 1024 * 1024  # bytes read at a time when the tokens are the bytes
# A fingerprint hashes SAMPLE_BLOCKS blocks of SAMPLE_BLOCK_BYTES, the first and the last included and the rest
# evenly between (the whole file when it is smaller): 2 MiB read, whatever the file's size. Part of the
# sidecar format: changing them makes every recorded sampled hash disagree.
SAMPLE_BLOCKS = 32
SAMPLE_BLOCK_BYTES = 64 * 1024
# The first bytes of formats a token file or a text input is sometimes mistaken for: (magic, what the file
# is, the fix). Each is 3 bytes or more, so uint16 token ids start with one by chance in under one file in
# ten million.
FOREIGN_MAGICS = (
    (b"\x1f\x8b\x08", "gzip-compressed", "decompress it first (gunzip -k FILE)"),  # 8: deflate, gzip's one method
    (b"BZh", "bzip2-compressed", "decompress it first (bunzip2 -k FILE)"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first (unxz -k FILE)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first (unzstd FILE)"),
    (b"PK\x03\x04", "a zip archive", "unzip it first"),
    (b"\x93NUMPY", "a NumPy .npy array", "write its ids with ndarray.tofile, nanoGPT's layout"),
    (b"MMIDIDX\x00\x00", "a Megatron-LM index", "name its dataset by prefix: data.source=PREFIX for PREFIX.bin + PREFIX.idx"),
    ((20240522).to_bytes(4, "little"), "an llm.c eval file (HellaSwag, MMLU)", "train on llm.c's token shards, whose magic is 20240520"),
)


@dataclass(frozen=True)
class Sidecar:
    """What `keel prepare-data` knew when it wrote a token file: the JSON beside it."""

    dtype: str  # "uint16" or "uint32"
    vocab_size: int  # the tokenizer's vocabulary: the model needs at least this many embeddings
    tokenizer: dict  # {"kind": "bytes"} or {"kind": "huggingface", "file": name, "sha256": hex}
    eod_id: int | None  # the id between documents; None when documents are simply concatenated
    tokens: int
    documents: int
    sha256: str  # of the token bytes, as on disk
    format: str = SIDECAR_FORMAT
    sampled_sha256: str | None = None  # of the blocks a Fingerprint samples; None in sidecars written before it was recorded


@dataclass(frozen=True)
class TokenScan:
    """One pass over a token array: its content hash and the range of its ids."""

    sha256: str
    min_id: int
    max_id: int


@dataclass(frozen=True)
class Fingerprint:
    """What tells, without reading it all, that a file is the one it was: a file changed in place almost
    always changes its size, its modification time or one of its sampled blocks. Not a proof: a change
    that keeps all three is only found by reading every byte (`keel verify-data`)."""

    size: int
    mtime_ns: int
    sampled_sha256: str


def fingerprint(path: str | os.PathLike) -> Fingerprint:
    stat = os.stat(path)
    return Fingerprint(stat.st_size, stat.st_mtime_ns, sampled_sha256(path, stat.st_size))


def sampled_blocks(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks a fingerprint hashes in a file of `size` bytes."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        return [(0, size)]
    last = size - SAMPLE_BLOCK_BYTES
    return [(i * last // (SAMPLE_BLOCKS - 1), SAMPLE_BLOCK_BYTES) for i in range(SAMPLE_BLOCKS)]


def sampled_sha256(path: str | os.PathLike, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for offset, length in sampled_blocks(size):
            digest.update(os.pread(f.fileno(), length, offset))
    return digest.hexdigest()


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    return Path(f"{bin_path}.json")


def foreign_format(head: bytes) -> tuple[str, str] | None:
    """(what the file is, the fix) when its first bytes `head` are one of FOREIGN_MAGICS, else None."""
    for magic, what, fix in FOREIGN_MAGICS:
        if head.startswith(magic):
            return what, fix
    return None


def read_head(path: Path, nbytes: int = 64 * 1024) -> bytes:
    with open(path, "rb") as f:
        return f.read(nbytes)


def new_temp_path(path: Path) -> Path:
    """A name beside `path` for a file written before it is renamed into place. Created here, exclusively,
    so that it can never be a file that was there before."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    open(tmp, "xb").close()
    return tmp


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest file dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def scan_tokens(tokens: np.ndarray, on_chunk: Callable[[int, int], None] | None = None) -> TokenScan:
    """Hashes the array's bytes and finds its smallest and largest id, one bounded chunk at a time.
    `on_chunk(bytes_read, tokens_read)` follows the progress."""
    digest = hashlib.sha256()
    lo, hi = 0, 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start : start + SCAN_CHUNK]
        digest.update(memoryview(np.ascontiguousarray(chunk)).cast("B"))
        lo = min(lo, int(chunk.min())) if start else int(chunk.min())
        hi = max(hi, int(chunk.max()))
        if on_chunk is not None:
            on_chunk(chunk.nbytes, start + len(chunk))
    return TokenScan(digest.hexdigest(), lo, hi)


class TokenFileWriter:
    """Writes a token file incrementally: ids go to a new `OUT.bin.PID.tmp` as they come, hashed on the way, and the
    file is renamed into place with its sidecar only when `finish` is called. Used as a context manager:
    leaving it on an exception removes the partial file."""

    def __init__(self, out_path: str | os.PathLike, vocab_size: int, tokenizer: dict, eod_id: int | None):
        self.out_path = Path(out_path)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eod_id = eod_id
        self.dtype_name = dtype_for_vocab(vocab_size)
        self.dtype = FILE_DTYPES[self.dtype_name]
        self.tokens = 0
        self.documents = 0
        self._digest = hashlib.sha256()
        self._tmp_path = new_temp_path(self.out_path)
        self._file = open(self._tmp_path, "wb")

    def write(self, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype)
        self._digest.update(memoryview(data).cast("B"))
        self._file.write(memoryview(data).cast("B"))
        self.tokens += len(data)

    def end_document(self) -> None:
        if self.eod_id is not None:
            self.write(np.array([self.eod_id]))
        self.documents += 1

    def finish(self) -> Sidecar:
        self._file.close()
        sampled = sampled_sha256(self._tmp_path, self.tokens * self.dtype.itemsize)  # 2 MiB just written: no second pass
        sidecar = Sidecar(
            self.dtype_name,
            self.vocab_size,
            self.tokenizer,
            self.eod_id,
            self.tokens,
            self.documents,
            self._digest.hexdigest(),
            sampled_sha256=sampled,
        )
        # The sidecar goes first: a stale sidecar beside a new file fails its hash check at open, loudly,
        # while a new sidecar can never be read beside a truncated file (the rename is atomic).
        write_sidecar(self.out_path, sidecar)
        try:
            os.replace(self._tmp_path, self.out_path)
        except OSError:
            sidecar_path(self.out_path).unlink()  # a sidecar must never describe a file that is not there
            raise
        return sidecar

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # nothing half-written is left where data.source could name it
            self._file.close()
            self._tmp_path.unlink(missing_ok=True)


def write_sidecar(bin_path: Path, sidecar: Sidecar) -> None:
    path = sidecar_path(bin_path)
    tmp = new_temp_path(path)
    tmp.write_text(json.dumps(asdict(sidecar), indent=2) + "\n")
    os.replace(tmp, path)


def read_sidecar(source: str, bin_path: Path) -> Sidecar:
    """The sidecar of `bin_path`, checked for shape (not yet against the file: see `check_sidecar`)."""
    path = sidecar_path(bin_path)
    try:
        fields = json.loads(path.read_text())
        sidecar = Sidecar(**fields)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"data.source={source}: sidecar {path} is not a Keel token description ({e}); remake it with `keel prepare-data` or delete it to read the file as plain uint16"
        ) from None
    if sidecar.format != SIDECAR_FORMAT or sidecar.dtype not in FILE_DTYPES:
        raise ConfigError(
            f"data.source={source}: sidecar {path} has format {sidecar.format!r} and dtype {sidecar.dtype!r}; Keel reads {SIDECAR_FORMAT} with dtype uint16 or uint32"
        )
    return sidecar


def check_sidecar(source: str, sidecar: Sidecar, nbytes: int, scan: TokenScan | None) -> None:
    """Refuses a sidecar that does not describe its file: its size, and with a full `scan` of it its content
    hash and ids within its vocabulary."""
    itemsize = FILE_DTYPES[sidecar.dtype].itemsize
    if nbytes != sidecar.tokens * itemsize:
        raise ConfigError(
            f"data.source={source}: the sidecar says {sidecar.tokens:,} {sidecar.dtype} tokens ({sidecar.tokens * itemsize:,} bytes) but the file has {nbytes:,} bytes; remake it with `keel prepare-data`"
        )
    if scan is None:
        return
    if scan.sha256 != sidecar.sha256:
        raise ConfigError(
            f"data.source={source}: the file's sha256 {scan.sha256[:16]} is not its sidecar's {sidecar.sha256[:16]}: the tokens changed since they were written; remake it with `keel prepare-data`"
        )
    if scan.max_id >= sidecar.vocab_size:
        raise ConfigError(
            f"data.source={source}: token id {scan.max_id} is outside the sidecar's vocabulary of {sidecar.vocab_size}; remake it with `keel prepare-data`"
        )


def check_sampled(source: str, sidecar: Sidecar, sampled: str) -> None:
    """Refuses a file whose sampled blocks (`sampled`, their sha256 now) are not those its sidecar recorded."""
    if sampled != sidecar.sampled_sha256:
        raise ConfigError(
            f"data.source={source}: the sha256 of the file's sampled blocks {sampled[:16]} is not its sidecar's {(sidecar.sampled_sha256 or '')[:16]}: the tokens changed since they were written; remake it with `keel prepare-data`"
        )


def write_token_file(
    out_path: str | os.PathLike, input_paths: list[str | os.PathLike], on_chunk: Callable[[int, int], None] | None = None
) -> Sidecar:
    """Writes the bytes of `input_paths`, in order, as uint16 tokens (vocabulary 256, no end-of-document id)
    with its sidecar. `on_chunk(bytes_read, tokens_written)` follows the progress."""
    with TokenFileWriter(out_path, 256, {"kind": "bytes"}, eod_id=None) as writer:
        for path in input_paths:
            with open(path, "rb") as f:
                while chunk := f.read(BYTE_CHUNK):
                    writer.write(np.frombuffer(chunk, dtype=np.uint8))
                    if on_chunk is not None:
                        on_chunk(len(chunk), writer.tokens)
            writer.end_document()
        return writer.finish()
