"""Fault kinds, each declared once: what it does, the fields it takes, how it behaves, where it is
injected and what a drill of it must see. No torch: the launcher reads it before any worker starts.

Everything about a kind is read from its `Kind` in KINDS: the spec parser (keel.chaos.fault_specs), the
fire-once and sequencing rules and the hooks' dispatch (keel.chaos.faults), the restart budget's
attribution (keel.trainer.launch.restarts), the drills and their verdict (keel.chaos.drill), the soak
(bench/soak.py), and docs/chaos.md's tables (tests/test_fault_kinds.py holds them to it). A kind's hooks,
the code that injects it, are functions the injector calls at the trainer's hook points; the entry names
them and they live in the kind's module (keel.chaos.faults for Keel's own), so this module never imports them.

Kinds from outside Keel (a test's, a site's own faults): KEEL_FAULT_KINDS names modules, comma-separated,
that call `register` when imported. This module imports them, so every process that reads a fault (the
launcher, the drill, each worker) knows the same kinds: they all inherit the variable.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from keel.monitor.event_kinds import EventKind

PLUGINS_ENV = "KEEL_FAULT_KINDS"
# Where hooks run: the keel.chaos.faults.FaultPlan methods the trainer calls (their docstrings give the
# arguments a hook gets there and what it returns).
POINTS = ("lr_scale", "at_step_start", "corrupt_loss", "corrupt_grads", "before_collective", "corrupt_batch", "corrupt_batch_loss")


@dataclass(frozen=True)
class Expectation:
    """What a drill of a fault must see (keel.chaos.verdict). compare: "identical" (the fault must not
    change the arithmetic), "skip" (equal to a reference that skipped the batches the recovery skipped), or
    "none" (the trajectory legitimately differs, e.g. one skipped update; the loss is shown, not judged)."""

    detect: tuple[EventKind, ...]  # event kinds that count as detection
    recover: tuple[EventKind, ...] = ()  # event kinds of the recovery action; () when finishing is the recovery
    compare: str = "identical"
    rtol: float = 0.0  # 0: bit-identical. OOM recovery changes the micro-batch split, so the sums differ in rounding.
    degraded: bool = False  # a slow rank: nothing to recover from, the run must only keep going (and be named)
    min_stage_ranks: int = 1  # ranks per pipeline stage needed to tell a slow rank from its peers

    @property
    def bit_identical(self) -> bool:
        """Whether the trajectory after the fault must be the fault-free one, bit for bit."""
        return self.compare == "identical" and self.rtol == 0


@dataclass(frozen=True)
class Kind:
    """A kind of fault. Its spec is KIND@step=S[,rank=R][,steps=K][,FIELD=VALUE...] (keel.chaos.fault_specs)."""

    does: str
    hooks: dict[str, str]  # point (POINTS) -> the function of `module` that injects the fault there
    expect: Expectation
    # Its drills by name, a fault template each ({S} the fault step, {R} the faulty rank, ...: keel.chaos.drill.expand).
    drills: dict[str, str]
    takes: tuple[str, ...] = ()  # the fields it takes besides step and steps (a Fault's fields)
    # The process ends (a restart follows): it acts only after its step's ckpt_corrupt has, so the restart
    # reads the damaged checkpoint (keel.chaos.faults sequences them).
    ends_process: bool = False
    # A property of a machine or of the data, not an event: it acts at every run of its steps (no fire-once marker).
    persistent: bool = False
    then: str = ""  # a fault that must follow it in drills and random plans, a template: {S} its step, {R} the faulty rank
    module: str = "keel.chaos.faults"


_ROLLBACK = Expectation(detect=(EventKind.NONFINITE,), recover=(EventKind.ROLLBACK,), compare="skip")
_SPIKE = Expectation(detect=(EventKind.SPIKE,), recover=(EventKind.ROLLBACK,), compare="skip")
_HANG = Expectation(detect=(EventKind.HANG,), recover=(EventKind.RESTART,))
_RESTART = Expectation(detect=(EventKind.RESTART,), recover=(EventKind.RESTART,))
_SLOW = Expectation(detect=(EventKind.STRAGGLER,), degraded=True, min_stage_ranks=2)
_NONFINITE_HOOKS = {"at_step_start": "nonfinite_param", "corrupt_loss": "nonfinite_loss", "corrupt_grads": "nonfinite_grads"}

# In the order kinds act where several hit one hook point at one step: oom, which ends the step, and the
# kinds that end the process come last, after ckpt_corrupt has damaged what their restart loads.
KINDS = {
    "nan": Kind(
        "NaN into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
        _NONFINITE_HOOKS,
        _ROLLBACK,
        {"nan": "nan@step={S},rank={R},steps={K}", "nan_param": "nan@step={S},rank={R},into=param"},
        ("rank", "into"),
    ),
    "inf": Kind(
        "Inf into the loss, a gradient or a parameter (into=loss|grad|param) at steps S..S+K-1",
        _NONFINITE_HOOKS,
        _ROLLBACK,
        {"inf_grad": "inf@step={S},rank={R},steps={K},into=grad"},
        ("rank", "into"),
    ),
    "spike": Kind(
        "a real loss spike: the batches of steps S..S+K-1 replaced by random bytes (data=1; in a loop whose data Keel does not "
        "read, their loss times 4) and/or the LR times lr=F",
        {"lr_scale": "lr_surge", "corrupt_batch": "random_bytes", "corrupt_batch_loss": "spiked_loss"},
        _SPIKE,
        {"spike": "spike@step={S},steps=5", "lr_surge": "spike@step={S},steps=3,lr=100,data=0"},
        ("lr", "data"),
    ),
    "data_corrupt": Kind(
        "token ids out of the vocabulary in the batches of steps S..S+K-1 (a damaged data file)",
        {"corrupt_batch": "data_corrupt"},
        Expectation(detect=(EventKind.BAD_BATCH,), compare="skip"),
        {"data_corrupt": "data_corrupt@step={S}"},
        persistent=True,
    ),
    "straggler": Kind(
        "the rank sleeps `ms` at the start of each of steps S..S+K-1",
        {"at_step_start": "straggler"},
        _SLOW,
        {"straggler": "straggler@step={S},rank={R},steps=1000,ms={MS}"},
        ("rank", "ms"),
        persistent=True,
    ),
    "late_collective": Kind(
        "the rank waits `ms` before each collective the trainer issues, at steps S..S+K-1",
        {"before_collective": "late_collective"},
        _SLOW,
        {"late_collective": "late_collective@step={S},rank={R},steps=1000,ms={MS}"},
        ("rank", "ms"),
        persistent=True,
    ),
    # A corrupt checkpoint only matters when it is read: the crash right after it makes the restart read it
    # (the crash waits for the flip: keel.chaos.faults sequences them).
    "ckpt_corrupt": Kind(
        "bytes flipped in a shard of the newest complete checkpoint, at the start of step S (by rank 0)",
        {"at_step_start": "ckpt_corrupt"},
        Expectation(detect=(EventKind.CHECKPOINT_CORRUPT,), recover=(EventKind.RESTART,)),
        {"ckpt_corrupt": "ckpt_corrupt@step={S}"},
        then="crash@step={S},rank={R}",
    ),
    "oom": Kind(
        "torch.OutOfMemoryError at the start of step S, and again each time it runs, while a micro-batch holds more than "
        "`rows` sequences (the most the rank's memory holds; real=1 on a GPU: a real over-allocation)",
        {"at_step_start": "oom"},
        Expectation(detect=(EventKind.OOM,), rtol=1e-5),
        {"oom": "oom@step={S},rank={R},rows={ROWS}"},
        ("rank", "rows", "real"),
        persistent=True,
    ),
    "hang": Kind(
        "the rank sleeps `seconds` before the step's first collective, while the others wait inside it",
        {"at_step_start": "hang"},
        _HANG,
        {"hang": "hang@step={S},rank={R}"},
        ("rank", "seconds"),
        ends_process=True,
    ),
    "deadlock": Kind(
        "a thread of the rank holds the GIL for `seconds`: no Python thread of the process runs",
        {"at_step_start": "deadlock"},
        _HANG,
        {"deadlock": "deadlock@step={S},rank={R}"},
        ("rank", "seconds"),
        ends_process=True,
    ),
    "crash": Kind(
        "the rank is killed (SIGKILL) at the start of step S",
        {"at_step_start": "crash"},
        _RESTART,
        {"crash": "crash@step={S},rank={R}"},
        ("rank",),
        ends_process=True,
    ),
    "segfault": Kind(
        "the rank reads address 0 (SIGSEGV) at the start of step S",
        {"at_step_start": "segfault"},
        _RESTART,
        {"segfault": "segfault@step={S},rank={R}"},
        ("rank",),
        ends_process=True,
    ),
    # keel train itself resumes the run when its torchrun agent is killed, as a scheduler requeues a job.
    "node_loss": Kind(
        "the rank's node dies at the start of step S: its torchrun agent and every worker under it are killed (SIGKILL)",
        {"at_step_start": "node_loss"},
        Expectation(detect=(EventKind.NODE_LOSS,), recover=(EventKind.NODE_LOSS,)),
        {"node_loss": "node_loss@step={S},rank={R}"},
        ("rank",),
        ends_process=True,
    ),
}


def register(name: str, kind: Kind) -> None:
    """Adds a kind from outside Keel (see the module's docstring); it acts after Keel's own at a hook point.
    Raises ValueError (one line) for a name taken or a hook at no point."""
    if name in KINDS:
        raise ValueError(f"fault kind '{name}' exists already; choose another name")
    if not set(kind.hooks) <= set(POINTS):
        raise ValueError(f"fault kind '{name}': hooks at {sorted(set(kind.hooks) - set(POINTS))}; the hook points are {list(POINTS)}")
    KINDS[name] = kind


def _import_plugins() -> None:
    # An environment variable rather than a config field: the config's own faults are parsed against
    # KINDS, so the kinds must be known before it is read, in every process.
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(module)


_import_plugins()  # last: a plugin imports `Kind` and `register` from this module while it loads
