"""Byte-level training data that needs no download (vocabulary 256).

Tokens are bytes. The default source, "builtin", is the Python standard library's own source code,
which exists wherever Keel is installed, so every example and test can train without a network.
Larger corpora are uint16 token files in nanoGPT's .bin layout, made with `keel prepare-data`.

The sampler is a pure function of (seed, batch_index, dp rank): resuming from a checkpoint,
skipping bad batches and changing the dp degree all see exactly the same global batches.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.config import ConfigError

VOCAB_SIZE = 256
BUILTIN_MAX_BYTES = 4 * 1024 * 1024
_HASH_CHUNK = 64 * 1024 * 1024  # tokens per pass when hashing a file, so memory stays flat


@dataclass(frozen=True)
class TokenSource:
    tokens: np.ndarray  # 1-D token ids (< 256): uint8 for the builtin corpus, np.memmap uint16 for files
    version: str  # "sha256:<first 16 hex>" of the token bytes, recorded with runs so data changes are visible
    description: str  # where the tokens came from, for logs and run records


def open_tokens(source: str, seq_len: int) -> TokenSource:
    """Opens `source` ("builtin" or a uint16 token file) and checks it holds at least one sequence."""
    ts = _builtin_tokens() if source == "builtin" else _file_tokens(source)
    if len(ts.tokens) < seq_len + 1:
        raise ConfigError(
            f"data.source={source}: {len(ts.tokens)} tokens is fewer than data.seq_len+1={seq_len + 1}; "
            f"lower data.seq_len or use a larger data.source"
        )
    return ts


@functools.cache
def _builtin_tokens() -> TokenSource:
    # Walk top-down with sorted names so the file order, and so the corpus, is deterministic; stop at
    # the cap so only the files we need are read (this keeps it well under half a second).
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    size = 0
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            data = Path(dirpath, name).read_bytes()[: BUILTIN_MAX_BYTES - size]
            chunks.append(data)
            size += len(data)
            if size >= BUILTIN_MAX_BYTES:
                break
        if size >= BUILTIN_MAX_BYTES:
            break
    corpus = b"".join(chunks)
    tokens = np.frombuffer(corpus, dtype=np.uint8)  # read-only, so the cached array is safe to share
    version = "sha256:" + hashlib.sha256(corpus).hexdigest()[:16]
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return TokenSource(tokens, version, f"builtin: {len(tokens):,} bytes of the Python {py} standard library")


def _file_tokens(source: str) -> TokenSource:
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"data.source={source}: file not found; make one with `keel prepare-data {source} FILES...` or use data.source=builtin"
        )
    nbytes = path.stat().st_size
    if nbytes == 0:
        raise ConfigError(f"data.source={source}: file is empty; remake it with `keel prepare-data {source} FILES...`")
    if nbytes % 2:
        raise ConfigError(
            f"data.source={source}: size {nbytes} bytes is not a multiple of 2, so it is not a uint16 token file; "
            f"remake it with `keel prepare-data {source} FILES...`"
        )
    tokens = np.memmap(path, dtype="<u2", mode="r")
    # One pass over the file for both the version hash and the vocabulary check.
    digest = hashlib.sha256()
    max_id = 0
    for start in range(0, len(tokens), _HASH_CHUNK):
        chunk = tokens[start : start + _HASH_CHUNK]
        digest.update(memoryview(chunk).cast("B"))
        max_id = max(max_id, int(chunk.max()))
    if max_id >= VOCAB_SIZE:
        raise ConfigError(
            f"data.source={source}: token id {max_id} is outside the byte vocabulary (< {VOCAB_SIZE}); "
            f"make the file with `keel prepare-data {source} FILES...`"
        )
    return TokenSource(tokens, "sha256:" + digest.hexdigest()[:16], str(path))


def write_token_file(out_path: str | os.PathLike, input_paths: list[str | os.PathLike]) -> int:
    """Writes the bytes of `input_paths`, in order, as raw little-endian uint16; returns the token count."""
    out_path = Path(out_path)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    count = 0
    # Write beside the target and rename, so a failed run never leaves a truncated token file behind.
    with open(tmp_path, "wb") as f:
        for p in input_paths:
            data = np.frombuffer(Path(p).read_bytes(), dtype=np.uint8)
            data.astype("<u2").tofile(f)
            count += len(data)
    os.replace(tmp_path, out_path)
    return count


def prepare_data_main(argv: list[str]) -> int:
    """`keel prepare-data OUT.bin FILE_OR_DIR...`: turns text files into a token file for data.source."""
    usage = "usage: keel prepare-data OUT.bin FILE_OR_DIR...  (directories: all files, recursively, sorted)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return EXIT_OK
    if len(argv) < 2:
        print(usage, file=sys.stderr)
        return EXIT_CONFIG
    out, inputs = Path(argv[0]), argv[1:]
    files: list[Path] = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.resolve() != out.resolve())
        elif p.is_file():
            files.append(p)
        else:
            print(f"keel prepare-data: {name}: no such file or directory", file=sys.stderr)
            return EXIT_CONFIG
    if not any(f.stat().st_size for f in files):
        print(f"keel prepare-data: the inputs {inputs} hold no bytes; pass non-empty text files", file=sys.stderr)
        return EXIT_CONFIG
    try:
        count = write_token_file(out, files)
    except OSError as e:
        print(f"keel prepare-data: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {count:,} tokens from {len(files)} files to {out}")
    return EXIT_OK


class BatchSampler:
    """Random fixed-length windows of `tokens`. Each dp rank reads its own rows of the global batch.

    A batch with a token id outside the vocabulary (a damaged file, a wrong tokenizer) is never
    trained on: it is passed over and its index kept in `rejected`. Every rank checks the whole
    global batch, so all ranks pass over the same batches without talking to each other."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        skip_ranges: list[tuple[int, int]] = (),
        vocab_size: int | None = None,
        transform: Callable[[int, np.ndarray, int], np.ndarray] | None = None,
    ):
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens is fewer than seq_len+1={seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.batch_index = 0  # the next batch to be read
        # Batches [first, end) never read: reaching `first` jumps to `end`. This is how a run reproduces
        # another run's rollback, which skipped the same window.
        self.skip_ranges = dict(skip_ranges)
        self.vocab_size = vocab_size
        self.transform = transform  # (batch_index, window, vocab_size) -> window: the chaos hook on data
        self.rejected: list[int] = []  # batches passed over since the last take_rejected()
        self._window = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 [global_batch_size // dp_size, seq_len]; targets are inputs shifted by one."""
        while True:
            while self.batch_index in self.skip_ranges:
                self.batch_index = self.skip_ranges[self.batch_index]
            # Every rank draws the whole global batch and keeps its own rows, so the union over dp ranks
            # is exactly the single-process batch whatever dp_size is.
            rng = np.random.default_rng([self.seed, self.batch_index])
            offsets = rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch_size)
            # Plain numpy: the launcher validates data without paying for importing torch. The check
            # reads the whole global batch in the file's own dtype; only this rank's rows become int64.
            window = np.asarray(self.tokens[offsets[:, None] + self._window])
            if self.transform is not None:
                window = self.transform(self.batch_index, window.astype(np.int64), self.vocab_size)
            self.batch_index += 1
            if self.vocab_size is None or int(window.max()) < self.vocab_size:
                break
            self.rejected.append(self.batch_index - 1)
        lo = self.dp_rank * self.local_batch_size
        rows = window[lo : lo + self.local_batch_size].astype(np.int64)
        return rows[:, :-1], rows[:, 1:]

    def rewind_to(self, batch_index: int) -> None:
        """Reads again from `batch_index`, an index already read: a step that runs again sees the same data."""
        self.batch_index = batch_index

    def skip_to(self, batch_index: int) -> None:
        """Moves on to `batch_index` without reading the batches before it (stepping over bad data)."""
        self.batch_index = batch_index

    def take_rejected(self) -> list[int]:
        """The batches passed over since the last call (see the class docstring); empties the list."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        # The seed travels with the position: the same batch_index under another seed is other data.
        self.seed = int(state["seed"])
        self.batch_index = int(state["batch_index"])


def parse_skip_ranges(specs: list[str]) -> list[tuple[int, int]]:
    """["80:107"] -> [(80, 107)]: batch index ranges, end excluded. Raises ValueError naming the bad one."""
    ranges = []
    for spec in specs:
        first, sep, end = spec.partition(":")
        if not (sep and first.isdigit() and end.isdigit() and int(first) < int(end)):
            raise ValueError(f"data.skip_batches: bad range '{spec}'; write FIRST:END with whole numbers, FIRST < END")
        ranges.append((int(first), int(end)))
    return ranges
