"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read in place: no conversion, no copy.

The .idx (the "MMIDIDX" format of megatron/core/datasets/indexed_dataset.py) is, little-endian:
the magic b"MMIDIDX\\x00\\x00", a u64 version (1), a u8 dtype code, a u64 sequence count, a u64 document
count, then int32 sequence lengths (in tokens), int64 sequence pointers (byte offsets into the .bin) and
int64 document indices (sequence index boundaries, 0 first and the sequence count last). Multimodal
datasets append an int8 mode per sequence, which Keel does not need.

Sequences are written back to back, so the .bin itself is the flat token array Keel samples from. Checking
that they are reads the whole index, so a start that knows the pair unchanged (keel.trainer.data.scan_cache)
reads its header alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.trainer.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# Megatron's DType enum: code -> numpy dtype. The floating-point codes exist there but hold no token ids.
DTYPE_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequences: int
    documents: int  # entries of the document index: one more than the documents


@dataclass(frozen=True)
class MegatronIndex:
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32, tokens per sequence
    sequence_pointers: np.ndarray  # int64, byte offset of each sequence in the .bin
    document_indices: np.ndarray  # int64, document d is sequences [document_indices[d], document_indices[d + 1])

    def document(self, tokens: np.ndarray, d: int) -> np.ndarray:
        """The tokens of document `d`, a view of `tokens` (the .bin as a flat array)."""
        first, end = self.document_indices[d], self.document_indices[d + 1]
        if first == end:
            return tokens[:0]
        start = self.sequence_pointers[first] // self.dtype.itemsize
        stop = self.sequence_pointers[end - 1] // self.dtype.itemsize + self.sequence_lengths[end - 1]
        return tokens[start:stop]


def megatron_paths(source: str) -> tuple[Path, Path] | None:
    """(PREFIX.bin, PREFIX.idx) when `source` names a Megatron dataset by its prefix, its .bin or its .idx and
    PREFIX.idx exists (PREFIX.bin may not: the reader says so), else None."""
    prefix = source.removesuffix(".bin") if source.endswith(".bin") else source.removesuffix(".idx")
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    return (bin_path, idx_path) if idx_path.is_file() else None


def read_header(source: str, idx_path: Path) -> IndexHeader:
    """Reads and checks the header of `idx_path` alone."""
    with open(idx_path, "rb") as f:
        head = f.read(HEADER.size)
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise ConfigError(f"data.source={source}: {idx_path} is not a Megatron MMIDIDX index (its first bytes are not {MAGIC!r})")
    if len(head) < HEADER.size:
        raise ConfigError(
            f"data.source={source}: {idx_path} is {len(head)} bytes, shorter than the {HEADER.size}-byte MMIDIDX header: it is truncated; copy or make it again"
        )
    _, version, code, n_seq, n_doc = HEADER.unpack(head)
    if version != 1 or code not in DTYPE_CODES:
        raise ConfigError(
            f"data.source={source}: {idx_path} has version {version} and dtype code {code}; Keel reads version 1 with integer codes {sorted(DTYPE_CODES)}"
        )
    return IndexHeader(np.dtype(DTYPE_CODES[code]), n_seq, n_doc)


def read_index(source: str, idx_path: Path, bin_size: int) -> MegatronIndex:
    """Reads and checks `idx_path`: a ConfigError names what is wrong, so a damaged index never trains."""
    header = read_header(source, idx_path)
    n_seq, n_doc = header.sequences, header.documents
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    arrays_end = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) < arrays_end:
        raise ConfigError(
            f"data.source={source}: {idx_path} is {len(raw):,} bytes, too short for its {n_seq:,} sequences and {n_doc:,} documents"
        )
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=HEADER.size)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=HEADER.size + 4 * n_seq)
    documents = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=HEADER.size + 12 * n_seq)
    index = MegatronIndex(header.dtype, lengths, pointers, documents)
    _check_contiguous(source, index, bin_size)
    return index


def _check_contiguous(source: str, index: MegatronIndex, bin_size: int) -> None:
    # Keel samples windows from the .bin as one array, which is right only if the sequences tile it.
    itemsize = index.dtype.itemsize
    ends = np.cumsum(index.sequence_lengths, dtype=np.int64) * itemsize
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    total = int(ends[-1]) if len(ends) else 0
    if not np.array_equal(starts, index.sequence_pointers) or total != bin_size:
        raise ConfigError(
            f"data.source={source}: the index's {len(ends):,} sequences cover {total:,} bytes, the .bin has {bin_size:,} (or they are not back to back); the .bin and .idx are not a pair"
        )
    docs = index.document_indices
    if len(docs) and (docs[0] != 0 or docs[-1] != len(ends) or np.any(np.diff(docs) < 0)):
        raise ConfigError(
            f"data.source={source}: the index's document boundaries do not run from 0 to its {len(ends):,} sequences in order; the .idx is damaged"
        )
