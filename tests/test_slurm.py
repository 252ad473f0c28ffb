"""examples/slurm/keel.sbatch on a real SLURM (tests/slurm_cluster.py: Debian's slurm-wlm 22.05, one node):
a dp2 run requeued mid-way with `scontrol requeue` comes back as the same job, resumes its run directory and
ends with the losses of an uninterrupted `keel train`, bit for bit.

What SLURM 22.05 does on `scontrol requeue` of a running batch job (seen here with proctrack/linuxproc; a
cgroup cluster signals the same processes): SIGCONT then SIGTERM, once each, to every process of every job
step (keel train, its agent and each worker, whatever their session) and to the batch shell; SIGKILL KillWait
seconds later. The job shows COMPLETING until the steps have ended, then PENDING with Reason=BeginTime: its
begin time is set to the requeue's end + cred_expire + 1 s (120 s by default; the test cluster sets 20 s), so
that no credential of the previous run is still valid when it starts again. It is not held: only `scontrol
requeuehold`, a RequeueExitHold exit code or the MaxBatchRequeue'th requeue (5 by default,
Reason=JobHoldMaxRequeue) hold a job, which then waits for `scontrol release`; the test releases it only then.
The job keeps its id; `Restarts` in scontrol (SLURM_RESTART_COUNT in the job) counts the requeues.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from servers import free_port
from slurm_cluster import CRED_EXPIRE_S, KILL_WAIT_S, slurm_cluster  # noqa: F401 (the fixture)

from keel.monitor.store import read_events, read_steps

pytestmark = pytest.mark.slow

RECIPE = REPO / "examples" / "slurm" / "keel.sbatch"
FLAGS = ["--dp=2", "--steps=40", "--checkpoint.interval_steps=5", "--monitor.prometheus=false", "--monitor.wandb=false"]
REQUEUE_AFTER_STEP = 12  # past the checkpoint at step 10, well before step 40
START_TIMEOUT_S = 300  # sbatch to the first steps: scheduling, srun, torchrun and two workers' start on 2 busy cores
RUN_TIMEOUT_S = 600


def _steps(run_dir: Path):
    try:
        return read_steps(run_dir)
    except Exception:  # no store yet, or its tables not created yet
        return None


def _last_step(run_dir: Path) -> int:
    steps = _steps(run_dir)
    return int(steps.step.max()) if steps is not None and len(steps) else 0


def test_requeued_job_resumes_bit_identical(slurm_cluster, tmp_path, tiny_dp2_40):  # noqa: F811
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    venv_bin = Path(sys.executable).parent  # the job runs this environment's keel, as after `source .venv/bin/activate`
    assert (venv_bin / "keel").exists(), f"no keel next to {sys.executable}"
    env = {
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv_bin.parent),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # as conftest.keel() sets it for the reference
        "PYTHONWARNINGS": "ignore",
        "KEEL_CONFIG": "tiny",
        "KEEL_ARGS": " ".join(FLAGS),
        "RUN_DIR": str(run_dir),
        "RDZV_PORT": str(free_port()),  # not 29500: other runs on this machine may hold it
    }
    out = tmp_path / "slurm-%j.out"
    job = cluster.submit(RECIPE, "--nodes=1", f"--chdir={tmp_path}", f"--output={out}", "--job-name=keel-requeue", env=env)
    out = tmp_path / f"slurm-{job}.out"

    def explain() -> str:
        return f"job output:\n{out.read_text(errors='replace')[-6000:] if out.exists() else '(none)'}\n{cluster.logs(1500)}"

    cluster.wait_for(job, "RUNNING", timeout=START_TIMEOUT_S)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _last_step(run_dir) <= REQUEUE_AFTER_STEP:
        state = cluster.state(job)
        assert state.state == "RUNNING", f"job {job} is {state.state} before step {REQUEUE_AFTER_STEP}\n{explain()}"
        assert time.monotonic() < deadline, f"no step {REQUEUE_AFTER_STEP} after {START_TIMEOUT_S} s\n{explain()}"
        time.sleep(0.1)
    cluster.requeue(job)

    # Back in the queue, then running again. A held job (see the module's docstring) is released.
    seen: list[str] = []
    deadline = time.monotonic() + KILL_WAIT_S + CRED_EXPIRE_S + START_TIMEOUT_S
    while True:
        state = cluster.state(job)
        seen.append(f"{state.state}/{state.reason}")
        if state.held:
            cluster.release(job)
        if state.state == "RUNNING" and state.restarts == 1:
            break
        assert state.state in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), f"job {job} is {state.state}: {seen}\n{explain()}"
        assert time.monotonic() < deadline, f"job {job} not running again: {list(dict.fromkeys(seen))}\n{explain()}"
        time.sleep(0.25)
    # The requeue set the job's submit time to its end, and its begin time cred_expire + 1 s later.
    delay = datetime.fromisoformat(state.fields["EligibleTime"]) - datetime.fromisoformat(state.fields["SubmitTime"])
    assert delay.total_seconds() >= CRED_EXPIRE_S, (state.fields, list(dict.fromkeys(seen)))

    final = cluster.wait_for(job, "COMPLETED", timeout=RUN_TIMEOUT_S)
    assert final.restarts == 1, final.fields
    text = out.read_text(errors="replace")
    assert text.count("keel.sbatch: job") == 2 and "--resume" in text, text[-6000:]  # two starts, the second a resume

    attempts = read_steps(run_dir).groupby("attempt").step.max()
    interrupted_at = int(attempts.iloc[0])  # the first start's last step
    assert len(attempts) == 2 and interrupted_at < 40, f"not one interruption mid-way: last steps {attempts.to_dict()}\n{explain()}"
    # The requeue's SIGTERM was a preemption: the step saved, no node loss, nobody paged; the resume loaded it.
    events = read_events(run_dir)
    [preempted] = events.query("kind == 'preempted'").itertuples()
    assert preempted.step == interrupted_at and preempted.severity == "warning", preempted.message
    assert events.query("kind == 'checkpoint_loaded'").step.tolist() == [interrupted_at]
    assert events.query("kind == 'node_loss'").empty and not (events.severity == "critical").any()
    resumed = read_steps(run_dir, effective=True)
    reference = tiny_dp2_40
    assert resumed.step.tolist() == list(range(1, 41)), resumed.step.tolist()
    assert np.array_equal(resumed.step.to_numpy(), reference.step.to_numpy())
    different = resumed.loss.to_numpy() != reference.loss.to_numpy()
    assert not different.any(), (
        f"losses differ at steps {resumed.step[different].tolist()}: {resumed.loss[different].tolist()} vs "
        f"{reference.loss[different].tolist()} (requeued at step {interrupted_at})\n{explain()}"
    )
