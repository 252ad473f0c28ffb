"""`keel drill` as a user runs it before a long job: real `keel train` runs (torchrun, gloo) per fault,
judged from their run stores, with the report a person reads and the exit code a job script gates on."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import drill, keel

from keel.chaos.drill import SUITES, select_drills
from keel.chaos.fault_specs import KINDS
from keel.monitor.detectors import SpikeConfig
from keel.monitor.store import read_events, read_rank_steps, read_steps

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

TINY = ("--config", "tiny")
# A short drill: the spike detector needs a baseline, so it may judge from step 12 on; faults hit step 22.
SHORT_SPIKE = ("--spike.warmup_steps=12", "--spike.min_baseline=8")
SPIKE_PERSISTENCE = SpikeConfig().persistence  # the steps that confirm a spike, from its first outlier on


def by_name(report: dict) -> dict:
    return {r["name"]: r for r in report["results"]}


def test_every_single_process_fault_is_detected_and_recovered_with_nothing_lost(tmp_path):
    faults = "nan;inf_grad;nan_param;spike;lr_surge;data_corrupt;oom;deadlock;segfault;ckpt_corrupt"
    # The drill's own watchdog floor, 5 s: with a floor of 2 s a loaded machine (three jobs on the 2 cores) once
    # stalled a step of this tiny model for 2.6 s, a hang before the fault that restarted the run.
    code, report, folder, output = drill(tmp_path / "job", *TINY, *SHORT_SPIKE, "--faults", faults, "--jobs", "2")
    results = by_name(report)
    assert code == 0 and report["passed"], output[-4000:]
    assert list(results) == faults.split(";")
    for r in results.values():
        assert r["status"] == "pass" and r["detected"] and r["recovered"], r
        # Detected in the fault's own step (a NaN, a bad batch, an OOM, a hang, the process it ended), or by the
        # spike detector once `persistence` steps from the first outlier on stood out: a corrupt batch's own
        # loss is the first (+2), an LR surge's is the step after it (+3). Never before the fault: the verdict
        # fails a detection before it (a false alarm) and shows its latency negative.
        window = SPIKE_PERSISTENCE if r["detected_by"] == "spike" else 0
        assert 0 <= r["detection_latency_steps"] <= window and r["detection_latency_s"] >= 0, r
        assert r["time_to_recover_s"] > 0 and r["goodput"] < 1, r
    # The rollbacks skipped data, so their reference skipped the same batches; the run matches it exactly.
    for name in ("nan", "inf_grad", "nan_param", "spike", "lr_surge", "data_corrupt"):
        assert results[name]["batches_skipped"] and results[name]["loss_compared_with"].startswith("reference-skip-"), name
        assert results[name]["loss_max_rel_diff"] == 0, name
    assert results["spike"]["detected_by"] == "spike" and results["spike"]["detection_latency_steps"] == 2
    assert results["data_corrupt"]["batches_skipped"] == [[21, 22]]  # the batch of step 22, and only it
    # Faults that do not change the arithmetic leave the loss bit-identical (OOM: the same sums in halves).
    for name in ("deadlock", "segfault", "ckpt_corrupt"):
        assert results[name]["loss_compared_with"] == "reference" and results[name]["loss_max_rel_diff"] == 0, name
    assert results["oom"]["loss_max_rel_diff"] < 1e-5
    assert results["deadlock"]["detected_by"] == "hang"
    assert list((folder / "runs" / "deadlock" / "dumps").glob("hang-attempt0-step22-rank0-gil.txt"))
    assert results["ckpt_corrupt"]["detected_by"] == "checkpoint_corrupt" and results["ckpt_corrupt"]["steps_lost"] > 5
    # The report a person reads: a table row per drill, and a picture.
    md = (folder / "report.md").read_text()
    assert "**PASS**: 10 passed, 0 failed" in md and md.count("| PASS |") == 10 and "![loss per drill](plot.png)" in md
    assert (folder / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (folder / "plot.png").stat().st_size > 50_000


def test_collective_faults_recover_at_pp2_dp2_tp2(collective_drill):
    code, report, folder, output = collective_drill
    results = by_name(report)
    assert code == 0 and report["passed"], output[-4000:]
    for name in ("hang", "crash", "late_collective"):
        r = results[name]
        assert r["status"] == "pass" and r["loss_max_rel_diff"] == 0 and "rank=7" in r["faults"][0], r
    assert results["hang"]["detected_by"] == "hang" and results["crash"]["detected_by"] == "restart"
    assert results["late_collective"]["detected_by"] == "straggler" and results["late_collective"]["steps_lost"] == 0
    # Every rank left its stacks; the stuck rank's shows where it stopped: before the step's first collective.
    hang_run = folder / "runs" / "hang"
    dumps = sorted((hang_run / "dumps").glob("hang-attempt0-step9-rank*.txt"))
    assert len(dumps) == 8
    assert "at_step_start" in (hang_run / "dumps" / "hang-attempt0-step9-rank7.txt").read_text()
    goodput = read_events(hang_run).query("kind == 'goodput'").iloc[-1]["data"]
    assert goodput["lost_s"]["hang"] >= 5 and goodput["lost_s"]["restart"] > 0  # the watchdog floor of the drill: 5 s
    # The SIGKILLed rank's group resumed from the newest state every rank had before step 9: its snapshot
    # files in /dev/shm (at their measured interval) or a complete checkpoint: losses and grad norms bit-identical.
    crash, reference = read_steps(folder / "runs" / "crash", effective=True), read_steps(folder / "runs" / "reference", effective=True)
    assert crash.grad_norm.tolist() == reference.grad_norm.tolist() and crash.loss.tolist() == reference.loss.tolist()
    crash_events = read_events(folder / "runs" / "crash")
    restart = crash_events.query("kind == 'restart'").iloc[0]
    [loaded] = crash_events.query("kind == 'checkpoint_loaded' and attempt == 1").itertuples()
    assert restart["data"]["restart_count"] == 1 and restart["step"] == loaded.step <= 8
    assert (crash[crash.step > restart["step"]].attempt == 1).all() and (crash[crash.step <= restart["step"]].attempt == 0).all()


def test_a_straggler_is_named_in_a_dp2_drill(tmp_path):
    code, report, _, output = drill(
        tmp_path / "job", *TINY, "--dp=2", "--faults=straggler", "--drill-steps=24", "--fault-step=10", "--checkpoint-every=5"
    )
    [r] = report["results"]
    assert code == 0 and r["status"] == "pass", output[-3000:]
    assert r["detected_by"] == "straggler" and ",rank=1," in r["faults"][0]
    stragglers = read_events(r["run_dir"]).query("kind == 'straggler'")
    assert set(stragglers["rank"]) == {1} and stragglers.iloc[0]["data"]["score"] < 0.75
    # Per-rank rows on the steps whose communication was measured, and no others; every step row keeps
    # the ranks' spread, and a measured step names its slowest ranks: rank 1 from the fault on.
    steps, ranks = read_steps(r["run_dir"]), read_rank_steps(r["run_dir"])
    measured = steps[steps.comm_share_max.notna()]
    assert len(measured) >= 5 and len(ranks) == 2 * len(measured)
    assert set(zip(ranks.step, ranks.attempt)) == set(zip(measured.step, measured.attempt))
    assert (steps.step_time_min_s <= steps.step_time_median_s).all() and (steps.step_time_median_s <= steps.step_time_s).all()
    # From the fault on, except where rank 0 does its own work for a checkpoint: it seals and records a save
    # in the two steps after it (a loaded machine once made that 330 ms, more than the straggler's sleep).
    saves = read_events(r["run_dir"]).query("kind == 'checkpoint_saved'").step.tolist()
    straggled = measured[(measured.step >= 10) & ~measured.step.map(lambda s: any(0 < s - e <= 2 for e in saves))]
    assert len(straggled) >= 3, straggled.step.tolist()
    per_rank = ranks.set_index(["step", "rank"])
    waits = per_rank.comm_time_s.unstack().loc[straggled.step]
    busy = (per_rank.step_time_s - per_rank.comm_time_s).unstack().loc[straggled.step]
    named_slowest = straggled.slowest_ranks.str.split(",").str[0].astype(int)
    # A step names as slowest the rank that was busy longest (outside communication): on every step, as
    # that is the same measurement whatever the load.
    assert named_slowest.tolist() == busy.idxmax(axis=1).tolist(), (straggled.slowest_ranks.tolist(), busy)
    # Rank 1 sleeps `ms` (twice a reference step) at each step start, and rank 0 waits for it in the
    # collectives: rank 1 is busier, and rank 0 waits longer, each by about the delay. Not on every step: a
    # loaded machine stalls one rank or the other by as much as the delay (4 drills at a load average of 8
    # to 17 on 2 cores: rank 1 ahead by 0.06 to 2.4 times the delay a step, 2 steps in 20 under half of it).
    # By the median over the fault's steps, which one or two such steps do not move: 1.01 to 1.19 times the
    # delay measured for the busy time, 0.95 to 1.04 for the wait, where the wrong rank slowed would give
    # about -1. And rank 1 named slowest on most of them (it was on 20 steps in 20).
    delay_s = int(r["faults"][0].split("ms=")[1]) / 1000
    assert (busy[1] - busy[0]).median() > delay_s / 2, busy
    assert (waits[0] - waits[1]).median() > delay_s / 2, waits
    assert (named_slowest == 1).mean() > 0.5, straggled.slowest_ranks.tolist()
    # comm_share_max, the alert's input, is the longest wait of the step, above the ranks' mean.
    np.testing.assert_allclose(straggled.comm_share_max, waits.max(axis=1).to_numpy() / straggled.step_time_s.to_numpy(), rtol=1e-6)
    assert (straggled.comm_share_max > straggled.comm_share).all()


def test_a_drill_without_its_recovery_fails_and_says_why(tmp_path):
    """Rollback off: the NaNs are still skipped, but nothing restores the run. The drill must not pass it."""
    code, report, folder, output = drill(tmp_path / "job", *TINY, *SHORT_SPIKE, "--faults", "nan_param", "--recovery.rollback=false")
    [r] = report["results"]
    assert code == 1 and not report["passed"] and r["status"] == "fail"
    assert r["detected"] and not r["recovered"]
    assert "not recovered: no rollback after the fault (recovery.rollback is false in this job)" in r["reasons"]
    assert "**FAIL**" in (folder / "report.md").read_text()
    # The console says why, and shows the end of the run's own console (a CI log keeps only this).
    assert f"nan_param failed: {'; '.join(r['reasons'])}" in output
    run_console = (folder / "runs" / "nan_param.log").read_text().splitlines()
    assert "\n".join(f"  | {line}" for line in run_console[-12:]) in output


def test_straggler_drills_do_not_apply_without_peers_in_a_stage(tmp_path):
    code, report, _, _ = drill(
        tmp_path / "job", *TINY, "--pp", "2", "--faults", "straggler", "--drill-steps", "8", "--fault-step", "6", "--checkpoint-every", "3"
    )
    [r] = report["results"]
    assert code == 0 and r["status"] == "n/a" and "needs 2 ranks per pipeline stage" in r["reasons"][0]


@pytest.mark.parametrize(
    "args, words",
    [
        (("--faults", "melt"), "unknown drill 'melt'"),
        (("--faults", "nan@step=x"), "bad value"),
        (("--fault-rank", "4", "--dp", "2"), "--fault-rank=4: the job has ranks 0..1"),
        (("--tp", "3"), "parallel.tp=3"),
    ],
)
def test_bad_drill_input_is_one_line_before_any_run(tmp_path, args, words):
    proc = keel("drill", "--run-dir", str(tmp_path / "job"), *TINY, *args)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "job").exists()


def test_keel_inject_hits_a_running_job(tmp_path):
    run_dir = tmp_path / "live"
    # Slow steps (a 60 ms straggler on the one rank) leave time to inject while the job runs.
    cmd = [
        sys.executable,
        "-m",
        "keel.cli",
        "train",
        f"--run-dir={run_dir}",
        *TINY,
        "--steps=80",
        "--fault=straggler@step=1,steps=80,ms=60",
        "--checkpoint.interval_steps=10",
    ]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True) as job:
        deadline = time.time() + 120
        while time.time() < deadline and not ((run_dir / "run.sqlite").exists() and len(read_steps(run_dir)) >= 5):
            time.sleep(0.5)
        proc = keel("inject", str(run_dir), "nan", "--rank", "0")
        assert proc.returncode == 0, proc.stderr
        requested = int(proc.stdout.split("nan@step=")[1].split(",")[0])
        assert job.wait(timeout=240) == 0
    events = read_events(run_dir)
    nonfinite = events[events.kind == "nonfinite"]
    assert len(nonfinite) == 1 and requested <= int(nonfinite.step.iloc[0]) <= requested + 3
    assert keel("inject", str(run_dir), "nan").returncode == 2  # the run has ended


def test_a_fault_spec_of_every_kind_is_judged_like_its_kinds_drill():
    """node_loss among them: keel train resumes the run, which records the loss of the node. A damaged
    checkpoint is followed by a crash, as in its drill, or nothing would load it."""
    for kind in KINDS:
        [d] = select_drills("standard", f"{kind}@step=30", nonfinite_limit=1)
        assert d.faults[0] == f"{kind}@step=30"
    [d] = select_drills("standard", "node_loss@step=30,rank=1", nonfinite_limit=3)
    assert d.expect.detect == d.expect.recover == ("node_loss",) and "node_loss" in SUITES["full"]
    [d] = select_drills("standard", "ckpt_corrupt@step=30", nonfinite_limit=3)
    assert d.faults == ("ckpt_corrupt@step=30", "crash@step=30,rank={R}") and d.expect.detect == ("checkpoint_corrupt",)
