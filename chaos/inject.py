"""`keel inject RUN_DIR FAULT [--rank R] [--step S]`: ask a running job to inject a fault, live.

The request is a small JSON file in RUN_DIR/control/faults/. Every rank of the running trainer looks
there at the start of each step and adds the fault to its plan (keel.chaos.faults.FaultPlan); a
request for a step already past fires at once. Without --step the fault hits the step after next,
counted from the newest step in the run store, so that every rank has seen the request by then.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

from keel.chaos.fault_specs import parse_fault
from keel.chaos.kinds import KINDS
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.run_dir import FAULT_REQUEST_DIR, STORE_FILE
from keel.monitor.store import read_events, read_meta, read_steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="keel inject",
        description="Ask a running `keel train` to inject a fault at its next step.",
        epilog="Example: keel inject runs/my-run nan --rank 1   |   keel inject runs/my-run 'hang@seconds=30' --step 120",
    )
    p.add_argument("run_dir", help="the run directory of a running job")
    p.add_argument("fault", help=f"a kind ({', '.join(KINDS)}), optionally with fields: KIND@FIELD=VALUE,...")
    p.add_argument("--rank", type=int, help="the rank to hit (default: every rank)")
    p.add_argument("--step", type=int, help="the step to hit (default: the step after next)")
    return p


def request(run_dir: str | Path, fault: str, rank: int | None = None, step: int | None = None) -> str:
    """Validates and leaves the request; returns the fault spec. Raises ValueError with a one-line reason."""
    run_dir = Path(run_dir)
    if not (run_dir / STORE_FILE).exists():
        raise ValueError(f"{run_dir}: no run store ({STORE_FILE}); give the run directory of a running `keel train`")
    try:
        events, steps, meta = read_events(run_dir), read_steps(run_dir), read_meta(run_dir)
    except sqlite3.Error as e:
        raise ValueError(f"{run_dir}: cannot read the run store ({e})") from None
    endings = events.kind[events.kind.isin([EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED])]
    if len(endings) and endings.iloc[-1] != EventKind.RUN_STARTED:
        raise ValueError(f"{run_dir}: the run has ended; inject into a running job, or use `keel train --fault` for a new one")
    world = int(meta.get("world_size", 1))
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"--rank={rank}: the run has ranks 0..{world - 1}")
    if step is None:
        step = (int(steps.step.max()) if len(steps) else 0) + 2
    kind, _, fields = fault.partition("@")
    parts = [f"step={step}"] + ([f"rank={rank}"] if rank is not None else []) + [f for f in fields.split(",") if f]
    spec = str(parse_fault(f"{kind}@{','.join(parts)}"))  # the same checks as --fault
    folder = run_dir / FAULT_REQUEST_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}"
    tmp = folder / f"{name}.tmp"
    tmp.write_text(json.dumps({"fault": spec, "requested_at": time.time()}) + "\n")
    tmp.rename(folder / f"{name}.json")  # the trainer lists *.json: it never sees a half-written request
    return spec


def main(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    try:
        spec = request(opts.run_dir, opts.fault, opts.rank, opts.step)
    except ValueError as e:
        print(f"keel inject: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"keel inject: requested {spec} in {opts.run_dir}; the trainer takes it at the start of its next step")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
