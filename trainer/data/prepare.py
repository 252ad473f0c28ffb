"""`keel prepare-data OUT.bin INPUTS...`: turns text files into a token file that data.source can name.

Each input file is one document. Without a tokenizer the tokens are the files' bytes, concatenated
(vocabulary 256). With `--tokenizer tokenizer.json`, or `--train-tokenizer N` (a byte-level BPE tokenizer
of N tokens trained on the inputs first and saved as OUT.bin.tokenizer.json), the text is encoded by the Hugging
Face tokenizers library and documents are separated by the end-of-document id. The output is uint16 when
the vocabulary fits, uint32 otherwise, with its sidecar OUT.bin.json (keel.trainer.data.token_files). Inputs are
streamed and the output written as it is made, so a corpus larger than memory is fine. Progress (bytes
and tokens per second) goes to stderr.

Nothing is lost or made up: an existing OUT.bin is replaced only with --force, and only when it is a token
file this command wrote; inputs that are not plain text (compressed, binary, JSON Lines) are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.hashing import sha256_file
from keel.trainer.config import ConfigError
from keel.trainer.data.token_files import (
    Sidecar,
    TokenFileWriter,
    check_sidecar,
    foreign_format,
    read_head,
    read_sidecar,
    sidecar_path,
    write_token_file,
)

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PROGRESS_EVERY_S = 0.5  # on a terminal; elsewhere (a log file) a line every PROGRESS_LOG_EVERY_S
PROGRESS_LOG_EVERY_S = 30.0
JSON_LINE_LIMIT = 16 * 1024 * 1024  # bytes of a first line read to tell JSON Lines from text


class UsageError(ValueError):
    """Bad arguments or inputs: one line on stderr, exit code EXIT_CONFIG."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (keel prepare-data --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="keel prepare-data", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, metavar="OUT.bin", help="the token file to write (its sidecar is OUT.bin.json)")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, or directories (all files below, sorted); one document per file")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--tokenizer", type=Path, metavar="TOKENIZER.json", help="a local Hugging Face tokenizer file to encode with")
    how.add_argument("--train-tokenizer", type=int, metavar="N", help="train a byte-level BPE tokenizer of N tokens on the inputs first")
    p.add_argument("--eod", metavar="TOKEN", help="the end-of-document token (default: the tokenizer's <|endoftext|>, </s>, ...)")
    p.add_argument("--force", action="store_true", help="replace OUT.bin when it is a token file this command wrote")
    return p


def main(argv: list[str]) -> int:
    try:
        opts = build_parser().parse_args(argv)
        check_outputs(opts.out, _trained_tokenizer_path(opts), opts.force)
        files = input_files(opts.out, opts.inputs)
        sidecar = prepare(opts, files)
    except (UsageError, OSError) as e:
        print(f"keel prepare-data: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {sidecar.tokens:,} tokens ({sidecar.dtype}, vocabulary {sidecar.vocab_size:,}) from {len(files)} files to {opts.out}")
    return EXIT_OK


def input_files(out: Path, inputs: list[str]) -> list[Path]:
    """The files to read, in order; directories give all their files below, sorted. Refuses inputs with no bytes."""
    files: list[Path] = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and not _is_output(f, out))
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"{name}: no such file or directory")
    for f in files:
        check_text(f)
    if not any(f.stat().st_size for f in files):
        raise UsageError(f"the inputs {inputs} hold no text; pass non-empty text files")
    return files


def check_text(path: Path) -> None:
    """Refuses an input that is not plain text: its bytes would become tokens that are not its text."""
    head = read_head(path)
    foreign = foreign_format(head)
    if foreign is not None:
        what, fix = foreign
        raise UsageError(f"{path}: is {what}, not text; {fix}")
    if b"\x00" in head:
        raise UsageError(f"{path}: is binary (a zero byte at offset {head.index(0)}), not UTF-8 text; pass text files")
    if _is_json_lines(path, head):
        raise UsageError(
            f"{path}: holds JSON records (JSON Lines), not plain text: their keys and quoting would be trained on; write each record's text to a file of its own (a file is a document) and pass those"
        )


def _is_json_lines(path: Path, head: bytes) -> bool:
    if not head.lstrip().startswith(b"{"):
        return False
    with open(path, "rb") as f:
        first_line = f.readline(JSON_LINE_LIMIT)
    try:
        return isinstance(json.loads(first_line), dict)
    except ValueError:
        return False


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


def prepare(opts: argparse.Namespace, files: list[Path]) -> Sidecar:
    """Writes the token file and returns its sidecar."""
    if opts.tokenizer is None and opts.train_tokenizer is None:
        return _prepare_bytes(opts.out, files)
    # Imported here: the tokenizers library is needed by this path only.
    from keel.trainer.data import text_tokenizers as tt

    try:
        tokenizer, tokenizer_path = _tokenizer(opts, files)
        eod = tt.eod_id(tokenizer, str(tokenizer_path), opts.eod)
    except tt.TokenizerError as e:
        raise UsageError(str(e)) from None
    identity = {"kind": "huggingface", "file": tokenizer_path.name, "sha256": sha256_file(tokenizer_path)}
    encoder = tt.DocumentEncoder(tokenizer)
    if not encoder.chunked:
        print(f"tokenizer {tokenizer_path}: chunks do not decode as whole documents; each file is encoded whole", file=sys.stderr)
    chunks = tt.read_chunks(files) if encoder.chunked else tt.read_documents(files)
    progress = Progress(sum(f.stat().st_size for f in files))
    with TokenFileWriter(opts.out, tokenizer.get_vocab_size(), identity, eod) as writer:

        def on_ids(ids: np.ndarray, chunk: tt.Chunk) -> None:
            writer.write(ids)
            if chunk.last_of_document:
                writer.end_document()
            progress.update(chunk.nbytes, writer.tokens)

        try:
            tt.encode_stream(encoder, chunks, on_ids)
        finally:
            progress.end()
        return writer.finish()


def _trained_tokenizer_path(opts: argparse.Namespace) -> Path | None:
    """OUT.bin.tokenizer.json with --train-tokenizer, where the trained tokenizer is saved."""
    return Path(f"{opts.out}.tokenizer.json") if opts.train_tokenizer is not None else None


def _tokenizer(opts: argparse.Namespace, files: list[Path]):
    """(the tokenizer, its file): the one named by --tokenizer, or one trained on `files` for --train-tokenizer."""
    from keel.trainer.data import text_tokenizers as tt

    if opts.train_tokenizer is None:
        return tt.load_tokenizer(opts.tokenizer), opts.tokenizer
    path = _trained_tokenizer_path(opts)
    tokenizer = tt.train_bpe(files, opts.train_tokenizer, path)
    print(f"trained a BPE tokenizer of {tokenizer.get_vocab_size():,} tokens: {path}")
    return tokenizer, path


def _prepare_bytes(out: Path, files: list[Path]) -> Sidecar:
    progress = Progress(sum(f.stat().st_size for f in files))
    try:
        return write_token_file(out, files, on_chunk=progress.update)
    finally:
        progress.end()


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

    def update(self, nbytes: int, tokens: int) -> None:
        self.bytes += nbytes
        self.tokens = tokens
        now = time.perf_counter()
        if now - self.shown >= self.every_s:
            self.shown = now
            self._show(end="\r" if self.interactive else "\n")

    def end(self) -> None:
        self._show(end="\n")

    def _show(self, end: str) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        mib, total = self.bytes / 2**20, self.total_bytes / 2**20
        line = f"{mib:,.1f}/{total:,.1f} MiB | {mib / elapsed:,.2f} MiB/s | {self.tokens:,} tokens | {self.tokens / elapsed:,.0f} tok/s"
        print(line, end=end, file=self.stream, flush=True)
