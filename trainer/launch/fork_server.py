"""Loaded by the fork server that keel.trainer.launch.agent starts (multiprocessing's forkserver preload list,
the one hook into that process): the trainer imported once, for every worker forked from the server,
and the server bound to the agent's life.

The server would otherwise outlive a killed agent: each worker it forks holds the server's "alive"
pipe (so that it could fork in turn), and the server waits for every holder to end. With the agent's
death ending the server, the workers, which end with their parent (keel.trainer.launch.lifetime), follow.
"""

from __future__ import annotations

import signal

import keel.trainer.train  # noqa: F401  (what every worker is forked with)
from keel.trainer.launch.lifetime import end_with_parent
from keel.trainer.preemption import PREEMPT_SIGNALS

# A preemption's SIGTERM or SIGUSR1 to the process group reaches the server too: it must not end it, for
# the agent reads each worker's exit status through the server (it would read 255 for every one). The
# workers take these signals back (keel.trainer.preemption); the server still ends with the agent.
for sig in PREEMPT_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
end_with_parent(signal.SIGKILL)
