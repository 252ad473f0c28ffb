"""tiktoken BPE files (`NAME.tiktoken`: a base64 token and its rank per line, as tiktoken.load.load_tiktoken_bpe
reads them) for `keel prepare-data`: `TiktokenTokenizer`, a TextTokenizer.

A rank file is not a whole tokenizer: the text is split by a regular expression before byte-pair merging,
and the special tokens are not in it. The split pattern is named with `--tiktoken-pattern` among tiktoken's
public encodings (tiktoken_ext.openai_public, which ships with tiktoken: gpt2, r50k_base, p50k_base,
cl100k_base, o200k_base, ...). Their constructors are called with their rank loaders replaced, so that their
patterns, special tokens and the sha256 of their rank files are read without downloading anything.

- A file whose sha256 is that of a public encoding's rank file (the user's copy of cl100k_base.tiktoken) is
  that encoding: its pattern and its special tokens, `<|endoftext|>` at 100257 for cl100k_base.
- Any other file gets cl100k_base's pattern (or the one named) and one special token, the end of document
  `<|endoftext|>` (or the name --eod gives), at the id after the largest rank.

Documents are encoded with encode_ordinary: text is text, "<|endoftext|>" in a document is those characters.
tiktoken decodes any ids to exactly the bytes they came from, so chunks always decode as the whole.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.trainer.data.text_inputs import Chunk, optional_import
from keel.trainer.data.text_tokenizers import TokenizerError, file_identity, first_line

DEFAULT_PATTERN = "cl100k_base"
EOD_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class PublicEncoding:
    name: str
    pattern: str
    special_tokens: dict[str, int]
    ranks_sha256: str | None  # of its .tiktoken rank file; None for gpt2, whose ranks come in another format


class TiktokenTokenizer:
    def __init__(self, path: Path, eod_token: str | None, pattern_name: str | None):
        tiktoken = optional_import("tiktoken", "tiktoken BPE files (--tokenizer NAME.tiktoken)")
        ranks = _load_ranks(path)
        self.identity = file_identity("tiktoken", path)
        public = public_encodings()
        known = next((e for e in public.values() if e.ranks_sha256 == self.identity["sha256"]), None)
        pattern_name = pattern_name or (known.name if known else DEFAULT_PATTERN)
        if pattern_name not in public:
            raise TokenizerError(
                f"--tiktoken-pattern {pattern_name}: not one of tiktoken's public encodings; name one of {', '.join(public)}"
            )
        specials = known.special_tokens if known else {eod_token or EOD_TOKEN: max(ranks.values()) + 1}
        eod_token = eod_token or EOD_TOKEN
        if eod_token not in specials:
            raise TokenizerError(
                f"--eod {eod_token}: {path} is tiktoken's {known.name}, whose special tokens are {', '.join(specials)}; name one of them"
            )
        self.encoding = tiktoken.Encoding(path.name, pat_str=public[pattern_name].pattern, mergeable_ranks=ranks, special_tokens=specials)
        self.identity["pattern"] = pattern_name  # the split is part of the tokenizer, though not of its file
        self.vocab_size = max(max(ranks.values()), *specials.values()) + 1
        self.eod_id = specials[eod_token]

    def encode(self, chunks: list[Chunk]) -> list[np.ndarray]:
        ids = self.encoding.encode_ordinary_batch([chunk.text for chunk in chunks], num_threads=os.cpu_count())
        return [np.array(chunk_ids, dtype=np.uint32) for chunk_ids in ids]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def _load_ranks(path: Path) -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe

    # tiktoken caches what it loads under the sha1 of its path and reads that copy back unchecked, so a file
    # changed at the same path would be read stale: the cache is turned off (an empty TIKTOKEN_CACHE_DIR).
    try:
        with _environment(TIKTOKEN_CACHE_DIR=""):
            ranks = load_tiktoken_bpe(str(path))
    except ValueError as e:
        raise TokenizerError(
            f"--tokenizer {path}: is not a tiktoken BPE file ({first_line(e)}); pass lines of a base64 token and its rank"
        ) from None
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        # tiktoken's merging starts from single bytes: a text holding a missing one cannot be encoded at all.
        raise TokenizerError(
            f"--tokenizer {path}: lacks {len(missing)} of the 256 single bytes (the first: {missing[0]:#04x}), so not every text encodes; pass a tiktoken BPE file whose ranks hold every byte"
        )
    return ranks


@contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def public_encodings() -> dict[str, PublicEncoding]:
    """tiktoken's public encodings, by name, without their ranks."""
    import tiktoken_ext.openai_public as openai_public

    found: dict[str, PublicEncoding] = {}
    for name, constructor in openai_public.ENCODING_CONSTRUCTORS.items():
        spec, ranks_sha256 = _without_ranks(openai_public, constructor)
        found[name] = PublicEncoding(name, spec["pat_str"], spec["special_tokens"], ranks_sha256)
    return found


def _without_ranks(openai_public, constructor) -> tuple[dict, str | None]:
    """(what `constructor` returns, the sha256 of the rank file it loads), its rank loaders replaced by stand-ins
    that load nothing."""
    hashes: list[str] = []

    def note_rank_file(*args, expected_hash=None, **kwargs) -> dict:
        hashes.append(expected_hash)
        return {}

    stand_ins = {"load_tiktoken_bpe": note_rank_file, "data_gym_to_mergeable_bpe_ranks": lambda *args, **kwargs: {}}
    originals = {loader: getattr(openai_public, loader) for loader in stand_ins}
    try:
        for loader, stand_in in stand_ins.items():
            setattr(openai_public, loader, stand_in)
        spec = constructor()
    finally:
        for loader, original in originals.items():
            setattr(openai_public, loader, original)
    return spec, hashes[0] if hashes else None
