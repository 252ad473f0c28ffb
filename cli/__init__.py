"""The `keel` command: one entry point, a subcommand per task."""

from __future__ import annotations

import sys

from keel.monitor.exits import EXIT_CONFIG, EXIT_OK

USAGE = """usage: keel COMMAND [ARGS]

commands:
  train          train a model with pp x dp x tp processes (keel train --help)
  metrics        print a run's step metrics (keel metrics RUN_DIR [--csv])
  drill          inject each fault into a short copy of a job and report the recovery (keel drill --help)
  inject         ask a running job to inject a fault at its next step (keel inject RUN_DIR FAULT)
  preflight      check ranks, links, checkpoint disk, memory and an overfit before a long job (keel preflight --help)
  dashboard      watch runs live in the browser (keel dashboard [RUNS_DIR ...] [--host] [--port] [--read-only])
  alert-rules    write the Prometheus alerting rules with your windows and thresholds (keel alert-rules --help)
  simulate       what one rank of a large layout holds, built on meta with a fake process group (keel simulate --help)
  estimate       GPU-hours, days and cost of a job from its parameters and tokens (keel estimate --help)
  plan           which pp x dp x tp layout: memory, bubble, communication and speed of each (keel plan --help)
  prepare-data   make a token file from text, JSONL, Parquet or a dataset, as bytes or tokens (keel prepare-data --help)
  verify-data    read token files whole and check them against their sidecar or kept scan (keel verify-data --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return EXIT_OK if argv else EXIT_CONFIG
    command, rest = argv[0], argv[1:]
    # Imports stay inside the branches so `keel metrics` does not pay for importing torch.
    if command == "train":
        from keel.trainer.launch.launcher import main as run
    elif command == "metrics":
        from keel.monitor.metrics_cli import main as run
    elif command == "drill":
        from keel.chaos.drill import main as run
    elif command == "inject":
        from keel.chaos.inject import main as run
    elif command == "preflight":
        from keel.chaos.preflight import main as run
    elif command == "dashboard":
        from keel.dashboard.launch import main as run
    elif command == "alert-rules":
        from keel.monitor.alert_rules import main as run
    elif command == "simulate":
        from keel.trainer.planning.simulate import main as run
    elif command == "estimate":
        from keel.trainer.planning.estimate import main as run
    elif command == "plan" and "--check" in rest:
        from keel.trainer.planning.run_plan import main as run
    elif command == "plan":
        from keel.trainer.planning.plan_command import main as run
    elif command == "prepare-data":
        from keel.trainer.data.prepare import main as run
    elif command == "verify-data":
        from keel.trainer.data.verify import main as run
    else:
        print(f"keel: error: unknown command '{command}'\n{USAGE}", end="", file=sys.stderr)
        return EXIT_CONFIG
    return run(rest)
