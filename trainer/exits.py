"""Exit codes with a meaning, in one place. `keel train` returns them; job scripts and drills branch on them.

A worker exits with EXIT_HANG or EXIT_OOM_RESTART so that torchrun restarts the group (these are
failures torchrun must see). A run that stops on purpose (the rollback cap) ends its workers cleanly,
so torchrun does not restart it, and records the code in a `run_stopped` event; `keel train` reads it
back and returns it.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a worker failed for another reason and torchrun gave up
EXIT_CONFIG = 2  # bad input, reported before any worker started
EXIT_HANG = 3  # the hang watchdog fired (a worker's exit code; torchrun restarts the group)
EXIT_ROLLBACK_CAP = 4  # too many rollbacks without progress: the run stopped instead of looping
EXIT_OOM_RESTART = 5  # out of memory with collectives in flight: restart with half the micro-batch
EXIT_OOM = 6  # out of memory and the micro-batch cannot be halved again

