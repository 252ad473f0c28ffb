"""The drill matrix: `keel drill --suite standard` at every layout Keel promises on CPU, in one table.

    python scripts/drill_matrix.py [--run-dir runs/drill-matrix] [--suite standard] [-- JOB ARGS...]

Runs one `keel drill` per layout (1x1x1, dp2, tp2, pp2, pp2·dp2·tp2) with the tiny preset unless job
arguments follow `--`, then prints a markdown table of drill × layout (PASS / FAIL / n/a, and the
detection and recovery times) and writes it to RUN_DIR/matrix.md. Exits 1 if any drill failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from keel.monitor.run_dir import DRILL_DIR

LAYOUTS = {"1x1x1": (1, 1, 1), "dp2": (1, 2, 1), "tp2": (1, 1, 2), "pp2": (2, 1, 1), "pp2·dp2·tp2": (2, 2, 2)}


def main() -> int:
    argv = sys.argv[1:]
    job = argv[argv.index("--") + 1 :] if "--" in argv else ["--config", "tiny"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/drill-matrix")
    p.add_argument("--suite", default="standard")
    opts = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    reports, failed = {}, False
    for name, (pp, dp, tp) in LAYOUTS.items():
        run_dir = Path(opts.run_dir) / name.replace("·", "-")
        start = time.time()
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "keel.cli",
                "drill",
                f"--run-dir={run_dir}",
                f"--suite={opts.suite}",
                f"--pp={pp}",
                f"--dp={dp}",
                f"--tp={tp}",
                *job,
            ]
        )
        failed |= code != 0
        found = sorted(run_dir.glob(f"{DRILL_DIR}/drill-*/report.json"))
        reports[name] = json.loads(found[-1].read_text()) if found else None
        print(f"{name}: exit {code} in {time.time() - start:.0f} s", flush=True)
    table = matrix(reports)
    print(table)
    Path(opts.run_dir, "matrix.md").write_text(table + "\n")
    return 1 if failed else 0


def matrix(reports: dict[str, dict | None]) -> str:
    drills = list(dict.fromkeys(r["name"] for rep in reports.values() if rep for r in rep["results"]))
    lines = ["| drill | " + " | ".join(reports) + " |", "|---|" + "---|" * len(reports)]
    for drill in drills:
        cells = []
        for rep in reports.values():
            r = next((x for x in rep["results"] if x["name"] == drill), None) if rep else None
            if r is None:
                cells.append("no report")
            elif r["status"] == "pass":
                back = "kept going" if r["time_to_recover_s"] is None else f"back {r['time_to_recover_s']:.1f} s"
                cells.append(f"PASS (found {r['detection_latency_s']:.1f} s, {back})")
            else:
                cells.append(r["status"].upper())
        lines.append(f"| {drill} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
