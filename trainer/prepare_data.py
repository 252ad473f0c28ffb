"""`keel prepare-data OUT.bin INPUTS...`: turns text files into a token file that data.source can name.

Each input file is one document. Without a tokenizer the tokens are the files' bytes, concatenated
(vocabulary 256). With `--tokenizer tokenizer.json`, or `--train-tokenizer N` (a byte-level BPE tokenizer
of N tokens trained on the inputs first and saved as OUT.bin.tokenizer.json), the text is encoded by the Hugging
Face tokenizers library and documents are separated by the end-of-document id. The output is uint16 when
the vocabulary fits, uint32 otherwise, with its sidecar OUT.bin.json (keel.trainer.token_files). Inputs are
streamed and the output written as it is made, so a corpus larger than memory is fine. Progress (bytes
and tokens per second) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.hashing import sha256_file
from keel.trainer.token_files import Sidecar, TokenFileWriter, write_token_file

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PROGRESS_EVERY_S = 0.5  # on a terminal; elsewhere (a log file) a line every PROGRESS_LOG_EVERY_S
PROGRESS_LOG_EVERY_S = 30.0


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
    return p


def main(argv: list[str]) -> int:
    try:
        opts = build_parser().parse_args(argv)
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
    if not any(f.stat().st_size for f in files):
        raise UsageError(f"the inputs {inputs} hold no text; pass non-empty text files")
    return files


def _is_output(path: Path, out: Path) -> bool:
    # The output, its sidecar, its trained tokenizer and their temporary files may sit in an input directory.
    return path.resolve().name.startswith(out.name) and path.resolve().parent == out.resolve().parent


def prepare(opts: argparse.Namespace, files: list[Path]) -> Sidecar:
    """Writes the token file and returns its sidecar."""
    if opts.tokenizer is None and opts.train_tokenizer is None:
        return _prepare_bytes(opts.out, files)
    # Imported here: the tokenizers library is needed by this path only.
    from keel.trainer import text_tokenizers as tt

    try:
        tokenizer, tokenizer_path = _tokenizer(opts, files)
        eod = tt.eod_id(tokenizer, str(tokenizer_path), opts.eod)
    except tt.TokenizerError as e:
        raise UsageError(str(e)) from None
    identity = {"kind": "huggingface", "file": tokenizer_path.name, "sha256": sha256_file(tokenizer_path)}
    progress = Progress(sum(f.stat().st_size for f in files))
    with TokenFileWriter(opts.out, tokenizer.get_vocab_size(), identity, eod) as writer:

        def on_ids(ids: np.ndarray, chunk: tt.Chunk) -> None:
            writer.write(ids)
            if chunk.last_of_document:
                writer.end_document()
            progress.update(chunk.nbytes, writer.tokens)

        try:
            tt.encode_stream(tokenizer, tt.read_chunks(files), on_ids)
        finally:
            progress.end()
        return writer.finish()


def _tokenizer(opts: argparse.Namespace, files: list[Path]):
    """(the tokenizer, its file): the one named by --tokenizer, or one trained on `files` for --train-tokenizer."""
    from keel.trainer import text_tokenizers as tt

    if opts.train_tokenizer is None:
        return tt.load_tokenizer(opts.tokenizer), opts.tokenizer
    path = Path(f"{opts.out}.tokenizer.json")
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
