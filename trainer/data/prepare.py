"""`keel prepare-data OUT.bin INPUTS...`: turns a corpus, as it comes, into a token file that data.source can name.

Inputs are plain text files (a file is a document), JSON Lines (a line is a document, its text in
--text-field), Parquet files and saved Hugging Face datasets (a row is a document, its text in the column
--text-field), any of the files gzip-, zstd-, bzip2- or xz-compressed, and directories of them. Without a
tokenizer the tokens are the documents' UTF-8 bytes, concatenated (vocabulary 256). With `--tokenizer FILE`
(a Hugging Face tokenizer.json, a SentencePiece .model or a tiktoken .tiktoken file), or `--train-tokenizer
N` (a byte-level BPE tokenizer of N tokens trained on the inputs first and saved as OUT.bin.tokenizer.json),
documents are encoded and separated by the end-of-document id. The output is uint16 when the vocabulary fits,
uint32 otherwise, with its sidecar OUT.bin.json (keel.trainer.data.token_files). Inputs are streamed and the
output written as it is made, so a corpus larger than memory is fine. Progress (bytes and tokens per
second) goes to stderr.

Nothing is lost or made up: an existing OUT.bin is replaced only with --force, and only when it is a token
file this command wrote; an input that is not text (binary, not UTF-8, a record without its text, a damaged
compressed stream) is refused in one line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.trainer.config import ConfigError
from keel.trainer.data.text_inputs import CHUNK_BYTES, PrepareError, TextInput, find_inputs, read_chunks
from keel.trainer.data.token_files import Sidecar, TokenFileWriter, check_sidecar, read_sidecar, sidecar_path

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PROGRESS_EVERY_S = 0.5  # on a terminal; elsewhere (a log file) a line every PROGRESS_LOG_EVERY_S
PROGRESS_LOG_EVERY_S = 30.0


class UsageError(PrepareError):
    """Bad arguments or inputs: one line on stderr, exit code EXIT_CONFIG."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (keel prepare-data --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="keel prepare-data", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, metavar="OUT.bin", help="the token file to write (its sidecar is OUT.bin.json)")
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text, JSON Lines or Parquet files (maybe .gz, .zst, .bz2, .xz), saved Hugging Face datasets, or directories of them (all below, sorted)",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--tokenizer",
        type=Path,
        metavar="FILE",
        help="a local tokenizer to encode with: a Hugging Face tokenizer.json, a SentencePiece .model or a tiktoken .tiktoken",
    )
    how.add_argument("--train-tokenizer", type=int, metavar="N", help="train a byte-level BPE tokenizer of N tokens on the inputs first")
    p.add_argument("--eod", metavar="TOKEN", help="the end-of-document token (default: the tokenizer's <|endoftext|>, </s>, its eos, ...)")
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field (JSON Lines) or column (Parquet, datasets) holding a document's text (default: text)",
    )
    p.add_argument("--split", metavar="NAME", help="the split of a saved DatasetDict to read (default: train)")
    p.add_argument(
        "--tiktoken-pattern",
        metavar="ENCODING",
        help="a .tiktoken file's split pattern: that of tiktoken's public encoding ENCODING (default: cl100k_base)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT.bin when it is a token file this command wrote")
    return p


def main(argv: list[str]) -> int:
    try:
        opts = build_parser().parse_args(argv)
        check_outputs(opts.out, _trained_tokenizer_path(opts), opts.force)
        inputs = input_files(opts)
        sidecar = prepare(opts, inputs)
    except (PrepareError, OSError) as e:
        print(f"keel prepare-data: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(
        f"wrote {sidecar.tokens:,} tokens ({sidecar.dtype}, vocabulary {sidecar.vocab_size:,}) of {sidecar.documents:,} documents from {len(inputs)} inputs to {opts.out}"
    )
    return EXIT_OK


def input_files(opts: argparse.Namespace) -> list[TextInput]:
    """The inputs to read, in order, each with its format (keel.trainer.data.text_inputs). Refuses inputs with no bytes."""
    inputs = find_inputs(opts.inputs, opts.split, excluded=lambda path: _is_output(path, opts.out))
    if not any(item.nbytes for item in inputs):
        raise UsageError(f"the inputs {opts.inputs} hold no text; pass non-empty text files")
    for item in inputs:
        if item.note:
            print(item.note, file=sys.stderr)
    return inputs


def check_outputs(out: Path, trained_tokenizer: Path | None, force: bool) -> None:
    """Refuses to write over anything that is there: a token file this command wrote is replaced with --force,
    anything else never."""
    if out.is_dir():
        raise UsageError(f"{out}: is a directory; name the token file to write, e.g. {out / 'train.bin'}")
    if not out.parent.is_dir():
        raise UsageError(f"{out}: its folder {out.parent} does not exist; create it first")
    targets = [out, sidecar_path(out)] + ([trained_tokenizer] if trained_tokenizer else [])
    existing = [p for p in targets if p.exists()]
    if existing and not _written_here(out, trained_tokenizer):
        raise UsageError(
            f"{existing[0]} exists and is not part of a token file that keel prepare-data wrote, so it is never replaced; name another output (it comes first: keel prepare-data OUT.bin INPUT...)"
        )
    if existing and not force:
        raise UsageError(f"{existing[0]} exists (a token file of keel prepare-data); pass --force to replace it")


def _written_here(out: Path, trained_tokenizer: Path | None) -> bool:
    """Whether what there is of OUT.bin, its sidecar and its trained tokenizer is a token file this command
    wrote: a Keel sidecar that describes OUT.bin (when there is one) and names that tokenizer file."""
    try:
        sidecar = read_sidecar(str(out), out)
        if out.exists():
            check_sidecar(str(out), sidecar, out.stat().st_size, scan=None)
    except ConfigError:
        return False
    return trained_tokenizer is None or not trained_tokenizer.exists() or sidecar.tokenizer.get("file") == trained_tokenizer.name


def _is_output(path: Path, out: Path) -> bool:
    # The output, its sidecar, its trained tokenizer and their temporary files may sit in an input directory.
    return path.resolve().name.startswith(out.name) and path.resolve().parent == out.resolve().parent


def prepare(opts: argparse.Namespace, inputs: list[TextInput]) -> Sidecar:
    """Writes the token file and returns its sidecar: one path for every kind of tokenizer, bytes included."""
    # Imported here: the tokenizers library is needed by this command only.
    from keel.trainer.data import text_tokenizers as tt

    tokenizer = _tokenizer(opts, inputs)
    chunked = tt.chunks_decode_as_whole(tokenizer)
    if not chunked:
        name = tokenizer.identity.get("file")
        print(f"tokenizer {name}: chunks do not decode as whole documents; each file is encoded whole, as each record is", file=sys.stderr)
    chunks = read_chunks(inputs, opts.text_field, CHUNK_BYTES if chunked else None)
    progress = Progress(sum(item.nbytes for item in inputs))
    with TokenFileWriter(opts.out, tokenizer.vocab_size, tokenizer.identity, tokenizer.eod_id) as writer:

        def on_ids(ids: np.ndarray, chunk: tt.Chunk) -> None:
            writer.write(ids)
            if chunk.last_of_document:
                writer.end_document()
            progress.update(chunk.nbytes, writer.tokens)

        try:
            tt.encode_stream(tokenizer, chunks, on_ids)
        except BaseException:
            progress.abandon()  # a refusal mid-stream is the one line of stderr that the user reads
            raise
        progress.end()
        return writer.finish()


def _trained_tokenizer_path(opts: argparse.Namespace) -> Path | None:
    """OUT.bin.tokenizer.json with --train-tokenizer, where the trained tokenizer is saved."""
    return Path(f"{opts.out}.tokenizer.json") if opts.train_tokenizer is not None else None


def _tokenizer(opts: argparse.Namespace, inputs: list[TextInput]):
    """The TextTokenizer: the file named by --tokenizer, one trained on `inputs` for --train-tokenizer, or bytes."""
    from keel.trainer.data import text_tokenizers as tt

    if opts.tokenizer is not None:
        return tt.load_text_tokenizer(opts.tokenizer, opts.eod, opts.tiktoken_pattern)
    if opts.tiktoken_pattern is not None:
        raise UsageError(
            f"--tiktoken-pattern {opts.tiktoken_pattern}: is the split pattern of a tiktoken BPE file; name the file with --tokenizer NAME.tiktoken, or leave it out"
        )
    if opts.train_tokenizer is None:
        if opts.eod is not None:
            raise UsageError(
                f"--eod {opts.eod}: bytes have no end-of-document token; pass --tokenizer or --train-tokenizer, or leave it out"
            )
        return tt.ByteTokenizer()
    path = _trained_tokenizer_path(opts)
    texts = (chunk.text for chunk in read_chunks(inputs, opts.text_field))
    tokenizer = tt.train_bpe(texts, opts.train_tokenizer, path)
    print(f"trained a BPE tokenizer of {tokenizer.get_vocab_size():,} tokens: {path}")
    return tt.HuggingFaceTokenizer(tokenizer, path, opts.eod)


class Progress:
    """One line on stderr: bytes read and tokens written, and their rates."""

    def __init__(self, total_bytes: int, stream=None):
        self.stream = stream or sys.stderr
        self.total_bytes = total_bytes
        self.bytes = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self.shown = self.started
        self.interactive = self.stream.isatty()
        self.every_s = PROGRESS_EVERY_S if self.interactive else PROGRESS_LOG_EVERY_S
        self.line_open = False  # a line rewritten in place (\r) is on the terminal

    def update(self, nbytes: int, tokens: int) -> None:
        self.bytes += nbytes
        self.tokens = tokens
        now = time.perf_counter()
        if now - self.shown >= self.every_s:
            self.shown = now
            self._show(end="\r" if self.interactive else "\n")

    def end(self) -> None:
        self._show(end="\n")

    def abandon(self) -> None:
        """Ends a line rewritten in place, so that what follows starts a line of its own; shows nothing more."""
        if self.line_open:
            print(file=self.stream, flush=True)

    def _show(self, end: str) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        mib, total = self.bytes / 2**20, self.total_bytes / 2**20
        line = f"{mib:,.1f}/{total:,.1f} MiB | {mib / elapsed:,.2f} MiB/s | {self.tokens:,} tokens | {self.tokens / elapsed:,.0f} tok/s"
        print(line, end=end, file=self.stream, flush=True)
        self.line_open = end == "\r"
