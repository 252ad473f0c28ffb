"""keel.trainer.checkpoint.snapshots in one process: a restored snapshot is the state it copied, bit for bit
(parameters, Adam's moments and step, the random generators, the LR scheduler), the interval keeps the
copies under their share of the step time, and enough snapshots are kept to reach behind a verdict's
first bad step. (A rollback to a snapshot in a real run: tests/test_stability.py.)"""

from __future__ import annotations

import math
import random
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
        assert 0 < snapshots.last_cost_s() <= took  # on a CPU: the step's own time in take, copy and file
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rank00000-slot0.bin", "rank00000-slot1.bin", "rank00000-step00000004.pt", "rank00000-step00000005.pt"]
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
