"""Fault specs, random fault plans and the injectors' hooks, without a training run (fast)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from keel.chaos.fault_specs import KINDS, parse_fault, random_faults
from keel.chaos.faults import FaultPlan
from keel.chaos.inject import request
from keel.monitor.detectors import SpikeConfig
from keel.monitor.store import RunStore
from keel.trainer.data.loader import BatchSampler


@pytest.mark.parametrize(
    "spec",
    [
        "nan@step=40,rank=1",
        "inf@step=3,steps=3,into=grad",
        "nan@step=5,into=param",
        "spike@step=100,steps=5",
        "spike@step=7,steps=3,lr=100,data=0",
        "data_corrupt@step=9",
        "oom@step=2,rank=0",
        "hang@step=4,rank=1,seconds=30",
        "deadlock@step=4,rank=3,seconds=5",
        "crash@step=11,rank=5",
        "segfault@step=3",
        "straggler@step=3,rank=1,steps=12,ms=300",
        "late_collective@step=2,rank=7,steps=10,ms=50",
        "ckpt_corrupt@step=12",
        "node_loss@step=6,rank=2",
    ],
)
def test_every_kind_parses_and_prints_back_the_same(spec):
    fault = parse_fault(spec)
    assert parse_fault(str(fault)) == fault
    assert fault.kind in KINDS


@pytest.mark.parametrize(
    "spec, words",
    [
        ("melt@step=3", ["unknown fault 'melt'", "choose one of"]),
        ("crash@rank=1", ["has no step"]),
        ("nan@step=3,ms=5", ["'ms' does not apply to nan", "nan takes step, steps, rank, into"]),
        ("spike@step=3,rank=1", ["'rank' does not apply to spike"]),
        ("nan@step=3,into=weights", ["into=weights", "choose one of ['loss', 'grad', 'param']"]),
        ("spike@step=3,data=0", ["injects nothing", "lr=F"]),
        ("hang@step=x", ["bad value", "step is a number"]),
    ],
)
def test_bad_specs_say_what_to_fix(spec, words):
    with pytest.raises(ValueError) as e:
        parse_fault(spec)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def _random(kinds: list[str], steps: int = 20_000, seed: int = 3, spike: SpikeConfig | None = None, nonfinite_limit: int = 3):
    return random_faults(20.0, kinds, steps=steps, world=8, seed=seed, spike=spike or SpikeConfig(), nonfinite_limit=nonfinite_limit)


def test_random_faults_have_the_mean_gap_asked_for_and_agree_across_ranks():
    plan = _random(["nan", "crash", "hang"])
    gaps = np.diff([0] + [f.step for f in plan])
    assert 0.9 < gaps.mean() / 20.0 < 1.1
    assert {f.kind for f in plan} == {"nan", "crash", "hang"} and {f.rank for f in plan} == set(range(8))
    assert plan == _random(["nan", "crash", "hang"])
    assert plan != _random(["nan", "crash", "hang"], seed=4)


def test_random_faults_last_long_enough_for_the_runs_own_recovery_to_act():
    """A one-step NaN is only skipped and a one-step spike heals: the random ones are shaped by the run's
    settings to roll back, and a damaged checkpoint is followed by a crash whose restart loads it."""
    spike = SpikeConfig(persistence=4, warmup_steps=30, min_baseline=8)
    plan = _random(["nan", "inf", "spike", "ckpt_corrupt", "node_loss"], steps=5000, spike=spike, nonfinite_limit=2)
    nonfinite = [f for f in plan if f.kind in ("nan", "inf")]
    assert {f.into for f in nonfinite} == {"loss", "grad", "param"}
    # A parameter stays non-finite until the rollback; a loss or a gradient is poisoned nonfinite_limit steps.
    assert all(f.steps == (1 if f.into == "param" else 2) for f in nonfinite)
    spikes = [f for f in plan if f.kind == "spike"]
    assert spikes and all(f.steps == 4 and f.step >= 30 and f.data == 1 for f in spikes)
    corrupt = [f for f in plan if f.kind == "ckpt_corrupt"]
    crashes = {(f.step, f.rank) for f in plan if f.kind == "crash"}
    assert corrupt and len(crashes) == len(corrupt) and {s for s, _ in crashes} == {f.step for f in corrupt}
    assert {f.rank for f in plan if f.kind == "node_loss"} == set(range(8))
    assert all(parse_fault(str(f)) == f for f in plan)  # every drawn fault is a spec a person could write


def test_nonfinite_faults_hit_the_parameter_the_gradient_and_every_micro_batch_loss(tmp_path):
    model = torch.nn.Linear(4, 4)
    plan = FaultPlan([parse_fault("nan@step=2,into=param"), parse_fault("inf@step=3,into=grad"), parse_fault("nan@step=4")], 0, tmp_path)
    plan.begin_step(1)
    plan.at_step_start([model], microbatch_rows=1)
    assert torch.isfinite(model.weight).all()
    plan.end_step()
    plan.begin_step(2)
    plan.at_step_start([model], microbatch_rows=1)
    assert torch.isnan(model.weight).any() and [f.into for f in plan.fired] == ["param"]
    plan.end_step()
    with torch.no_grad():
        model.weight.copy_(torch.ones(4, 4))
    plan.begin_step(3)
    model(torch.ones(1, 4)).sum().backward()
    plan.corrupt_grads([model])
    assert not torch.isfinite(model.weight.grad).all()
    plan.end_step()
    plan.begin_step(4)
    losses = [plan.corrupt_loss(torch.tensor(1.0)) for _ in range(3)]  # three micro-batches: all poisoned
    assert all(torch.isnan(x) for x in losses)
    plan.end_step()
    # A rerun of step 4 (after a rollback), even in a new process, is clean: the fault fired once.
    again = FaultPlan(plan.faults, 0, tmp_path)
    again.begin_step(4)
    assert torch.isfinite(again.corrupt_loss(torch.tensor(1.0)))
    log = [json.loads(line) for line in (tmp_path / "chaos" / "injected.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in log] == [("nan", 2), ("inf", 3), ("nan", 4)]


def test_an_lr_surge_fires_once_but_its_poisoned_batches_stay_poisoned(tmp_path):
    """A restart re-runs the steps: the surge (a transient event) does not come back, the bad data does."""
    spike = parse_fault("spike@step=3,steps=2,lr=50")
    window = np.zeros((2, 9), dtype=np.int64)
    for attempt in range(2):  # a new FaultPlan per attempt, as in a restarted process
        plan = FaultPlan([spike], rank=0, run_dir=tmp_path)
        scales = []
        for step in (3, 4):
            plan.begin_step(step)
            poisoned = plan.corrupt_batch(step - 1, window, 256)
            assert poisoned.any(), (attempt, step)  # random bytes, every attempt
            scales.append(plan.lr_scale())
            plan.end_step()
        assert scales == ([50.0, 50.0] if attempt == 0 else [1.0, 1.0])


def test_corrupt_batches_are_passed_over_by_every_rank_alike():
    tokens = np.arange(10_000) % 256
    plan = FaultPlan([parse_fault("data_corrupt@step=3")], rank=0)
    samplers = [BatchSampler(tokens, 16, 8, r, 2, seed=0, vocab_size=256, transform=plan.corrupt_batch) for r in range(2)]
    clean = [BatchSampler(tokens, 16, 8, r, 2, seed=0, skip_ranges=[(2, 3)]) for r in range(2)]
    for _ in range(4):
        for s, c in zip(samplers, clean):
            np.testing.assert_array_equal(s.next_batch()[0], c.next_batch()[0])
    assert [s.rejected for s in samplers] == [[2], [2]]


def test_ckpt_corrupt_flips_bytes_of_the_newest_complete_checkpoint(tmp_path):
    for step in (4, 8):
        folder = tmp_path / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
        (folder / "manifest.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-step-00000012").mkdir()  # a save in flight is not touched
    plan = FaultPlan([parse_fault("ckpt_corrupt@step=10")], rank=0, run_dir=tmp_path)
    plan.begin_step(10)
    plan.at_step_start([], microbatch_rows=1)
    assert (tmp_path / "checkpoints" / "step-00000004" / "__0_0.distcp").read_bytes() == bytes(range(256)) * 4
    changed = (tmp_path / "checkpoints" / "step-00000008" / "__0_0.distcp").read_bytes()
    assert sum(a != b for a, b in zip(changed, bytes(range(256)) * 4)) == 16


def test_ckpt_corrupt_waits_for_the_save_in_flight_and_flips_that_one(tmp_path):
    """The drill's corrupt checkpoint must be the one the next load reads: a background save that lands
    after the flip would otherwise be loaded clean and the fault never seen (found under load in CI)."""
    shard = bytes(range(256)) * 4

    def write_checkpoint(step: int) -> None:
        folder = tmp_path / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(shard)
        (folder / "manifest.json").write_text("{}")

    write_checkpoint(15)
    plan = FaultPlan([parse_fault("ckpt_corrupt@step=22")], rank=0, run_dir=tmp_path)
    plan.begin_step(22)
    plan.at_step_start([], microbatch_rows=1, settle_checkpoints=lambda: write_checkpoint(20))  # the save of step 20 lands
    assert (tmp_path / "checkpoints" / "step-00000015" / "__0_0.distcp").read_bytes() == shard
    changed = (tmp_path / "checkpoints" / "step-00000020" / "__0_0.distcp").read_bytes()
    assert sum(a != b for a, b in zip(changed, shard)) == 16


@pytest.mark.slow
def test_a_held_gil_is_caught_by_the_watchdog_backstop(tmp_path):
    """The hang watchdog is a Python thread, which a held GIL stops too; faulthandler's timer is not."""
    code = textwrap.dedent(f"""
        from keel.chaos.faults import _hold_gil
        from keel.trainer.config import WatchdogConfig
        from keel.trainer.watchdog import Watchdog
        dog = Watchdog(WatchdogConfig(floor_s=1, startup_s=1, poll_s=0.2), {str(tmp_path)!r}, rank=3)
        dog.beat("step", 7, attempt=2)
        _hold_gil(60)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1  # faulthandler's exit: torchrun sees a failed worker and restarts the group
    from keel.trainer.watchdog import stalled_dumps

    [info] = stalled_dumps(tmp_path)
    assert (info["rank"], info["step"], info["attempt"], info["phase"]) == (3, 7, 2, "step")
    dump = (tmp_path / "dumps" / "hang-attempt2-step7-rank3-gil.txt").read_text()
    assert "_hold_gil" in dump and "Timeout" in dump
    assert stalled_dumps(tmp_path) == []  # reported once


def test_inject_checks_the_run_and_leaves_a_request_the_plan_takes(tmp_path):
    with pytest.raises(ValueError, match="no run store"):
        request(tmp_path, "nan")
    store = RunStore(tmp_path)
    store.set_meta("world_size", 2)
    store.write_event("run_started", "2 processes", step=0, attempt=0, rank=0)
    store.close()
    with pytest.raises(ValueError, match=r"--rank=2: the run has ranks 0..1"):
        request(tmp_path, "nan", rank=2)
    with pytest.raises(ValueError, match="unknown fault 'melt'"):
        request(tmp_path, "melt")
    assert request(tmp_path, "hang@seconds=5", rank=1) == "hang@step=2,rank=1,seconds=5"  # no steps yet: step 0 + 2
    plan = FaultPlan([], rank=1, run_dir=tmp_path)
    plan.begin_step(5)  # taken late: it fires now
    assert [str(f) for f in plan.faults] == ["hang@step=5,rank=1,seconds=5"]


def test_an_oom_fault_is_a_memory_that_holds_rows_sequences(tmp_path):
    """It runs out again each time the step runs with a larger micro-batch: a plain retry does not get past it."""
    plan = FaultPlan([parse_fault("oom@step=6,rows=2")], rank=0, run_dir=tmp_path)
    plan.begin_step(6)
    for rows in (8, 8, 4):  # the step and its retries, the micro-batch halved after the second
        with pytest.raises(torch.OutOfMemoryError):
            plan.at_step_start([], microbatch_rows=rows)
    plan.at_step_start([], microbatch_rows=2)  # fits: the step runs
    assert [f.kind for f in plan.fired] == ["oom"]
    plan.begin_step(7)
    plan.at_step_start([], microbatch_rows=8)  # the fault's span (steps=1) is over


def _injected(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "chaos" / "injected.jsonl").read_text().splitlines()]


def test_a_fault_that_ends_the_process_waits_for_its_steps_ckpt_corrupt(tmp_path):
    """The drill's crash once beat rank 0, still waiting for its save in flight before the flip, and the
    restart loaded a clean checkpoint. The killing fault (here a hang of 0 s, which returns) is sequenced
    after the flip by rank 0's marker, however late rank 0 gets there."""
    faults = [parse_fault("ckpt_corrupt@step=5"), parse_fault("hang@step=5,rank=1,seconds=0")]
    ranks = [FaultPlan(faults, rank, tmp_path) for rank in (0, 1)]
    for plan in ranks:
        plan.begin_step(5)
    rank1 = threading.Thread(target=ranks[1].at_step_start, args=([], 1))
    rank1.start()
    rank1.join(timeout=0.5)
    assert rank1.is_alive() and not (tmp_path / "chaos" / "injected.jsonl").exists()  # waiting for the flip
    ranks[0].at_step_start([], 1, settle_checkpoints=lambda: time.sleep(0.2))  # the save in flight lands, then the flip
    rank1.join(timeout=10)
    assert [(e["kind"], e["rank"]) for e in _injected(tmp_path)] == [("ckpt_corrupt", 0), ("hang", 1)]


def test_the_wait_for_ckpt_corrupt_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr("keel.chaos.faults._SEQUENCE_WAIT_S", 0.1)
    plan = FaultPlan([parse_fault("ckpt_corrupt@step=5"), parse_fault("hang@step=5,rank=1,seconds=0")], 1, tmp_path)
    plan.begin_step(5)
    plan.at_step_start([], 1)  # rank 0 never gets there: the hang fires anyway, and says so
    [entry] = _injected(tmp_path)
    assert entry["kind"] == "hang" and entry["detail"] == "ckpt_corrupt of step 5 had not fired after 0 s"


# A node of two workers, one under an intermediate process (as keel's agent forks its workers from a
# server); worker 1 injects node_loss. The "agent" names itself in KEEL_AGENT_PID as keel's agent does,
# or is a script called torchrun that exports nothing, as plain torchrun.
_NODE = """
import os, subprocess, sys, time
if {export!r}:
    os.environ["KEEL_AGENT_PID"] = str(os.getpid())
worker = [sys.executable, "-c", "import time; time.sleep(60)"]
injector = [sys.executable, "-c", {injector!r}]
server = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)", *injector]
children = [subprocess.Popen(worker), subprocess.Popen(server)]
open({pids!r}, "w").write(" ".join(str(c.pid) for c in children))
time.sleep(60)
"""
_INJECTOR = """
from keel.chaos.fault_specs import parse_fault
from keel.chaos.faults import FaultPlan
plan = FaultPlan([parse_fault("node_loss@step=3,rank=1")], 1, {run_dir!r})
plan.begin_step(3)
plan.at_step_start([], 1)
"""


def _ended(pid: int, within_s: float = 10.0) -> bool:
    """Whether the process is gone within `within_s`: a SIGKILL is delivered when the process next runs,
    which on a loaded machine comes a moment after the agent's own death."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] in "ZX":  # a zombie: dead, not yet reaped
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("export", [True, False], ids=["KEEL_AGENT_PID", "plain torchrun"])
def test_node_loss_kills_the_agent_and_every_worker_after_recording_itself(tmp_path, export):
    agent_script = tmp_path / "torchrun"
    pids = tmp_path / "pids"
    agent_script.write_text(_NODE.format(export=export, injector=_INJECTOR.format(run_dir=str(tmp_path)), pids=str(pids)))
    env = {k: v for k, v in os.environ.items() if k != "KEEL_AGENT_PID"}
    agent = subprocess.Popen([sys.executable, str(agent_script)], env=env)
    assert agent.wait(timeout=120) == -signal.SIGKILL
    assert all(_ended(int(pid)) for pid in pids.read_text().split())
    [entry] = _injected(tmp_path)  # written (and fsync'd) before the kill
    how = "KEEL_AGENT_PID" if export else "KEEL_AGENT_PID unset: the nearest ancestor running torchrun"
    assert entry["kind"] == "node_loss" and entry["detail"] == f"agent {agent.pid} ({how}) and the 3 processes under it"


def test_a_killing_fault_on_every_rank_is_spent_once_any_rank_fired_it(tmp_path):
    """crash@step=5 (no rank: every rank) kills the first rank that reaches it, and torchrun takes the
    group down before the others get there. After the restart those others must not crash at step 5
    again: the resumed run would otherwise lose one more attempt per rank it had not reached. A fault
    that leaves the process alive (a NaN on every rank) still acts on each rank once."""
    first = FaultPlan([parse_fault("crash@step=5"), parse_fault("nan@step=5")], 0, tmp_path)
    first.begin_step(5)
    for fault in first.faults:
        first.fire(fault)  # what rank 0's hooks record before they act
    code = textwrap.dedent(f"""
        import torch
        from keel.chaos.fault_specs import parse_fault
        from keel.chaos.faults import FaultPlan
        plan = FaultPlan([parse_fault("crash@step=5"), parse_fault("nan@step=5")], 1, {str(tmp_path)!r})
        plan.begin_step(5)
        plan.at_step_start([], 1)
        print(plan.corrupt_loss(torch.tensor(1.0)).item())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]  # -9 when rank 1 crashed again
    assert proc.stdout.strip() == "nan"
