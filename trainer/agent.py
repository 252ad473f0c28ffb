"""The process `keel train` starts on each node: PyTorch's own torchrun agent (torch.distributed.run),
with Keel's workers forked from a process that has already imported torch and the trainer.

A new interpreter imports torch and Keel's trainer again in every worker, 4.3 s of CPU each: on two
cores, 17 s before a pp2 dp2 tp2 job's first step, and again at every restart. Here the workers are
torchrun's function entrypoint `keel.trainer.forked_worker.forked_main`, started with multiprocessing's
"forkserver" method, the server preloading the trainer: it imports them once, and each worker is a fork
of it, in milliseconds. Not a fork of the agent itself: the agent has threads (its rendezvous store),
and a fork copies whatever lock another thread held at that moment (a worker once hung forever in
getaddrinfo, on glibc's resolver lock). The server is a fresh interpreter with no other thread, and
it ends with the agent (keel.trainer.fork_server). Any other worker module is started as torchrun starts it.

    python -m keel.trainer.agent TORCHRUN_ARGS...   # exactly `torchrun TORCHRUN_ARGS...`
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback

import torch.distributed.run as torchrun

from keel.trainer.forked_worker import forked_main

WORKER_MODULE = "keel.trainer.train"


def forking(config_from_args):
    """torchrun's config_from_args, with Keel's worker module turned into a function forked by the server."""

    def config_with_forked_workers(args):
        config, cmd, cmd_args = config_from_args(args)
        if not (args.module and args.training_script == WORKER_MODULE):
            return config, cmd, cmd_args
        multiprocessing.get_context("forkserver").set_forkserver_preload(["keel.trainer.fork_server"])
        config.start_method = "forkserver"
        return config, forked_main, list(args.training_script_args)

    return config_with_forked_workers


def run_agent() -> int:
    """torchrun's exit status: 0, SystemExit's code (argparse's 2), or 1 with the traceback for any other
    exception, as the interpreter gives. Ctrl-C also gives 1 here, where the interpreter would end by
    SIGINT; `keel train` gets the same Ctrl-C and returns its own code."""
    # torchrun's run() launches whatever entrypoint config_from_args gives it: the one place to swap the
    # worker command for a forked function without writing run() again.
    torchrun.config_from_args = forking(torchrun.config_from_args)
    try:
        torchrun.main()
    except SystemExit as e:  # argparse's usage errors (2), or an explicit exit
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # a worker failed past its restarts (ChildFailedError), or a signal
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = run_agent()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
