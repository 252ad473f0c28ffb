"""Combinations users run that the parity and stability tests do not reach on their own: a resume with
several model parts per rank, a spike rollback under pp and tp, the 1b preset's shapes, workers started
by srun, and two nodes meeting through torchrun's rendezvous (on loopback). The layouts that only need
loss parity with one process are in test_parity.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import NO_WANDB, keel, train

from keel.monitor.checkpoints import verify
from keel.monitor.run_dir import list_checkpoints
from keel.monitor.store import read_events, read_meta, read_steps
from keel.trainer.model_args import MODEL_PRESETS, count_params, flops_per_token

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY = ["--config=tiny", "--monitor.prometheus=false"]
# Four steps stay within the LR warmup (5 steps), where the schedule does not depend on the run's length.
DP2 = [*TINY, "--dp=2", "--steps=4"]


def events_of(run_dir: Path, kind: str):
    events = read_events(run_dir)
    return events[events.kind == kind]


INTERLEAVED = [
    *TINY,
    "--pp=2",
    "--parallel.pp_schedule=Interleaved1F1B",
    "--parallel.pp_virtual_stages=2",
    "--training.microbatches=4",
    "--checkpoint.interval_steps=4",
    "--checkpoint.async_save=false",  # the save of step 8 is surely complete when the crash comes
]


def test_interleaved_run_resumes_exactly(tmp_path):
    """With two virtual stages each pp rank holds two model parts, and a checkpoint must bring back both
    (weights and optimizer state). A run killed at step 11 and continued with `keel train --resume` is
    the uninterrupted run, bit for bit."""
    whole = train(tmp_path / "whole", *INTERLEAVED)
    run_dir = tmp_path / "run"
    crashed = keel("train", f"--run-dir={run_dir}", *INTERLEAVED, "--fault=crash@step=11", "--max-restarts=0")
    assert crashed.returncode != 0
    assert list(read_steps(run_dir).step) == list(range(1, 11))
    resumed = keel("train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(events_of(run_dir, "checkpoint_loaded").step) == [8]
    run = read_steps(run_dir, effective=True)
    assert list(run.step) == list(range(1, 21)) and (run[run.step > 8].attempt == 1).all()
    np.testing.assert_array_equal(run.loss, whole.loss)
    np.testing.assert_array_equal(run.grad_norm, whole.grad_norm)


SPIKE_PP_TP = [
    *TINY,
    "--pp=2",
    "--tp=2",
    "--steps=30",
    "--checkpoint.interval_steps=8",
    "--spike.warmup_steps=12",
    "--spike.min_baseline=8",
]


def test_spike_under_pp_and_tp_is_rolled_back_and_its_data_skipped(tmp_path):
    """Three batches of random bytes at steps 18..20 of a pp2·tp2 run: every rank restores its share of
    the same in-memory snapshot from before step 18 and skips the same batches. The run is then exactly a
    run that never read them: nothing of the spike is left on any stage or tensor-parallel shard."""
    run_dir = tmp_path / "spike"
    run = train(run_dir, *SPIKE_PP_TP, "--fault=spike@step=18,steps=3")
    events = read_events(run_dir)
    story = events[events.kind.isin(["loss_outlier", "spike", "rollback", "skip_data"])]
    assert list(story.kind) == ["loss_outlier", "spike", "rollback", "skip_data"]
    outlier, spike, rollback, skip = (story.iloc[i] for i in range(4))
    assert outlier["step"] == 18 and spike["data"]["start_step"] == 18 and 18 < spike["step"] <= 23
    to_step = rollback["data"]["to_step"]
    assert rollback["data"]["in_memory"] and 0 <= to_step < 18 and rollback["data"]["from_step"] == spike["step"]
    assert skip["data"]["first_batch"] == to_step and skip["data"]["end_batch"] == spike["step"] + 5
    assert list(run.step) == list(range(1, 31))
    same_skip = train(tmp_path / "same-skip", *SPIKE_PP_TP, f"--data.skip_batches={to_step}:{skip['data']['end_batch']}")
    np.testing.assert_array_equal(run.loss.to_numpy(), same_skip.loss.to_numpy())
    np.testing.assert_array_equal(run.grad_norm.to_numpy(), same_skip.grad_norm.to_numpy())


def test_1b_preset_builds_and_trains_a_step(tmp_path):
    """The 1b preset's shapes (dim 2048, 32 query and 8 key/value heads split over tp2, ffn 8192, Llama 3's
    128,256-token vocabulary in one tied matrix) for one step, with 2 of its 16 layers and 64 tokens. The
    whole preset needs 16 bytes a parameter (fp32 weights, gradients, two AdamW moments): 20 GB, too much
    for CI. The stages the run built must hold exactly the parameters the FLOPs and MFU are computed from."""
    run_dir = tmp_path / "run"
    shape = ["--model.n_layers=2", "--data.seq_len=32", "--training.global_batch_size=2"]
    no_checkpoints = ["--checkpoint.interval_steps=0", "--checkpoint.interval_minutes=0"]
    run = train(run_dir, "--config=1b", "--monitor.prometheus=false", "--tp=2", "--steps=1", *shape, *no_checkpoints)
    # A random model guesses near uniformly over the whole vocabulary (the bytes are only its first 256 ids).
    assert list(run.step) == [1] and abs(run.loss.iloc[0] - np.log(128_256)) < 1
    args = replace(MODEL_PRESETS["1b"], n_layers=2)
    assert built_parameters(run_dir) == count_params(args)[0]
    assert read_meta(run_dir)["flops_per_token"] == flops_per_token(args, 32)


def built_parameters(run_dir: Path) -> int:
    """The parameters of every pipeline stage, as the ranks that built them logged them (a stage is
    built on each of its dp·tp ranks, with the same count)."""
    logs = "".join(path.read_text() for path in (run_dir / "logs").iterdir())
    stages = dict(re.findall(r"pipeline stage (\d+) built: (\d+) parameters", logs))
    return sum(map(int, stages.values()))


# -- launched without torchrun's standalone mode ---------------------------------------------------


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """dp2 started by `keel train` on one node: what every other way of starting two ranks must reproduce."""
    return train(tmp_path_factory.mktemp("dp2") / "run", *DP2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(
    commands: list[tuple[list[str], dict]], timeout: float = 180, cwd: Path | None = None
) -> list[subprocess.CompletedProcess]:
    """Starts every (command, environment) at once, as a cluster starts one per node or task; waits for
    all of them. On a timeout every process group is killed."""
    procs = [
        subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd, env in commands
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_workers_started_by_srun_form_the_group(tmp_path, dp2_run):
    """`srun -n 2 python -m keel.trainer.train ...` gives each task only SLURM_PROCID, SLURM_NTASKS and
    SLURM_LOCALID (and the job script a MASTER_ADDR and MASTER_PORT): the workers must map them onto a
    process group of two ranks and train exactly as dp2 under torchrun."""
    run_dir = tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    base |= {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "keel.trainer.train", *DP2, f"--run-dir={run_dir}", NO_WANDB]
    tasks = [(cmd, {**base, "SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(task)}) for task in (0, 1)]
    for proc in run_together(tasks):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_meta(run_dir)["world_size"] == 2
    assert "rank 1 of 2" in (run_dir / "logs" / "rank-1.log").read_text()
    run = read_steps(run_dir, effective=True)
    np.testing.assert_array_equal(run.loss, dp2_run.loss)


def test_two_nodes_meet_through_the_rendezvous(tmp_path, dp2_run):
    """`keel train --nnodes 2` on two "nodes" (two launchers on loopback, one worker each) started in one
    folder, as on a shared filesystem, without --run-dir: torchrun's c10d rendezvous joins them into one
    dp2 job, the rendezvous id names the run on both, rank 0 records it, and each rank writes its own log
    and checkpoint shard into that one directory. (Before, each launcher named a run of its own, and
    rank 1's shard landed in the other one: a checkpoint that verified and could not load.)"""
    endpoint = f"127.0.0.1:{free_port()}"
    rendezvous = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", "--max-restarts=0"]
    cmd = [sys.executable, "-m", "keel.cli", "train", *DP2, NO_WANDB, *rendezvous]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for proc in run_together([([*cmd, f"--node-rank={node}"], env) for node in (0, 1)], cwd=tmp_path):
        assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name == "two-nodes" and read_meta(run_dir)["world_size"] == 2
    # Each rank's log (beside them the agents' torchrun log, which both nodes' agents append to).
    assert sorted(path.name for path in (run_dir / "logs").glob("rank-*")) == ["rank-0.log", "rank-1.log"]
    [(step, checkpoint)] = list_checkpoints(run_dir)
    assert step == 4 and verify(checkpoint) is None and len(list(checkpoint.glob("*.distcp"))) == 2
    run = read_steps(run_dir, effective=True)
    np.testing.assert_array_equal(run.loss, dp2_run.loss)
