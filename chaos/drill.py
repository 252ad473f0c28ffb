"""`keel drill`: prove that a job recovers from the faults that will happen, before it runs for weeks.

At the job's own parallel layout and model, for a short length, the drill runs a fault-free reference
and then one run per fault, each a plain `keel train` process (the drill never imports the train
loop). Each run is judged from its run store (keel.chaos.verdict) and the results go to
RUN_DIR/drills/<id>/report.md, report.json and plot.png (keel.chaos.report). The exit code is 1 when
any drill fails, so a job script can gate on it.

`--command` drills a user's own script instead (a loop that opens its run with keel.trainer.toolkit's
`open_run`): each run is that command, with the drill's settings and faults in KEEL_ARGS, judged the same way.

The drill changes only what makes it short and quick to judge: the number of steps, a checkpoint
every few steps, a watchdog floor of seconds, frequent communication sampling (and the straggler score
from the fault's step on), and no exporters or alert channels (a drill must not page anyone). Everything
else is the job's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from keel.chaos.fault_specs import parse_fault
from keel.chaos.kinds import KINDS, Expectation
from keel.chaos.verdict import DrillResult, judge, skipped_batches
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from keel.monitor.run_dir import DRILL_DIR, STORE_FILE
from keel.monitor.store import read_events, read_steps
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.launch.launcher import build_parser as train_parser
from keel.trainer.launch.launcher import loop_layout_flags, parse_train_args, resolve_run_dir

_LOG_TAIL_LINES = 12  # of a failed drill's run console, printed under the table


@dataclass(frozen=True)
class Drill:
    name: str
    faults: tuple[str, ...]  # templates: {S} fault step, {R} faulty rank, {K} recovery.nonfinite_limit, {MS} a delay,
    # {ROWS} half the job's micro-batch (sequences): a memory that one halving gets under
    expect: Expectation

    def train_args(self, setup: DrillSetup) -> list[str]:
        """A slow rank is scored on the steps whose communication is measured: measure every other one, from
        the fault's step on. Samples from before it measure the machine, and two shared cores can make the
        faulty rank slower on their own (a fault-free run of a user's loop had its rank 1 scored 0.58): flagged
        before the fault, it is reported again only once its score halves, so the fault could go unreported."""
        if self.expect.min_stage_ranks == 1:
            return []
        first_scored = max(setup.cfg.stragglers.warmup_steps, setup.fault_step - 1)
        return ["--metrics.comm_sample_every=2", f"--stragglers.warmup_steps={first_scored}"]


def drill_of(name: str, fault: str, step: int | str = "{S}") -> Drill:
    """The drill of one fault (a template, or a spec at `step`) and of what its kind says must follow it,
    judged as its kind says (keel.chaos.kinds)."""
    kind = KINDS[fault.partition("@")[0]]
    then = (kind.then.format(S=step, R="{R}"),) if kind.then else ()
    return Drill(name, (fault, *then), kind.expect)


DRILLS = {name: drill_of(name, template) for kind in KINDS.values() for name, template in kind.drills.items()}
SUITES = {"standard": ["nan", "spike", "oom", "hang", "crash", "ckpt_corrupt", "straggler", "late_collective"], "full": list(DRILLS)}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: --fault (a `keel train` flag) must not be taken for --faults or --fault-step.
    p = argparse.ArgumentParser(
        prog="keel drill",
        allow_abbrev=False,
        description="Run a short copy of a job once without faults and once per fault; report detection, recovery and loss. "
        "Every other flag and --section.key=value is the job's, as for `keel train`.",
        epilog="Example: keel drill --config job.toml --pp 2 --dp 2 --tp 2 --suite standard",
    )
    p.add_argument("--suite", choices=sorted(SUITES), default="standard", help="which drills (default: standard)")
    p.add_argument(
        "--faults",
        help=f"instead of a suite: drill names and/or fault specs separated by ';' "
        f"(e.g. 'hang;nan@step=30,rank=1'), or a TOML file with faults = [...]. Drills: {', '.join(DRILLS)}",
    )
    p.add_argument("--drill-steps", type=int, help="length of each run (default: spike.warmup_steps + 30)")
    p.add_argument("--fault-step", type=int, help="the step the faults hit (default: spike.warmup_steps + 10)")
    p.add_argument("--fault-rank", type=int, help="the rank the faults hit (default: the last rank)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="checkpoint interval of the drill runs, in steps (default 5)")
    p.add_argument("--watchdog-floor", type=float, default=5.0, help="watchdog.floor_s of the drill runs (default 5 s)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it counts as failed (default 900)")
    p.add_argument(
        "--command",
        help="drill this command line (quoted) in place of `keel train`: a script whose loop opens its run with "
        "keel.trainer.toolkit.open_run, which reads the drill's settings from KEEL_ARGS; give the job's world with --dp, "
        "and let its torchrun restart (--max-restarts) for the restart drills",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (default 1); more only when the machine holds the job several "
        "times over, e.g. a 1-process CPU job on a multi-core box",
    )
    return p


@dataclass
class DrillSetup:
    cfg: JobConfig
    job_argv: list[str]
    steps: int
    fault_step: int
    fault_rank: int
    checkpoint_every: int
    watchdog_floor: float
    timeout: float
    jobs: int
    folder: Path
    command: list[str] | None = None  # a user's script to drill in place of `keel train`


def parse_drill_args(argv: list[str]) -> tuple[DrillSetup, list[Drill]]:
    """The drill's setup and drills. Raises ConfigError (one line) on bad input."""
    opts, job_argv = build_parser().parse_known_args(argv)
    if opts.command is not None:  # a user's loop is data parallel over its world (--dp), whatever Keel's default job is
        job_argv = [*loop_layout_flags(train_parser().parse_known_args(job_argv)[0].dp or 1), *job_argv]
    cfg, _ = parse_train_args(job_argv)
    steps = opts.drill_steps or cfg.spike.warmup_steps + 30
    fault_step = opts.fault_step or cfg.spike.warmup_steps + 10
    fault_rank = cfg.world_size - 1 if opts.fault_rank is None else opts.fault_rank
    if not 1 <= fault_step < steps:
        raise ConfigError(f"--fault-step={fault_step}: must be in 1..{steps - 1} (--drill-steps={steps})")
    if not 0 <= fault_rank < cfg.world_size:
        raise ConfigError(f"--fault-rank={fault_rank}: the job has ranks 0..{cfg.world_size - 1}")
    if opts.checkpoint_every < 1 or opts.checkpoint_every >= fault_step:
        raise ConfigError(
            f"--checkpoint-every={opts.checkpoint_every}: must be at least 1 and below the fault step {fault_step}, "
            "so that a checkpoint exists to recover from"
        )
    resolve_run_dir(cfg)
    folder = Path(cfg.run.run_dir) / DRILL_DIR / ("drill-" + time.strftime("%Y%m%d-%H%M%S"))
    if opts.jobs < 1:
        raise ConfigError(f"--jobs={opts.jobs}: must be at least 1")
    command = shlex.split(opts.command) if opts.command is not None else None
    if command == []:
        raise ConfigError("--command: empty; give the script's command line, e.g. 'torchrun --nproc-per-node 2 --max-restarts 3 train.py'")
    setup = DrillSetup(
        cfg, job_argv, steps, fault_step, fault_rank, opts.checkpoint_every, opts.watchdog_floor, opts.timeout, opts.jobs, folder, command
    )
    return setup, select_drills(opts.suite, opts.faults, cfg.recovery.nonfinite_limit)


def select_drills(suite: str, faults: str | None, nonfinite_limit: int) -> list[Drill]:
    if faults is None:
        return [DRILLS[name] for name in SUITES[suite]]
    if faults.endswith(".toml"):
        try:
            items = tomllib.loads(Path(faults).read_text())["faults"]
        except (OSError, tomllib.TOMLDecodeError, KeyError) as e:
            raise ConfigError(f"--faults {faults}: cannot read a TOML list 'faults = [...]' from it ({e})") from None
    else:
        items = [x.strip() for x in faults.split(";") if x.strip()]
    drills = []
    for item in items:
        if "@" in item:
            try:
                fault = parse_fault(item)
            except ValueError as e:
                raise ConfigError(f"--faults: {e}") from None
            drill = drill_of(str(fault), str(fault), fault.step)
            if EventKind.NONFINITE in drill.expect.detect and fault.into != "param" and fault.steps < nonfinite_limit:
                # Too few to roll back: the guard skips the steps, which changes the trajectory by design.
                drill = replace(drill, expect=Expectation(detect=(EventKind.NONFINITE,), compare="none"))
            drills.append(drill)
        elif item in DRILLS:
            drills.append(DRILLS[item])
        else:
            raise ConfigError(f"--faults: unknown drill '{item}'; choose from {list(DRILLS)} or give a spec KIND@step=S[,rank=R]")
    if not drills:
        raise ConfigError("--faults: no drill given")
    names = [d.name for d in drills]
    if len(set(names)) < len(names):
        raise ConfigError(f"--faults: a drill is listed twice in {names}; give each once")
    return drills


class Progress:
    """A progress bar on the terminal, or a line per finished run when the output is not a terminal
    or several runs go at once."""

    def __init__(self, total: int, live: bool):
        self.total, self.done, self.live = total, 0, live and sys.stderr.isatty()
        self._lock = threading.Lock()

    def show(self, label: str, elapsed: float, final: str = "") -> None:
        width = 24
        filled = width * self.done // max(1, self.total)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label} {elapsed:5.0f} s {final}"
        if self.live:
            print("\r" + line.ljust(100), end="" if not final else "\n", file=sys.stderr, flush=True)
        elif final:
            print(line, file=sys.stderr, flush=True)

    def run(self, label: str, cmd: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None) -> int:
        start = time.monotonic()
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
        timed_out = False
        with (
            open(log_path, "w") as log,
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True) as proc,
        ):
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)  # the run's whole process tree: torchrun and its workers
                    proc.wait()
                    timed_out = True
                    break
                self.show(label, time.monotonic() - start)
                time.sleep(0.5)
        code = 124 if timed_out else proc.returncode
        with self._lock:
            self.done += 1
            self.show(label, time.monotonic() - start, "ok" if code == 0 else f"exit {code}")
        return code


class DrillRunner:
    def __init__(self, setup: DrillSetup, n_runs: int):
        self.setup, self.progress = setup, Progress(n_runs, live=setup.jobs == 1)
        (setup.folder / "runs").mkdir(parents=True, exist_ok=True)

    def train(self, name: str, extra: list[str]) -> tuple[Path, int]:
        s = self.setup
        run_dir = s.folder / "runs" / name
        flags = [
            *s.job_argv,
            f"--run-dir={run_dir}",
            f"--steps={s.steps}",
            f"--checkpoint.interval_steps={s.checkpoint_every}",
            f"--watchdog.floor_s={s.watchdog_floor}",
            "--monitor.prometheus=false",
            "--monitor.wandb=false",
            "--monitor.webhook_url=",
            "--chaos.faults=",
            "--chaos.mtbf_steps=0",
            *extra,
        ]
        log_path = s.folder / "runs" / f"{name}.log"
        if s.command is not None:  # the user's script reads the flags from KEEL_ARGS (keel.trainer.toolkit.loop)
            return run_dir, self.progress.run(name, s.command, log_path, s.timeout, {"KEEL_ARGS": shlex.join(flags)})
        return run_dir, self.progress.run(name, [sys.executable, "-m", "keel.cli", "train", *flags], log_path, s.timeout)


def expand(drill: Drill, setup: DrillSetup, step_time_s: float) -> list[str]:
    values = {
        "S": setup.fault_step,
        "R": setup.fault_rank,
        "K": setup.cfg.recovery.nonfinite_limit,
        "MS": max(50, round(2000 * step_time_s)),  # twice a step: a slowdown the straggler score must see
        "ROWS": max(1, setup.cfg.microbatch_rows // 2),
    }
    return [t.format(**values) for t in drill.faults]


def applicable(drill: Drill, cfg: JobConfig, command: list[str] | None = None) -> str | None:
    """Why a drill cannot run at this layout (or in a user's script, `command`), or None."""
    if command is not None and EventKind.OOM in drill.expect.detect:
        return "a loop Keel did not write splits its own micro-batches: Keel halves only its own trainer's"
    stage_ranks = cfg.parallel.dp * cfg.parallel.tp
    if stage_ranks < drill.expect.min_stage_ranks:
        return (
            f"needs {drill.expect.min_stage_ranks} ranks per pipeline stage to compare a slow rank with its peers; "
            f"this layout has {stage_ranks} (dp*tp)"
        )
    return None


def run_drills(setup: DrillSetup, drills: list[Drill]) -> list[DrillResult]:
    """The reference first (its step time sizes the straggler delays), then every fault run, then one
    reference per distinct set of skipped batches; `setup.jobs` runs at a time."""
    if all(applicable(d, setup.cfg, setup.command) for d in drills):  # nothing can run at this layout: no reference needed
        return [
            DrillResult(d.name, expand(d, setup, 0.0), "n/a", [applicable(d, setup.cfg, setup.command)], fault_step=setup.fault_step)
            for d in drills
        ]
    runner = DrillRunner(setup, len(drills) + 1)
    reference, code = runner.train("reference", [])
    if code != 0:
        raise RuntimeError(f"the fault-free reference run failed (exit {code}); see {setup.folder / 'runs' / 'reference.log'}")
    ref_steps = read_steps(reference, effective=True)
    step_time = float(ref_steps.step_time_s.iloc[len(ref_steps) // 2 :].median())
    plans = {d.name: (d, expand(d, setup, step_time), applicable(d, setup.cfg, setup.command)) for d in drills}
    runnable = [(d, specs) for d, specs, why_not in plans.values() if why_not is None]
    runner.progress.total -= len(drills) - len(runnable)
    with ThreadPoolExecutor(setup.jobs) as pool:
        runs = dict(
            zip(
                [d.name for d, _ in runnable],
                pool.map(lambda x: runner.train(x[0].name, x[0].train_args(setup) + [f"--fault={s}" for s in x[1]]), runnable),
            )
        )
        skips = {
            name: tuple(skipped_batches(read_events(run_dir)))
            for name, (run_dir, _) in runs.items()
            if plans[name][0].expect.compare == "skip" and (run_dir / STORE_FILE).exists()
        }
        wanted = sorted({s for s in skips.values() if s})
        runner.progress.total += len(wanted)
        names = [f"reference-skip-{i + 1}" for i in range(len(wanted))]
        made = pool.map(lambda x: runner.train(x[0], ["--data.skip_batches=" + ";".join(f"{a}:{b}" for a, b in x[1])]), zip(names, wanted))
        skip_refs = {s: (run_dir if code == 0 else None) for s, (run_dir, code) in zip(wanted, made)}
    hint = "" if setup.cfg.recovery.rollback else " (recovery.rollback is false in this job)"
    results = []
    for drill, specs, why_not in plans.values():
        if why_not:
            results.append(DrillResult(drill.name, specs, "n/a", [why_not], fault_step=setup.fault_step))
            continue
        run_dir, code = runs[drill.name]
        compare_with = skip_refs[skips[drill.name]] if skips.get(drill.name) else reference
        first = parse_fault(specs[0])
        results.append(judge(drill.name, specs, drill.expect, run_dir, code, compare_with, first.step, first.rank, hint))
    return results


def main(argv: list[str]) -> int:
    from keel.chaos.report import write_report

    try:
        setup, drills = parse_drill_args(argv)
    except ConfigError as e:
        print(f"keel drill: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    cfg = setup.cfg
    print(
        f"keel drill: {len(drills)} drills at pp{cfg.parallel.pp} dp{cfg.parallel.dp} tp{cfg.parallel.tp}, "
        f"{setup.steps} steps each, faults at step {setup.fault_step} on rank {setup.fault_rank}; in {setup.folder}",
        flush=True,
    )
    try:
        results = run_drills(setup, drills)
    except RuntimeError as e:
        print(f"keel drill: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    paths = write_report(setup, results)
    print(paths["table"], flush=True)
    print_failures(setup.folder, results)
    print(f"report: {paths['md']}  (also {paths['json'].name}, {paths['png'].name})", flush=True)
    return EXIT_OK if all(r.status != "fail" for r in results) else EXIT_FAILED


def print_failures(folder: Path, results: list[DrillResult]) -> None:
    """Why each failed drill failed, and the last lines of its run's console: what a person (or a CI log,
    the run directories gone) needs first."""
    for r in results:
        if r.status != "fail":
            continue
        print(f"{r.name} failed: {'; '.join(r.reasons)}", flush=True)
        log = folder / "runs" / f"{r.name}.log"
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            print(f"  the end of {log}:", *(f"  | {line}" for line in tail), sep="\n", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
