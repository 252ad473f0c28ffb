"""Hugging Face tokenizers for `keel prepare-data`, from local files only: load one, train a byte-level BPE one,
and encode documents in parallel while streaming them.

Nothing is downloaded: a tokenizer is a tokenizer.json on disk (`Tokenizer.from_file`). Text is read in
chunks of about CHUNK_BYTES bytes cut at line ends, and batches of chunks are encoded by the library's own
thread pool (encode_batch_fast, which releases the GIL) while the ids of earlier ones are written: memory
depends on the batch size, never on the size of the corpus. A token never spans a chunk boundary, so the ids
near a cut can differ from encoding the whole document at once; `DocumentEncoder` makes sure decoding still
gives what the whole document's ids give, or encodes each document whole where it cannot.

Text is always text: a document that contains "<|endoftext|>" or "<s>" is encoded as those characters, never
as the special token (tiktoken's encode_ordinary, which nanoGPT uses for the same reason).

Imported only by `keel prepare-data`, so training never pays for importing the tokenizers library.
"""

from __future__ import annotations

import codecs
import json
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
# Encoded in pieces and whole: the pieces must decode as the whole does. Each piece but the first starts a
# line as a chunk does; between them they hold what tokenizers treat specially (leading and repeated
# spaces, a tab, an empty line, special-token text, characters outside ASCII, a last line without its end).
PROBE = (
    "The first line of a document.\n",
    "  an indented line with  two spaces and a\ttab\n",
    "<|endoftext|> </s> <s> <eos> stay text\n",
    "\n",
    "ünïcödé, 数字 and 123, no line end",
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: the message is one line that says why and what to do."""


@dataclass(frozen=True)
class Chunk:
    text: str
    nbytes: int  # the bytes of the file read for this chunk, for the progress line
    first_of_document: bool
    last_of_document: bool


class DocumentEncoder:
    """Encodes chunks of documents so that a document's ids decode as the ids of the whole document would.

    Many tokenizers mark where a text starts: SentencePiece's (a "▁" prepended by a Metaspace pre-tokenizer
    or a Prepend normalizer, which the decoder strips once) and byte-level BPE with add_prefix_space. Every
    chunk is a text of its own to the library, so every chunk would gain the mark: one space per cut. The
    first chunk of a document is therefore encoded by the tokenizer as it is, the others by a copy that marks
    no start. A probe checks the result; `chunked` is False where chunks still do not decode as the whole
    (e.g. a normalizer that strips each text's trailing whitespace), and documents must be encoded whole."""

    def __init__(self, tokenizer: Tokenizer):
        self.first = _for_documents(tokenizer)
        config = json.loads(tokenizer.to_str())
        unmarked = {**config, "normalizer": _unmarked(config["normalizer"]), "pre_tokenizer": _unmarked(config["pre_tokenizer"])}
        self.rest = self.first if unmarked == config else _for_documents(Tokenizer.from_str(json.dumps(unmarked)))
        self.chunked = self._decodes_as_whole(PROBE)

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """The ids of each chunk, as uint32 arrays (an Encoding and a list of ints cost tens of bytes per token)."""
        ids: list[np.ndarray] = [np.zeros(0, np.uint32)] * len(chunks)
        for tokenizer, picked in self._by_tokenizer(chunks):
            # add_special_tokens=False: no BOS/EOS of a post-processor inside a document; Keel adds the eod itself.
            encodings = tokenizer.encode_batch_fast([chunks[i].text for i in picked], add_special_tokens=False)
            for i, encoding in zip(picked, encodings):
                ids[i] = np.array(encoding.ids, dtype=np.uint32)
        return ids

    def _by_tokenizer(self, chunks: list[Chunk]) -> list[tuple[Tokenizer, list[int]]]:
        if self.rest is self.first:
            return [(self.first, list(range(len(chunks))))]
        firsts = [i for i, chunk in enumerate(chunks) if chunk.first_of_document]
        rests = [i for i, chunk in enumerate(chunks) if not chunk.first_of_document]
        return [(tokenizer, picked) for tokenizer, picked in ((self.first, firsts), (self.rest, rests)) if picked]

    def _decodes_as_whole(self, pieces: tuple[str, ...]) -> bool:
        chunks = [Chunk(text, 0, i == 0, i == len(pieces) - 1) for i, text in enumerate(pieces)]
        chunked = np.concatenate(self.encode(chunks)).tolist()
        whole = self.first.encode("".join(pieces), add_special_tokens=False).ids
        return self.first.decode(chunked, skip_special_tokens=False) == self.first.decode(whole, skip_special_tokens=False)


def _for_documents(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` set to encode documents: special-token text stays text, and no padding or truncation that
    a tokenizer.json may carry (they would add pad ids to the data or drop text)."""
    tokenizer.encode_special_tokens = True
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _unmarked(component: dict | None) -> dict | None:
    """A normalizer or pre-tokenizer, as `Tokenizer.to_str` writes it, that marks no start of text: no Prepend,
    and Metaspace and ByteLevel without their prefix. Sequences are rewritten member by member."""
    if component is None or component["type"] == "Prepend":
        return None
    if component["type"] == "Sequence":
        key = "normalizers" if "normalizers" in component else "pretokenizers"
        members = [m for m in map(_unmarked, component[key]) if m is not None]
        return {**component, key: members}
    if component["type"] == "Metaspace":
        return {**component, "prepend_scheme": "never"}
    if "add_prefix_space" in component:  # ByteLevel's pre-tokenizer
        return {**component, "add_prefix_space": False}
    return component


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
            carry, first = "", True
            while block := f.read(chunk_bytes):
                text = carry + decoder.decode(block)
                # Cut after the last line end, so that a word is never split between two encode calls.
                cut = text.rfind("\n") + 1 or len(text)
                yield Chunk(text[:cut], len(block), first, last_of_document=False)
                carry, first = text[cut:], False
            yield Chunk(carry + decoder.decode(b"", final=True), 0, first, last_of_document=True)


def read_documents(paths: list[Path]) -> Iterator[Chunk]:
    """Each file's text whole, one chunk per document: for a tokenizer whose chunks do not decode as the whole."""
    for path in paths:
        data = path.read_bytes()
        yield Chunk(data.decode("utf-8", errors="replace"), len(data), first_of_document=True, last_of_document=True)


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
    encoder: DocumentEncoder, chunks: Iterator[Chunk], on_ids: Callable[[np.ndarray, Chunk], None], batch_bytes: int = BATCH_BYTES
) -> None:
    """Encodes `chunks` and calls `on_ids(ids, chunk)` for each, in order. IN_FLIGHT batches are encoded at
    once, so the library's threads that finish one batch's last chunks pick up the next batch's first
    instead of waiting; this thread reads the text and hands the ids on meanwhile."""
    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as encoders:
        pending: deque[tuple[list[Chunk], Future]] = deque()
        for batch in batches(chunks, batch_bytes):
            pending.append((batch, encoders.submit(encoder.encode, batch)))
            if len(pending) > IN_FLIGHT:
                _hand_on(*pending.popleft(), on_ids)
        while pending:
            _hand_on(*pending.popleft(), on_ids)


def _hand_on(batch: list[Chunk], future: Future, on_ids: Callable[[np.ndarray, Chunk], None]) -> None:
    for chunk, ids in zip(batch, future.result()):
        on_ids(ids, chunk)
