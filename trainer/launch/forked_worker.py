"""The worker as torchrun's function entrypoint, run in a process forked by keel.trainer.launch.agent's fork
server. Its own module, so that the agent can name it without importing the trainer: the server has
imported that already, before it forks."""

from __future__ import annotations

import logging
import sys


def forked_main(*argv: str) -> None:
    """keel.trainer.train's main, with the exit status torchrun sees: a failure is a non-zero exit, as for
    a worker started as its own interpreter."""
    from keel.trainer import train

    sys.argv = [train.__file__, *argv]  # what a worker's own interpreter would have (W&B records it)
    code = train.main(list(argv))
    logging.shutdown()
    if code:
        sys.exit(code)
