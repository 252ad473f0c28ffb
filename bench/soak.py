"""The soak: a long job with random faults of every kind, left alone to its last step.

Runs the job twice, unattended: clean, then with random faults (`chaos.mtbf_steps`, every kind in
`--kinds`), one node loss and one preemption from outside, on `--nodes` launchers (one per node, in one
rendezvous on loopback). When the faulty run reaches `--node-loss-step`, the bench kills a node's
`keel train` and every process under it (SIGKILL, as a machine dies): on one node it resumes the job
with `keel train --resume`, as a cluster scheduler would requeue it; on several it starts the same
command again 5 s later, as a scheduler replaces a node. At `--preempt-step` it sends SIGTERM to every
node (a scheduler taking them back) and requeues the job. Then, per fault: kind, step, rank, what
detected it and how fast, what recovered it, and the steps and seconds it cost; the exit code; whether
the losses are bit-identical to the clean run up to the first fault that changes the data; and goodput
measured from outside (clean wall / faulty wall) beside Keel's own.

    python bench/soak.py                                   # the main job, 300 steps, a fault every ~25
    python bench/soak.py --dp 2 --pp 1 --tp 1 --steps 400 --mtbf 15 --config tiny
    python bench/soak.py --nodes 2 --dp 2 --pp 1 --tp 1 --steps 400 --mtbf 25 --config tiny   # two nodes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from keel.chaos.kinds import KINDS
from keel.monitor.exits import EXIT_PREEMPTED
from keel.monitor.run_dir import CHAOS_DIR, INJECTED_FILE, STORE_FILE
from keel.monitor.store import read_events, read_meta, read_steps, step_bounds

RANDOM_KINDS = "nan;inf;spike;data_corrupt;oom;hang;deadlock;crash;segfault;ckpt_corrupt"
# What detects a fault, and what recovers from it, is what its kind's drill expects (keel.chaos.kinds).
RECOVERIES = {event for kind in KINDS.values() for event in kind.expect.recover}
# Faults after which the trajectory may rightly differ from the clean run's: skipped data or updates,
# or another micro-batch split.
CHANGES_DATA = [name for name, kind in KINDS.items() if not kind.expect.bit_identical]
REPLACE_AFTER_S = 5.0  # a lost node's replacement starts this long after it died (a scheduler's reaction)
PREEMPT_GRACE_S = 30.0  # SIGKILL follows SIGTERM after this (SLURM's KillWait, Kubernetes' grace)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keel_train(run_dir: Path, args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "keel.cli", "train", "--run-dir", str(run_dir), *args]
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


class Job:
    """The job's `keel train` launchers, one per node, on this machine: with several nodes, each a node of
    its own in one c10d rendezvous on loopback, sharing the run directory (as a cluster with a shared
    filesystem). A scheduler's actions: `kill_node` (a machine dies), `start_node` (its replacement, the same
    command), `preempt` (SIGTERM to every node, then the whole job requeued with --resume)."""

    def __init__(self, run_dir: Path, args: list[str], nodes: int):
        self.run_dir, self.args, self.nodes = run_dir, args, nodes
        self.log = run_dir.with_suffix(".log")
        self.port = free_port()
        self.procs = self.start_all(args)

    def start_node(self, node: int, args: list[str]) -> subprocess.Popen:
        if self.nodes > 1:
            rdzv = f"--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{self.port} --rdzv-id=soak".split()
            args = [*args, f"--nnodes={self.nodes}", f"--node-rank={node}", *rdzv]
        return keel_train(self.run_dir, args, self.log)

    def kill_node(self, node: int) -> None:
        kill_tree(self.procs[node])

    def replace_node(self, node: int) -> None:
        self.procs[node] = self.start_node(node, self.args)

    def restart(self) -> None:
        """The whole job started again from its run directory, as a requeue does (a new rendezvous port)."""
        self.port = free_port()
        self.procs = self.start_all(["--resume", str(self.run_dir)])

    def start_all(self, args: list[str]) -> list[subprocess.Popen]:
        """Node 0 first, the others once its agent serves the rendezvous store: node 0 hosts it (on loopback
        every agent would try to), so the node the bench kills is never the host (losing it ends the job)."""
        first = self.start_node(0, args)
        deadline = time.time() + 120
        while self.nodes > 1 and not _listening(self.port) and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        return [first, *(self.start_node(k, args) for k in range(1, self.nodes))]

    def preempt(self) -> list[int]:
        """SIGTERM to every node's process group, as a scheduler takes the nodes back; their exit codes."""
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        return [proc.wait(timeout=PREEMPT_GRACE_S) for proc in self.procs]

    def wait(self) -> int:
        codes = [proc.wait() for proc in self.procs]
        return next((code for code in codes if code), 0)

    def running(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (a worker may sit in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to `keel train` and everything under it at once, as when its machine dies; returns once all
    of them are gone, as a scheduler requeues a job only after its node is down (a worker that is still
    dying holds the run directory's lock, and the resumed job would rightly refuse it)."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has already dropped its files and locks)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def furthest(run_dir: Path) -> int:
    try:
        bounds = step_bounds(run_dir) if (run_dir / STORE_FILE).exists() else None
    except sqlite3.Error:
        return 0
    return 0 if bounds is None else bounds[1]


@dataclass
class Run:
    code: int = 0
    wall_s: float = 0.0
    node_killed: float | None = None  # when the node was killed
    preempted_at: float | None = None  # when SIGTERM reached the nodes
    preempted_codes: list[int] = field(default_factory=list)  # the nodes' exit codes then
    preempt_exit_s: float = 0.0  # from SIGTERM until the last node ended


def run_unattended(run_dir: Path, args: list[str], nodes: int, node_loss_step: int, preempt_step: int) -> Run:
    """The job left alone but for one node loss and one preemption, each acted on as a scheduler would: a
    lost node replaced REPLACE_AFTER_S later (on one node: the whole job resumed at once), a preempted job
    requeued at once."""
    start, run = time.time(), Run()
    job, replace_at = Job(run_dir, args, nodes), None
    while job.running() or replace_at:
        time.sleep(0.5)
        step = furthest(run_dir)
        if node_loss_step and run.node_killed is None and step >= node_loss_step:
            run.node_killed = time.time()
            job.kill_node(nodes - 1)
            if nodes == 1:
                job.restart()
            else:
                replace_at = time.time() + REPLACE_AFTER_S
        if replace_at and time.time() >= replace_at:
            job.replace_node(nodes - 1)
            replace_at = None
        if preempt_step and not run.preempted_codes and not replace_at and step >= preempt_step:
            run.preempted_at = time.time()
            run.preempted_codes = job.preempt()
            run.preempt_exit_s = time.time() - run.preempted_at
            job.restart()
    run.code, run.wall_s = job.wait(), time.time() - start
    return run


def injections(run_dir: Path, node_killed: float | None) -> pd.DataFrame:
    path = run_dir / CHAOS_DIR / INJECTED_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rows = [r for r in rows if r["kind"] in KINDS]
    if node_killed:
        rows.append({"kind": "node_loss", "step": None, "rank": None, "time": node_killed, "fault": "killed from outside"})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # A fault that hits several steps or micro-batches logs a line each: its first is when it struck.
    return frame.sort_values("time").drop_duplicates("fault", keep="first").reset_index(drop=True)


def detections(faults: pd.DataFrame, events: pd.DataFrame) -> list[pd.Series | None]:
    """Each fault's detection: the first event its kind's drill counts as detection, after it struck and
    before the next fault that the same events would detect (a NaN's `nonfinite` is not an Inf's)."""
    found = []
    for i, fault in enumerate(faults.itertuples(index=False)):
        kinds = set(KINDS[fault.kind].expect.detect)
        later = faults.iloc[i + 1 :]
        rival = later[[bool(kinds & set(KINDS[k].expect.detect)) for k in later.kind]]
        until = rival.time.iloc[0] if len(rival) else float("inf")
        hits = events[(events.time >= fault.time) & (events.time < until) & events.kind.isin(kinds)]
        found.append(hits.iloc[0] if len(hits) else None)
    return found


def recoveries(faults: pd.DataFrame, found: list, events: pd.DataFrame) -> list[pd.Series | None]:
    """Each detected fault's recovery: the first recovery event after its detection, before another
    fault's detection (a ckpt_corrupt and the crash at its step, which brings its load, share one restart)."""
    recovered = events[events.kind.isin(RECOVERIES)]
    out = []
    for fault, detect in zip(faults.itertuples(index=False), found):
        if detect is None:
            out.append(None)
            continue
        others = [d.time for f, d in zip(faults.itertuples(index=False), found) if d is not None and f.step != fault.step]
        nxt = min((t for t in others if t > detect.time), default=float("inf"))
        hits = recovered[(recovered.time >= detect.time) & (recovered.time < nxt)]
        out.append(hits.iloc[0] if len(hits) else None)
    return out


def account(fault, detect, recovery, covered_by: str, steps: pd.DataFrame, step_s: float) -> dict:
    """What one fault cost: detection, recovery, steps recomputed and seconds lost. `covered_by`: the
    fault whose recovery undid this one's steps before it was detected (a spike struck during an Inf's
    last steps, then skipped with them)."""
    step = fault.step if fault.step == fault.step and fault.step is not None else _step_at(steps, fault.time)
    row = {"kind": fault.kind, "step": int(step), "rank": "all" if fault.rank is None or fault.rank != fault.rank else int(fault.rank)}
    row["detected by"] = detect.kind if detect is not None else "-"
    row["delay s"] = round(detect.time - fault.time, 1) if detect is not None else None
    row["recovery"], row["steps lost"] = "", 0
    if recovery is not None:
        row["recovery"] = recovery.kind
        if "from_step" in recovery.data:  # a rollback: the steps between the checkpoint and the one it left
            row["steps lost"] = int(recovery.data["from_step"]) - int(recovery.data["to_step"])
        else:  # a restart resumes from the checkpoint it loaded; the fault's step had not finished
            row["steps lost"] = max(int(step) - 1 - int(recovery.step or 0), 0)
    elif covered_by:
        row["recovery"] = f"with {covered_by}"
    else:
        row["recovery"] = "went on" if detect is not None else "harmless"
    since = recovery.time if recovery is not None else fault.time
    past = steps[(steps.time > since) & (steps.step > step)].head(1)  # the run got past the fault's step again
    row["s lost"] = round(max(past.time.iloc[0] - fault.time - 2 * step_s, 0.0), 1) if len(past) else None
    return row


def fault_table(faults: pd.DataFrame, events: pd.DataFrame, steps: pd.DataFrame, step_s: float) -> pd.DataFrame:
    found = detections(faults, events)
    recovered = recoveries(faults, found, events)
    rows = []
    for i, fault in enumerate(faults.itertuples(index=False)):
        covered_by = ""
        if found[i] is None:  # struck between an earlier fault and that fault's recovery, which undid it
            earlier = [(faults.iloc[k], recovered[k]) for k in range(i) if recovered[k] is not None]
            covering = [f"{f.kind}@{int(f.step)}" for f, r in earlier if f.time <= fault.time <= r.time]
            covered_by = covering[-1] if covering else ""
        rows.append(account(fault, found[i], recovered[i], covered_by, steps, step_s))
    return pd.DataFrame(rows)


def _step_at(steps: pd.DataFrame, when: float) -> int:
    before = steps[steps.time <= when]
    return int(before.step.iloc[-1]) + 1 if len(before) else 1


def first_difference(clean: pd.DataFrame, faulty: pd.DataFrame) -> int | None:
    """The first step whose loss differs (bit for bit) between the two effective trajectories."""
    both = clean.set_index("step").loss.to_frame("clean").join(faulty.set_index("step").loss.to_frame("faulty"), how="inner")
    differ = both[both.clean != both.faulty]
    return None if differ.empty else int(differ.index[0])


def preemption_line(run_dir: Path, run: Run) -> tuple[str, bool]:
    """What the preemption cost, and whether it went as promised: every node saved and exited with 143
    inside the grace, and the resume loaded the saved step."""
    events = read_events(run_dir)
    preempted = events[events.kind == "preempted"]
    if run.preempted_at is None or preempted.empty:
        return "preemption: none", run.preempted_at is None
    event = preempted.iloc[0]
    loaded = events[(events.kind == "checkpoint_loaded") & (events.time > event.time)]
    resumed_at = int(loaded.step.iloc[0]) if len(loaded) else None
    ok = all(code == EXIT_PREEMPTED for code in run.preempted_codes) and resumed_at == event.data["saved_step"]
    line = (
        f"preemption at step {int(event.step)}: exit codes {run.preempted_codes} (target {EXIT_PREEMPTED}) "
        f"{run.preempt_exit_s:.1f} s after SIGTERM (target under the 20 s grace); saved step {event.data['saved_step']}, "
        f"{event.data['lost_steps']} steps lost; resumed at step {resumed_at}"
    )
    return line, ok


def report(clean_dir: Path, faulty_dir: Path, clean: Run, faulty: Run) -> bool:
    events, steps = read_events(faulty_dir), read_steps(faulty_dir).sort_values("time")
    step_s = statistics.median(read_steps(clean_dir, effective=True).step_time_s)
    faults = injections(faulty_dir, faulty.node_killed)
    table = fault_table(faults, events, steps, step_s) if len(faults) else pd.DataFrame()
    print(table.to_string(index=False) if len(table) else "no faults fired")
    # Undetected and unrecovered: a ckpt_corrupt nothing loads is harmless, as is a fault whose steps an
    # earlier fault's recovery undid.
    missed = (
        (table["detected by"] == "-") & (table.kind != "ckpt_corrupt") & ~table.recovery.str.startswith("with ") if len(table) else None
    )
    undetected = table[missed] if len(table) else table
    # Where the data may first change: a data-changing fault's step, or earlier where a rollback's data skip
    # (its margin) reaches back before the fault.
    skips = events[events.kind == "skip_data"]
    changing = min([*table[table.kind.isin(CHANGES_DATA)].step, *(skips.step + 1)], default=None) if len(table) else None
    differs = first_difference(read_steps(clean_dir, effective=True), read_steps(faulty_dir, effective=True))
    identical = differs is None or (changing is not None and differs >= changing)
    preempt_line, preempt_ok = preemption_line(faulty_dir, faulty)
    ok = faulty.code == 0 and clean.code == 0 and undetected.empty and identical and preempt_ok
    print(f"\nexit codes: clean {clean.code}, faulty {faulty.code}                         target 0 and 0")
    print(preempt_line)
    print(
        f"faults fired {len(table)}, undetected {len(undetected)} (harmless: a ckpt_corrupt nothing loads, a fault undone with another)   target 0"
    )
    print(f"loss: first step that differs from the clean run {differs}, first fault that changes the data at step {changing}; "
          f"bit-identical before it: {identical}")  # fmt: skip
    keel_goodput = read_meta(faulty_dir).get("goodput", {})
    if faulty.code != 0:
        print(
            f"goodput: n/a, the faulty run ended at step {furthest(faulty_dir)} with exit {faulty.code} (clean wall {clean.wall_s:.0f} s)"
        )
        print("soak: FAILED")
        return False
    print(f"goodput: clean wall {clean.wall_s:.0f} s / faulty wall {faulty.wall_s:.0f} s = {clean.wall_s / faulty.wall_s:.1%}; "
          f"Keel's own: {keel_goodput.get('goodput', float('nan')):.1%} of {keel_goodput.get('wall_s', float('nan')):.0f} s "
          f"(lost by cause: {', '.join(f'{k} {v:.0f} s' for k, v in keel_goodput.get('lost_s', {}).items() if v >= 0.5)})")  # fmt: skip
    print("soak:", "PASSED" if ok else "FAILED")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--mtbf", type=float, default=25, help="mean steps between random faults")
    p.add_argument("--kinds", default=RANDOM_KINDS)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1, help="launchers, one per node, in one rendezvous on loopback (default 1)")
    p.add_argument(
        "--node-loss-step",
        type=int,
        help="kill a node from outside at this step (default: half way; 0: never); one node: the whole job, resumed at once; "
        f"several: the last node, replaced {REPLACE_AFTER_S:g} s later",
    )
    p.add_argument("--preempt-step", type=int, help="SIGTERM to every node at this step, then requeue (default: 3/4 of the way; 0: never)")
    p.add_argument("--dir", type=Path, help="where the two runs go (default: a temporary folder, kept)")
    opts, extra = p.parse_known_args()
    out = opts.dir or Path(tempfile.mkdtemp(prefix="keel-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    # A checkpoint every 10 steps: Young's rule for a save of about a second and a fault every ~25 steps
    # of ~1.5 s gives about 9 s (see docs/stability.md); the preset's 30 minutes would save none.
    job = [f"--config={opts.config}", f"--pp={opts.pp}", f"--dp={opts.dp}", f"--tp={opts.tp}", f"--steps={opts.steps}"]
    job += ["--checkpoint.interval_steps=10", *extra]
    chaos = [f"--chaos.mtbf_steps={opts.mtbf}", f"--chaos.random_kinds={opts.kinds}", f"--chaos.random_seed={opts.seed}"]
    node_loss_step = opts.steps // 2 if opts.node_loss_step is None else opts.node_loss_step
    preempt_step = opts.steps * 3 // 4 if opts.preempt_step is None else opts.preempt_step
    print(
        f"soak in {out}: {' '.join(job)} on {opts.nodes} node(s); faults every ~{opts.mtbf:g} steps ({opts.kinds}), "
        f"node loss at step {node_loss_step}, preemption at step {preempt_step}"
    )
    clean = run_unattended(out / "clean", job, opts.nodes, 0, 0)
    print(f"clean: exit {clean.code} in {clean.wall_s:.0f} s")
    faulty = run_unattended(out / "faulty", job + chaos, opts.nodes, node_loss_step, preempt_step)
    print(f"faulty: exit {faulty.code} in {faulty.wall_s:.0f} s\n")
    return 0 if report(out / "clean", out / "faulty", clean, faulty) else 1


if __name__ == "__main__":
    sys.exit(main())
