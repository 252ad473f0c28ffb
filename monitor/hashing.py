"""SHA-256 of a file, read in blocks so that memory stays flat: how checkpoints are verified and tokenizer
files are identified. Standard library only, so that light commands (keel prepare-data) can use it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
