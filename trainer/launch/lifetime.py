"""Processes that end with their parent. torchrun starts each worker in a session of its own, so a
launcher killed with its process group (SIGKILL to `keel train`) used to leave the workers training
and writing the run directory. With Linux's parent-death signal, `keel train`'s death ends torchrun
and torchrun's ends the workers, within the time they take to handle SIGTERM.

No torch here: the launcher imports it before any worker exists.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send `sig` to this process when its parent ends (Linux only; elsewhere a no-op).
    A parent that died before the request was made leaves the process to init: it ends now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:
        os.kill(os.getpid(), sig)
