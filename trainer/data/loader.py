"""The training data: where tokens come from (`open_tokens`) and how batches are drawn from them (`BatchSampler`).

Sources, each read as one flat array of token ids, never converted or loaded whole:
- "builtin": the Python standard library's own source code as bytes (vocabulary 256). It exists wherever
  Keel is installed, so every example and test can train without a network.
- a token file made by `keel prepare-data` (uint16 or uint32 with a JSON sidecar), or a plain nanoGPT
  uint16 .bin (keel.trainer.data.token_files);
- an llm.c / modded-nanogpt shard: a header of 256 int32 (magic, version, token count), then the ids;
- a Megatron-LM indexed dataset, PREFIX.bin + PREFIX.idx, named by its prefix, its .bin or its .idx
  (keel.trainer.data.megatron_index).

A file without a sidecar or a header cannot prove its layout, so it is read as nanoGPT's uint16 only when
it shows none of the marks of something else (a known magic, text, 32-bit ids).
No start reads a whole file: a sidecar's size and sampled blocks are checked, and a file without one is
read whole once, its scan kept for its fingerprint (keel.trainer.data.scan_cache); `keel verify-data`
reads every byte on request.
`open_tokens` refuses data whose vocabulary or tokenizer is not the model's, before any worker starts.
The sampler is a pure function of (seed, batch_index, dp rank) whatever the source: resuming from a
checkpoint, skipping bad batches and changing the dp degree all see exactly the same global batches.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.monitor.hashing import sha256_file
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.megatron_index import megatron_paths, read_header, read_index
from keel.trainer.data.scan_cache import StartChecks, scan_key
from keel.trainer.data.token_files import FILE_DTYPES, check_sidecar, foreign_format, read_head, read_sidecar, sidecar_path
from keel.trainer.data.token_files import write_token_file as write_token_file  # re-exported: the byte writer tests use

BYTE_VOCAB_SIZE = 256
BUILTIN_MAX_BYTES = 4 * 1024 * 1024
# llm.c's shards (dev/data/data_common.py, read as such by modded-nanogpt): magic -> (version, token dtype).
LLMC_SHARDS = {20240520: (1, "<u2"), 20240801: (7, "<u4")}
LLMC_HEADER_BYTES = 256 * 4
CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0b\x0e-\x1f\x7f]")  # in no text file; ids below 2,304 put one in every uint16
WIDE_ID_CHECK = 1 << 20  # uint16 values looked at for the high halves of 32-bit ids
START_CHECKS = StartChecks()


@dataclass(frozen=True)
class TokenSource:
    tokens: np.ndarray  # 1-D token ids: uint8 for the builtin corpus, an np.memmap of the file otherwise
    version: str  # "sha256:<first 16 hex>" of the token bytes, recorded with runs so data changes are visible
    description: str  # where the tokens came from, for logs and run records
    vocab_size: int  # the smallest model vocabulary that holds every id: the tokenizer's, else the largest id + 1
    vocab_origin: str  # why vocab_size is what it is, for the error that refuses a smaller model
    eod_id: int | None = None  # the end-of-document id, when the source says
    tokenizer: dict | None = None  # the sidecar's tokenizer identity; None when the source records none

    @property
    def dtype(self) -> str:
        return self.tokens.dtype.name


def open_job_tokens(cfg: JobConfig) -> TokenSource:
    """The job's token source, checked against its model and, when data.tokenizer names one, its tokenizer."""
    from keel.trainer.model_args import model_args  # here: model_args imports the config, as this module does

    return open_tokens(cfg.data.source, cfg.data.seq_len, model_args(cfg).vocab_size, cfg.data.tokenizer or None)


def open_tokens(
    source: str, seq_len: int, vocab_size: int, tokenizer: str | None = None, checks: StartChecks = START_CHECKS
) -> TokenSource:
    """Opens `source` and checks it holds at least one sequence of ids a model of `vocab_size` can embed, made
    with the tokenizer file `tokenizer` when one is named."""
    ts = open_source(source, checks)
    _check_vocab(source, ts, vocab_size)
    if tokenizer is not None:
        _check_tokenizer(source, ts, tokenizer)
    if len(ts.tokens) < seq_len + 1:
        raise ConfigError(
            f"data.source={source}: {len(ts.tokens)} tokens is fewer than data.seq_len+1={seq_len + 1}; "
            f"lower data.seq_len or use a larger data.source"
        )
    return ts


def _check_vocab(source: str, ts: TokenSource, vocab_size: int) -> None:
    if ts.vocab_size > vocab_size:
        raise ConfigError(
            f"data.source={source}: {ts.vocab_origin} need model.vocab_size >= {ts.vocab_size}; the model has {vocab_size} "
            f"(set --model.vocab_size={ts.vocab_size} or more)"
        )
    # A sidecar knows the tokenizer's exact vocabulary, so a model built for another one is another tokenizer.
    if ts.tokenizer is not None and ts.vocab_size != vocab_size:
        raise ConfigError(
            f"data.source={source}: it was made with a tokenizer of {ts.vocab_size:,} tokens ({_tokenizer_name(ts.tokenizer)}) and the model's vocabulary is {vocab_size:,}, "
            f"so the job expects another tokenizer; set --model.vocab_size={ts.vocab_size} (Keel pads the embedding itself) or make the data with the model's tokenizer"
        )


def _check_tokenizer(source: str, ts: TokenSource, tokenizer: str) -> None:
    if ts.tokenizer is None:
        raise ConfigError(
            f"data.tokenizer={tokenizer}: data.source={source} records no tokenizer (only the sidecar of `keel prepare-data` does), so it cannot be checked; "
            f"make the data with `keel prepare-data OUT.bin FILES... --tokenizer {tokenizer}` or unset data.tokenizer"
        )
    if not Path(tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer={tokenizer}: file not found; name the tokenizer file the job expects (tokenizer.json, a SentencePiece .model or a tiktoken file)"
        )
    digest = sha256_file(Path(tokenizer))
    recorded = ts.tokenizer.get("sha256", "")
    if digest != recorded:
        raise ConfigError(
            f"data.tokenizer={tokenizer}: data.source={source} was made with another tokenizer ({_tokenizer_name(ts.tokenizer)}, sha256 {recorded[:16] or 'none'}; "
            f"this one is {digest[:16]}); make the data with `keel prepare-data OUT.bin FILES... --tokenizer {tokenizer}` or name the tokenizer it was made with"
        )


def _tokenizer_name(identity: dict) -> str:
    return identity.get("file", identity.get("kind", "?"))


def open_source(source: str, checks: StartChecks = START_CHECKS) -> TokenSource:
    """The tokens of `source`, proved to be what was written (or first read) as `checks` say: cheaply at a
    start, every byte for keel verify-data."""
    return _builtin_tokens() if source == "builtin" else _file_tokens(source, checks)


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


def _file_tokens(source: str, checks: StartChecks = START_CHECKS) -> TokenSource:
    megatron = megatron_paths(source)
    if megatron is not None:
        return _megatron_tokens(source, *megatron, checks)
    path = Path(source)
    if path.is_dir():
        raise ConfigError(
            f"data.source={source}: is a directory; name a token file (the OUT.bin of `keel prepare-data`) or a Megatron PREFIX (PREFIX.bin + PREFIX.idx)"
        )
    if not path.is_file():
        raise ConfigError(
            f"data.source={source}: file not found; make one with `keel prepare-data {source} FILES...`, name a Megatron PREFIX (PREFIX.bin + PREFIX.idx) or use data.source=builtin"
        )
    nbytes = path.stat().st_size
    if nbytes == 0:
        raise ConfigError(f"data.source={source}: file is empty; remake it with `keel prepare-data {source} FILES...`")
    if sidecar_path(path).is_file():
        return _described_tokens(source, path, nbytes, checks)
    head = read_head(path)
    _refuse_foreign(source, path, head)
    if len(head) >= 12 and int.from_bytes(head[:4], "little") in LLMC_SHARDS:
        return _llmc_tokens(source, path, nbytes, head, checks)
    return _nanogpt_tokens(source, path, nbytes, checks)


def _refuse_foreign(source: str, path: Path, head: bytes) -> None:
    """Refuses a file without a sidecar whose first bytes show it is not token ids."""
    foreign = foreign_format(head)
    if foreign is not None:
        what, fix = foreign
        raise ConfigError(f"data.source={source}: {path} is {what}, not token ids; {fix}")
    if _is_text(head):
        raise ConfigError(
            f"data.source={source}: {path} is text, not token ids (its first {len(head):,} bytes are UTF-8 text); make a token file with `keel prepare-data OUT.bin {path}`"
        )


def _is_text(head: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # not final: `head` may end inside a character
    except UnicodeDecodeError:
        return False
    return CONTROL_BYTES.search(head) is None


def _described_tokens(source: str, path: Path, nbytes: int, checks: StartChecks) -> TokenSource:
    sidecar = read_sidecar(source, path)
    check_sidecar(source, sidecar, nbytes, scan=None)  # the size first: it costs nothing and says the most
    tokens = np.memmap(path, dtype=FILE_DTYPES[sidecar.dtype], mode="r")
    # Ids past the vocabulary are not looked for here: the sampler passes over any batch holding one.
    checks.sidecar(source, sidecar, tokens)
    eod = f", end-of-document id {sidecar.eod_id}" if sidecar.eod_id is not None else ""
    description = f"{path}: {sidecar.tokens:,} {sidecar.dtype} tokens in {sidecar.documents:,} documents, vocabulary {sidecar.vocab_size:,} ({_tokenizer_name(sidecar.tokenizer)}){eod}"
    origin = f"its tokenizer's {sidecar.vocab_size:,} token ids"
    return TokenSource(tokens, "sha256:" + sidecar.sha256[:16], description, sidecar.vocab_size, origin, sidecar.eod_id, sidecar.tokenizer)


def _nanogpt_tokens(source: str, path: Path, nbytes: int, checks: StartChecks) -> TokenSource:
    if nbytes % 2:
        raise ConfigError(
            f"data.source={source}: size {nbytes} bytes is not a multiple of 2, so it is not a uint16 token file; "
            f"remake it with `keel prepare-data {source} FILES...`"
        )
    tokens = np.memmap(path, dtype="<u2", mode="r")
    _refuse_wide_ids(source, path, tokens)
    scan = checks.scan(source, scan_key(tokens), tokens)  # one pass, once, for both the version hash and the vocabulary the data needs
    description = f"{path}: {len(tokens):,} uint16 tokens, no sidecar (nanoGPT layout)"
    origin = f"token ids up to {scan.max_id}"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, scan.max_id + 1, origin)


def _refuse_wide_ids(source: str, path: Path, tokens: np.ndarray) -> None:
    # Little-endian 32-bit ids of a vocabulary below 262,144 read as uint16 alternate an id with a high half
    # of 0 to 3; real uint16 token data never keeps every second id that small.
    head = np.asarray(tokens[:WIDE_ID_CHECK])
    if len(head) >= 16 and head[1::2].max() < 4 <= head[0::2].max():
        raise ConfigError(
            f"data.source={source}: {path} holds 32-bit token ids, not nanoGPT's uint16 (every second uint16 of its first {len(head):,} is below 4: the high halves of 32-bit ids); "
            f"it is a Megatron .bin without its .idx (put PREFIX.idx beside it) or a 32-bit token file without its sidecar (remake it with `keel prepare-data`)"
        )


def _llmc_tokens(source: str, path: Path, nbytes: int, head: bytes, checks: StartChecks) -> TokenSource:
    magic, version, count = np.frombuffer(head[:12], dtype="<i4").tolist()
    want_version, dtype = LLMC_SHARDS[magic]
    expected = LLMC_HEADER_BYTES + count * np.dtype(dtype).itemsize
    if version != want_version or count < 1 or nbytes != expected:
        raise ConfigError(
            f"data.source={source}: {path} has llm.c's shard magic {magic} but version {version}, {count:,} tokens and {nbytes:,} bytes "
            f"(a shard of {magic} is version {want_version}, at least one token, and {LLMC_HEADER_BYTES:,} bytes of header plus its tokens); the shard is damaged, make it again"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
    scan = checks.scan(source, scan_key(tokens), tokens)
    description = f"{path}: {count:,} {tokens.dtype.name} tokens (llm.c shard, magic {magic})"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, scan.max_id + 1, f"token ids up to {scan.max_id}")


def _megatron_tokens(source: str, bin_path: Path, idx_path: Path, checks: StartChecks) -> TokenSource:
    if not bin_path.is_file():
        raise ConfigError(
            f"data.source={source}: {bin_path} is missing beside {idx_path}; a Megatron dataset is the pair PREFIX.bin + PREFIX.idx, put its .bin there"
        )
    nbytes = bin_path.stat().st_size
    header = read_header(source, idx_path)
    if nbytes == 0:
        read_index(source, idx_path, nbytes)  # an index of sequences says they are not in the .bin
        raise ConfigError(f"data.source={source}: {bin_path} holds no tokens")
    tokens = np.memmap(bin_path, dtype=header.dtype, mode="r")
    # The whole index is checked against the .bin when the .bin is scanned, and with it once for the pair.
    scan = checks.scan(source, scan_key(tokens, idx_path), tokens, lambda: read_index(source, idx_path, nbytes))
    if scan.min_id < 0:
        raise ConfigError(f"data.source={source}: {bin_path} holds the negative token id {scan.min_id}; the .bin is damaged")
    n_docs = max(header.documents - 1, 0)
    description = f"{bin_path} (Megatron, {idx_path.name}): {len(tokens):,} {header.dtype.name} tokens in {n_docs:,} documents"
    origin = f"token ids up to {scan.max_id}"
    return TokenSource(tokens, "sha256:" + scan.sha256[:16], description, scan.max_id + 1, origin)


class BatchSampler:
    """Random fixed-length windows of `tokens`, or of a blend of token arrays drawn by `weights`. Each dp
    rank reads its own rows of the global batch.

    A blend (keel.trainer.data.blend) draws each row's source from the batch's own generator, by weight
    (a multinomial draw, as numpy's `Generator.choice`), then the row's window in that source: a batch
    stays a pure function of (seed, batch index, dp rank). One array draws no source, so a blend of one
    source reads exactly the batches of that source alone.

    A batch with a token id outside the vocabulary (a damaged file, a wrong tokenizer) is never
    trained on: it is passed over and its index kept in `rejected`. Every rank checks the whole
    global batch, so all ranks pass over the same batches without talking to each other."""

    def __init__(
        self,
        tokens: np.ndarray | Sequence[np.ndarray],
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        skip_ranges: list[tuple[int, int]] = (),
        vocab_size: int | None = None,
        transform: Callable[[int, np.ndarray, int], np.ndarray] | None = None,
        weights: Sequence[float] | None = None,
        on_batch: Callable[[np.ndarray], None] | None = None,
    ):
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        self.sources = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        self.weights = np.ones(1) if weights is None else np.asarray(weights, dtype=np.float64)
        if len(self.weights) != len(self.sources) or not np.isclose(self.weights.sum(), 1.0):
            raise ValueError(f"weights {list(self.weights)} must be one per token array ({len(self.sources)}) and sum to 1")
        for source in self.sources:
            if len(source) < seq_len + 1:
                raise ValueError(f"{len(source)} tokens is fewer than seq_len+1={seq_len + 1}")
        self._window_ends = np.array([len(source) - seq_len for source in self.sources])  # a window starts below its source's end
        self._dtype = np.result_type(*(source.dtype for source in self.sources))
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
        # Told of every batch returned: the tokens of its global batch read from each source (a blend's shares).
        self.on_batch = on_batch
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
            # Plain numpy: the launcher validates data without paying for importing torch. The check
            # reads the whole global batch in the files' own dtype; only this rank's rows become int64.
            rows_source, window = self._draw(rng)
            if self.transform is not None:
                window = self.transform(self.batch_index, window.astype(np.int64), self.vocab_size)
            self.batch_index += 1
            if self.vocab_size is None or int(window.max()) < self.vocab_size:
                break
            self.rejected.append(self.batch_index - 1)
        if self.on_batch is not None:
            self.on_batch(np.bincount(rows_source, minlength=len(self.sources)) * self.seq_len)
        lo = self.dp_rank * self.local_batch_size
        rows = window[lo : lo + self.local_batch_size].astype(np.int64)
        return rows[:, :-1], rows[:, 1:]

    def _draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(each row's source, the global batch's windows [global_batch_size, seq_len + 1]) from the batch's generator."""
        if len(self.sources) == 1:  # no draw of sources: exactly the windows of the source read alone
            offsets = rng.integers(0, self._window_ends[0], size=self.global_batch_size)
            return np.zeros(self.global_batch_size, dtype=np.int64), np.asarray(self.sources[0][offsets[:, None] + self._window])
        rows_source = rng.choice(len(self.sources), size=self.global_batch_size, p=self.weights)
        offsets = rng.integers(0, self._window_ends[rows_source])
        window = np.empty((self.global_batch_size, self.seq_len + 1), dtype=self._dtype)
        for i, source in enumerate(self.sources):
            rows = np.flatnonzero(rows_source == i)
            window[rows] = source[offsets[rows, None] + self._window]
        return rows_source, window

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
