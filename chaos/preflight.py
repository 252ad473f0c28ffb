"""`keel preflight`: the sanity check to run before a long job, with the job's own config and layout.

It validates the config exactly as `keel train` does, then starts the job's pp·dp·tp processes with
torchrun (keel.chaos.preflight_worker) and checks that every rank joins, the collective bandwidth of
each mesh dim, the checkpoint disk's write and read speed, the estimated memory per rank against the
free memory, and that the real model at this layout overfits one batch. This module is the launcher:
it parses the arguments, starts the workers, prints their pass/fail table and returns 0 when every
check passed, 1 when any failed, 2 on bad input (before any worker starts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from keel.monitor.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from keel.trainer.config import ConfigError, JobConfig, check_run_dir
from keel.trainer.data.blend import open_job_data
from keel.trainer.launch.launcher import parse_train_args, resolve_run_dir, torchrun_command, worker_env

RESULTS_FILE = "preflight.json"
WORKER_MODULE = "keel.chaos.preflight_worker"


@dataclass
class Check:
    """One row of the table: a check's name, "pass" | "fail" | "skip", a line for a person, and the numbers."""

    name: str
    result: str
    detail: str
    data: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.result == "pass"


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an abbreviation must never capture one of `keel train`'s flags (--m... is --max-restarts there).
    p = argparse.ArgumentParser(
        prog="keel preflight",
        allow_abbrev=False,
        description="Check ranks, links, checkpoint disk, memory and a tiny overfit before a long job. Takes every "
        "`keel train` flag and --section.key=value override as well (see `keel train --help`).",
        epilog="Example: keel preflight --config small --pp 2 --dp 4 --run-dir runs/big   (exit 0: all passed, 1: a check failed, 2: bad input)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for all ranks to join, and for any collective to complete (default 120)"
    )
    p.add_argument(
        "--overfit-steps",
        dest="overfit_steps",
        type=int,
        default=30,
        help="steps on one repeated batch; passes when the last loss is below half the first (default 30)",
    )
    p.add_argument(
        "--min-bandwidth-gbps",
        dest="min_bandwidth_gbps",
        type=float,
        default=0.0,
        help="fail a mesh dim whose all-reduce bus bandwidth is below this many GB/s (default 0: no minimum)",
    )
    p.add_argument(
        "--memory-limit-bytes",
        dest="memory_limit_bytes",
        type=int,
        help="compare the job's memory estimate with this many bytes per rank instead of the measured free memory",
    )
    p.add_argument("--results", help=argparse.SUPPRESS)  # set by the launcher: where the workers write their rows
    return p


def parse_preflight_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Preflight's own options, and the rest of argv for parse_train_args. Raises ConfigError on a bad value."""
    opts, rest = build_parser().parse_known_args(argv)
    if not opts.timeout > 0:
        raise ConfigError(f"--timeout={opts.timeout}: must be positive (seconds)")
    if opts.overfit_steps < 2:
        raise ConfigError(f"--overfit-steps={opts.overfit_steps}: must be at least 2 (the first and the last loss are compared)")
    if not opts.min_bandwidth_gbps >= 0:
        raise ConfigError(f"--min-bandwidth-gbps={opts.min_bandwidth_gbps}: must be 0 (no minimum) or more")
    if opts.memory_limit_bytes is not None and opts.memory_limit_bytes < 0:
        raise ConfigError(f"--memory-limit-bytes={opts.memory_limit_bytes}: must be 0 or more")
    return opts, rest


def worker_command(cfg: JobConfig, train_opts: argparse.Namespace, timeout: float, worker_argv: list[str]) -> list[str]:
    """`keel train`'s torchrun command, running the preflight workers, without restarts (a failed check
    is an answer, not a fault to retry) and with torchrun's own rendezvous bounded by --timeout."""
    train_opts.max_restarts = 0
    train_opts.rdzv_conf = f"join_timeout={max(1, round(timeout))}"
    return torchrun_command(cfg, train_opts, worker_argv, module=WORKER_MODULE)


def main(argv: list[str]) -> int:
    try:
        opts, train_argv = parse_preflight_args(argv)
        cfg, train_opts = parse_train_args(train_argv)
        # A run directory the user named (--run-dir, --resume, run.run_dir) gets preflight.json. Otherwise the
        # checks use the one `keel train` would pick and leave nothing there: no half-made run in runs/.
        keep_results = bool(cfg.run.run_dir)
        resolve_run_dir(cfg)
        check_run_dir(cfg.run.run_dir)
        # A missing, empty or too-wide data file fails here, once, not in every worker.
        open_job_data(cfg)
        cmd = worker_command(cfg, train_opts, opts.timeout, [*argv, f"--run.run_id={cfg.run.run_id}", f"--run.run_dir={cfg.run.run_dir}"])
    except ConfigError as e:
        print(f"keel preflight: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    results_dir = Path(tempfile.mkdtemp(prefix="keel-preflight-"))  # the workers' rows, on this node
    cmd.append(f"--results={results_dir / RESULTS_FILE}")
    par = cfg.parallel
    print(
        f"keel preflight: {cfg.world_size} processes (pp{par.pp} dp{par.dp} tp{par.tp}); checking ranks, links, the checkpoint "
        f"disk under {cfg.run.run_dir}, memory, and an overfit of {opts.overfit_steps} steps",
        flush=True,
    )
    try:
        checks = read_results(results_dir / RESULTS_FILE, subprocess.call(cmd, env=worker_env(cfg, train_opts, Path(cfg.run.run_dir))))
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops the workers
        return EXIT_INTERRUPTED
    finally:
        shutil.rmtree(results_dir, ignore_errors=True)
    print(format_table(checks))
    failed = [c.name for c in checks if c.result == "fail"]
    skipped = [c.name for c in checks if c.result == "skip"]
    if failed or skipped:
        print(
            f"keel preflight: {len(failed)} of {len(checks)} checks failed: {', '.join(failed)}"
            + (f" (not run: {', '.join(skipped)})" if skipped else "")
        )
    else:
        print(f"keel preflight: all {len(checks)} checks passed")
    if keep_results and train_opts.node_rank in (None, 0):  # one writer, when the run dir is shared between nodes
        write_report(Path(cfg.run.run_dir) / RESULTS_FILE, cfg, checks)
        print(f"keel preflight: results in {Path(cfg.run.run_dir) / RESULTS_FILE}")
    return EXIT_FAILED if failed or skipped else EXIT_OK


def read_results(path: Path, torchrun_code: int) -> list[Check]:
    """The workers' rows; when they stopped before finishing (the rendezvous failed, a worker died), a
    failing row that says so, so the table always ends with a verdict."""
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        results = {"complete": False, "checks": []}
    checks = [Check(**c) for c in results["checks"]]
    if not results["complete"]:
        stage = (
            f"after the '{checks[-1].name}' check" if checks else "before any rank reported (the rendezvous or a worker's start-up failed)"
        )
        name = "workers" if checks else "ranks reachable"
        checks.append(
            Check(
                name,
                "fail",
                f"torchrun exited with code {torchrun_code} {stage}; see its messages above",
                {"torchrun_exit_code": torchrun_code},
            )
        )
    return checks


def format_table(checks: list[Check]) -> str:
    rows = [("check", "result", "detail")] + [(c.name, c.result.upper(), c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)


def write_report(path: Path, cfg: JobConfig, checks: list[Check]) -> None:
    par = cfg.parallel
    report = {
        "time": time.time(),
        "passed": all(c.passed for c in checks),
        "layout": {"pp": par.pp, "dp": par.dp, "tp": par.tp, "dp_mode": par.dp_mode, "pp_schedule": par.pp_schedule},
        "checks": [asdict(c) for c in checks],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
