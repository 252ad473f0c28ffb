"""The process `keel train` starts on each node: PyTorch's own torchrun agent (torch.distributed.run),
with Keel's workers forked from a process that has already imported torch and the trainer.

A new interpreter imports torch and Keel's trainer again in every worker, 4.3 s of CPU each: on two
cores, 17 s before a pp2 dp2 tp2 job's first step, and again at every restart. Here the workers are
torchrun's function entrypoint `keel.trainer.launch.forked_worker.forked_main`, started with multiprocessing's
"forkserver" method, the server preloading the trainer: it imports them once, and each worker is a fork
of it, in milliseconds. Not a fork of the agent itself: the agent has threads (its rendezvous store),
and a fork copies whatever lock another thread held at that moment (a worker once hung forever in
getaddrinfo, on glibc's resolver lock). The server is a fresh interpreter with no other thread, and
it ends with the agent (keel.trainer.launch.fork_server). Any other worker module is started as torchrun starts it.

Started by `keel train` (which names the run directory in KEEL_RUN_DIR), the agent also decides each
restart by Keel's budget of `--max-restarts` failures in a row without progress (keel.trainer.launch.restarts)
rather than torchrun's life-long count of them, prints one line
per failure naming the rank that failed first, and keeps torchrun's own log lines and tracebacks in
RUN_DIR/logs/agent.log, off the console.

    python -m keel.trainer.launch.agent TORCHRUN_ARGS...   # exactly `torchrun TORCHRUN_ARGS...`
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

# The agent's own C++ warnings stay off the console: its rendezvous store's client retries a connection the
# server reset (seen with four agents on one host), and prints a stack trace per retry that succeeds (torch's
# noise, pytorch/pytorch#182725). Set before torch loads (it reads the level once), for this process only:
# `keel train` names the level the workers get, the user's own or torch's default.
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
import torch.distributed.run as torchrun  # noqa: E402
from torch.distributed.elastic.agent.server.api import WorkerState  # noqa: E402
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler  # noqa: E402

from keel.monitor.exits import EXIT_PREEMPTED
from keel.monitor.log_file import LogFile
from keel.monitor.run_dir import AGENT_LOG, LOG_DIR, list_checkpoints
from keel.trainer.launch.failure_board import FailureBoard
from keel.trainer.launch.forked_worker import forked_main
from keel.trainer.launch.restarts import RUN_DIR_ENV, TORCHRUN_MAX_RESTARTS, WORKERS_CPP_LOG_LEVEL_ENV, RestartBudget
from keel.trainer.preemption import AGENT_PID_ENV, PREEMPT_SIGNALS, note_signal

WORKER_MODULE = "keel.trainer.train"
# How long a node that joins a running job waits for the job's next checkpoint before the group restarts for it
# anyway: well inside torch's join_timeout (600 s by default), after which the joining node would give up.
GROW_WAIT_S = 300.0


def keel_config(config_from_args):
    """torchrun's config_from_args, with Keel's restart budget when `keel train` named a run directory,
    and Keel's worker module turned into a function forked by the server."""

    def config_with_forked_workers(args):
        config, cmd, cmd_args = config_from_args(args)
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir:
            budget = RestartBudget(run_dir, config.max_restarts)
            config.max_restarts = TORCHRUN_MAX_RESTARTS
            LocalElasticAgent._monitor_workers = budgeted(LocalElasticAgent._monitor_workers, budget)
            LocalElasticAgent._start_workers = passing_preemption_on(LocalElasticAgent._start_workers)
            LocalElasticAgent._restart_workers = counting_membership_restarts(LocalElasticAgent._restart_workers)
            DynamicRendezvousHandler.num_nodes_waiting = growing_at_checkpoints(DynamicRendezvousHandler.num_nodes_waiting, Path(run_dir))
        if not (args.module and args.training_script == WORKER_MODULE):
            return config, cmd, cmd_args
        multiprocessing.get_context("forkserver").set_forkserver_preload(["keel.trainer.launch.fork_server"])
        config.start_method = "forkserver"
        return config, forked_main, list(args.training_script_args)

    return config_with_forked_workers


def budgeted(monitor_workers, budget: RestartBudget):
    """torchrun's monitor of the worker group, with Keel's decision after each failure, agreed by every
    node (keel.trainer.launch.failure_board): the failure is attributed and recorded once for the job,
    the node that recorded it prints its one console line, and a spent budget stops every node's restarts."""
    since = time.time()
    board = FailureBoard(budget, socket.gethostname())
    joined = [None]  # the store of the round this node last joined

    def monitor(agent: LocalElasticAgent, worker_group):
        nonlocal since
        result = monitor_workers(agent, worker_group)
        store, key = worker_group.store, _round_key(agent, worker_group)
        ranks = [w.global_rank for w in worker_group.workers]
        if joined[0] is not store:
            board.joined(store, key, worker_group.group_rank, worker_group.group_world_size, ranks)
            joined[0] = store
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            if result.state == WorkerState.HEALTHY:
                board.still_running(store, key, ranks)
            return result
        exits = _exit_statuses(agent, worker_group, result.failures)
        if _preempting or EXIT_PREEMPTED in exits.values():  # the run was stopping for a preemption: no failure
            agent._remaining_restarts = 0
            return result
        failure, recorded_here = board.failed(store, key, ranks, exits, since)
        since = failure.time
        # One line for the job: on the node where the rank failed; when that node is gone, on the recording one.
        if failure.node == board.node if failure.rank is not None and failure.node is not None else recorded_here:
            print(failure.console_line(budget.max_in_a_row), file=sys.stderr, flush=True)
        if failure.gave_up:
            agent._remaining_restarts = 0  # torchrun stops the group and returns the failure
        return result

    return monitor


def growing_at_checkpoints(num_nodes_waiting, run_dir: Path):
    """torchrun's count of the nodes waiting to join a running job (a node back to an elastic job, or one more),
    held at 0 until the run has saved a checkpoint since the first of them arrived (at most GROW_WAIT_S):
    torchrun restarts the group as soon as it sees one, from the newest checkpoint, and every step since it
    would be trained again. So the job grows at its next checkpoint."""
    first_seen: list = [None]  # (when a node was first seen waiting, the newest checkpoint's step then)

    def waiting(handler) -> int:
        count = num_nodes_waiting(handler)
        if not count:
            first_seen[0] = None
            return 0
        newest = _newest_checkpoint_step(run_dir)
        if first_seen[0] is None:
            first_seen[0] = (time.monotonic(), newest)
            print(f"keel train: {count} node(s) waiting to join: growing at the next checkpoint", file=sys.stderr, flush=True)
        since, step = first_seen[0]
        return count if newest > step or time.monotonic() - since > GROW_WAIT_S else 0

    return waiting


def _newest_checkpoint_step(run_dir: Path) -> int:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1][0] if checkpoints else 0


def counting_membership_restarts(restart_workers):
    """torchrun's restart of the worker group, counted also when it is no failure's but a node's that joined
    (a replacement, or a node coming back to an elastic job): torchrun does not count those, and workers that
    see no restart would start the run over instead of loading its newest checkpoint."""

    def restart(agent: LocalElasticAgent, worker_group):
        if worker_group.state == WorkerState.HEALTHY:  # a failure's restart comes with FAILED or UNHEALTHY
            agent._remaining_restarts -= 1
        return restart_workers(agent, worker_group)

    return restart


_preempting = False  # whether this node's agent has passed a preemption on to its workers


def passing_preemption_on(start_workers):
    """torchrun's start of the workers, after which a preemption (SIGTERM or SIGUSR1 to the agent, alone or
    with its process group) is passed on to the workers as SIGUSR1, so that they save and end within the
    grace (keel.trainer.preemption), instead of torchrun's own handling: SIGTERM to the workers at once,
    which they read as being stopped. torchrun sets its handlers at every start, hence here."""

    def start(agent: LocalElasticAgent, worker_group):
        pids = start_workers(agent, worker_group)

        def pass_on(signum, frame):
            global _preempting
            first, _preempting = not _preempting, True  # set before printing: a second signal may land mid-print
            if first:
                # No signal name: keel train passes its own SIGTERM on as SIGUSR1; its last line names the first.
                print("keel train: preempted: saving the current step, then stopping", file=sys.stderr, flush=True)
                note_signal(os.environ[RUN_DIR_ENV], signum)
            for pid in pids.values():  # the pids, not the agent: a handler holding it kept torch's queues alive
                with contextlib.suppress(ProcessLookupError):  # a worker that has just ended
                    os.kill(pid, signal.SIGUSR1)

        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, pass_on)
        return pids

    return start


def _round_key(agent: LocalElasticAgent, worker_group) -> str:
    """The key of this rendezvous round's failure in the round's store. torch's c10d rendezvous gives every
    round a store of its own; the static one (--standalone, --master-addr) shares one store across its
    rounds, whose agents restart together: there the restart count tells the rounds apart."""
    if hasattr(worker_group.spec.rdzv_handler, "_state_holder"):
        return "keel/failure"
    return f"keel/failure/{worker_group.spec.max_restarts - agent._remaining_restarts}"


def _exit_statuses(agent: LocalElasticAgent, worker_group, failures: dict) -> dict[int, int]:
    """Every local rank's exit status by global rank. torchrun's result names one failed process; the
    forked processes it stopped still hold their own statuses (-SIGTERM for those it stopped)."""
    exits = {rank: failure.exitcode for rank, failure in failures.items()}
    processes = getattr(getattr(agent._pcontext, "_pc", None), "processes", None) or []
    for local_rank, process in enumerate(processes):
        if process.exitcode is not None:
            exits.setdefault(worker_group.workers[local_rank].global_rank, process.exitcode)
    return exits


def _logs_off_console(run_dir: Path) -> None:
    """torchrun's log lines (a traceback per failure, most of them about the peers that saw a connection
    drop) go to RUN_DIR/logs/agent.log; the console gets Keel's one line per failure."""
    (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    handler = LogFile(run_dir / LOG_DIR / AGENT_LOG, delay=True)  # no file for a run torch said nothing of
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # torch gives its own stderr handler to "torch" and to some packages below it (torch.distributed).
    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    for logger in map(logging.getLogger, names):
        console = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        for old in console:
            logger.removeHandler(old)
        if console:
            logger.addHandler(handler)


def _restore_workers_log_level() -> None:
    """The workers' C++ log level: the one the user set (keel train passes it on), or torch's default."""
    level = os.environ.pop(WORKERS_CPP_LOG_LEVEL_ENV, "")
    if level:
        os.environ["TORCH_CPP_LOG_LEVEL"] = level
    else:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def run_agent() -> int:
    """torchrun's exit status: 0, SystemExit's code (argparse's 2), or 1 with the traceback for any other
    exception, as the interpreter gives. Ctrl-C also gives 1 here, where the interpreter would end by
    SIGINT; `keel train` gets the same Ctrl-C and returns its own code."""
    # torchrun's run() launches whatever entrypoint config_from_args gives it: the one place to swap the
    # worker command for a forked function without writing run() again.
    torchrun.config_from_args = keel_config(torchrun.config_from_args)
    _restore_workers_log_level()
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        os.environ[AGENT_PID_ENV] = str(os.getpid())
        _logs_off_console(Path(run_dir))
        # A crash of the agent itself (a segfault in its rendezvous store, an abort) prints its threads'
        # stacks; `keel train` sees the signal and resumes the run.
        faulthandler.enable(all_threads=True)
    try:
        torchrun.main()
    except SystemExit as e:  # argparse's usage errors (2), or an explicit exit
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except (ChildFailedError, SignalException, KeyboardInterrupt):  # a worker failed past its restarts, or a signal
        if run_dir:  # the console has had its line per failure; `keel train` says how the run ended
            logging.getLogger("torch").error("torchrun ended with a failure\n%s", traceback.format_exc())
        else:
            traceback.print_exc()
        return 1
    except BaseException as e:  # the agent's own failure: its rendezvous, starting the workers
        if run_dir:
            logging.getLogger("torch").error("torchrun's agent failed\n%s", traceback.format_exc())
            print(f"keel train: torchrun's agent failed: {type(e).__name__}: {e}; see logs/{AGENT_LOG}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = run_agent()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
