"""Shared by the activation-memory benches (activation_memory.py, tensor_parallel_memory.py): one step's
activation memory measured by the kernel in a fresh process, the modes run in ABBA rounds, and the table."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure_steps(step: Callable[[], None], optimizer) -> dict:
    """(activation bytes, median step seconds) of `step` (a forward and backward) in this process: a first
    step and an optimizer step allocate the gradients and the optimizer state; then the peak resident
    memory of the next step less the resident memory just before it, and three steps' median time."""

    def timed() -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    timed()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    before = rss_bytes()
    seconds = [timed()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds += [timed() for _ in range(2)]
    return {"activation_bytes": peak - before, "step_s": statistics.median(seconds)}


def abba(names: list[str], run: Callable[[str], dict], rounds: int) -> dict[str, list[dict]]:
    """Each mode's measurements, in the order A B C C B A per round."""
    got = {name: [] for name in names}
    for _ in range(rounds):
        for name in names + names[::-1]:
            got[name].append(run(name))
    return got


def print_table(got: dict[str, list[dict]], estimate: Callable[[str], int], extra: Callable[[str, dict], str] | None = None) -> None:
    """Per mode: activations and step time (median and range) beside preflight's estimate; the target is
    that each mode keeps less than the one before it (plus `extra(mode, medians)` where given)."""
    names = list(got)
    width = max(map(len, names)) + 2
    print(
        f"{'mode':<{width}} | {'activations MiB, median (min-max)':>34} | {'estimate MiB':>12} | {'step s, median (min-max)':>26} | target"
    )
    medians = {m: statistics.median(r["activation_bytes"] for r in got[m]) for m in names}
    for i, mode in enumerate(names):
        mib, secs = [r["activation_bytes"] / 2**20 for r in got[mode]], [r["step_s"] for r in got[mode]]
        kept = f"{statistics.median(mib):.1f} ({min(mib):.1f}-{max(mib):.1f})"
        took = f"{statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f})"
        target = "" if i == 0 else f"< {names[i - 1]}: {'met' if medians[mode] < medians[names[i - 1]] else 'MISSED'}"
        if extra is not None:
            target += extra(mode, medians)
        print(f"{mode:<{width}} | {kept:>34} | {estimate(mode) / 2**20:>12.1f} | {took:>26} | {target}")


def main(doc: str, modes, measure: Callable[[str], dict], run: Callable[[str], dict], estimate: Callable[[str], int], extra=None) -> None:
    """A bench's command line: `--rounds N` measures every mode (`run`, which starts fresh processes that
    call the script again with `--child MODE`, where `measure` runs) and prints the table."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each mode measured twice per round)")
    p.add_argument("--child", choices=list(modes), help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.child)))
        return
    print_table(abba(list(modes), run, opts.rounds), estimate, extra)
