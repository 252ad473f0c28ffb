"""A blend of token sources, each read in proportion to its weight: Megatron-LM's `--data-path 0.7 web 0.3 code`,
written `data.sources = ["0.7", "web.bin", "0.3", "code.bin"]`.

`parse_sources` reads the list (a weight, then its source, in pairs) and normalizes the weights to sum to 1,
as Megatron-LM does (megatron/core/datasets/utils.py, `normalize`). `open_job_data` opens the job's data, a
blend or data.source alone, and checks it as one before any worker starts: every source against the model
(keel.trainer.data.loader.open_tokens) and the sources against each other (one tokenizer).

How a row gets its source: a multinomial draw from the batch's own generator (keel.trainer.data.loader.
BatchSampler), not Megatron's blending index (BlendedDataset: each sample goes to the source whose share lags
its weight the most, an index built ahead for the whole run). The greedy index gives exact shares, but the
source of sample n depends on every sample before it, so a batch would no longer be a pure function of (seed,
batch index, dp rank) without an index over the whole run built ahead and kept. The draw keeps it one; its
shares stray from the weights by about sqrt(w(1 - w) / n) of the rows (0.46% of 10,000 rows at w = 0.3).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.loader import TokenSource, open_job_tokens, open_tokens
from keel.trainer.model_args import model_args

EXAMPLE = "['0.7', 'web.bin', '0.3', 'code.bin'] (on the command line --data.sources='0.7;web.bin;0.3;code.bin')"


@dataclass(frozen=True)
class DataBlend:
    """The job's training data: its sources, in the order data.sources names them, and their weights."""

    names: tuple[str, ...]  # each source as the config names it
    sources: tuple[TokenSource, ...]
    weights: tuple[float, ...]  # normalized: they sum to 1

    @property
    def tokens(self) -> list[np.ndarray]:
        return [source.tokens for source in self.sources]

    @property
    def eod_id(self) -> int | None:
        """The end-of-document id, when every source records the same one (one tokenizer), else None."""
        ids = {source.eod_id for source in self.sources}
        return ids.pop() if len(ids) == 1 else None

    @property
    def version(self) -> str:
        """Recorded with the run and its checkpoints; a resume on another version is refused. One source keeps
        its own version (data.sources = ["1", X] reads exactly the batches of data.source = X); a blend's
        hashes every source's version with its weight, in order, so other weights are other data."""
        if len(self.sources) == 1:
            return self.sources[0].version
        pairs = [[repr(weight), source.version] for weight, source in zip(self.weights, self.sources)]
        return "sha256:" + hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]

    @property
    def description(self) -> str:
        if len(self.sources) == 1:
            return self.sources[0].description
        parts = "; ".join(f"{weight:.4g} x {source.description}" for weight, source in zip(self.weights, self.sources))
        return f"a blend of {len(self.sources)} sources: {parts}"

    def record(self) -> list[dict]:
        """A row per source for the run store (keel.monitor.store.read_data_sources reads them back)."""
        return [
            {"source": name, "weight": weight, "version": source.version, "description": source.description}
            for name, weight, source in zip(self.names, self.weights, self.sources)
        ]


def parse_sources(items: list[str]) -> list[tuple[float, str]]:
    """["0.7", "web.bin", "0.3", "code.bin"] -> [(0.7, "web.bin"), (0.3, "code.bin")], the weights normalized.
    Needs no disk: config validation calls it. Raises ConfigError naming the bad item."""
    if len(items) % 2:
        raise ConfigError(f"data.sources={items}: {len(items)} items, not weight and source pairs; write e.g. {EXAMPLE}")
    pairs = []
    for text, source in zip(items[::2], items[1::2]):
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(
                f"data.sources: the weight {text!r} of {source!r} is not a positive number; each source follows its weight, e.g. {EXAMPLE}"
            )
        pairs.append((weight, source))
    total = sum(weight for weight, _ in pairs)
    return [(weight / total, source) for weight, source in pairs]


def open_job_data(cfg: JobConfig) -> DataBlend:
    """The job's training data, checked against its model and data.tokenizer: the blend data.sources names,
    else data.source alone (a blend of one, weight 1)."""
    if not cfg.data.sources:
        return DataBlend((cfg.data.source,), (open_job_tokens(cfg),), (1.0,))
    vocab_size = model_args(cfg).vocab_size
    entries = parse_sources(cfg.data.sources)
    sources = tuple(_open_entry(name, cfg.data.seq_len, vocab_size, cfg.data.tokenizer or None) for _, name in entries)
    names = tuple(name for _, name in entries)
    _check_one_tokenizer(names, sources)
    return DataBlend(names, sources, tuple(weight for weight, _ in entries))


def _open_entry(name: str, seq_len: int, vocab_size: int, tokenizer: str | None) -> TokenSource:
    # open_tokens says what is wrong with the source and how to fix it, naming it as data.source.
    try:
        return open_tokens(name, seq_len, vocab_size, tokenizer)
    except ConfigError as e:
        raise ConfigError(f"data.sources: {e}") from None


def _check_one_tokenizer(names: tuple[str, ...], sources: tuple[TokenSource, ...]) -> None:
    """The sources a tokenizer is known for (a sidecar's, or the builtin bytes) must all have the same one, and
    the others (ids only: nanoGPT, llm.c, Megatron) ids inside its vocabulary. Sources that say nothing of their
    tokenizer are checked against the model's vocabulary only (open_tokens)."""
    known = [(name, source) for name, source in zip(names, sources) if _tokenizer_of(name, source) is not None]
    if not known:
        return
    first_name, first = known[0]
    for name, source in known[1:]:
        if _tokenizer_of(name, source) != _tokenizer_of(first_name, first):
            raise ConfigError(
                f"data.sources: {first_name} was made with {_tokenizer_text(first_name, first)} and {name} with "
                f"{_tokenizer_text(name, source)}; a blend's sources must share one tokenizer: make them with the same one"
            )
    for name, source in zip(names, sources):
        if source.vocab_size > first.vocab_size:
            raise ConfigError(
                f"data.sources: {name}: {source.vocab_origin} need a vocabulary of {source.vocab_size:,}, but {first_name} was made with "
                f"{_tokenizer_text(first_name, first)}; blend sources made with one tokenizer"
            )


def _tokenizer_of(name: str, source: TokenSource) -> tuple | None:
    """What identifies a source's tokenizer (its kind, its file's sha256, its vocabulary), or None when unknown."""
    if name == "builtin":
        return ("bytes", None, source.vocab_size)
    if source.tokenizer is None:
        return None
    return (source.tokenizer.get("kind"), source.tokenizer.get("sha256"), source.vocab_size)


def _tokenizer_text(name: str, source: TokenSource) -> str:
    kind, sha256, vocab_size = _tokenizer_of(name, source)
    if kind == "bytes":
        return f"byte tokens (vocabulary {vocab_size})"
    return f"the tokenizer {source.tokenizer.get('file', kind)} (sha256 {(sha256 or 'none')[:16]}, vocabulary {vocab_size:,})"
