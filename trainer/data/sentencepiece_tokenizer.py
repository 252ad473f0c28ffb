"""SentencePiece tokenizers (a `.model` file) for `keel prepare-data`: `SentencePieceTokenizer`, a TextTokenizer.

Loaded with the sentencepiece library from the local file (`SentencePieceProcessor(model_file=...)`).
Documents are encoded without BOS or EOS (the processor's defaults; Keel writes the end-of-document id
itself): that id is the model's eos (`</s>` in most models), or the control symbol `--eod` names. Text is
text: SentencePiece never encodes text as a control symbol, so "</s>" in a document stays those characters.

A model that adds a dummy prefix (a "▁" before every text, which decoding strips once: Llama 2's, T5's and
most others) would put a space at every chunk boundary; a document's later chunks are therefore encoded by a
copy of the model without it (its normalizer spec's add_dummy_prefix off, as transformers' non-legacy Llama
tokenizer does). A model that also trims and collapses whitespace (remove_extra_whitespaces, SentencePiece's
default) turns the line end at a cut into one space, which is the dummy prefix of the next chunk: for it,
every chunk keeps the prefix. text_tokenizers' probe decides between the two; a model that passes neither
(one that trims without a dummy prefix) has its documents encoded whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from keel.trainer.data.text_inputs import Chunk, optional_import
from keel.trainer.data.text_tokenizers import TokenizerError, chunks_decode_as_whole, encode_by_start, file_identity, first_line


class SentencePieceTokenizer:
    def __init__(self, path: Path, eod_token: str | None):
        spm = optional_import("sentencepiece", "SentencePiece tokenizers (--tokenizer NAME.model)")
        try:
            self.first = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # the library raises OSError or RuntimeError with the parser's message
            raise TokenizerError(
                f"--tokenizer {path}: sentencepiece cannot load it ({first_line(e)}); pass a SentencePiece .model (a tiktoken BPE file is named .tiktoken)"
            ) from None
        self.rest = _without_dummy_prefix(spm, self.first)
        if self.rest is not None and not chunks_decode_as_whole(self):
            self.rest = None  # a model that trims: every chunk keeps its dummy prefix (see above)
        self.identity = file_identity("sentencepiece", path)
        self.vocab_size = self.first.get_piece_size()
        self.eod_id = self._eod_id(path, eod_token)

    def _eod_id(self, path: Path, eod_token: str | None) -> int:
        if eod_token is None:
            if self.first.eos_id() < 0:
                raise TokenizerError(f"tokenizer {path} has no eos piece; name its end-of-document control symbol with --eod TOKEN")
            return self.first.eos_id()
        piece_id = self.first.piece_to_id(eod_token)
        if self.first.id_to_piece(piece_id) != eod_token:
            raise TokenizerError(f"--eod {eod_token}: tokenizer {path} has no such piece; name one of its control symbols (e.g. </s>)")
        if not self.first.is_control(piece_id):
            # An ordinary or user-defined piece is what some text encodes to: documents would hold the eod id.
            raise TokenizerError(
                f"--eod {eod_token}: is a piece that text encodes to in {path}, not a control symbol; name a control symbol (e.g. </s>)"
            )
        return piece_id

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        return encode_by_start(chunks, self._encoder(self.first), self.rest and self._encoder(self.rest))

    def decode(self, ids: list[int]) -> str:
        return self.first.decode(ids)

    @staticmethod
    def _encoder(processor):
        return lambda texts: processor.encode(texts, out_type=int, add_bos=False, add_eos=False, num_threads=os.cpu_count())


def _without_dummy_prefix(spm, processor):
    """A copy of `processor` that adds no dummy prefix, or None when it adds none. The model's protobuf is
    edited with the schema sentencepiece ships (sentencepiece_model_pb2, which needs protobuf); where that
    cannot be imported the copy is None too, and the probe decides whether chunks decode as the whole."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        return None
    model = sentencepiece_model_pb2.ModelProto.FromString(processor.serialized_model_proto())
    if not model.normalizer_spec.add_dummy_prefix:
        return None
    model.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())
