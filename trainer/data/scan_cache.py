"""How a start proves a token file is the one it was without reading it all (`StartChecks`), and the record
that makes this possible for files without a sidecar: the result of one full pass, kept per user.

A file without a sidecar (a nanoGPT .bin, an llm.c shard, a Megatron .bin + .idx) says neither the
vocabulary it needs (its largest id + 1) nor the version a run records (the sha256 of its tokens): both
take one pass over every byte, 1-1.6 s per GiB, which the launcher and every worker would pay at every
start and restart. The pass is made once and its result (`TokenScan`) kept in
$XDG_CACHE_HOME/keel/token-scans/ (~/.cache/keel/token-scans/ by default), one JSON record per file, with
the fingerprints (size, mtime_ns, sampled sha256: keel.trainer.data.token_files.Fingerprint) of the files
it was computed from. A start whose files have the same fingerprints uses the record; any other scans
again. A change that keeps a file's size, its modification time and its sampled blocks is not seen at a
start: `keel verify-data` reads every byte (keel.trainer.data.verify).

Records are written to a temporary file and renamed into place, so a reader never sees half of one; a
cache that cannot be written costs a full pass at the next start and one log line. Deleting the folder is
always safe. A file with a sidecar needs no record: the sidecar holds its full hash and its sampled one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from keel.trainer.data.token_files import (
    Fingerprint,
    Sidecar,
    TokenScan,
    check_sampled,
    check_sidecar,
    fingerprint,
    new_temp_path,
    sampled_sha256,
    scan_tokens,
)

RECORD_FORMAT = "keel-token-scan/1"
log = logging.getLogger("keel.data")


@dataclass(frozen=True)
class ScanKey:
    """What a scan depends on: the files (the token file first) and how the token file's bytes are read."""

    files: tuple[str, ...]  # resolved paths
    layout: str  # the ids' dtype and the byte offset where they start, e.g. "<u2@1024"


def scan_key(tokens: np.memmap, *also: Path) -> ScanKey:
    """The key of a scan of `tokens`, a memmap of a token file, that also depends on the files `also` (a
    Megatron index): taken from the memmap itself, so it always says how the ids were read."""
    files = (Path(tokens.filename), *also)
    return ScanKey(tuple(str(p.resolve()) for p in files), f"{tokens.dtype.str}@{tokens.offset}")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG base directory specification: a relative path is invalid and ignored.
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "keel" / "token-scans"


def record_path(key: ScanKey) -> Path:
    digest = hashlib.sha256(json.dumps(asdict(key)).encode()).hexdigest()[:16]
    return cache_dir() / f"{Path(key.files[0]).name}-{digest}.json"


def fingerprints(key: ScanKey) -> list[Fingerprint]:
    return [fingerprint(path) for path in key.files]


def recorded_scan(key: ScanKey, now: list[Fingerprint]) -> TokenScan | None:
    """The scan recorded for `key` when its files' fingerprints then were `now`, else None."""
    try:
        record = json.loads(record_path(key).read_text())
        if record["format"] != RECORD_FORMAT or ScanKey(tuple(record["key"]["files"]), record["key"]["layout"]) != key:
            return None
        if [Fingerprint(**fp) for fp in record["fingerprints"]] != now:
            return None
        return TokenScan(**record["scan"])
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or not one of ours: scan again
        return None


def keep_scan(key: ScanKey, before: list[Fingerprint], scan: TokenScan) -> None:
    """Records `scan`, made of files whose fingerprints were `before` it, unless they changed during it."""
    if fingerprints(key) != before:  # written to while it was read: the scan may describe neither state
        return
    record = {"format": RECORD_FORMAT, "key": asdict(key), "fingerprints": [asdict(fp) for fp in before], "scan": asdict(scan)}
    path = record_path(key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_temp_path(path)
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("data: cannot keep the scan of %s in %s (%s); the next start reads it whole again", key.files[0], path.parent, e)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


class StartChecks:
    """What a start checks: the size and sampled blocks a sidecar recorded, or the scan recorded for the
    same fingerprints; a full pass only when there is neither. keel verify-data's FullChecks reads every
    byte instead."""

    def sidecar(self, source: str, sidecar: Sidecar, tokens: np.memmap) -> None:
        """Refuses a file (`tokens`, the whole file, its size already checked) that is not what its sidecar describes."""
        if sidecar.sampled_sha256 is None:  # a sidecar from before it was recorded: the whole hash, checked once and kept
            check_sidecar(source, sidecar, tokens.nbytes, self.scan(source, scan_key(tokens), tokens))
        else:
            check_sampled(source, sidecar, sampled_sha256(tokens.filename, tokens.nbytes))

    def scan(self, source: str, key: ScanKey, tokens: np.ndarray, check_whole: Callable[[], object] | None = None) -> TokenScan:
        """The scan of `tokens`: recorded, or made now and kept. `check_whole` checks what else is read
        whole (a Megatron index); it runs when the scan does, so a recorded scan means it passed."""
        before = fingerprints(key)
        scan = recorded_scan(key, before)
        if scan is not None:
            return scan
        if check_whole is not None:
            check_whole()
        log.info(
            "data: reading %s whole once (%.2f GiB) for its hash and largest id; kept in %s",
            key.files[0],
            tokens.nbytes / 2**30,
            cache_dir(),
        )
        scan = scan_tokens(tokens)
        keep_scan(key, before, scan)
        return scan
