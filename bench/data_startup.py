"""How long a fresh process takes to open a token file, measured from outside, and whether it grows with the file.

Start-up: the wall time of a new `python -c "open_tokens(...)"` process, from its start to its exit
(interpreter, imports and the open: nothing subtracted), on Keel token files of --small-gib and --large-gib
(default 1 and 8 GiB, with their sidecars), alternated A B B A for --rounds rounds so that drift in the
machine's load falls on both alike. Target: flat, the large file's median over the small one's <= 1.2.

A sidecar-less nanoGPT .bin (the small file's bytes, hard-linked under another name, so without its
sidecar) is timed the same way on its first start (no kept scan: the one full pass) against a later start
(the scan kept for its fingerprint), with a cache folder of the bench's own (XDG_CACHE_HOME), emptied
before each first start. For reference, the old cost of every start: one full `scan_tokens` pass over
the small file, timed inside a process, per GiB; and a process that only imports the loader.

The files are written with numpy in chunks through TokenFileWriter (as `keel prepare-data` writes them:
the sidecar with its full and sampled sha256) in a temporary folder under --dir, and removed at the end.

    python bench/data_startup.py [--small-gib 1] [--large-gib 8] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from keel.trainer.data.token_files import TokenFileWriter

TARGET_RATIO = 1.2
VOCAB = 50257  # GPT-2's
WRITE_CHUNK = 64 * 2**20  # tokens generated and written at a time
OPEN = "import sys; from keel.trainer.data.loader import open_tokens; open_tokens(sys.argv[1], 1024, int(sys.argv[2]))"
IMPORT_ONLY = "import keel.trainer.data.loader"
OLD_PASS = """
import sys, time
import numpy as np
from keel.trainer.data.token_files import scan_tokens
tokens = np.memmap(sys.argv[1], dtype="<u2", mode="r")
started = time.perf_counter()
scan_tokens(tokens)
print(time.perf_counter() - started)
"""


def write_token_file(path: Path, gib: float) -> None:
    """`gib` GiB of random GPT-2 ids as a Keel token file with its sidecar."""
    count = int(gib * 2**30) // 2
    rng = np.random.default_rng(0)
    with TokenFileWriter(path, VOCAB, {"kind": "random ids (bench)"}, eod_id=None) as writer:
        for start in range(0, count, WRITE_CHUNK):
            writer.write(rng.integers(0, VOCAB, min(WRITE_CHUNK, count - start), dtype=np.uint16))
        writer.finish()


def run_child(code: str, *args: str, env: dict | None = None) -> tuple[float, str]:
    """(wall seconds from start to exit, stdout) of `python -c code args`."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"python -c {code[:60]!r} {args} failed:\n{proc.stderr[-2000:]}")
    return wall, proc.stdout


def start_up(path: Path, env: dict) -> float:
    return run_child(OPEN, str(path), str(VOCAB), env=env)[0]


def abba(a, b, rounds: int, label_a: str, label_b: str) -> tuple[list[float], list[float]]:
    """Per round a(), b(), b(), a(); each call's seconds."""
    times_a, times_b = [], []
    for _ in range(rounds):
        a1, b1, b2, a2 = a(), b(), b(), a()
        times_a += [a1, a2]
        times_b += [b1, b2]
        print(f"  round: {label_a} {a1:.3f} {a2:.3f} s, {label_b} {b1:.3f} {b2:.3f} s", flush=True)
    return times_a, times_b


def summary(times: list[float]) -> str:
    return f"median {statistics.median(times):.3f} s (range {min(times):.3f}-{max(times):.3f}, n={len(times)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-gib", type=float, default=1.0, help="the small file, GiB (default 1)")
    p.add_argument("--large-gib", type=float, default=8.0, help="the large file, GiB (default 8)")
    p.add_argument("--rounds", type=int, default=5, help="ABBA rounds per comparison (default 5)")
    p.add_argument("--dir", default=None, help="where the temporary folder goes (default: the system's temporary folder)")
    opts = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-startup-", dir=opts.dir) as tmp:
        workdir = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache")}
        small, large, nanogpt = workdir / "small.bin", workdir / "large.bin", workdir / "nanogpt.bin"
        for path, gib in ((small, opts.small_gib), (large, opts.large_gib)):
            started = time.perf_counter()
            write_token_file(path, gib)
            print(f"wrote {path.name}: {gib:g} GiB with its sidecar in {time.perf_counter() - started:.1f} s", flush=True)
        os.link(small, nanogpt)
        print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; files in {workdir}")

        imports = [run_child(IMPORT_ONLY, env=env)[0] for _ in range(3)]
        print(f"a process that only imports the loader: {summary(imports)}")
        print(f"start-up with a sidecar, {opts.small_gib:g} GiB (A) vs {opts.large_gib:g} GiB (B):", flush=True)
        times_small, times_large = abba(lambda: start_up(small, env), lambda: start_up(large, env), opts.rounds, "A", "B")

        def first_start() -> float:
            shutil.rmtree(workdir / "cache", ignore_errors=True)
            return start_up(nanogpt, env)

        print(f"nanoGPT .bin without a sidecar, {opts.small_gib:g} GiB: first start (A) vs a later start (B):", flush=True)
        times_first, times_kept = abba(first_start, lambda: start_up(nanogpt, env), opts.rounds, "A", "B")
        old_pass = [float(run_child(OLD_PASS, str(small))[1]) / opts.small_gib for _ in range(3)]

        ratio = statistics.median(times_large) / statistics.median(times_small)
        print(f"start-up, {opts.small_gib:g} GiB with a sidecar: {summary(times_small)}")
        print(f"start-up, {opts.large_gib:g} GiB with a sidecar: {summary(times_large)}")
        print(
            f"ratio {opts.large_gib:g}G/{opts.small_gib:g}G of the medians: {ratio:.3f}; target <= {TARGET_RATIO}: {'holds' if ratio <= TARGET_RATIO else 'MISSED'}"
        )
        print(f"nanoGPT .bin, first start (full pass): {summary(times_first)}")
        print(f"nanoGPT .bin, later start (kept scan): {summary(times_kept)}")
        print(f"old cost, one full scan_tokens pass: {summary(old_pass).replace(' s ', ' s/GiB ', 1)}, in every process at every start")


if __name__ == "__main__":
    main()
