"""Exit codes with a meaning, in one place. Every `keel` command returns them; job scripts and drills branch on them.

They live in the monitor, the lowest layer, because they are part of the run's record (a `run_stopped`
event stores its code) and every component returns or reads them.

A worker exits with EXIT_HANG or EXIT_OOM_RESTART so that torchrun restarts the group (these are
failures torchrun must see). A run that stops on purpose (the rollback cap) ends its workers cleanly,
so torchrun does not restart it, and records the code in a `run_stopped` event; `keel train` reads it
back and returns it.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # the command failed: a worker failed and torchrun gave up, a drill or a preflight check failed
EXIT_CONFIG = 2  # bad input, reported before any worker started
EXIT_HANG = 3  # the hang watchdog fired (a worker's exit code; torchrun restarts the group)
EXIT_ROLLBACK_CAP = 4  # too many rollbacks without progress: the run stopped instead of looping
EXIT_OOM_RESTART = 5  # out of memory with collectives in flight: restart with half the micro-batch
EXIT_OOM = 6  # out of memory and the micro-batch cannot be halved again
EXIT_RESTART_CAP = 7  # the workers failed too many times in a row without progress (keel.trainer.launch.restarts)
EXIT_SAVES_FAILING = 8  # checkpoints failed several times in a row (a disk that stays full): the run stopped
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
# Preempted (SIGTERM, or SIGUSR1 from SLURM's --signal): the current step saved, or the newest checkpoint
# stands. 128 + SIGTERM, as a shell reports it, so a scheduler that retries signal exits (Kubeflow's
# restartPolicy ExitCode: 128 and above) requeues it; `keel train --resume` continues at the saved step.
EXIT_PREEMPTED = 143


# Each code in a few words, for reports (a drill's verdict names how its run ended).
EXIT_MEANINGS = {
    EXIT_FAILED: "a worker failed and torchrun gave up",
    EXIT_CONFIG: "bad configuration",
    EXIT_HANG: "hang",
    EXIT_ROLLBACK_CAP: "rollback cap reached",
    EXIT_OOM_RESTART: "OOM restart",
    EXIT_OOM: "out of memory at the smallest micro-batch",
    EXIT_RESTART_CAP: "restart budget spent: failures in a row without progress",
    EXIT_SAVES_FAILING: "checkpoints failing: saves failed in a row",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PREEMPTED: "preempted: saved, to be resumed",
}
