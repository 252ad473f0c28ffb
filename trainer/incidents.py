"""What rank 0 writes down when something happens: an event in the run store for each incident, and
an alert for the ones a person should hear about. Every method is a no-op on the other ranks (they
hold no recorder), so the train loop calls them unconditionally.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

from keel.monitor.alerts import Alert
from keel.monitor.detectors import Finding
from keel.monitor.event_kinds import EventKind
from keel.monitor.exits import EXIT_PREEMPTED
from keel.monitor.recorder import RunRecorder
from keel.trainer.checkpoint.checkpointer import Restored, SaveResult
from keel.trainer.launch.restarts import Failure

# Detector findings: (event kind, severity, alert name or None). A confirmed spike is acted on
# (rollback); an outlier that may heal and a grad-norm jump are reported, not acted on.
_FINDINGS = {
    "loss_outlier": (EventKind.LOSS_OUTLIER, "info", None),
    "spike_healed": (EventKind.SPIKE_HEALED, "info", None),
    "grad_norm_spike": (EventKind.GRAD_NORM_SPIKE, "warning", "grad_norm_spike"),
    "spike_confirmed": (EventKind.SPIKE, "critical", "loss_spike"),
}


class Incidents:
    def __init__(self, recorder: RunRecorder | None, run_id: str):
        self.recorder, self.run_id = recorder, run_id

    def _note(
        self,
        kind: EventKind,
        message: str,
        severity: str = "info",
        *,
        step=None,
        attempt=None,
        rank=None,
        data: dict | None = None,
        alert: str | None = None,
    ) -> None:
        if self.recorder is None:
            return
        self.recorder.event(kind, message, severity=severity, step=step, attempt=attempt, rank=rank, data=data)
        if alert:
            values = {k: v for k, v in (data or {}).items() if isinstance(v, (int, float, str))}
            self.recorder.alert(Alert(alert, severity, message, self.run_id, step=step, attempt=attempt, rank=rank, values=values))

    def step(self, row: dict, fault_ranks: list[int], findings: list[Finding]) -> None:
        step, attempt = row["step"], row["attempt"]
        for r in fault_ranks:
            self._note(
                EventKind.FAULT_INJECTED, f"fault injected on rank {r} at step {step}", "warning", step=step, attempt=attempt, rank=r
            )
        if row["skipped"]:
            values = {"loss": row["loss"], "grad_norm": row["grad_norm"]}
            message = f"non-finite step {step} skipped (no update): loss={row['loss']}, grad_norm={row['grad_norm']}"
            self._note(EventKind.NONFINITE, message, "critical", step=step, attempt=attempt, data=values, alert="nonfinite_loss")
        for f in findings:
            kind, severity, alert = _FINDINGS[f.kind]
            data = {"start_step": f.start_step, "value": f.value, "baseline": f.baseline, "threshold": f.threshold}
            self._note(kind, f.message(), severity, step=step, attempt=attempt, data=data, alert=alert)

    def rollback(
        self, step: int, attempt: int, reason: str, bad_from: int, restored: Restored, skipped: tuple[int, int], discarded: list[str]
    ) -> None:
        self.loaded(restored, attempt)
        data = {
            "from_step": step,
            "to_step": restored.step,
            "bad_from": bad_from,
            "checkpoint": restored.label,
            "in_memory": restored.in_memory,
            "load_s": restored.load_s,
            "discarded": discarded,
        }
        target = restored.label if restored.in_memory else f"the checkpoint of step {restored.step}"
        message = f"rolled back from step {step} to {target} ({reason})"
        self._note(EventKind.ROLLBACK, message, "critical", step=step, attempt=attempt, data=data, alert="rollback")
        first, end = skipped
        if end > first:
            self._note(
                EventKind.SKIP_DATA,
                f"skipping batches {first}..{end - 1} ({end - first} batches), read at steps {restored.step + 1}..{step} and after",
                "warning",
                step=restored.step,
                attempt=attempt,
                data={"first_batch": first, "end_batch": end, "batches": end - first},
            )

    def no_rollback_target(self, step: int, attempt: int, reason: str, bad_from: int, corrupt: list[str]) -> None:
        self._corrupt(corrupt, attempt)
        self._note(
            EventKind.ROLLBACK_FAILED,
            f"cannot roll back ({reason}): no snapshot or good checkpoint before step {bad_from}; training goes on",
            "critical",
            step=step,
            attempt=attempt,
            data={"bad_from": bad_from},
            alert="rollback_failed",
        )

    def _corrupt(self, problems: list[str], attempt: int) -> None:
        for problem in problems:
            self._note(
                EventKind.CHECKPOINT_CORRUPT,
                f"corrupt checkpoint {problem}; falling back to an older one",
                "critical",
                attempt=attempt,
                data={"problem": problem},
                alert="checkpoint_corrupt",
            )

    def loaded(self, restored: Restored, attempt: int) -> None:
        self._corrupt(restored.corrupt, attempt)
        self._note(
            EventKind.CHECKPOINT_LOADED,
            f"loaded {restored.label} in {restored.load_s:.2f} s",
            step=restored.step,
            attempt=attempt,
            data={"path": None if restored.in_memory else str(restored.path), "in_memory": restored.in_memory, "load_s": restored.load_s},
        )
        if restored.layout_change:
            self._note(
                EventKind.LAYOUT_CHANGED,
                restored.layout_change,
                step=restored.step,
                attempt=attempt,
                data={"checkpoint": restored.path.name},
            )

    def no_checkpoint(self, attempt: int, corrupt: list[str]) -> None:
        self._corrupt(corrupt, attempt)
        self._note(EventKind.CHECKPOINT_MISSING, "no good checkpoint to resume from: starting at step 1", "warning", attempt=attempt)

    def saved(self, results: list[SaveResult], attempt: int) -> None:
        for r in results:
            if r.error:
                self._note(
                    EventKind.CHECKPOINT_FAILED,
                    f"checkpoint of step {r.step} failed: {r.error}",
                    "critical",
                    step=r.step,
                    attempt=attempt,
                    data={"error": r.error},
                    alert="checkpoint_failed",
                )
            else:
                self._note(
                    EventKind.CHECKPOINT_SAVED,
                    f"{r.path.name}: blocked {r.blocking_s * 1000:.0f} ms, written in {r.total_s:.2f} s",
                    step=r.step,
                    attempt=attempt,
                    data={"path": str(r.path), "blocking_s": r.blocking_s, "total_s": r.total_s, "removed": r.removed},
                )

    def restart(self, attempt: int, restart_count: int, down_s: float, step: int, failure: Failure | None) -> None:
        """The restart of the worker group, with the failure that caused it as the agent attributed it;
        an injected fault that ended its process is recorded here, as it could not record itself."""
        if failure and failure.rank is None and failure.node is not None:
            self._node_replaced(attempt, down_s, step, failure)
            return
        cause = f" after {failure.describe()}" if failure else ""
        data = {"restart_count": restart_count, "down_s": down_s, **(asdict(failure) if failure else {})}
        # The run's own count (control/failures.jsonl): torchrun's starts again at 1 after a node loss.
        number = failure.restart + 1 if failure else restart_count
        self._note(
            EventKind.RESTART,
            f"workers restarted{cause} (failure {number} of the run), resuming at step {step + 1}",
            "warning",
            step=step,
            attempt=attempt,
            rank=failure.rank if failure else None,
            data=data,
        )
        if failure and failure.fault:
            self._injected_kill(failure, attempt - 1)

    def _node_replaced(self, attempt: int, down_s: float, step: int, failure: Failure) -> None:
        """A node of the job lost while the others lived on: they waited for a replacement (or, in an elastic
        job, went on without it) and restarted from the newest checkpoint. A warning: the job recovered."""
        self._note(
            EventKind.NODE_LOSS,
            f"node {failure.node} ({failure.host}) lost after step {failure.step}; the job went on {down_s:.0f} s later "
            f"at step {step + 1} (failure {failure.restart + 1} of the run)",
            "warning",
            step=step,
            attempt=attempt,
            data={"down_s": down_s, "last_step": failure.step, **asdict(failure)},
        )
        if failure.fault:
            self._injected_kill(failure, attempt - 1)

    def node_loss(self, attempt: int, down_s: float, step: int, last_step: int, failure: Failure | None) -> None:
        """A resume after the run's processes ended with no record of it (a node lost, or the job killed
        from outside): the gap is lost time."""
        self._note(
            EventKind.NODE_LOSS,
            f"the run's processes vanished after step {last_step}; resumed {down_s:.0f} s later at step {step + 1}",
            "critical",
            step=step,
            attempt=attempt,
            data={"down_s": down_s, "last_step": last_step},
            alert="node_loss",
        )
        if failure and failure.fault:
            self._injected_kill(failure, attempt - 1)

    def _injected_kill(self, failure: Failure, attempt: int) -> None:
        self._note(
            EventKind.FAULT_INJECTED,
            f"fault injected on {'the node' if failure.rank is None else f'rank {failure.rank}'} at step {failure.fault_step}: "
            f"{failure.fault} (it ended the process)",
            "warning",
            step=failure.fault_step,
            attempt=attempt,
            rank=failure.rank,
            data={"fault": failure.fault},
        )

    def hang(self, info: dict) -> None:
        message = (
            f"hang: no progress for {info['stalled_s']:.0f} s in {info['phase']} of step {info['step']} "
            f"(allowed {info['timeout_s']:.0f} s); stacks in {info['dump']}; restarting"
        )
        self._note(EventKind.HANG, message, "critical", step=info["step"], attempt=info["attempt"], data=info, alert="hang")

    def bad_batches(self, step: int, attempt: int, batches: list[int], vocab_size: int) -> None:
        message = f"batches {batches} passed over at step {step}: token ids outside the vocabulary (< {vocab_size})"
        self._note(
            EventKind.BAD_BATCH,
            message,
            "critical",
            step=step,
            attempt=attempt,
            data={"batches": batches, "vocab_size": vocab_size},
            alert="bad_batch",
        )

    def oom(self, step: int, attempt: int, rank: int, old: int, new: int, how: str) -> None:
        self._note(
            EventKind.OOM,
            f"out of memory on rank {rank} at step {step}: micro-batches {old} -> {new} ({how})",
            "critical",
            step=step,
            attempt=attempt,
            rank=rank,
            data={"microbatches": new, "previous": old, "how": how},
            alert="oom",
        )

    def oom_retry(self, step: int, attempt: int, old: int, new: int, configured: int) -> None:
        self._note(
            EventKind.OOM_RETRY,
            f"micro-batches {old} -> {new} at step {step}: the larger micro-batch again after an out-of-memory",
            step=step,
            attempt=attempt,
            data={"microbatches": new, "previous": old, "configured": configured},
        )

    def stragglers(self, step: int, attempt: int, flagged: list[tuple[int, float]]) -> None:
        for rank, score in flagged:
            if math.isfinite(score):
                self._note(
                    EventKind.STRAGGLER,
                    f"rank {rank} is a straggler: score {score:.2f} (fastest rank's median busy time / its own)",
                    "warning",
                    step=step,
                    attempt=attempt,
                    rank=rank,
                    data={"score": score},
                    alert="straggler",
                )

    def note(self, message: str, step: int, attempt: int, data: dict) -> None:
        self._note(EventKind.NOTE, message, step=step, attempt=attempt, rank=0, data=data or None)

    def preempted(self, step: int, attempt: int, cause: str, requested: float | None) -> None:
        """The run saved `step` and stops for a preemption (`cause`: the signal and whom it reached):
        `preempted` (a warning) and `run_stopped` with EXIT_PREEMPTED, without an alert: the scheduler
        requeues the job, and the resume starts after `step`."""
        took = f" in {time.time() - requested:.1f} s" if requested else ""
        message = f"preempted ({cause}): step {step} saved{took}; the resume starts at step {step + 1}"
        data = {"signal": cause, "saved_step": step, "lost_steps": 0, "exit_code": EXIT_PREEMPTED}
        self._note(EventKind.PREEMPTED, message, "warning", step=step, attempt=attempt, data=data)
        reason = f"preempted ({cause})"
        stopped = {"exit_code": EXIT_PREEMPTED, "reason": reason}
        self._note(EventKind.RUN_STOPPED, f"run stopped at step {step}: {reason}", "warning", step=step, attempt=attempt, data=stopped)

    def stopped(self, step: int, attempt: int, reason: str, exit_code: int) -> None:
        self._note(
            EventKind.RUN_STOPPED,
            f"run stopped at step {step}: {reason}",
            "critical",
            step=step,
            attempt=attempt,
            data={"exit_code": exit_code, "reason": reason},
            alert="run_stopped",
        )
