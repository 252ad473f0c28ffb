"""keel train --plan and keel plan --check: the planner's memory and communication against real CPU runs.

Each layout trains a few steps with --plan (its link timed before the first step), and the prediction is
set beside what it measured. The compute efficiency is calibrated on a single-process run of the same
model, as docs/planning.md tells a user to: the MFU a step reaches where nothing waits.

Tolerances, from the errors measured on a 2-core machine (python bench/plan_accuracy.py; the table is in
docs/planning.md):
- memory of the busiest rank, against the CPU allocator's peak on the profiled steps: within 15% (measured
  -10.4% to +8.5% over 22 runs of 11 layouts);
- comm share where the step waits on the pipeline above all: within 6 points (measured 1.7 at most). The
  measured share is the median of the profiled steps after warm-up: twelve steps profile five (4, 6, ..., 12),
  as one step's share ranged 0.21-0.30 within a calm pp2 m4 run; with six steps (two samples) a CI run
  measured 0.283 against 0.213 predicted;
- elsewhere the predicted wait is a lower bound on the seconds a step waits, give or take the probe's own
  spread (PROBE_SPREAD), and its share at most 20 points under the measured one (measured 2 to 14): two ranks
  sharing two cores arrive at each collective apart, which the link probe, timed while nothing computes,
  cannot see.
"""

from __future__ import annotations

import json

import pytest
from conftest import keel, train

from keel.trainer.planning.run_plan import check

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

MODEL = ("--config=small", "--data.seq_len=256", "--training.global_batch_size=8", "--steps=12", "--metrics.comm_sample_every=2",
         "--checkpoint.interval_steps=1000", "--eval.every=0", "--plan")  # fmt: skip
LAYOUTS = {
    "dp2 zero3 m4": ("--pp=1", "--dp=2", "--tp=1", "--training.microbatches=4"),
    "dp2 zero2 m4": ("--pp=1", "--dp=2", "--tp=1", "--training.microbatches=4", "--parallel.dp_mode=zero2"),
    "dp2 zero3 m4 full AC": ("--pp=1", "--dp=2", "--tp=1", "--training.microbatches=4", "--training.activation_checkpointing=full"),
    "dp2 replicate m2 selective AC": (
        "--pp=1",
        "--dp=2",
        "--tp=1",
        "--training.microbatches=2",
        "--parallel.dp_mode=replicate",
        "--training.activation_checkpointing=selective",
    ),  # fmt: skip
    "tp2 m4": ("--pp=1", "--dp=1", "--tp=2", "--training.microbatches=4"),
    "pp2 m2": ("--pp=2", "--dp=1", "--tp=1", "--training.microbatches=2"),
    "pp2 m4": ("--pp=2", "--dp=1", "--tp=1", "--training.microbatches=4"),
}
PIPELINED = ("pp2 m2", "pp2 m4")  # the step waits on the pipeline above all
# The link probe's bus bandwidth between two ranks varied from 0.59 to 1.05 GB/s between runs on this machine:
# where a step's communication is one all-reduce (replicate), its predicted share moves as much.
PROBE_SPREAD = 0.59 / 1.05  # the slowest probe over the fastest: a prediction may be this far off by the probe alone


@pytest.fixture(scope="session")
def planned_runs(tmp_path_factory):
    """The single-process reference and every layout, each trained once with --plan."""
    root = tmp_path_factory.mktemp("planned")
    runs = {"single": root / "single"}
    single = keel("train", "--run-dir", str(runs["single"]), *MODEL, "--pp=1", "--dp=1", "--tp=1", "--training.microbatches=4")
    assert single.returncode == 0, single.stderr[-3000:]
    runs["single console"] = single.stdout
    for name, layout in LAYOUTS.items():
        runs[name] = root / name.replace(" ", "-")
        train(runs[name], *MODEL, *layout)
    return runs


@pytest.fixture(scope="session")
def compute_efficiency(planned_runs) -> float:
    single = check(planned_runs["single"])
    assert single["measured"]["comm_share"] == 0.0  # nothing to wait for: its MFU is the compute efficiency
    return single["achieved_compute_efficiency"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_busiest_ranks_memory_is_predicted_within_15_percent(planned_runs, layout):
    got = check(planned_runs[layout])
    predicted, measured = got["predicted"]["memory_bytes"], got["measured"]["memory_bytes"]
    assert measured is not None
    assert predicted == pytest.approx(measured, rel=0.15), (
        f"{layout}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f}"
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_comm_share_is_predicted(planned_runs, compute_efficiency, layout):
    got = check(planned_runs[layout], compute_efficiency)
    predicted, measured = got["predicted"]["comm_share"], got["measured"]["comm_share"]
    if layout in PIPELINED:
        assert predicted == pytest.approx(measured, abs=0.06), f"{layout}: predicted {predicted:.3f}, measured {measured:.3f}"
    else:
        # A lower bound on the seconds a step waits, give or take the link probe's own spread: the ranks' waits for
        # each other come on top. In seconds, not as a share: two ranks on two cores compute slower than the
        # single-process efficiency predicts (1.6-2.8x, bench/plan_accuracy.py), which shrinks the measured share
        # of the same wait (CI: replicate's one all-reduce measured 0.021 of the step against 0.039 predicted).
        waited, predicted_wait = measured * got["measured"]["step_s"], predicted * got["predicted"]["step_s"]
        assert PROBE_SPREAD * predicted_wait <= waited, f"{layout}: waited {waited:.4f} s a step, predicted {predicted_wait:.4f} s"
        assert measured <= predicted + 0.20, f"{layout}: predicted share {predicted:.3f}, measured {measured:.3f}"


def test_train_prints_the_plan_before_the_first_step(planned_runs):
    console = planned_runs["single console"]
    assert console.index("plan: pp1 dp1 zero3 tp1 m4 ac=none: ") < console.index("step 1")
    assert "MiB on the busiest rank" in console and "tokens/s" in console


def test_the_pipeline_bubble_is_narayanans_for_the_run(planned_runs):
    assert check(planned_runs["pp2 m2"])["predicted"]["bubble"] == pytest.approx(1 / 3)
    assert check(planned_runs["pp2 m4"])["predicted"]["bubble"] == pytest.approx(1 / 5)


def test_the_check_command_prints_the_table_and_json(planned_runs):
    text = keel("plan", "--check", str(planned_runs["pp2 m4"]))
    assert text.returncode == 0, text.stderr
    for row in ("tokens/s", "memory MiB, busiest rank", "comm share", "bubble", "--compute-efficiency"):
        assert row in text.stdout
    as_json = json.loads(keel("plan", "--check", str(planned_runs["pp2 m4"]), "--json").stdout)
    assert as_json["layout"] == "pp2 dp1 zero3 tp1 m4 ac=none"
    assert as_json["measured"]["memory_bytes"] > 0


def test_a_run_without_a_plan_is_one_line(tmp_path, reference_dir):
    got = keel("plan", "--check", str(reference_dir))
    assert got.returncode == 2 and got.stderr.strip().count("\n") == 0
    assert "keel train --plan" in got.stderr
    missing = keel("plan", "--check", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no run store" in missing.stderr
    bad = keel("plan", "--check", str(reference_dir), "--compute-efficiency", "0")
    assert (
        bad.returncode == 2 and bad.stderr.strip() == "keel plan: error: --compute-efficiency 0: must be in (0, 1], a fraction of the peak"
    )
