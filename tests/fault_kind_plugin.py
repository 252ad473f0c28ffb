"""A fault kind added through the registry alone, as a site adds its own: every process of a run imports
this module when KEEL_FAULT_KINDS=fault_kind_plugin (tests/test_fault_kinds.py). `mark` changes nothing in
training; it leaves a file in the run directory at its step, so a test sees that its hook ran in the worker."""

from __future__ import annotations

from keel.chaos.kinds import Expectation, Kind, register
from keel.monitor.event_kinds import EventKind


def mark(plan, fault, start) -> None:
    plan.fire(fault, "marked")
    (plan.run_dir / f"marked-step{plan.step}-rank{plan.rank}").touch()


register(
    "mark",
    Kind(
        "leaves RUN_DIR/marked-stepS-rankR at the start of step S, and changes nothing else",
        {"at_step_start": "mark"},
        # Nothing to recover from: its own fault_injected event is what a drill sees, and the loss stays bit-identical.
        Expectation(detect=(EventKind.FAULT_INJECTED,)),
        {"mark": "mark@step={S},rank={R}"},
        ("rank",),
        module=__name__,
    ),
)
