"""The process `keel train` starts on each node: PyTorch's own torchrun agent (torch.distributed.run),
with Keel's workers forked from it rather than started as new interpreters.

A new interpreter imports torch and Keel's trainer again in every worker, 4.3 s of CPU each: on two
cores, 17 s before a pp2 dp2 tp2 job's first step, and again at every restart. The agent imports them
once and forks each worker from itself (torchrun's function entrypoint, start method "fork"), so a
worker starts in milliseconds with the modules already loaded. The agent has started no accelerator
context and trained nothing when it forks. Any other worker module is started as torchrun starts it.

    python -m keel.trainer.agent TORCHRUN_ARGS...   # exactly `torchrun TORCHRUN_ARGS...`
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import torch.distributed.run as torchrun

WORKER_MODULE = "keel.trainer.train"


def forked_worker(*argv: str) -> None:
    """One worker, in a process forked from the agent: `keel.trainer.train`'s main."""
    # The agent's handlers turn these signals into exceptions for its own shutdown; a worker ends on them.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from keel.trainer import train

    sys.argv = [train.__file__, *argv]  # what the worker's own interpreter would have had (W&B records it)
    code = train.main(list(argv))
    logging.shutdown()
    if code:
        sys.exit(code)  # the worker's exit status, as torchrun sees a failed process


def forking(config_from_args):
    """torchrun's config_from_args, with Keel's worker module turned into `forked_worker`, forked."""

    def config_with_forked_workers(args):
        config, cmd, cmd_args = config_from_args(args)
        if not (args.module and args.training_script == WORKER_MODULE):
            return config, cmd, cmd_args
        import keel.trainer.train  # noqa: F401  (imported here, once, before the workers are forked)

        config.start_method = "fork"
        return config, forked_worker, list(args.training_script_args)

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
