"""A log file that outlives its disk filling up. Python's FileHandler prints `--- Logging error ---` and a
traceback to stderr for every record it cannot write: hundreds of lines that bury the cause. This one says
it once, in one line naming the file, the error and the space left there, and drops the records it cannot
write after that (quietly: the line said so)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from keel.monitor.free_space import free_space


class LogFile(logging.FileHandler):
    def __init__(self, path: str | Path, delay: bool = False):
        super().__init__(path, delay=delay)
        self._reported = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if self._reported:
            return
        self._reported = True
        error = sys.exc_info()[1]
        print(
            f"keel: cannot write {self.baseFilename}: {error} ({free_space(Path(self.baseFilename).parent)}); its records are lost",
            file=sys.stderr,
            flush=True,
        )
