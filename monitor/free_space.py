"""The space left where a write failed, as every "disk full" message in Keel words it."""

from __future__ import annotations

import shutil
from pathlib import Path


def free_bytes(path: str | Path) -> tuple[int, Path]:
    """(bytes free, the folder they were measured in): the nearest existing folder at or above `path`."""
    folder = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    return shutil.disk_usage(folder).free, folder


def free_space(path: str | Path) -> str:
    """ "12.5 MiB free on /the/folder", for `path` (see free_bytes)."""
    free, folder = free_bytes(path)
    return f"{free / 2**20:.1f} MiB free on {folder}"
