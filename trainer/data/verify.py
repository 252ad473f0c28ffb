"""`keel verify-data SOURCE...`: reads every byte of each token source once and checks it against what a start
trusts without reading it all.

A start checks a token file's size and a sample of its blocks against its sidecar, or reuses the scan kept
for a file without one (keel.trainer.data.scan_cache). A change that keeps the size, the modification
time and the sampled blocks gets past that; this command does not: it hashes the whole file and compares
the sha256 with the sidecar's (and its ids with the sidecar's vocabulary), or with the scan a start would
use, which it then replaces so that later starts record the file as it is. One line per source on stdout,
"ok: ..." or "failed: ..." with the fix; progress on stderr. Exit code 0 when every source is as recorded,
1 when one is not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from keel.monitor.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from keel.trainer.config import ConfigError
from keel.trainer.data.loader import TokenSource, open_source, open_tokens
from keel.trainer.data.megatron_index import megatron_paths
from keel.trainer.data.prepare import Progress, UsageError
from keel.trainer.data.scan_cache import ScanKey, StartChecks, fingerprints, keep_scan, recorded_scan
from keel.trainer.data.token_files import Sidecar, TokenScan, check_sidecar, scan_tokens

DESCRIPTION = __doc__.split("\n\n", 1)[1]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (keel verify-data --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="keel verify-data", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="what data.source names: a token file, a Megatron PREFIX, or builtin")
    p.add_argument("--vocab-size", type=int, metavar="N", help="the model's vocabulary (model.vocab_size): also check the data fits it")
    return p


class FullChecks(StartChecks):
    """Every byte read: the whole hash compared with the sidecar's, or with the scan kept for the file."""

    def __init__(self):
        self.scanned: TokenScan | None = None  # the last full pass

    def sidecar(self, source: str, sidecar: Sidecar, tokens: np.memmap) -> None:
        check_sidecar(source, sidecar, tokens.nbytes, self._read(tokens))

    def scan(self, source, key: ScanKey, tokens: np.ndarray, check_whole=None) -> TokenScan:
        if check_whole is not None:
            check_whole()
        before = fingerprints(key)
        kept = recorded_scan(key, before)  # what a start would use now
        scan = self._read(tokens)
        keep_scan(key, before, scan)
        if kept is not None and kept.sha256 != scan.sha256:
            raise ConfigError(
                f"data.source={source}: its sha256 is {scan.sha256[:16]}, not the {kept.sha256[:16]} of the scan kept for it: the file changed in place keeping its size, "
                f"modification time and sampled blocks, so the starts since recorded it as sha256:{kept.sha256[:16]}; the kept scan is replaced, so the next start records "
                f"sha256:{scan.sha256[:16]} and refuses to resume a run of the old data; restore the file if the change was not meant"
            )
        return scan

    def _read(self, tokens: np.ndarray) -> TokenScan:
        progress = Progress(tokens.nbytes)
        try:
            self.scanned = scan_tokens(tokens, on_chunk=progress.update)
        finally:
            progress.end()
        return self.scanned


def main(argv: list[str]) -> int:
    try:
        opts = build_parser().parse_args(argv)
        for source in opts.sources:
            _check_names_data(source)
        if opts.vocab_size is not None and opts.vocab_size < 1:
            raise UsageError(f"--vocab-size {opts.vocab_size}: a vocabulary holds at least one token; pass model.vocab_size")
    except UsageError as e:
        print(f"keel verify-data: {e}", file=sys.stderr)
        return EXIT_CONFIG
    results = [verify(source, opts.vocab_size) for source in opts.sources]
    return EXIT_OK if all(results) else EXIT_FAILED


def _check_names_data(source: str) -> None:
    """Refuses, before anything is read, a source that names nothing to read."""
    if source != "builtin" and not Path(source).is_file() and megatron_paths(source) is None:
        raise UsageError(f"{source}: no such token file or Megatron PREFIX (PREFIX.idx); name what data.source names, or builtin")


def verify(source: str, vocab_size: int | None) -> bool:
    """Reads `source` whole and prints its line; whether it is as recorded."""
    checks = FullChecks()
    try:
        ts = open_tokens(source, 0, vocab_size, checks=checks) if vocab_size else open_source(source, checks)
    except ConfigError as e:
        print(f"failed: {e}", flush=True)
        return False
    print(f"ok: {ts.description}: {_what_was_read(ts, checks.scanned)}", flush=True)
    return True


def _what_was_read(ts: TokenSource, scan: TokenScan | None) -> str:
    if scan is None:  # the builtin corpus, hashed whole whenever it is read
        return f"data version {ts.version}"
    return f"sha256 {scan.sha256}, ids {scan.min_id} to {scan.max_id} (data version {ts.version})"
