"""The process `keel train` starts on each node: PyTorch's own torchrun agent (torch.distributed.run),
unchanged, ended without Python's teardown of the torch modules it imported. That teardown costs 0.6 s
of CPU at the end of every run, after the workers are done and the agent has nothing left to write.

    python -m keel.trainer.agent TORCHRUN_ARGS...   # exactly `torchrun TORCHRUN_ARGS...`
"""

from __future__ import annotations

import os
import sys
import traceback

from torch.distributed.run import main as torchrun_main


def run_agent() -> int:
    """torchrun's exit status: 0, SystemExit's code (argparse's 2), or 1 with the traceback for any other
    exception, as the interpreter gives. Ctrl-C also gives 1 here, where the interpreter would end by
    SIGINT; `keel train` gets the same Ctrl-C and returns its own code."""
    try:
        torchrun_main()
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
