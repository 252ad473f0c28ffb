"""keel.trainer.toolkit in one process: the sampler a rollback moves, the settings' order, the norm every
rank agrees on, and a loop stopped and resumed from Keel's checkpoint as if it had never stopped."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from keel.monitor.store import read_events, read_steps
from keel.trainer.data.loader import BatchSampler
from keel.trainer.toolkit import DataPosition, KeelUsageError, ResumableBatchSampler, open_run
from keel.trainer.toolkit.grads import global_grad_norm
from keel.trainer.toolkit.loop import loop_config
from keel.trainer.toolkit.run import KeelRun

sys.path.insert(0, str(REPO / "examples"))
from plain_loop import BLOCK, GPT, corpus  # noqa: E402 (the example is the loop under test)

QUIET = {"monitor.prometheus": False, "monitor.wandb": False}


def test_a_batch_is_the_same_at_any_world_size_and_position():
    whole = ResumableBatchSampler(100, 8, seed=3)
    halves = [ResumableBatchSampler(100, 8, rank, 2, seed=3) for rank in range(2)]
    for _ in range(30):  # past the end of an epoch (12 batches): a new shuffle
        assert whole.next_indices() == halves[0].next_indices() + halves[1].next_indices()
    again = ResumableBatchSampler(100, 8, seed=3)
    again.load_state_dict(whole.state_dict())
    assert again.next_indices() == whole.next_indices()
    # A rollback's jump and rewind, and a skip range from data.skip_batches, move only the position.
    first = ResumableBatchSampler(100, 8, seed=3)
    batches = [first.next_indices() for _ in range(10)]
    skipping = ResumableBatchSampler(100, 8, seed=3)
    skipping.skip_ranges = {2: 5}
    assert [skipping.next_indices() for _ in range(3)] == [batches[0], batches[1], batches[5]]
    skipping.rewind_to(1)
    assert skipping.next_indices() == batches[1]
    assert isinstance(skipping, DataPosition)
    assert isinstance(BatchSampler(np.arange(1000), 8, 4, 0, 1, 0), DataPosition)  # Keel's own sampler follows it too


def test_a_huge_dataset_is_sampled_without_an_epochs_permutation():
    huge = [ResumableBatchSampler(10**12, 8, rank, 2, seed=3) for rank in range(2)]
    whole = ResumableBatchSampler(10**12, 8, seed=3)
    for _ in range(3):
        indices = whole.next_indices()
        assert indices == huge[0].next_indices() + huge[1].next_indices() and max(indices) < 10**12
    assert whole._order.size == 0  # no 8 TB permutation


def test_bad_sampler_input_is_one_line():
    with pytest.raises(ValueError, match="global_batch_size=6: must be a positive multiple of the world size 4"):
        ResumableBatchSampler(100, 6, 0, 4)
    with pytest.raises(ValueError, match="num_samples=3: fewer than one global batch of 8"):
        ResumableBatchSampler(3, 8)


def test_settings_come_from_the_code_then_the_file_then_keel_args(tmp_path, monkeypatch):
    toml = tmp_path / "keel.toml"
    toml.write_text("[checkpoint]\ninterval_steps = 7\nkeep = 5\n")
    monkeypatch.setenv("KEEL_CONFIG", str(toml))
    monkeypatch.setenv("KEEL_ARGS", "--checkpoint.keep=9 --fault spike@step=3 --steps 12")
    cfg = loop_config(50, 2, {"checkpoint.interval_steps": 3, "checkpoint.keep": 4, "spike.window": 64})
    assert (cfg.checkpoint.interval_steps, cfg.checkpoint.keep, cfg.spike.window) == (7, 9, 64)
    assert cfg.training.steps == 12 and cfg.chaos.faults == ["spike@step=3"] and cfg.parallel.dp == 2
    monkeypatch.setenv("KEEL_ARGS", "--spike.window=-1")
    with pytest.raises(ValueError, match="spike.window=-1"):
        loop_config(50, 1)
    toml.write_text("[checkpoint\n")
    with pytest.raises(ValueError, match=f"KEEL_CONFIG={toml}: cannot read it as TOML"):
        loop_config(50, 1)


def test_the_global_norm_is_torchs_in_one_process_and_nan_with_a_bad_loss():
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    exact = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
    torchs = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    # torch's fused norm in the gradients' float32, as clip_grad_norm_: its rounding, not float64's.
    assert global_grad_norm(model.parameters(), 1) == pytest.approx(torchs, rel=1e-7) == pytest.approx(exact, rel=1e-6)
    assert np.isnan(global_grad_norm(model.parameters(), 1, loss_finite=False))


def train(run_dir, steps: int, total: int | None = None) -> list[float]:
    """examples/plain_loop.py's model and loop in this process, `steps` of a `total`-step schedule."""
    torch.manual_seed(0)
    model = GPT(dim=32, layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (total or steps))
    data = corpus(1 << 16)
    sampler = ResumableBatchSampler(len(data) - BLOCK - 1, 4, seed=1)
    config = {**QUIET, "checkpoint.interval_steps": 3}
    run = open_run(model, optimizer, scheduler=scheduler, data=sampler, steps=steps, run_dir=str(run_dir), config=config)
    for step in run.steps():
        if step == 2:
            run.note("evaluated", eval_loss=1.5)
        offsets = torch.tensor(sampler.next_indices())[:, None] + torch.arange(BLOCK)
        loss = run.loss(model(data[offsets], data[offsets + 1]))
        loss.backward()
        run.clip_grad_norm(1.0)
        run.optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        run.log(batch_loss_x2=2 * loss.item())
    assert run.close() == 0
    return read_steps(run_dir, effective=True).loss.tolist()


def test_a_loop_stopped_and_started_again_resumes_bit_identically(tmp_path):
    whole = train(tmp_path / "whole", 8)
    train(tmp_path / "parts", 4, total=8)  # its last step is saved (checkpointing is on)
    resumed = train(tmp_path / "parts", 8)
    assert resumed == whole
    events = read_events(tmp_path / "parts")
    assert events.query("kind == 'checkpoint_loaded'").step.tolist() == [4]
    note = read_events(tmp_path / "whole").query("kind == 'note'").iloc[0]
    assert (note.step, note.message, note.data) == (2, "evaluated", {"eval_loss": 1.5})
    assert read_steps(tmp_path / "parts").groupby("attempt").step.agg(["min", "max"]).values.tolist() == [[1, 4], [5, 8]]


def test_a_framework_step_that_goes_backwards_is_refused(tmp_path):
    cfg = loop_config(10, 1, {**QUIET, "run.run_dir": str(tmp_path)})
    keel = KeelRun(cfg, 0, 1, torch.device("cpu"))
    keel.follow_step(5)
    assert keel.begin_step() == 5
    with pytest.raises(KeelUsageError, match="step 3 after step 5: steps must go forward"):
        keel.follow_step(3)
    keel.watchdog.stop()
    keel.recorder.close()
