"""What the checkpoint and rollback settings promise, each held on a real `keel train` run: a save every
`checkpoint.interval_minutes` of the run's own clock whatever `interval_steps` says (and none by the
clock when it is 0), `checkpoint.keep_lookback_steps` keeping a checkpoint older than the newest `keep`
for a spike found late, and the LR times `recovery.lr_factor` for `recovery.lr_factor_steps` steps
after that rollback, then the schedule's again."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import train

from keel.monitor.run_dir import list_checkpoints
from keel.monitor.store import read_events, read_steps
from keel.trainer.config import load_config
from keel.trainer.optim import lr_at

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY = ["--config=tiny", "--monitor.prometheus=false"]

MINUTES = 0.01  # a save every 0.6 s of the run's clock
TIMED_STEPS = 50

# A save every 2 steps and only the newest kept, plus the lookback's. The detector confirms a spike after 5
# outliers, so when it does (step 29) the newest saves (26, 28) hold bad steps: the rollback must go back
# past them, to the checkpoint of step 24 that only the lookback kept.
SPIKE_STEPS, EVERY, KEEP, LOOKBACK = 40, 2, 1, 4
SPIKE_AT, PERSISTENCE = 25, 5
LR_FACTOR, LR_FACTOR_STEPS = 0.5, 6


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """Saves by the clock only (interval_steps far beyond the run). Each step sleeps 50 ms (a one-rank
    straggler fault), so that even an idle machine spends several intervals in the 50 steps."""
    run_dir = tmp_path_factory.mktemp("timed") / "run"
    train(run_dir, *TINY, f"--steps={TIMED_STEPS}", "--checkpoint.interval_steps=1000", f"--checkpoint.interval_minutes={MINUTES}",
          f"--fault=straggler@step=1,steps={TIMED_STEPS},ms=50")  # fmt: skip
    return run_dir


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory):
    """Saves by the step count only (interval_minutes=0), a spike from bad data found late, its rollback and the lowered LR.
    No in-memory snapshots: the rollback must find its checkpoint on disk, among those retention kept."""
    run_dir = tmp_path_factory.mktemp("lookback") / "run"
    train(run_dir, *TINY, f"--steps={SPIKE_STEPS}", f"--checkpoint.interval_steps={EVERY}", "--checkpoint.interval_minutes=0",
          f"--checkpoint.keep={KEEP}", f"--checkpoint.keep_lookback_steps={LOOKBACK}", "--spike.warmup_steps=12",
          "--spike.min_baseline=8", f"--spike.persistence={PERSISTENCE}", f"--fault=spike@step={SPIKE_AT},steps={PERSISTENCE}",
          f"--recovery.lr_factor={LR_FACTOR}", f"--recovery.lr_factor_steps={LR_FACTOR_STEPS}",
          "--checkpoint.snapshot_cost=0")  # fmt: skip
    return run_dir


def saved_steps(run_dir) -> list[int]:
    return sorted(read_events(run_dir).query("kind == 'checkpoint_saved'").step.astype(int))


def test_a_checkpoint_is_saved_each_time_interval_minutes_have_passed(timed_run):
    saves = saved_steps(timed_run)
    assert saves[-1] == TIMED_STEPS  # the last step is always saved
    timed = [s for s in saves if s < TIMED_STEPS]
    assert len(timed) >= 3, saves
    # Each save after the first comes at the first step whose agreed time (the run store's `time`, the
    # clock the ranks decide on) is interval_minutes past the previous save's: not one step earlier, not later.
    # (The first interval starts before step 1, at a time the store does not hold.)
    clock = read_steps(timed_run, effective=True).set_index("step").time
    due = [timed[0]]
    for step in range(timed[0] + 1, TIMED_STEPS):
        if clock[step] - clock[due[-1]] >= 60 * MINUTES:
            due.append(step)
    assert timed == due


def test_no_checkpoint_is_saved_by_the_clock_when_interval_minutes_is_0(spike_run):
    # 0 turns the clock off; were it read as an interval of 0 minutes, every step would be due and saved.
    assert all(step % EVERY == 0 for step in saved_steps(spike_run))


def test_keep_lookback_steps_keeps_an_older_checkpoint_for_a_spike_found_late(spike_run):
    # Without the lookback's checkpoint there is none saved before the spike: `rollback_failed`, and training goes on.
    attempts = read_events(spike_run).query("kind in ['rollback', 'rollback_failed']")
    assert list(attempts.kind) == ["rollback"], attempts.message.tolist()
    rollback = attempts.data.iloc[0]
    assert rollback["bad_from"] == SPIKE_AT and rollback["from_step"] == SPIKE_AT + PERSISTENCE - 1
    # The saves made since the spike began (the newest, 28, and 26) are discarded; the rollback restored the
    # newest checkpoint at least keep_lookback_steps older than the newest, which keep=1 alone would have removed.
    discarded = sorted(int(name.removeprefix("step-")) for name in rollback["discarded"])
    assert discarded == [26, 28]
    assert rollback["to_step"] == discarded[-1] - LOOKBACK == SPIKE_AT - 1
    # At the end: the newest, the one keep_lookback_steps older, and between them the oldest save of the last
    # keep_lookback_steps, kept to become the lookback checkpoint at the next save.
    assert [s for s, _ in list_checkpoints(spike_run)] == [SPIKE_STEPS - LOOKBACK, SPIKE_STEPS - EVERY, SPIKE_STEPS]


def test_the_lr_is_lowered_for_lr_factor_steps_after_a_rollback_then_follows_the_schedule(spike_run):
    [rollback] = read_events(spike_run).query("kind == 'rollback'").data
    cfg = load_config(str(spike_run / "config.toml"))
    run = read_steps(spike_run, effective=True)
    assert list(run.step) == list(range(1, SPIKE_STEPS + 1))
    lowered = (run.step > rollback["to_step"]) & (run.step <= rollback["to_step"] + LR_FACTOR_STEPS)
    schedule = np.array([lr_at(step, cfg.optim, cfg.training.steps) for step in run.step])
    np.testing.assert_allclose(run.lr, np.where(lowered, schedule * LR_FACTOR, schedule), rtol=1e-12)


def test_each_save_is_recorded_under_the_attempt_that_made_it(spike_run):
    # A save still being written when the spike was confirmed belongs to the attempt that made it. Recorded
    # after the rollback under the new attempt, it would claim a step the new attempt had not run yet.
    ran_at = read_steps(spike_run).set_index(["step", "attempt"]).time  # every attempt's rows
    saves = read_events(spike_run).query("kind == 'checkpoint_saved'")
    for save in saves.itertuples():
        assert save.time >= ran_at[(save.step, save.attempt)], f"step {save.step}'s save recorded as attempt {save.attempt} before it ran"
    # The saves the rollback discarded, made by attempt 0, and the new attempt's own saves of the same steps.
    assert sorted(saves[saves.step == 28].attempt) == [0, 1]
