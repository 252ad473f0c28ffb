"""`keel train`: parse flags and overrides, validate everything, then start torchrun with pp·dp·tp workers;
at the end, print the commands that show the run and upload its offline W&B runs.

torchrun restarts failed workers as Keel's budget allows (keel.trainer.launch.restarts, decided in the agent).
When the agent itself dies of a signal (SIGKILL: the node's processes vanished; SIGSEGV or SIGABRT: the
agent crashed, and its workers ended with it), `keel train` resumes the run as a cluster scheduler would
requeue it, under the same budget. When the budget is spent, it records
`run_stopped` with an alert and prints the command that resumes the run; a Ctrl-C records `run_stopped`
too (no alert), so that the run reads stopped rather than killed.

All checks that can fail on user input run here, before any worker exists, so a mistake costs one
line of output and not a stack trace from eight processes.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_HANG, EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED, EXIT_RESTART_CAP
from keel.monitor.redact import REDACTED
from keel.monitor.run_dir import CONFIG_FILE, CONTROL_DIR, DUMP_DIR, STORE_FILE, wandb_offline_runs
from keel.monitor.run_lock import RunDirBusy, check_free
from keel.monitor.store import RunStore, last_event, step_bounds
from keel.trainer.checkpoint.manifest import config_record, newest_manifest, vet_resume
from keel.trainer.config import ConfigError, JobConfig, check_run_dir, load_config, validate
from keel.trainer.data.blend import open_job_data
from keel.trainer.data.documents import eod_to_mask
from keel.trainer.data.validation import split_for_validation
from keel.trainer.launch.lifetime import end_with_parent
from keel.trainer.launch.restarts import (
    RUN_DIR_ENV,
    WORKERS_CPP_LOG_LEVEL_ENV,
    Failure,
    Node,
    RestartBudget,
    ended_unrecorded,
    furthest_step,
    last_failure,
)
from keel.trainer.model_args import allocated_params, model_args
from keel.trainer.planning.memory_model import MODEL_STATE_BYTES_PER_PARAM
from keel.trainer.preemption import PREEMPT_SIGNALS, note_signal, take_signal_note

# Flags passed through to torchrun so that the same command spans machines.
TORCHRUN_OPTIONS = (
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_id",
    "master_addr",
    "master_port",
    "max_restarts",
    "rdzv_conf",
)
# Short flags for everyday fields.
SHORT_FLAGS = {
    "pp": "parallel.pp",
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "steps": "training.steps",
    "seed": "training.seed",
    "run_dir": "run.run_dir",
}
DEFAULT_CONFIG = "small"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="keel train",
        description="Train with pp x dp x tp processes. Any config field can be set as --section.key=value.",
        epilog="Example: keel train --config tiny --pp 2 --dp 2 --tp 2 --optim.lr=1e-3",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML file or preset name (default: {DEFAULT_CONFIG})")
    for name in ("pp", "dp", "tp", "steps", "seed"):
        p.add_argument(f"--{name}", type=int, help=f"shorthand for --{SHORT_FLAGS[name]}")
    p.add_argument("--run-dir", dest="run_dir", help="output directory (default: runs/<run_id>)")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print keel plan's estimate of this layout before training and keep it (keel plan --check RUN_DIR)",
    )
    p.add_argument("--fault", action="append", default=[], metavar="KIND@step=S[,rank=R]", help="inject a fault (repeatable)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest good checkpoint, with its config.toml "
        "(flags and overrides given here still apply, e.g. --steps to train longer)",
    )
    p.add_argument(
        "--reset-restarts",
        dest="reset_restarts",
        action="store_true",
        help="with --resume: the failures so far no longer count against --max-restarts (after fixing what made the run give up)",
    )
    tr = p.add_argument_group("torchrun (multi-node)")
    tr.add_argument(
        "--nnodes",
        type=node_range,
        default=(1, 1),
        metavar="N or MIN:MAX",
        help="nodes of the job; MIN:MAX: a job that lost nodes goes on with MIN or more, at a smaller dp (pp x tp kept, "
        "the same global batch in more micro-batches), and grows back when they return",
    )
    tr.add_argument("--node-rank", dest="node_rank", type=int)
    tr.add_argument("--rdzv-endpoint", dest="rdzv_endpoint")
    tr.add_argument("--rdzv-backend", dest="rdzv_backend")
    tr.add_argument("--rdzv-id", dest="rdzv_id")
    tr.add_argument("--master-addr", dest="master_addr")
    tr.add_argument("--master-port", dest="master_port", type=int)
    tr.add_argument("--rdzv-conf", dest="rdzv_conf", help="torchrun's --rdzv-conf, e.g. join_timeout=900")
    tr.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        default=3,
        help="failures in a row without progress (no step past the previous failure's) before the run stops; "
        "a failure after progress starts the count again; default 3",
    )
    return p


def node_range(text: str) -> tuple[int, int]:
    """`--nnodes` as torchrun takes it: N, or MIN:MAX for an elastic job."""
    low, colon, high = text.partition(":")
    try:
        low, high = int(low), int(high if colon else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give a number of nodes (2) or a range (1:2)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"'{text}': nodes must be at least 1, and MIN at most MAX (1:2)")
    return low, high


def _dotted_overrides(extra: list[str]) -> list[str]:
    """Turns the leftover arguments into "section.key=value" strings; anything else is an error."""
    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        name = arg.removeprefix("--").partition("=")[0]
        if not arg.startswith("--") or "." not in name:
            raise ConfigError(f"unknown option '{arg}': see `keel train --help`; config fields are set as --section.key=value")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(extra):
            out.append(f"{name}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"option '{arg}' needs a value: --{name}=VALUE")
    return out


def parse_train_args(argv: list[str], world_size: int | None = None) -> tuple[JobConfig, argparse.Namespace]:
    """The validated JobConfig and the parsed flags. Raises ConfigError on any bad input."""
    opts, extra = build_parser().parse_known_args(argv)
    opts.min_nodes, opts.nnodes = opts.nnodes
    if opts.reset_restarts and not opts.resume:
        raise ConfigError("--reset-restarts: only with --resume RUN_DIR (a new run has no failures to forget)")
    if opts.max_restarts < 0:
        raise ConfigError(f"--max-restarts={opts.max_restarts}: must be 0 or more (0: stop at the first failure)")
    overrides = [f"{SHORT_FLAGS[k]}={getattr(opts, k)}" for k in SHORT_FLAGS if getattr(opts, k) is not None]
    if opts.fault:
        overrides.append("chaos.faults=" + ";".join(opts.fault))
    if opts.plan:
        overrides.append("metrics.plan=true")
    source = opts.config
    if opts.resume:
        source = str(resume_config(opts.resume))
        overrides += [f"run.run_dir={opts.resume}", "run.resume=true"]
    cfg = load_config(source, _dotted_overrides(extra) + overrides)
    if opts.min_nodes < opts.nnodes and not cfg.parallel.elastic_dp:
        cfg.parallel.elastic_dp = cfg.parallel.dp  # the full job's; fewer nodes train at a smaller dp
    if opts.resume:
        _forget_redacted_secrets(cfg)
    validate(cfg, world_size)
    return cfg, opts


def loop_layout_flags(world: int) -> list[str]:
    """A loop Keel did not write (keel.trainer.toolkit), in `keel train`'s terms: data parallel over its whole
    world. Its batch is its own: the trainer's batch fields only have to pass their checks."""
    return ["--pp=1", "--tp=1", f"--dp={world}", f"--training.global_batch_size={world}", "--training.microbatches=1"]


def resume_config(run_dir: str) -> Path:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no {CONFIG_FILE} there; pass the run directory of an earlier `keel train`")
    return path


def check_resume(cfg: JobConfig, data_version: str) -> str | None:
    """Refuses (ConfigError) a resume whose newest checkpoint holds another model or data, so no worker
    starts to find out; returns the line that says how the parallel layout changed, or None."""
    found = newest_manifest(cfg.run.run_dir)
    if found is None:
        return None
    checkpoint, manifest = found
    return vet_resume(manifest, checkpoint, config_record(cfg, data_version))


def _forget_redacted_secrets(cfg: JobConfig) -> None:
    """A resumed run reads a config.toml whose secrets were redacted: they come from the environment
    again (KEEL_WEBHOOK_URL, WANDB_API_KEY), never from the placeholder."""
    for section in vars(cfg).values():
        for key, value in vars(section).items():
            if value == REDACTED:
                setattr(section, key, "")


def resolve_run_dir(cfg: JobConfig) -> None:
    if not cfg.run.run_id:
        cfg.run.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    if not cfg.run.run_dir:
        cfg.run.run_dir = str(Path("runs") / cfg.run.run_id)


def name_multi_node_run(cfg: JobConfig, opts: argparse.Namespace) -> None:
    """Every node's launcher must name the same run: the same directory (without --run-dir each would make
    up its own, and the ranks would write their shards and logs to different places) and the same run id
    (the one its alerts and W&B carry). The rendezvous id names it, or else the run directory."""
    if opts.nnodes == 1 or cfg.run.run_id:
        return
    if not opts.rdzv_id and not cfg.run.run_dir:
        raise ConfigError(
            f"--nnodes={opts.nnodes} without --run-dir: each node would write a run directory of its own; "
            "give every node the same --run-dir (on a shared filesystem) or the same --rdzv-id"
        )
    cfg.run.run_id = opts.rdzv_id or Path(cfg.run.run_dir).name


def check_model_fits(cfg: JobConfig, nnodes: int) -> None:
    """Refuses a model whose states alone cannot fit in this machine's memory, in one line before any
    worker starts: a typo in model.* (a vocabulary or width a thousand times too big) otherwise ends in
    every worker's allocation traceback. A lower bound (no activations), checked on CPU machines only:
    a GPU job's states live in GPU memory, which the planner accounts for."""
    if os.path.exists("/dev/nvidiactl"):
        return
    args = model_args(cfg)
    params = allocated_params(args, cfg.parallel.tp)
    needed = MODEL_STATE_BYTES_PER_PARAM * params / nnodes
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        fields = ", ".join(f"model.{k}={getattr(args, k)}" for k in ("vocab_size", "dim", "n_layers", "ffn_dim"))
        raise ConfigError(
            f"{fields}: {params:,} parameters need at least {needed / 2**30:,.0f} GiB per node for weights, gradients and "
            f"optimizer state, more than this machine's {memory / 2**30:,.0f} GiB; choose a smaller model or more nodes (--nnodes)"
        )


def torchrun_command(cfg: JobConfig, opts: argparse.Namespace, worker_argv: list[str], module: str = "keel.trainer.train") -> list[str]:
    if cfg.world_size % opts.nnodes:
        raise ConfigError(f"--nnodes={opts.nnodes}: pp*dp*tp={cfg.world_size} processes do not split evenly over the nodes")
    # keel.trainer.launch.agent is torchrun itself, only quicker to exit.
    cmd = [
        sys.executable,
        "-m",
        "keel.trainer.launch.agent",
        f"--nproc-per-node={cfg.world_size // opts.nnodes}",
        f"--nnodes={opts.nnodes if opts.min_nodes == opts.nnodes else f'{opts.min_nodes}:{opts.nnodes}'}",
    ]
    if opts.nnodes == 1 and not opts.rdzv_endpoint and not opts.master_addr:
        cmd.append("--standalone")  # a free local port, no fixed 29500 to collide on
    for name in TORCHRUN_OPTIONS[2:]:
        value = getattr(opts, name)
        if value is not None:
            cmd.append(f"--{name.replace('_', '-')}={value}")
    if opts.node_rank is not None:
        cmd.append(f"--node-rank={opts.node_rank}")
    return cmd + ["-m", module, *worker_argv]


def main(argv: list[str]) -> int:
    try:
        cfg, opts = parse_train_args(argv)
        name_multi_node_run(cfg, opts)
        resolve_run_dir(cfg)
        check_run_dir(cfg.run.run_dir)
        if opts.nnodes == 1:  # a trainer still on this run (a resume beside it) is refused here; a node that
            check_free(cfg.run.run_dir)  # joins a running job finds rank 0's lock held, as it should
        # A missing, empty or too-wide data file fails here, once, not in every worker.
        data = open_job_data(cfg)
        split_for_validation(cfg, data, model_args(cfg).vocab_size)  # validation data that cannot serve fails here too
        eod_to_mask(cfg, data)
        check_model_fits(cfg, opts.nnodes)
        layout_change = check_resume(cfg, data.version) if cfg.run.resume else None
        worker_argv = _strip_torchrun_values(argv) + [f"--run.run_id={cfg.run.run_id}", f"--run.run_dir={cfg.run.run_dir}"]
        cmd = torchrun_command(cfg, opts, worker_argv)
    except (ConfigError, RunDirBusy) as e:
        print(f"keel train: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.run.resume and (opts.node_rank or 0) == 0:  # one node decides for the job
        budget = RestartBudget(run_dir, opts.max_restarts)
        if opts.reset_restarts:
            budget.reset()
        elif ended_unrecorded(run_dir) and count_vanished_start(cfg, budget):
            return EXIT_RESTART_CAP
    if layout_change:
        print(f"keel train: {layout_change}")
    print(
        f"keel train: {cfg.world_size} processes (pp{cfg.parallel.pp} dp{cfg.parallel.dp} tp{cfg.parallel.tp}), run dir {cfg.run.run_dir}",
        flush=True,
    )
    # Ctrl-C stops the run whatever this process inherited: a job started in the background by a script
    # ignores SIGINT, yet torchrun handles it anyway and stops the workers, so this process must too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = run_torchrun(cmd, {**worker_env(cfg, opts, run_dir), RUN_DIR_ENV: str(run_dir)}, run_dir, opts.max_restarts, opts.nnodes)
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops the workers
        record_interrupt(run_dir)
        return EXIT_INTERRUPTED
    finally:  # the snapshot files this node's workers left (a crash's last restart, a kill): host memory, given back
        folder = cfg.checkpoint.snapshot_folder(run_dir)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    code = exit_code_of_run(run_dir, code)
    if preempted_by and code not in (EXIT_OK, EXIT_PREEMPTED):
        code = record_unsaved_preemption(run_dir, *preempted_by[0])
    if code == EXIT_PREEMPTED:
        print(preemption_line(run_dir), file=sys.stderr)
    if code == EXIT_RESTART_CAP:
        failure = last_failure(run_dir)
        if claim_once(run_dir, f"gave-up-{failure.restart}"):  # every node's launcher ends here; one reports
            report_give_up(cfg, run_dir, failure)
        else:
            print(f"keel train: stopped: the job's restart budget is spent ({failure.describe()})", file=sys.stderr)
    for line in next_commands(run_dir):
        print(line)
    return code


def run_torchrun(cmd: list[str], env: dict[str, str], run_dir: Path, max_restarts: int, nnodes: int = 1) -> int:
    """torchrun's exit status, after resuming the run each time the agent itself died of a signal (killed:
    the node's processes vanished; or crashed) while the restart budget allows it. A signal the agent
    handles (SIGTERM, SIGINT) ends it with an exit status, not by the signal: that stop is not resumed.
    On one of several nodes the agent is started again, to join the job's next rendezvous round as a
    replaced node would; the job's other nodes count the failure."""
    while True:
        started = time.time()
        # torchrun ends with this process (and its workers with torchrun): nothing trains on unwatched.
        code = _wait_passing_preemption_on(subprocess.Popen(cmd, env=env, preexec_fn=end_with_parent), run_dir)
        if code >= 0 or preempted_by:
            return code
        if nnodes > 1:  # the job goes on without this node; the other nodes record its loss (failure_board)
            print(f"keel train: this node's agent ended by {signal.Signals(-code).name}; rejoining the job", file=sys.stderr, flush=True)
            continue
        failure = RestartBudget(run_dir, max_restarts).record(None, code, started, {0: Node(socket.gethostname(), [], False)})
        print(failure.console_line(max_restarts, "resuming the run as a scheduler would"), file=sys.stderr, flush=True)
        if failure.gave_up:
            return EXIT_FAILED
        if "--run.resume=true" not in cmd:
            cmd = [*cmd, "--run.resume=true"]  # the new workers must load the newest checkpoint


preempted_by: list[tuple[int, float]] = []  # (the signal, when) that preempted this launcher


def _wait_passing_preemption_on(agent: subprocess.Popen, run_dir: Path) -> int:
    """The agent's exit status. A preemption (SIGTERM: Kubernetes, SLURM; SIGUSR1: SLURM's --signal) to this
    process is passed on to the agent as SIGUSR1, which passes it to the workers: they save the current
    step and end (keel.trainer.preemption). A signal to the whole process group reaches the agent too."""

    def pass_on(signum, frame):
        if not preempted_by:
            preempted_by.append((signum, time.time()))
            note_signal(run_dir, signum)
        if agent.poll() is None:
            agent.send_signal(signal.SIGUSR1)

    previous = {sig: signal.signal(sig, pass_on) for sig in PREEMPT_SIGNALS}
    try:
        return agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def record_interrupt(run_dir: Path) -> None:
    """A Ctrl-C ends the run on purpose: `run_stopped` with its exit code, so that the run reads stopped, not
    killed, and a resume does not count it as processes that vanished. No alert: whoever pressed it knows."""
    if not (run_dir / STORE_FILE).exists():
        return  # stopped before the first worker wrote anything
    with RunStore(run_dir) as store:  # opened first: it completes the tables of a store a worker had just begun
        bounds = step_bounds(run_dir)
        store.write_event(
            EventKind.RUN_STOPPED,
            "run stopped: interrupted (Ctrl-C)",
            step=None if bounds is None else bounds[1],
            data={"exit_code": EXIT_INTERRUPTED, "reason": "interrupted (Ctrl-C)"},
        )


def count_vanished_start(cfg: JobConfig, budget: RestartBudget) -> bool:
    """The run's last start vanished without a record (its node lost, the job killed; a scheduler's requeue
    or a person resumes it): a failure of the run's budget, so that a loop of starts that die, driven by a
    scheduler, stops too. Returns whether the budget is spent (then reported, and nothing starts)."""
    run_dir = budget.run_dir
    failure = budget.record(None, -signal.SIGKILL, time.time(), {0: Node("an unknown host", [], False)})
    if not failure.gave_up:
        return False
    print(failure.console_line(budget.max_in_a_row), file=sys.stderr, flush=True)
    if claim_once(run_dir, f"gave-up-{failure.restart}"):
        report_give_up(cfg, run_dir, failure)
    return True


def preemption_line(run_dir: Path) -> str:
    """The console's line for a preempted run: what was saved, what was lost, and how to go on."""
    found = last_event(run_dir, [EventKind.PREEMPTED])
    data = found[1] if found else {"signal": "a signal", "saved_step": 0, "lost_steps": 0}
    lost = f", {data['lost_steps']} steps since lost" if data["lost_steps"] else ""
    saved = f"step {data['saved_step']} saved" if data["saved_step"] else "no checkpoint yet"
    return (
        f"keel train: preempted by {data['signal']}: {saved}{lost}; "
        f"exit code {EXIT_PREEMPTED}; resume: keel train --resume {_shown(run_dir)}"
    )


def record_unsaved_preemption(run_dir: Path, signum: int, when: float) -> int:
    """A preemption whose save did not finish within the grace (the workers ended without recording it):
    `preempted` and `run_stopped` with the steps it costs, the newest complete checkpoint standing."""
    found = newest_manifest(str(run_dir))
    saved = int(found[1]["step"]) if found else 0
    with RunStore(run_dir) as store:
        last = furthest_step(run_dir)
        name = take_signal_note(run_dir) or signal.Signals(signum).name
        message = (
            f"preempted ({name}): the save did not finish in {time.time() - when:.0f} s; step {saved} stands, {last - saved} steps lost"
        )
        data = {"signal": name, "saved_step": saved, "lost_steps": last - saved, "exit_code": EXIT_PREEMPTED}
        store.write_event(EventKind.PREEMPTED, message, severity="warning", step=saved, data=data)
        stopped = {"exit_code": EXIT_PREEMPTED, "reason": f"preempted ({name})"}
        store.write_event(EventKind.RUN_STOPPED, f"run stopped: preempted ({name})", severity="warning", step=last, data=stopped)
    return EXIT_PREEMPTED


def claim_once(run_dir: Path, name: str) -> bool:
    """Whether this process is the first of the job's launchers to claim `name` (an atomic create in the
    shared run directory): what happens once per job, not once per node."""
    path = run_dir / CONTROL_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def report_give_up(cfg: JobConfig, run_dir: Path, failure: Failure) -> None:
    """The spent restart budget, everywhere a person looks: `run_stopped` and its alert (run store,
    webhook, W&B), and one console line with the command that resumes the run."""
    # Imported here: torch and the sinks load only for a run that gave up.
    from keel.monitor.recorder import RunRecorder
    from keel.trainer.incidents import Incidents
    from keel.trainer.recorder_setup import build_sinks

    reason = f"{failure.in_a_row} failures in a row without progress, the last: {failure.describe()}"
    recorder = RunRecorder(cfg.run.run_id, RunStore(run_dir), build_sinks(cfg, run_dir, prometheus=False), cfg.monitor.alert_throttle_s)
    Incidents(recorder, cfg.run.run_id).stopped(failure.step, None, reason, EXIT_RESTART_CAP)
    recorder.close()
    print(f"keel train: stopped: {reason}. Fix the cause, then resume: keel train --resume {_shown(run_dir)}", file=sys.stderr)


def worker_env(cfg: JobConfig, opts: argparse.Namespace, run_dir: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **nccl_resilience_env(run_dir)}
    env[WORKERS_CPP_LOG_LEVEL_ENV] = os.environ.get("TORCH_CPP_LOG_LEVEL", "")  # the agent quiets its own (agent.py)
    if opts.nnodes > 1:
        # Each rendezvous round's workers get a store of their own, on rank 0's host. With the rendezvous
        # store shared (torch's default), a node that replaces a lost one waits forever for connection
        # details the survivors cached from the round before (torch 2.13's dynamic rendezvous).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Share the cores among the local workers (torchrun would pin every worker to 1 thread).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (cfg.world_size // opts.nnodes))))
    return env


def nccl_resilience_env(run_dir: Path) -> dict[str, str]:
    """On GPUs: NCCL errors and timeouts end the process (so torchrun can restart it) instead of hanging,
    and the flight recorder dumps the last collectives of every rank to RUN_DIR/dumps/ on a timeout.
    A user's own setting wins. (No effect with gloo on CPU.)"""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str((run_dir / DUMP_DIR / "nccl_trace_rank_").resolve()),
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def exit_code_of_run(run_dir: Path, torchrun_code: int) -> int:
    """torchrun reports 1 for any failure; the run store says which (see keel.monitor.exits)."""
    try:
        last = last_event(run_dir, [EventKind.RUN_STARTED, EventKind.RUN_FINISHED, EventKind.RUN_STOPPED, EventKind.HANG, EventKind.OOM])
    except (FileNotFoundError, sqlite3.Error):
        return torchrun_code
    if last is not None and last[0] == EventKind.RUN_STOPPED:
        return int(last[1]["exit_code"])
    if torchrun_code == 0:
        return EXIT_OK
    failure = last_failure(run_dir)
    if failure is not None and failure.gave_up:
        return EXIT_RESTART_CAP
    return {EventKind.HANG: EXIT_HANG, EventKind.OOM: EXIT_OOM}.get(None if last is None else last[0], EXIT_FAILED)


def next_commands(run_dir: Path) -> list[str]:
    """What `keel train` prints last: the command that shows the run, and the one that uploads its
    offline W&B runs (if any). Nothing on a node whose rank 0 is elsewhere: the run store is there."""
    if not (run_dir / STORE_FILE).is_file():
        return []
    lines = [f"Watch it:   keel dashboard {_shown(_dashboard_folder(run_dir))}"]
    offline = wandb_offline_runs(run_dir)
    if offline:
        lines.append(f"Upload it:  wandb sync {' '.join(map(_shown, offline))}")
    return lines


def _dashboard_folder(run_dir: Path) -> Path:
    """The folder holding the run, so the dashboard lists it beside its siblings (runs/ by default);
    the run itself when that folder is the working directory or above it, where the dashboard would
    search every folder below (a virtual environment, say)."""
    parent = run_dir.resolve().parent
    return run_dir if Path.cwd().resolve().is_relative_to(parent) else parent


def _shown(path: Path) -> str:
    """A path to copy and paste: relative to the working directory when below it, quoted for the shell."""
    path = path.resolve()
    if path.is_relative_to(Path.cwd().resolve()):
        path = path.relative_to(Path.cwd().resolve())
    return shlex.quote(str(path))


def _strip_torchrun_values(argv: list[str]) -> list[str]:
    """argv without the torchrun flags (and their values), which the workers must not see."""
    # --nnodes stays: a worker of an elastic job (MIN:MAX) learns from it that its world may be smaller.
    flags = {f"--{name.replace('_', '-')}" for name in TORCHRUN_OPTIONS if name != "nnodes"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.partition("=")[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
