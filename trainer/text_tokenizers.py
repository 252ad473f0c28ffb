"""Hugging Face tokenizers for `keel prepare-data`, from local files only: load one, train a byte-level BPE one,
and encode documents in parallel while streaming them.

Nothing is downloaded: a tokenizer is a tokenizer.json on disk (`Tokenizer.from_file`). Text is read in
chunks of about CHUNK_BYTES bytes cut at line ends, and batches of chunks are encoded by the library's own
thread pool (encode_batch_fast, which releases the GIL) while the ids of earlier ones are written: memory
depends on the batch size, never on the size of the corpus. A token never spans a chunk boundary, so the ids
near a cut can differ from encoding the whole document at once; decoding still gives the text back exactly.

Imported only by `keel prepare-data`, so training never pays for importing the tokenizers library.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Memory is set by these, never by the corpus: at most IN_FLIGHT + 1 batches of BATCH_BYTES of text are held
# with their encodings (the library keeps tens of bytes per token): some tens of MiB, whatever the core count.
CHUNK_BYTES = 32 * 1024  # small enough that a batch gives every core of a large machine a chunk
BATCH_BYTES = 512 * 1024  # text per encode_batch_fast call
IN_FLIGHT = 2  # batches being encoded at once
# Looked for, in this order, when the user names no --eod: the end-of-text tokens of GPT-2, Llama 3,
# Llama 2 / Mistral and Gemma.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TRAINED_EOD = "<|endoftext|>"
MIN_TRAINED_VOCAB = 257  # the 256 byte symbols of byte-level BPE and the end-of-document token


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: the message is one line that says why and what to do."""


@dataclass(frozen=True)
class Chunk:
    text: str
    nbytes: int  # the bytes of the file read for this chunk, for the progress line
    last_of_document: bool


def load_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise TokenizerError(f"--tokenizer {path}: file not found; pass a local tokenizer.json (nothing is downloaded)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception subclasses of its own for every kind of bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(
            f"--tokenizer {path}: the tokenizers library cannot load it ({reason}); pass a Hugging Face tokenizer.json"
        ) from None


def eod_id(tokenizer: Tokenizer, name: str, eod_token: str | None) -> int:
    """The id documents are separated by: `eod_token` if given, else the first known end-of-text token it has."""
    candidates = (eod_token,) if eod_token else EOD_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    if eod_token:
        raise TokenizerError(f"--eod {eod_token}: tokenizer {name} has no such token; name one of its tokens")
    raise TokenizerError(
        f"tokenizer {name} has none of the end-of-text tokens {list(EOD_CANDIDATES)}; name its end-of-document token with --eod TOKEN"
    )


def train_bpe(paths: list[Path], vocab_size: int, save_to: Path) -> Tokenizer:
    """Trains a byte-level BPE tokenizer of `vocab_size` tokens (its end-of-document token included) on the
    files' text, streamed, and saves it to `save_to`."""
    if vocab_size < MIN_TRAINED_VOCAB:
        raise TokenizerError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE tokenizer needs at least {MIN_TRAINED_VOCAB} tokens (256 bytes and the end-of-document token)"
        )
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string has an encoding (no unknown token) and decoding gives it back exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TRAINED_EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator((chunk.text for chunk in read_chunks(paths)), trainer)
    tokenizer.save(str(save_to))
    return tokenizer


def read_chunks(paths: list[Path], chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """The files' text in chunks of about `chunk_bytes` bytes, each file a document. Bytes that are not
    UTF-8 become U+FFFD."""
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may straddle two reads
        with open(path, "rb") as f:
            carry = ""
            while block := f.read(chunk_bytes):
                text = carry + decoder.decode(block)
                # Cut after the last line end, so that a word is never split between two encode calls.
                cut = text.rfind("\n") + 1 or len(text)
                yield Chunk(text[:cut], len(block), last_of_document=False)
                carry = text[cut:]
            yield Chunk(carry + decoder.decode(b"", final=True), 0, last_of_document=True)


def batches(chunks: Iterator[Chunk], max_bytes: int) -> Iterator[list[Chunk]]:
    """`chunks` grouped into lists of at most `max_bytes` bytes read (and at least one chunk)."""
    batch: list[Chunk] = []
    size = 0
    for chunk in chunks:
        if batch and size + chunk.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += chunk.nbytes
    if batch:
        yield batch


def encode_stream(
    tokenizer: Tokenizer, chunks: Iterator[Chunk], on_ids: Callable[[np.ndarray, Chunk], None], batch_bytes: int = BATCH_BYTES
) -> None:
    """Encodes `chunks` and calls `on_ids(ids, chunk)` for each, in order. IN_FLIGHT batches are encoded at
    once, so the library's threads that finish one batch's last chunks pick up the next batch's first
    instead of waiting; this thread reads the text and hands the ids on meanwhile."""

    def encode(batch: list[Chunk]) -> list[np.ndarray]:
        # add_special_tokens=False: no BOS/EOS of a post-processor inside a document; Keel adds the eod itself.
        encodings = tokenizer.encode_batch_fast([c.text for c in batch], add_special_tokens=False)
        # To arrays at once: an Encoding and a list of ints cost tens of bytes per token, an array four.
        return [np.array(encoding.ids, dtype=np.uint32) for encoding in encodings]

    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as encoders:
        pending: deque[tuple[list[Chunk], Future]] = deque()
        for batch in batches(chunks, batch_bytes):
            pending.append((batch, encoders.submit(encode, batch)))
            if len(pending) > IN_FLIGHT:
                _hand_on(*pending.popleft(), on_ids)
        while pending:
            _hand_on(*pending.popleft(), on_ids)


def _hand_on(batch: list[Chunk], future: Future, on_ids: Callable[[np.ndarray, Chunk], None]) -> None:
    for chunk, ids in zip(batch, future.result()):
        on_ids(ids, chunk)
