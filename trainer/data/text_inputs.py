"""The inputs of `keel prepare-data`, as corpora come, read as a stream of documents' text in chunks.

| input | how it is known | a document | its text |
|---|---|---|---|
| plain text | anything below that is UTF-8 | the file | the file |
| JSON Lines | `.jsonl`, `.json`, `.ndjson`, or a first line that is a JSON object | a line | the field --text-field |
| Parquet | `.parquet`, or the magic PAR1 | a row | the column --text-field |
| a saved Hugging Face dataset | a directory of `Dataset.save_to_disk` (state.json, dataset_info.json); a DatasetDict's (dataset_dict.json) gives its split --split, else "train" | a row | the column --text-field |
| gzip, zstd, bzip2, xz | their magic bytes (token_files.FOREIGN_MAGICS), never only the suffix; a zstd file's frames are walked first (`check_zstd_frames`) | as for what they hold: `x.jsonl.gz` is JSON Lines | |

Memory is flat: files and compressed streams are read in blocks, Parquet in record batches
(`ParquetFile.iter_batches`), datasets in batches of their memory-mapped Arrow files; a document's text is
cut into chunks of about CHUNK_BYTES at line ends, or kept whole where a tokenizer needs it so (then memory
grows with the longest document).

What cannot be read as text is refused in one line (`PrepareError`) naming the file, and the line or row,
and the fix: another format's magic, a zero byte, bytes that are not UTF-8 (with their offset), a record
without its text, a truncated or damaged compressed stream. Nothing is turned into U+FFFD or read as bytes.

pyarrow, zstandard and datasets (the `data` extra) are imported only when an input needs them.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import importlib
import json
import lzma
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from keel.trainer.data.token_files import foreign_format

CHUNK_BYTES = 32 * 1024  # a chunk's text: small enough that a batch gives every core of a large machine a chunk
HEAD_BYTES = 64 * 1024  # of a file's (decompressed) text looked at to tell its format
JSON_LINE_LIMIT = 16 * 1024 * 1024  # bytes of a first line read to tell JSON Lines from text
RECORD_ROWS = 1024  # Parquet and dataset rows read at a time
PARQUET_BUFFER_BYTES = 1024 * 1024
ZSTD_MAX_FRAME_HEADER = 18  # bytes: magic 4, descriptor 1, window 1, dictionary id 4, content size 8
ZSTD_SKIPPABLE_MAGIC = 0x184D2A50  # the 16 magics 0x184D2A50..5F, in their low 4 bits
ZSTD_RLE_BLOCK = 1
JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_MAGIC = b"PAR1"
# The compressed streams read as what they hold, by what token_files.FOREIGN_MAGICS calls them: their suffixes.
STREAMS = {"gzip-compressed": (".gz",), "zstd-compressed": (".zst", ".zstd"), "bzip2-compressed": (".bz2",), "xz-compressed": (".xz",)}
TEXT_COLUMN_TYPES = ("string", "large_string")  # Arrow's, as pyarrow and datasets name them


class PrepareError(ValueError):
    """An input, a tokenizer or an option `keel prepare-data` cannot use: one line that says why and the fix."""


@dataclass(frozen=True)
class Chunk:
    text: str
    nbytes: int  # the bytes of the input, as on disk, read for this chunk: for the progress line
    first_of_document: bool
    last_of_document: bool


@dataclass(frozen=True)
class TextInput:
    path: Path  # a file, or a saved dataset's directory
    format: str  # "text", "jsonl", "parquet" or "dataset"
    compression: str | None  # a key of STREAMS when the file is decompressed as it is read
    nbytes: int  # on disk
    note: str = ""  # what the user should know of how it is read (a DatasetDict's split picked for them)


def optional_import(module: str, needed_for: str):
    """`module`, or a one-line PrepareError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise PrepareError(f"{needed_for} need the {package} library, which is not installed; pip install 'keel[data]'") from None


# Finding the inputs and their formats.


def find_inputs(names: list[str], split: str | None, excluded: Callable[[Path], bool]) -> list[TextInput]:
    """The inputs `names` stand for, in order, each with its format: a directory gives the files and saved
    datasets below it, sorted; a file its format is checked, so that what is not text is refused before
    anything is written. `excluded` files (the output's own) are left out of directories."""
    paths: list[Path] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            paths += [path] if _is_saved_dataset(path) else _below(path, excluded)
        elif path.is_file():
            paths.append(path)
        else:
            raise PrepareError(f"{name}: no such file or directory")
    return [_dataset_input(p, split) if p.is_dir() else _file_input(p) for p in paths]


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _below(folder: Path, excluded: Callable[[Path], bool]) -> list[Path]:
    """The files below `folder`, and its saved datasets (a directory each, not descended into), sorted."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        datasets = [name for name in dirnames if _is_saved_dataset(here / name)]
        dirnames[:] = [name for name in dirnames if name not in datasets]
        found += [here / name for name in datasets]
        found += [here / name for name in filenames if (here / name).is_file() and not excluded(here / name)]
    return sorted(found)


def _dataset_input(folder: Path, split: str | None) -> TextInput:
    if not (folder / "dataset_dict.json").is_file():
        return TextInput(folder, "dataset", None, _size(folder))
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
    except (ValueError, KeyError, TypeError) as e:
        raise PrepareError(
            f"{folder}: its dataset_dict.json names no splits ({e!r}); save the DatasetDict again with save_to_disk"
        ) from None
    note = ""
    if split is None:
        if "train" not in splits:
            raise PrepareError(f"{folder}: is a DatasetDict of the splits {splits}; name the one to read with --split NAME")
        split, note = "train", f"{folder}: a DatasetDict of the splits {splits}: reading 'train' (another with --split NAME)"
    elif split not in splits:
        raise PrepareError(f"--split {split}: {folder} is a DatasetDict of the splits {splits}; name one of them")
    return TextInput(folder / split, "dataset", None, _size(folder / split), note)


def _size(dataset: Path) -> int:
    return sum(f.stat().st_size for f in dataset.iterdir() if f.is_file())


def _file_input(path: Path) -> TextInput:
    compression = _compression(path)
    if compression == "zstd-compressed":
        try:
            check_zstd_frames(path)
        except (EOFError, OSError) as e:
            raise PrepareError(f"{path}: is not a whole zstd-compressed stream ({e}); it is damaged or truncated: make it again") from None
    name = path.name
    if compression is not None:
        name = name[: -len(path.suffix)] if path.suffix.lower() in STREAMS[compression] else name
    head = _head(path, compression)
    return TextInput(path, _format(path, name, head, compression), compression, path.stat().st_size)


def _compression(path: Path) -> str | None:
    """The compressed stream the file is, by its magic bytes; a compression's suffix without its magic is refused."""
    with open(path, "rb") as f:
        magic = f.read(16)
    foreign = foreign_format(magic)
    if foreign is not None and foreign[0] in STREAMS:
        return foreign[0]
    claimed = next((what for what, suffixes in STREAMS.items() if path.suffix.lower() in suffixes), None)
    if claimed is not None and magic:
        raise PrepareError(
            f"{path}: is named {path.suffix} but is not {claimed} (it lacks the magic bytes); rename it or compress it again"
        )
    return None


def _head(path: Path, compression: str | None) -> bytes:
    """The first HEAD_BYTES of the file's (decompressed) bytes, and the rest of its first line (up to
    JSON_LINE_LIMIT), which tells JSON Lines from text."""
    parts, size = [], 0
    for block, _ in _blocks(path, compression, HEAD_BYTES):
        parts.append(block)
        size += len(block)
        if size >= JSON_LINE_LIMIT or (size >= HEAD_BYTES and b"\n" in block):
            break
    return b"".join(parts)


def _format(path: Path, name: str, head: bytes, compression: str | None) -> str:
    if name.lower().endswith(".parquet") or head.startswith(PARQUET_MAGIC):
        if compression is not None:
            raise PrepareError(f"{path}: is a {compression} Parquet file; decompress it first (Parquet compresses its own pages)")
        return "parquet"
    foreign = foreign_format(head)
    if foreign is not None:
        what, fix = foreign
        raise PrepareError(f"{path}: is {what}, not text; {fix}")
    if b"\x00" in head:
        raise PrepareError(f"{path}: is binary (a zero byte at offset {head.index(0)}), not UTF-8 text; pass text files")
    if name.lower().endswith(JSON_LINES_SUFFIXES) or _is_json_object(head.split(b"\n", 1)[0]):
        return "jsonl"
    return "text"


def _is_json_object(line: bytes) -> bool:
    if not line.lstrip().startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


# Reading them.


def read_chunks(inputs: list[TextInput], text_field: str, chunk_bytes: int | None = CHUNK_BYTES) -> Iterator[Chunk]:
    """The documents of `inputs`, in order, in chunks of about `chunk_bytes` cut after a line end (a line
    longer than that is cut where the chunk is full); with None, each document whole in one chunk."""
    for item in inputs:
        if item.format == "text":
            yield from _text_chunks(item, chunk_bytes)
            continue
        records = {"jsonl": _json_lines, "parquet": _parquet_rows, "dataset": _dataset_rows}[item.format](item, text_field)
        for text, nbytes in records:
            pieces = [text] if chunk_bytes is None else _cut(text, chunk_bytes)
            for i, piece in enumerate(pieces):
                yield Chunk(piece, nbytes if i == 0 else 0, i == 0, i == len(pieces) - 1)


def _cut(text: str, size: int) -> list[str]:
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size) + 1 or start + size
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]]


def _text_chunks(item: TextInput, chunk_bytes: int | None) -> Iterator[Chunk]:
    """A plain-text file (maybe decompressed): one document, strictly UTF-8, without zero bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")()  # a character may straddle two blocks
    carry, first, offset, whole, nbytes = "", True, 0, [], 0
    for block, disk in _blocks(item.path, item.compression, chunk_bytes or HEAD_BYTES):
        text = _decoded(item, decoder, block, offset)
        offset += len(block)
        if chunk_bytes is None:
            whole.append(text)
            nbytes += disk
            continue
        text = carry + text
        # Cut after the last line end, so that a word is never split between two encode calls.
        cut = text.rfind("\n") + 1 or len(text)
        yield Chunk(text[:cut], disk, first, last_of_document=False)
        carry, first = text[cut:], False
    rest = _decoded(item, decoder, b"", offset, final=True)
    if chunk_bytes is None:
        yield Chunk("".join(whole) + rest, nbytes, first_of_document=True, last_of_document=True)
    else:
        yield Chunk(carry + rest, 0, first, last_of_document=True)


def _decoded(item: TextInput, decoder, block: bytes, offset: int, final: bool = False) -> str:
    """`block`, read at byte `offset` of the text, decoded; bytes that are not UTF-8 or a zero byte are refused."""
    start = offset - len(decoder.getstate()[0])  # the offset of the bytes the decoder still holds
    where = " of its decompressed text" if item.compression else ""
    try:
        text = decoder.decode(block, final)
    except UnicodeDecodeError as e:
        raise PrepareError(
            f"{item.path}: is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {start + e.start:,}{where}); convert it to UTF-8 (iconv -f ENCODING -t UTF-8) or leave it out"
        ) from None
    zero = text.find("\x00")
    if zero >= 0:
        at = start + len(text[:zero].encode())
        raise PrepareError(f"{item.path}: is binary (a zero byte at offset {at:,}{where}), not UTF-8 text; pass text files")
    return text


def _blocks(path: Path, compression: str | None, size: int) -> Iterator[tuple[bytes, int]]:
    """The file's bytes, decompressed, in blocks of at most about `size`, each with the bytes read from disk for it."""
    with open(path, "rb") as raw:
        if compression is None:
            while block := raw.read(size):
                yield block, len(block)
            return
        read = 0
        try:
            for block in _decompressed(raw, compression, size):
                disk, read = raw.tell() - read, raw.tell()
                yield block, disk
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
            raise PrepareError(f"{path}: is not a whole {compression} stream ({e}); it is damaged or truncated: make it again") from None


def _decompressed(raw, compression: str, size: int) -> Iterator[bytes]:
    if compression == "zstd-compressed":
        yield from _zstd_blocks(raw, size)
        return
    if compression == "gzip-compressed":
        stream = gzip.GzipFile(fileobj=raw)
    else:
        stream = bz2.BZ2File(raw) if compression == "bzip2-compressed" else lzma.LZMAFile(raw)
    with stream:
        while block := stream.read(size):
            yield block


def _zstd_blocks(raw, size: int) -> Iterator[bytes]:
    """A zstd file whose frames `check_zstd_frames` found whole, decompressed in blocks of at most `size`."""
    zstandard = optional_import("zstandard", "zstd-compressed inputs")
    # Every frame, however many: a file of several frames (pzstd, or files joined with cat) is one stream.
    with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False) as stream:
        try:
            while block := stream.read(size):
                yield block
        except zstandard.ZstdError as e:  # a damaged block: said as the other formats' errors are
            raise OSError(str(e)) from None


def check_zstd_frames(path: Path) -> None:
    """Walks the frames of a zstd file by their headers and block headers, reading nothing else, and raises
    EOFError where the file ends inside one. zstandard's stream_reader ends a truncated stream silently,
    and its decompressobj, which knows, returns all the output of what it is given at once: 16 KiB of
    very repetitive text decompress to hundreds of MiB. Frame layout: RFC 8878, section 3.1."""
    zstandard = optional_import("zstandard", "zstd-compressed inputs")
    size = path.stat().st_size
    with open(path, "rb") as f:
        at = 0
        while at < size:
            header = os.pread(f.fileno(), ZSTD_MAX_FRAME_HEADER, at)
            if int.from_bytes(header[:4], "little") & 0xFFFFFFF0 == ZSTD_SKIPPABLE_MAGIC:
                at += 8 + int.from_bytes(header[4:8], "little")  # a skippable frame: its length follows its magic
                continue
            try:
                checksum = 4 if zstandard.get_frame_parameters(header).has_checksum else 0
                at += zstandard.frame_header_size(header)
            except zstandard.ZstdError as e:
                raise OSError(f"no zstd frame at byte {at:,}: {e}") from None
            last = False
            while not last:
                if at + 3 > size:
                    raise EOFError("the stream ends inside a zstd frame")
                block = int.from_bytes(os.pread(f.fileno(), 3, at), "little")
                last, kind = block & 1, (block >> 1) & 3
                at += 3 + (1 if kind == ZSTD_RLE_BLOCK else block >> 3)  # an RLE block stores its one byte
            at += checksum
        if at > size:
            raise EOFError("the stream ends inside a zstd frame")


# Records: (their text, the bytes on disk read for them).


def _json_lines(item: TextInput, field: str) -> Iterator[tuple[str, int]]:
    for number, line, nbytes in _lines(item):
        if not line.strip():
            continue
        where = f"{item.path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise PrepareError(f"{where}: is not a JSON record ({e}); a JSON Lines input holds one JSON object per line") from None
        if not isinstance(record, dict):
            raise PrepareError(
                f"{where}: is a JSON {type(record).__name__}, not an object; a JSON Lines input holds one JSON object per line"
            )
        if field not in record:
            fields = ", ".join(list(record)[:10])
            raise PrepareError(
                f"{where}: the record has no field {field!r} (its fields: {fields}); name the field that holds the text with --text-field NAME"
            )
        yield _text(record[field], where, f"field {field!r}"), nbytes


def _lines(item: TextInput) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, bytes on disk read since the last line) of a (decompressed) file."""
    parts: list[bytes] = []
    number, nbytes = 0, 0
    for block, disk in _blocks(item.path, item.compression, HEAD_BYTES):
        nbytes += disk
        *complete, rest = block.split(b"\n")
        if complete:
            complete[0] = b"".join([*parts, complete[0]])  # joined once: a long line costs no quadratic copying
            parts = []
        for line in complete:
            number += 1
            yield number, line, nbytes
            nbytes = 0
        parts.append(rest)
    yield number + 1, b"".join(parts), nbytes


def _text(value: object, where: str, what: str) -> str:
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise PrepareError(f"{where}: {what} is {kind}, not a string; name the field that holds the text with --text-field NAME")
    return value


def _check_column(path: Path, field: str, types: dict[str, str]) -> None:
    """`types`: each column's Arrow type, as its library names it."""
    if field not in types:
        raise PrepareError(
            f"{path}: has no column {field!r} (its columns: {', '.join(types)}); name the column that holds the text with --text-field NAME"
        )
    if types[field] not in TEXT_COLUMN_TYPES:
        raise PrepareError(
            f"{path}: column {field!r} holds {types[field]}, not strings; name the column that holds the text with --text-field NAME"
        )


def _rows(item: TextInput, field: str, batches: Iterator[list], rows: int) -> Iterator[tuple[str, int]]:
    """The texts of `batches` of a column; the file's bytes on disk spread over its `rows` for the progress line."""
    row = 0
    for batch in batches:
        for value in batch:
            nbytes = item.nbytes * (row + 1) // rows - item.nbytes * row // rows
            yield _text(value, f"{item.path}: row {row}", f"column {field!r}"), nbytes
            row += 1


def _parquet_rows(item: TextInput, field: str) -> Iterator[tuple[str, int]]:
    pq = optional_import("pyarrow.parquet", "Parquet inputs")
    try:
        # Buffered reads of each column chunk, not the chunk whole: memory is the buffer and a batch, whatever
        # the file's row groups (a row group of 200 MB of text: 12 MiB of Arrow memory, 27 MiB unbuffered).
        parquet = pq.ParquetFile(item.path, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
    except Exception as e:  # pyarrow raises ArrowInvalid, ArrowIOError, OSError for a damaged file
        raise PrepareError(
            f"{item.path}: pyarrow cannot read it as Parquet ({e}); pass a Parquet file, or rename it if it is not one"
        ) from None
    schema = parquet.schema_arrow
    _check_column(item.path, field, {name: str(schema.field(name).type) for name in schema.names})
    batches = (batch.column(0).to_pylist() for batch in parquet.iter_batches(batch_size=RECORD_ROWS, columns=[field]))
    yield from _rows(item, field, batches, max(parquet.metadata.num_rows, 1))


def _dataset_rows(item: TextInput, field: str) -> Iterator[tuple[str, int]]:
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read where datasets reads its settings: nothing is downloaded
    datasets = optional_import("datasets", "saved Hugging Face datasets")
    try:
        dataset = datasets.load_from_disk(str(item.path))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, Arrow errors for a damaged folder
        raise PrepareError(f"{item.path}: datasets cannot load it ({e}); pass a folder written by Dataset.save_to_disk") from None
    types = {name: getattr(feature, "dtype", type(feature).__name__) for name, feature in dataset.features.items()}
    _check_column(item.path, field, types)
    batches = (batch[field] for batch in dataset.select_columns([field]).iter(batch_size=RECORD_ROWS))
    yield from _rows(item, field, batches, max(len(dataset), 1))
