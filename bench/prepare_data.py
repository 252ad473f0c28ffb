"""How fast `keel prepare-data --tokenizer` encodes, and how much memory it holds, measured from outside.

Speed: tokens per second of `keel prepare-data OUT FILES --tokenizer T` against the tokenizers library's own
`encode_batch` of the same files (every file read whole and encoded in one call, its ids collected): the
bar a user would otherwise reach for. Both are child processes timed by wall clock from start to exit
(interpreter start and imports included), alternated A B B A for --rounds rounds so that drift in the
machine's load falls on both alike. The ratio is keel's rate over the library's; the target is >= 0.8.
`encode_batch_fast` (no offsets, what keel itself calls) is reported beside it as the stricter bar.

Memory: the peak resident set of `keel prepare-data --tokenizer` (the child's ru_maxrss from wait4) on an
input larger than --budget-mib, set against that budget; the small speed runs' peak is printed beside it,
so a peak that grew with the input would show.

The tokenizer is a byte-level BPE of 4096 tokens trained by `keel prepare-data --train-tokenizer` on part of
the Python standard library; the corpus is the standard library's .py files: nothing is downloaded.

    python bench/prepare_data.py [--mb 8] [--rounds 2] [--budget-mib 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 0.8
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# The library's own batch encoding of whole files, as a user would call it: argv = tokenizer, file list, method.
LIBRARY_ENCODE = """
import sys
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = [open(p, encoding="utf-8", errors="replace").read() for p in open(sys.argv[2]).read().splitlines()]
encodings = getattr(tokenizer, sys.argv[3])(texts, add_special_tokens=False)
print(sum(len(e.ids) for e in encodings))
"""


def stdlib_files(megabytes: float) -> list[Path]:
    """The standard library's .py files in sorted order, as many as make `megabytes` MB."""
    files, total = [], 0
    for path in sorted(STDLIB.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= megabytes * 1e6:
            break
    return files


def run_child(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak resident MiB, stdout) of a child process, measured from outside."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed with exit code {proc.returncode}")
    return wall, usage.ru_maxrss / 1024, stdout  # ru_maxrss is in KiB on Linux


def keel_prepare(out: Path, files: list[Path], tokenizer: Path) -> tuple[float, float]:
    """(tokens per second, peak MiB) of `keel prepare-data --tokenizer`."""
    wall, peak, _ = run_child(
        [sys.executable, "-m", "keel.cli", "prepare-data", str(out), *map(str, files), "--tokenizer", str(tokenizer), "--force"]
    )
    return json.loads(Path(f"{out}.json").read_text())["tokens"] / wall, peak


def library_encode(file_list: Path, tokenizer: Path, method: str) -> float:
    """Tokens per second of the library's own `method` (encode_batch or encode_batch_fast) on the same files."""
    wall, _, stdout = run_child([sys.executable, "-c", LIBRARY_ENCODE, str(tokenizer), str(file_list), method])
    return int(stdout) / wall


def train_tokenizer(workdir: Path) -> Path:
    out = workdir / "train.bin"
    run_child([sys.executable, "-m", "keel.cli", "prepare-data", str(out), *map(str, stdlib_files(2)), "--train-tokenizer", "4096"])
    return Path(f"{out}.tokenizer.json")


def abba_ratios(workdir: Path, files: list[Path], tokenizer: Path, method: str, rounds: int) -> tuple[list[float], list[float]]:
    """Per round, keel's tokens/s over the library's (A B B A); and every peak MiB keel reached."""
    file_list = workdir / "files.txt"
    file_list.write_text("\n".join(map(str, files)))
    ratios, peaks = [], []
    for _ in range(rounds):
        a1, peak1 = keel_prepare(workdir / "a.bin", files, tokenizer)
        b1 = library_encode(file_list, tokenizer, method)
        b2 = library_encode(file_list, tokenizer, method)
        a2, peak2 = keel_prepare(workdir / "a.bin", files, tokenizer)
        ratios.append((a1 + a2) / (b1 + b2))
        peaks += [peak1, peak2]
        print(f"  round: keel {a1:,.0f} {a2:,.0f} tok/s, {method} {b1:,.0f} {b2:,.0f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
    return ratios, peaks


def write_large_input(path: Path, megabytes: float) -> None:
    """One text file of `megabytes` MB: the standard library's source repeated, written in pieces."""
    piece = b"".join(p.read_bytes() for p in stdlib_files(4))
    with open(path, "wb") as f:
        for _ in range(int(megabytes * 1e6 // len(piece)) + 1):
            f.write(piece)


def report_speed(method: str, ratios: list[float]) -> None:
    median = statistics.median(ratios)
    verdict = "holds" if median >= TARGET_RATIO else "MISSED"
    print(
        f"speed vs {method}: ratio median {median:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} ABBA rounds; "
        f"target >= {TARGET_RATIO}: {verdict}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=8.0, help="size of the speed corpus in MB (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds per comparison (default 2)")
    p.add_argument("--budget-mib", type=float, default=128.0, help="the memory budget; the memory input is 1.25x it (default 128)")
    opts = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-prepare-") as tmp:
        workdir = Path(tmp)
        tokenizer = train_tokenizer(workdir)
        files = stdlib_files(opts.mb)
        size_mb = sum(f.stat().st_size for f in files) / 1e6
        print(
            f"corpus: {len(files)} standard-library files, {size_mb:.1f} MB; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
        )
        results = {}
        for method in ("encode_batch", "encode_batch_fast"):
            results[method] = abba_ratios(workdir, files, tokenizer, method, opts.rounds)
        for method, (ratios, _) in results.items():
            report_speed(method, ratios)
        small_peak = max(peak for _, peaks in results.values() for peak in peaks)
        big = workdir / "big.txt"
        write_large_input(big, opts.budget_mib * 1.25 * 2**20 / 1e6)
        rate, peak = keel_prepare(workdir / "big.bin", [big], tokenizer)
        verdict = "holds" if peak <= opts.budget_mib else "MISSED"
        print(
            f"memory: peak {peak:.0f} MiB on a {big.stat().st_size / 2**20:.0f} MiB input ({rate:,.0f} tok/s), {small_peak:.0f} MiB on the {size_mb:.1f} MB corpus; "
            f"budget {opts.budget_mib:.0f} MiB: {verdict}"
        )


if __name__ == "__main__":
    main()
