"""The live console line of a training run: step, loss, tokens/s, MFU, comm share, ETA; and a line per evaluation."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ProgressLine:
    """Rewrites one line on a terminal; prints a line every `every` steps when output is a file.

    The ETA is the remaining steps at the pace of the steps this process ran since its first line (or
    since a rollback moved the step back), so a restart or a resume at step 200 of 300 does not divide
    the time of one process by the whole run's step. The final line gives the run's own wall time, from
    `run_began` (epoch seconds: when the run's first process started), restarts and resumes included."""

    def __init__(self, total_steps: int, every: int = 1, stream=None, run_began: float | None = None):
        self.total, self.every = total_steps, every
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.run_began = time.time() if run_began is None else run_began
        self._pace_from: tuple[int, float] | None = None  # (step, clock) the pace is measured from
        self._last_step = 0

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float, comm_share: float | None, step_time_s: float) -> None:
        now = time.perf_counter()
        if self._pace_from is None or step <= self._last_step:  # first line, or a rollback went back
            self._pace_from = (step - 1, now - step_time_s)  # from this step's start
        self._last_step = step
        if step % self.every and step != self.total:
            return
        first_step, since = self._pace_from
        eta = (now - since) / (step - first_step) * (self.total - step)
        comm = "  n/a" if comm_share is None else f"{comm_share:5.1%}"
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} | loss {loss:7.4f} | {tokens_per_s:9,.0f} tok/s | "
            f"MFU {mfu:6.2%} | comm {comm} | {step_time_s:6.3f} s/step | ETA {_duration(eta)}"
        )
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def validation(self, step: int, loss: float, perplexity: float) -> None:
        """A line of its own that stays, under the progress line: an evaluation is worth reading back."""
        line = f"step {step:>{len(str(self.total))}}/{self.total} | validation loss {loss:7.4f} | perplexity {perplexity:,.2f}"
        self.stream.write(f"\r{line}\n" if self.tty else line + "\n")
        self.stream.flush()

    def finish(self, stopped_at: int | None = None) -> None:
        """The last line: the run done, or stopped (a preemption, the rollback cap) after step `stopped_at`."""
        if self.tty:
            self.stream.write("\n")
        took = _duration(time.time() - self.run_began)
        done = f"done: {self.total} steps" if stopped_at is None else f"stopped after step {stopped_at} of {self.total}"
        self.stream.write(f"{done} in {took}\n")
        self.stream.flush()
