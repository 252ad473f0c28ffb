"""Loaded by the fork server that keel.trainer.launch.agent starts (multiprocessing's forkserver preload list,
the one hook into that process): the trainer imported once, for every worker forked from the server,
and the server bound to the agent's life.

The server would otherwise outlive a killed agent: each worker it forks holds the server's "alive"
pipe (so that it could fork in turn), and the server waits for every holder to end. With the agent's
death ending the server, the workers, which end with their parent (keel.trainer.launch.lifetime), follow.
"""

from __future__ import annotations

import signal

# What every worker is forked with: the trainer, and what it would otherwise import after the fork, at each
# start and restart of eight workers at once (found by comparing sys.modules here and in a worker after
# its steps). Imported once here: a crash in the main job is back to training in 1.4-1.6 s on 2 cores, was
# 5.0-5.9 s (bench/recovery_times.py --only crash, the main job's flags).
import numpy.random  # noqa: F401  (the data's shuffles)
import pandas  # noqa: F401  (rank 0: goodput and the metrics it publishes)
import torch._dynamo  # noqa: F401  (initialising a parameter on the meta device imports it: 1.2 s a process)
import torch.distributed.checkpoint  # noqa: F401  (durable checkpoints, fsspec with them)
import torch.distributed.pipelining  # noqa: F401  (pp > 1)
import torch.distributed.run  # noqa: F401  (the launcher's flags, parsed by every worker)

import keel.trainer.train  # noqa: F401
from keel.trainer.launch.lifetime import end_with_parent
from keel.trainer.preemption import PREEMPT_SIGNALS

# A preemption's SIGTERM or SIGUSR1 to the process group reaches the server too: it must not end it, for
# the agent reads each worker's exit status through the server (it would read 255 for every one). The
# workers take these signals back (keel.trainer.preemption); the server still ends with the agent.
for sig in PREEMPT_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
end_with_parent(signal.SIGKILL)
