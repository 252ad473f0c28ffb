"""`keel metrics RUN_DIR`: print a run's step metrics from its run store, as a table or as CSV."""

from __future__ import annotations

import argparse
import sqlite3
import sys

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.store import read_steps

# Table columns and how each is shown; --csv writes every step column at full precision instead.
_TABLE_COLUMNS = ["step", "attempt", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "comm_share", "step_time_s"]
_TABLE_FORMATS = {
    "loss": "{:.4g}".format,
    "grad_norm": "{:.4g}".format,
    "lr": "{:.3g}".format,
    "tokens_per_s": "{:.0f}".format,
    "mfu": "{:.3g}".format,
    "comm_share": "{:.3f}".format,
    "step_time_s": "{:.4g}".format,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel metrics", description="Print a run's step metrics: the last attempt of each step unless --all-attempts."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `keel train`")
    parser.add_argument("--csv", action="store_true", help="write every step column as CSV")
    parser.add_argument("--all-attempts", action="store_true", help="also show attempts abandoned by a rollback or restart")
    args = parser.parse_args(argv)

    try:
        steps = read_steps(args.run_dir, effective=not args.all_attempts)
    except FileNotFoundError as e:
        print(f"keel metrics: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except sqlite3.Error as e:
        print(f"keel metrics: error: cannot read the run store in {args.run_dir}: {e}", file=sys.stderr)
        return EXIT_CONFIG

    if args.csv:
        steps.to_csv(sys.stdout, index=False)
    elif steps.empty:
        print(f"no steps recorded yet in {args.run_dir}")
    else:
        # "-" marks a value that was not recorded, such as comm_share on a step where it was not sampled.
        print(steps[_TABLE_COLUMNS].to_string(index=False, formatters=_TABLE_FORMATS, na_rep="-"))
    return EXIT_OK
