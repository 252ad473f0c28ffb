"""The training data: where tokens come from (`open_tokens`) and how batches are drawn from them (`BatchSampler`).

Sources, each read as one flat array of token ids, never converted or loaded whole:
- "builtin": the Python standard library's own source code as bytes (vocabulary 256). It exists wherever
  Keel is installed, so every example and test can train without a network.
- a token file made by `keel prepare-data` (uint16 or uint32 with a JSON sidecar), or a plain nanoGPT
  uint16 .bin (keel.trainer.token_files);
- a Megatron-LM indexed dataset, PREFIX.bin + PREFIX.idx, named by its prefix or its .bin
  (keel.trainer.megatron_index).

`open_tokens` refuses data whose vocabulary does not fit the model's, before any worker starts.
The sampler is a pure function of (seed, batch_index, dp rank) whatever the source: resuming from a
checkpoint, skipping bad batches and changing the dp degree all see exactly the same global batches.
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

from keel.trainer.config import ConfigError
from keel.trainer.megatron_index import megatron_paths, read_index
from keel.trainer.token_files import FILE_DTYPES, check_sidecar, read_sidecar, scan_tokens, sidecar_path
from keel.trainer.token_files import write_token_file as write_token_file  # re-exported: the byte writer tests use

BYTE_VOCAB_SIZE = 256
BUILTIN_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class TokenSource:
    tokens: np.ndarray  # 1-D token ids: uint8 for the builtin corpus, an np.memmap of the file otherwise
    version: str  # "sha256:<first 16 hex>" of the token bytes, recorded with runs so data changes are visible
    description: str  # where the tokens came from, for logs and run records
    vocab_size: int  # the smallest model vocabulary that holds every id: the tokenizer's, else the largest id + 1
    vocab_origin: str  # why vocab_size is what it is, for the error that refuses a smaller model
    eod_id: int | None = None  # the end-of-document id, when the source says

    @property
    def dtype(self) -> str:
        return self.tokens.dtype.name


def open_tokens(source: str, seq_len: int, vocab_size: int) -> TokenSource:
    """Opens `source` and checks it holds at least one sequence of ids a model of `vocab_size` can embed."""
    ts = _builtin_tokens() if source == "builtin" else _file_tokens(source)
    if ts.vocab_size > vocab_size:
        raise ConfigError(
            f"data.source={source}: {ts.vocab_origin} need model.vocab_size >= {ts.vocab_size}; the model has {vocab_size} "
            f"(set --model.vocab_size={ts.vocab_size} or more)"
        )
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
    description = f"builtin: {len(tokens):,} bytes of the Python {py} standard library"
    return TokenSource(tokens, version, description, BYTE_VOCAB_SIZE, "byte tokens")


def _file_tokens(source: str) -> TokenSource:
    megatron = megatron_paths(source)
    if megatron is not None:
        return _megatron_tokens(source, *megatron)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"data.source={source}: file not found; make one with `keel prepare-data {source} FILES...`, name a Megatron PREFIX (PREFIX.bin + PREFIX.idx) or use data.source=builtin"
        )
    nbytes = path.stat().st_size
    if nbytes == 0:
        raise ConfigError(f"data.source={source}: file is empty; remake it with `keel prepare-data {source} FILES...`")
    if sidecar_path(path).is_file():
        return _described_tokens(source, path, nbytes)
    return _nanogpt_tokens(source, path, nbytes)


def _described_tokens(source: str, path: Path, nbytes: int) -> TokenSource:
    sidecar = read_sidecar(source, path)
    check_sidecar(source, sidecar, nbytes, scan=None)  # the size first: it costs nothing and says the most
    tokens = np.memmap(path, dtype=FILE_DTYPES[sidecar.dtype], mode="r")
    scan = scan_tokens(tokens)
    check_sidecar(source, sidecar, nbytes, scan)
    tokenizer = sidecar.tokenizer.get("file", sidecar.tokenizer.get("kind", "?"))
    eod = f", end-of-document id {sidecar.eod_id}" if sidecar.eod_id is not None else ""
    description = f"{path}: {sidecar.tokens:,} {sidecar.dtype} tokens in {sidecar.documents:,} documents, vocabulary {sidecar.vocab_size:,} ({tokenizer}){eod}"
    origin = f"its tokenizer's {sidecar.vocab_size:,} token ids"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, sidecar.vocab_size, origin, sidecar.eod_id)


def _nanogpt_tokens(source: str, path: Path, nbytes: int) -> TokenSource:
    if nbytes % 2:
        raise ConfigError(
            f"data.source={source}: size {nbytes} bytes is not a multiple of 2, so it is not a uint16 token file; "
            f"remake it with `keel prepare-data {source} FILES...`"
        )
    tokens = np.memmap(path, dtype="<u2", mode="r")
    scan = scan_tokens(tokens)  # one pass for both the version hash and the vocabulary the data needs
    description = f"{path}: {len(tokens):,} uint16 tokens, no sidecar (nanoGPT layout)"
    origin = f"token ids up to {scan.max_id}"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, scan.max_id + 1, origin)


def _megatron_tokens(source: str, bin_path: Path, idx_path: Path) -> TokenSource:
    nbytes = bin_path.stat().st_size
    index = read_index(source, idx_path, nbytes)
    if nbytes == 0:
        raise ConfigError(f"data.source={source}: {bin_path} holds no tokens")
    tokens = np.memmap(bin_path, dtype=index.dtype, mode="r")
    scan = scan_tokens(tokens)
    if scan.min_id < 0:
        raise ConfigError(f"data.source={source}: {bin_path} holds the negative token id {scan.min_id}; the .bin is damaged")
    n_docs = max(len(index.document_indices) - 1, 0)
    description = f"{bin_path} (Megatron, {idx_path.name}): {len(tokens):,} {index.dtype.name} tokens in {n_docs:,} documents"
    origin = f"token ids up to {scan.max_id}"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, scan.max_id + 1, origin)


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
