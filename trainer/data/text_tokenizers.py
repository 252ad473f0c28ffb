"""The tokenizers of `keel prepare-data`, from local files only, behind one interface (`TextTokenizer`), and
the streaming encoder that feeds them.

| kind | file | library | end of document |
|---|---|---|---|
| bytes | none | none: a document's UTF-8 bytes, vocabulary 256 | none, documents are concatenated |
| huggingface | a tokenizer.json, or one trained here (`train_bpe`) | tokenizers, `Tokenizer.from_file` | `<|endoftext|>`, `</s>`, ... or --eod |
| sentencepiece | a `.model` | sentencepiece (keel.trainer.data.sentencepiece_tokenizer) | its eos, or --eod |
| tiktoken | a `.tiktoken` BPE file | tiktoken (keel.trainer.data.tiktoken_tokenizer) | `<|endoftext|>`, or --eod |

Nothing is downloaded. Text comes in chunks of about CHUNK_BYTES cut at line ends
(keel.trainer.data.text_inputs), and batches of chunks are encoded IN_FLIGHT at a time on threads (the
libraries' batch encoders release the GIL) while the ids of earlier ones are written: memory depends on the
batch size, never on the size of the corpus. A token never spans a chunk boundary, so the ids near a cut can
differ from encoding the whole document at once; each tokenizer encodes a document's first chunk as it is
and the others without the mark of a text's start, and `chunks_decode_as_whole` probes that decoding still
gives what the whole document's ids give. Where it does not, documents are encoded whole.

Text is always text: a document that contains "<|endoftext|>" or "<s>" is encoded as those characters, never
as the special token (tiktoken's encode_ordinary, which nanoGPT uses for the same reason).

Imported only by `keel prepare-data`, so training never pays for importing the tokenizers library.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.monitor.hashing import sha256_file
from keel.trainer.data.text_inputs import Chunk, PrepareError

# Memory is set by these, never by the corpus: at most IN_FLIGHT + 1 batches of BATCH_BYTES of text are held
# with their encodings (the library keeps tens of bytes per token): some tens of MiB, whatever the core count.
BATCH_BYTES = 512 * 1024  # text per batch encode call (characters of chunks: bytes, for ASCII)
IN_FLIGHT = 2  # batches being encoded at once
# Looked for, in this order, when the user names no --eod: the end-of-text tokens of GPT-2, Llama 3,
# Llama 2 / Mistral and Gemma.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TRAINED_EOD = "<|endoftext|>"
MIN_TRAINED_VOCAB = 257  # the 256 byte symbols of byte-level BPE and the end-of-document token
KINDS = {".model": "sentencepiece", ".tiktoken": "tiktoken"}  # by the file's suffix; any other: a tokenizer.json
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


class TokenizerError(PrepareError):
    """A tokenizer that cannot be used: the message is one line that says why and what to do."""


class TextTokenizer(Protocol):
    """What `keel prepare-data` needs of a tokenizer, whatever its kind."""

    identity: dict  # the sidecar's "tokenizer": {"kind": ...}, and the file's name and sha256 where there is one
    vocab_size: int
    eod_id: int | None  # the id written after each document; None: documents are concatenated

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """Each chunk's ids; a chunk that is not the first of its document is encoded as text that does not
        start a document (no start-of-text mark)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


def file_identity(kind: str, path: Path) -> dict:
    """A tokenizer named by its file's content, so that two token files made with it can be told so."""
    return {"kind": kind, "file": path.name, "sha256": sha256_file(path)}


def chunks_decode_as_whole(tokenizer: TextTokenizer) -> bool:
    """Whether PROBE's pieces, encoded as chunks of one document, decode as the ids of their whole text do."""
    chunks = [Chunk(text, 0, i == 0, i == len(PROBE) - 1) for i, text in enumerate(PROBE)]
    pieces = np.concatenate(tokenizer.encode(chunks)).tolist()
    [whole] = tokenizer.encode([Chunk("".join(PROBE), 0, True, True)])
    return tokenizer.decode(pieces) == tokenizer.decode(whole.tolist())


def encode_by_start(
    chunks: list[Chunk], first: Callable[[list[str]], Iterable], rest: Callable[[list[str]], Iterable] | None
) -> list[np.ndarray]:
    """The ids of each chunk as uint32 arrays (a list of ints costs tens of bytes per token): the first
    chunks of documents encoded in one call of `first`, the others in one call of `rest` (None: `first`
    too), which must mark no start of text."""
    ids: list[np.ndarray] = [np.zeros(0, np.uint32)] * len(chunks)
    groups = [(first, range(len(chunks)))]
    if rest is not None:
        groups = [
            (first, [i for i, c in enumerate(chunks) if c.first_of_document]),
            (rest, [i for i, c in enumerate(chunks) if not c.first_of_document]),
        ]
    for encode, picked in groups:
        if picked:
            for i, chunk_ids in zip(picked, encode([chunks[i].text for i in picked])):
                ids[i] = np.array(chunk_ids, dtype=np.uint32)
    return ids


class ByteTokenizer:
    """No tokenizer: a document's UTF-8 bytes (its text's, whatever its file's format), vocabulary 256."""

    identity = {"kind": "bytes"}
    vocab_size = 256
    eod_id = None

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        return [np.frombuffer(chunk.text.encode(), dtype=np.uint8) for chunk in chunks]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer that encodes chunks of documents so that a document's ids decode as the ids of
    the whole document would.

    Many tokenizers mark where a text starts: SentencePiece's (a "▁" prepended by a Metaspace pre-tokenizer
    or a Prepend normalizer, which the decoder strips once) and byte-level BPE with add_prefix_space. Every
    chunk is a text of its own to the library, so every chunk would gain the mark: one space per cut. The
    first chunk of a document is therefore encoded by the tokenizer as it is, the others by a copy that marks
    no start."""

    def __init__(self, tokenizer: Tokenizer, path: Path, eod_token: str | None):
        self.first = _for_documents(tokenizer)
        config = json.loads(tokenizer.to_str())
        unmarked = {**config, "normalizer": _unmarked(config["normalizer"]), "pre_tokenizer": _unmarked(config["pre_tokenizer"])}
        self.rest = None if unmarked == config else _for_documents(Tokenizer.from_str(json.dumps(unmarked)))
        self.identity = file_identity("huggingface", path)
        self.vocab_size = tokenizer.get_vocab_size()
        self.eod_id = eod_id(tokenizer, str(path), eod_token)

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        return encode_by_start(chunks, _batch_encoder(self.first), self.rest and _batch_encoder(self.rest))

    def decode(self, ids: list[int]) -> str:
        return self.first.decode(ids, skip_special_tokens=False)


def _batch_encoder(tokenizer: Tokenizer) -> Callable[[list[str]], list[list[int]]]:
    # add_special_tokens=False: no BOS/EOS of a post-processor inside a document; Keel adds the eod itself.
    return lambda texts: [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def load_text_tokenizer(path: Path, eod_token: str | None, tiktoken_pattern: str | None) -> TextTokenizer:
    """The tokenizer in the local file `path`, of the kind its suffix says (KINDS)."""
    if not path.is_file():
        raise TokenizerError(f"--tokenizer {path}: file not found; pass a local tokenizer file (nothing is downloaded)")
    kind = KINDS.get(path.suffix.lower(), "huggingface")
    if tiktoken_pattern is not None and kind != "tiktoken":
        raise TokenizerError(
            f"--tiktoken-pattern {tiktoken_pattern}: applies to a tiktoken BPE file (--tokenizer NAME.tiktoken) only; leave it out"
        )
    if kind == "sentencepiece":
        from keel.trainer.data.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(path, eod_token)
    if kind == "tiktoken":
        from keel.trainer.data.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(path, eod_token, tiktoken_pattern)
    return HuggingFaceTokenizer(load_tokenizer(path), path, eod_token)


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
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception subclasses of its own for every kind of bad file
        raise TokenizerError(
            f"--tokenizer {path}: the tokenizers library cannot load it ({first_line(e)}); pass a Hugging Face tokenizer.json, a SentencePiece .model or a tiktoken .tiktoken file"
        ) from None


def first_line(error: Exception) -> str:
    """What a library's exception says, on one line."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


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


def train_bpe(texts: Iterable[str], vocab_size: int, save_to: Path) -> Tokenizer:
    """Trains a byte-level BPE tokenizer of `vocab_size` tokens (its end-of-document token included) on
    `texts`, streamed, and saves it to `save_to`."""
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
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(save_to))
    return tokenizer


def batches(chunks: Iterator[Chunk], max_chars: int) -> Iterator[list[Chunk]]:
    """`chunks` grouped into lists of at most `max_chars` characters of text (and at least one chunk)."""
    batch: list[Chunk] = []
    size = 0
    for chunk in chunks:
        if batch and size + len(chunk.text) > max_chars:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += len(chunk.text)
    if batch:
        yield batch


def encode_stream(
    encoder: TextTokenizer, chunks: Iterator[Chunk], on_ids: Callable[[np.ndarray, Chunk], None], batch_bytes: int = BATCH_BYTES
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
