"""Keel in a loop it did not write: examples/plain_loop.py (a nanoGPT-shaped loop, DDP at dp2 under a real
torchrun with gloo workers) through keel.trainer.toolkit, drilled by `keel drill --command` and watched by
a real Prometheus and the dashboard. One drill of the standard suite is shared by the tests that read its
runs (a spike rolled back past its batches, a hang ended and resumed, a NaN rolled back)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, drill
from servers import start_prometheus, wait_until
from streamlit.testing.v1 import AppTest

from keel.dashboard.runs_page import RUNS_ENV
from keel.monitor.store import read_custom_metrics, read_events, read_steps

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "plain_loop.py"
WORLD = 2


def torchrun(*script_args: str, restarts: int = 3) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", f"--max-restarts={restarts}",
            str(EXAMPLE), "--steps=200", *script_args]  # fmt: skip


def run_loop(run_dir: Path, *keel_args: str, script_args: tuple[str, ...] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """The example under torchrun with Keel's settings in KEEL_ARGS, as a user launches it."""
    flags = [f"--run-dir={run_dir}", "--steps=30", "--monitor.wandb=false", "--spike.warmup_steps=10", *keel_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "KEEL_ARGS": shlex.join(flags)}
    proc = subprocess.run(torchrun(*script_args), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="session")
def loop_drill(tmp_path_factory) -> tuple[int, dict, Path, str]:
    """`keel drill --command` on the example at dp2, the standard suite."""
    run_dir = tmp_path_factory.mktemp("loop-drill") / "job"
    job = ["--dp=2", "--spike.warmup_steps=10", "--monitor.prometheus=false"]
    return drill(run_dir, "--command", shlex.join(torchrun()), *job, timeout=1800)


def by_name(report: dict) -> dict:
    return {r["name"]: r for r in report["results"]}


def test_keel_drill_passes_the_standard_suite_on_a_users_loop(loop_drill):
    code, report, folder, output = loop_drill
    results = by_name(report)
    assert code == 0 and report["passed"], output[-4000:]
    assert sorted(results) == sorted(["nan", "spike", "oom", "hang", "crash", "ckpt_corrupt", "straggler", "late_collective"])
    for name, r in results.items():
        if name == "oom":  # the loop's micro-batches are its own: Keel halves only its trainer's
            assert r["status"] == "n/a" and "micro-batch" in r["reasons"][0], r
        else:
            assert r["status"] == "pass" and r["detected"], r
    # The faults that do not change the arithmetic leave the loop's losses bit-identical after the restart.
    for name in ("hang", "crash", "ckpt_corrupt"):
        assert results[name]["loss_compared_with"] == "reference" and results[name]["loss_max_rel_diff"] == 0, results[name]
    assert "| PASS |" in (folder / "report.md").read_text()


def test_a_spike_in_a_users_loop_is_rolled_back_past_its_batches(loop_drill):
    _, report, folder, _ = loop_drill
    r = by_name(report)["spike"]
    assert r["detected_by"] == "spike" and r["recovered"], r
    # Confirmed, rolled back to a checkpoint before it, the batches read since skipped; the losses after the
    # recovery equal, bit for bit, those of a run of the same loop that skipped the same batches.
    events = read_events(folder / "runs" / "spike")
    rollback = events.query("kind == 'rollback'").iloc[0]
    assert rollback["data"]["to_step"] < r["fault_step"] <= rollback["step"]
    assert r["batches_skipped"] and r["batches_skipped"][0][0] == rollback["data"]["to_step"]
    assert r["loss_compared_with"].startswith("reference-skip-") and r["loss_max_rel_diff"] == 0, r


def test_a_hang_in_a_users_loop_is_ended_and_resumed(loop_drill):
    _, report, folder, _ = loop_drill
    r = by_name(report)["hang"]
    assert r["detected_by"] == "hang" and r["recovered"], r
    run = folder / "runs" / "hang"
    events = read_events(run)
    assert set(events.kind) >= {"hang", "restart", "checkpoint_loaded", "run_finished"}
    # Both ranks left their stacks; the stuck one stopped in Keel's step start, the other inside DDP's collective.
    stuck = run / "dumps" / f"hang-attempt0-step{r['fault_step']}-rank1.txt"
    assert "at_step_start" in stuck.read_text()
    steps = read_steps(run, effective=True)
    assert steps.step.tolist() == list(range(1, 41)) and steps.attempt.iloc[-1] == 1


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """A NaN put into one rank's gradient shard after FSDP2's reduce-scatter: every rank must skip the step,
    or half the model moves. Two runs, the NaN on rank 1 and on rank 0, then follow the same trajectory
    exactly: where only the NaN rank skipped, each run would have the other rank's shards updated and the
    losses would differ. (DDP's replicas are drilled by the standard suite above.)"""
    runs = {}
    for rank in (0, 1):
        nan = f"--fault=nan@step=15,rank={rank},into=grad"
        run_loop(tmp_path / f"nan-rank{rank}", nan, "--monitor.prometheus=false", script_args=("--fsdp",))
        runs[rank] = read_steps(tmp_path / f"nan-rank{rank}", effective=True)
    for steps in runs.values():
        assert steps.set_index("step").skipped.to_dict()[15] == 1 and steps.skipped.sum() == 1
        assert math.isnan(steps.set_index("step").grad_norm[15])
    assert runs[0].loss.tolist() == runs[1].loss.tolist()
    events = read_events(tmp_path / "nan-rank1")
    assert "nonfinite" in set(events.kind) and "rollback" not in set(events.kind)


def test_a_users_loop_on_prometheus_and_the_dashboard(tmp_path, monkeypatch):
    port = exporter_port()
    run_dir = tmp_path / "watched"
    with start_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], [], None) as prom:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        flags = [f"--run-dir={run_dir}", "--run.run_id=watched", "--steps=30", "--monitor.wandb=false",
                 f"--monitor.prometheus_port={port}", "--monitor.prometheus_linger_s=6"]  # fmt: skip
        proc = subprocess.Popen(torchrun(), env={**env, "KEEL_ARGS": shlex.join(flags)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            # Scraped while the loop trains (or lingers after it): the loss of a step the store holds.
            result = wait_until(
                lambda: prom.api("/api/v1/query", query='keel_loss{run_id="watched"}')["result"], 240, "the loop's loss in Prometheus"
            )
            scraped = float(result[0]["value"][1])
            custom = wait_until(
                lambda: prom.api("/api/v1/query", query='keel_custom_metric{run_id="watched",name="perplexity"}')["result"],
                60, "the loop's own metric in Prometheus",
            )  # fmt: skip
            assert float(custom[0]["value"][1]) > 1
        finally:
            out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out.decode()[-4000:]
    steps = read_steps(run_dir, effective=True)
    assert steps.step.tolist() == list(range(1, 31))
    assert any(math.isclose(scraped, loss, rel_tol=1e-6) for loss in steps.loss)
    perplexity = read_custom_metrics(run_dir, effective=True).query("name == 'perplexity'")
    assert len(perplexity) == 30
    # The dashboard's Run page shows the loop's run: its loss chart and its own metric.
    monkeypatch.setenv(RUNS_ENV, str(run_dir.parent))
    app = AppTest.from_string("from keel.dashboard.run_page import render_run\nrender_run()", default_timeout=60)
    app.query_params["run"] = run_dir.name
    app.run()
    assert not app.exception, app.exception
    titles = [panel["title"] for chart in app.get("bidi_component") for panel in json.loads(chart.proto.json)["panels"]]
    assert any("loss" in t.lower() for t in titles) and any("perplexity" in t for t in titles), titles


def exporter_port() -> int:
    from test_alert_rules_e2e import exporter_ports

    return exporter_ports(1)[0]


def test_misuse_is_one_clear_line(tmp_path):
    """Calls in the wrong place, a second run on one directory, a model Keel cannot checkpoint: one line each."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO / "examples")!r})
from plain_loop import GPT
from keel.trainer.toolkit import KeelUsageError, ResumableBatchSampler, open_run
model = GPT(); opt = torch.optim.AdamW(model.parameters())
sampler = ResumableBatchSampler(100, 4)
run = open_run(model, opt, data=sampler, steps=3, run_dir={str(tmp_path / "r")!r}, config={{"monitor.prometheus": False, "monitor.wandb": False}})
for case in ("outside", "second", "foreign"):
    try:
        if case == "outside":
            run.loss(torch.tensor(1.0))
        elif case == "second":
            open_run(model, opt, data=sampler, steps=3, run_dir={str(tmp_path / "r")!r})
        else:
            other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
            open_run(model, other, data=sampler, steps=3, run_dir={str(tmp_path / "s")!r}, config={{"monitor.prometheus": False, "monitor.wandb": False}})
    except KeelUsageError as e:
        print(case, "|", e)
for step in run.steps():
    pass
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    assert "outside a step" in lines["outside"] and "run.steps()" in lines["outside"]
    assert "is in use by pid" in lines["second"], lines
    assert "cannot checkpoint" in lines["foreign"], lines
    # A step that ends without an update is named, with the call to add.
    assert proc.returncode != 0 and "ended without run.optimizer_step()" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
