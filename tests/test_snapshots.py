"""keel.trainer.checkpoint.snapshots in one process: a restored snapshot is the state it copied, bit for bit
(parameters, Adam's moments and step, the random generators, the LR scheduler), the interval keeps the
copies under their share of the step time, and enough snapshots are kept to reach behind a verdict's
first bad step. (A rollback to a snapshot in a real run: tests/test_stability.py.)"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from keel.trainer.checkpoint.snapshots import SnapshotFiles, Snapshots


def setup(cost: float = 0.01, every: int = 0, lookback: int = 6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    snapshots = Snapshots(model, optimizer, scheduler, host_rng=True, cost=cost, every_steps=every, lookback_steps=lookback)
    return model, optimizer, scheduler, snapshots


def train_step(model, optimizer, scheduler, snapshots) -> None:
    loss = model(torch.randn(5, 8)).square().mean() + random.random() + float(np.random.rand())
    loss.backward()
    snapshots.before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def state_of(model, optimizer, scheduler) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in enumerate(optimizer.state.values())},
        "scheduler": scheduler.state_dict(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(a: dict, b: dict) -> None:
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)
    assert a["optim"].keys() == b["optim"].keys()
    for i in a["optim"]:
        for k in a["optim"][i]:
            torch.testing.assert_close(a["optim"][i][k], b["optim"][i][k], rtol=0, atol=0)
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1] and (a["rng"][2] == b["rng"][2]).all()


def test_a_restored_snapshot_is_the_state_it_copied_and_training_from_it_repeats_itself():
    model, optimizer, scheduler, snapshots = setup(every=1)
    for step in range(1, 4):
        train_step(model, optimizer, scheduler, snapshots)
        snapshots.take(step, {"step": step})
    snapshots.before_update()
    at_3 = state_of(model, optimizer, scheduler)
    for step in range(4, 7):
        train_step(model, optimizer, scheduler, snapshots)
        snapshots.take(step, {"step": step})
    after = state_of(model, optimizer, scheduler)
    snapshot = snapshots.newest_before(4)
    assert snapshot.step == 3 and snapshot.train_state == {"step": 3}
    snapshots.restore(snapshot)
    assert [s.step for s in snapshots.kept] == [1, 2, 3]  # the abandoned trajectory's are gone
    assert_same(state_of(model, optimizer, scheduler), at_3)
    for _ in range(4, 7):  # the same steps again, from the restored random generators: the same state
        train_step(model, optimizer, scheduler, snapshots)
    assert_same(state_of(model, optimizer, scheduler), after)


def test_a_snapshot_from_before_the_first_update_restores_an_empty_optimizer():
    model, optimizer, scheduler, snapshots = setup(every=1)
    snapshots.take(0, {"step": 0})
    snapshots.before_update()
    start = state_of(model, optimizer, scheduler)
    train_step(model, optimizer, scheduler, snapshots)
    snapshots.restore(snapshots.newest_before(1))
    assert not optimizer.state
    assert_same(state_of(model, optimizer, scheduler), start)
    train_step(model, optimizer, scheduler, snapshots)  # and Adam starts its state again
    assert len(optimizer.state) == 4


@pytest.mark.parametrize(("copy_s", "step_s", "every"), [(0.001, 1.0, 1), (0.05, 1.0, 5), (0.5, 1.0, 50), (0.0101, 1.0, 2)])
def test_the_interval_keeps_the_copies_under_their_share_of_the_step(copy_s, step_s, every):
    *_, snapshots = setup(cost=0.01)
    assert snapshots.due(1, step_s, float("nan"))  # before any copy was measured: every step
    snapshots.due(1, step_s, copy_s)
    assert snapshots.every == every and copy_s / snapshots.every <= 0.01 * step_s
    # Kept: enough to reach 6 steps (the lookback) behind the newest, two at least.
    assert snapshots.keep == max(2, -(-6 // every) + 1)


def test_snapshot_files_give_back_each_step_bit_for_bit_and_a_restart_never_overwrites_what_it_restored(tmp_path):
    model, optimizer, scheduler, snapshots = setup(every=1)
    snapshots.files = SnapshotFiles(tmp_path, 0, {"model": "mlp"})
    assert math.isnan(snapshots.last_cost_s())  # none taken yet
    for step in range(1, 6):
        train_step(model, optimizer, scheduler, snapshots)
        took = time.perf_counter()
        snapshots.take(step, {"step": step})
        took = time.perf_counter() - took
        assert 0 < snapshots.last_cost_s() <= took  # on a CPU: take's processor time (no wait for a core measured)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".alive", "rank00000-slot0.bin", "rank00000-slot1.bin", "rank00000-step00000004.pt", "rank00000-step00000005.pt"]
    for step in (4, 5):
        kept, read = next(s for s in snapshots.kept if s.step == step), snapshots.files.read(step)
        assert read.train_state == {"step": step} and read.optimizer_keys == kept.optimizer_keys
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(read.tensors, kept.tensors))
    # A restarted process restores step 5 and snapshots it again at once: step 5's record moves to the other
    # slot, never rewritten in place; then the run goes on.
    restarted = SnapshotFiles(tmp_path, 0, {"model": "mlp"})
    restored = restarted.read(5)
    restarted.write(restored)
    assert restarted.steps() == [5] and torch.equal(restarted.read(5).tensors[0], restored.tensors[0])
    for step in (6, 7):
        restored.step = step
        restarted.write(restored)
    assert restarted.steps() == [6, 7]
    assert SnapshotFiles(tmp_path, 0, {"model": "another"}).read(7) is None  # another model's files are not loaded


def test_snapshots_are_kept_to_reach_behind_the_lookback_and_their_buffers_reused():
    model, optimizer, scheduler, snapshots = setup(every=2, lookback=6)
    snapshots.take(0, {"step": 0})  # as a run starts
    for step in range(1, 21):
        train_step(model, optimizer, scheduler, snapshots)
        if snapshots.due(step, 1.0, 0.0):
            snapshots.take(step, {"step": step})
    assert [s.step for s in snapshots.kept] == [14, 16, 18, 20]
    assert snapshots.newest_before(15).step == 14 and snapshots.newest_before(14) is None
    buffers = {id(t) for s in snapshots.kept for t in s.tensors}
    train_step(model, optimizer, scheduler, snapshots)
    snapshots.take(22, {"step": 22})
    assert {id(t) for t in snapshots.kept[-1].tensors} <= buffers  # the oldest one's host memory, copied into


def test_off_takes_none():
    *_, snapshots = setup(cost=0, every=0)
    assert not snapshots.enabled and not snapshots.due(5, 1.0, 0.001)


def test_a_snapshot_copies_the_tensors_a_load_put_in_place_of_the_old():
    """The shards of the live tensors are kept from snapshot to snapshot; an optimizer state that a load
    replaced (as a checkpoint's does) is copied, not the old one."""
    model, optimizer, scheduler, snapshots = setup(every=1)
    for step in range(1, 3):
        train_step(model, optimizer, scheduler, snapshots)
        snapshots.take(step, {"step": step})
    loaded = optimizer.state_dict()
    for state in loaded["state"].values():
        state["exp_avg"] = torch.full_like(state["exp_avg"], 7.0)
    optimizer.load_state_dict(loaded)  # new tensors in the optimizer's state
    snapshots.take(3, {"step": 3})
    snapshots.before_update()
    newest = snapshots.kept[-1]
    optimizer_tensors = newest.tensors[len(newest.tensors) - len(newest.optimizer_keys) :]
    moments = [t for t, (_, key) in zip(optimizer_tensors, newest.optimizer_keys) if key == "exp_avg"]
    assert moments and all(bool((m == 7.0).all()) for m in moments)


def test_on_a_shared_core_a_snapshot_costs_its_processor_time_times_the_wait_for_the_core():
    """Pinned to one core beside a process that spins on it, the training thread waits for the core about as
    long as it runs (longer on a loaded machine): a snapshot's cost is its processor time times that wait,
    as the kernel counted it over the same steps, not the wall time of whatever ran meanwhile."""
    core = sorted(os.sched_getaffinity(0))[0]
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        model, optimizer, scheduler, snapshots = setup(every=1)
        snapshots.due(0, 1.0, float("nan"))
        before = schedstat()
        for step in range(1, 8):
            busy_until = time.thread_time() + 0.02
            while time.thread_time() < busy_until:
                pass
            snapshots.due(step, 1.0, float("nan"))
        running, waiting = (now - then for now, then in zip(schedstat(), before))
        started = time.thread_time()
        snapshots.take(8, {"step": 8})
        processor = time.thread_time() - started
    finally:
        os.sched_setaffinity(0, mask)
        spinner.kill()
        spinner.wait()
    waited = 1 + waiting / running
    assert waited > 1.4  # the spinner took the core from the thread
    assert 0.6 * waited < snapshots.last_cost_s() / processor < 1.6 * waited, (snapshots.last_cost_s(), processor, waited)


def schedstat() -> tuple[int, int]:
    running, waiting, _ = open("/proc/thread-self/schedstat").read().split()
    return int(running), int(waiting)


def test_a_run_removes_the_snapshot_folders_that_killed_runs_left_and_no_other(tmp_path):
    """A tmpfs is memory: folders of runs killed with SIGKILL go when the next run starts on the node,
    while the folder of a live run (its files held open), or of one that wrote a moment ago (between two
    worker groups), stays."""
    identity = {"world": 1}
    live = SnapshotFiles(tmp_path / "keel-snapshots-live", 0, identity)
    old = time.time() - 2 * SnapshotFiles.ABANDONED_S
    for name in ("live", "killed", "restarting"):
        folder = tmp_path / f"keel-snapshots-{name}"
        folder.mkdir(exist_ok=True)
        (folder / "rank00000-slot0.bin").write_bytes(b"x")
        if name != "restarting":
            for path in (folder, *folder.iterdir()):
                os.utime(path, (old, old))
    SnapshotFiles(tmp_path / "keel-snapshots-new", 0, identity)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keel-snapshots-live", "keel-snapshots-new", "keel-snapshots-restarting"]
    del live
