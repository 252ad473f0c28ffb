"""The live console line of a training run: step, loss, tokens/s, MFU, comm share, ETA."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ProgressLine:
    """Rewrites one line on a terminal; prints a line every `every` steps when output is a file."""

    def __init__(self, total_steps: int, every: int = 1, stream=None):
        self.total, self.every = total_steps, every
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float, comm_share: float | None, step_time_s: float) -> None:
        if step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / step * (self.total - step)
        comm = "  n/a" if comm_share is None else f"{comm_share:5.1%}"
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} | loss {loss:7.4f} | {tokens_per_s:9,.0f} tok/s | "
            f"MFU {mfu:6.2%} | comm {comm} | {step_time_s:6.3f} s/step | ETA {_duration(eta)}"
        )
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.write(f"done: {self.total} steps in {_duration(time.perf_counter() - self.started)}\n")
        self.stream.flush()
