"""`keel metrics RUN_DIR`: print a run's step metrics from its run store, as a table or as CSV; under the table,
a run on a blend of sources (data.sources) gets each source's share of the tokens read."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Callable
from typing import Any

from keel.monitor import metric_registry
from keel.monitor.exits import EXIT_CONFIG, EXIT_OK
from keel.monitor.store import read_data_sources, read_steps


def _table() -> tuple[list[str], dict[str, Callable[[Any], str]]]:
    """The table's columns and how those not left to pandas are shown, from keel.monitor.metric_registry;
    --csv writes every step column at full precision instead."""
    shown = [m for m in metric_registry.STEP_METRICS if m.table is not None]
    return [m.column for m in shown], {m.column: m.table.format for m in shown if m.table}


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
        columns, formats = _table()
        columns = [c for c in columns if steps[c].notna().any()]  # e.g. validation_loss of a run that never evaluated
        print(steps[columns].to_string(index=False, formatters=formats, na_rep="-"))
        _print_data_sources(args.run_dir)
    return EXIT_OK


def _print_data_sources(run_dir: str) -> None:
    """A blend's sources: each one's weight and its share of the tokens read by the steps that count."""
    sources = read_data_sources(run_dir)
    if sources.empty:
        return
    print("\ndata sources (tokens read by the steps that count):")
    formats = {"weight": "{:.4g}".format, "tokens": "{:,}".format, "share": "{:.2%}".format}
    print(sources[["source", "weight", "tokens", "share"]].to_string(index=False, formatters=formats))
