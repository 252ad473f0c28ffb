"""Evaluation (eval.every): the validation loss on every layout, and training that does not notice it.

The runs are real: the tiny job on one process and at dp2·tp2 and pp2, each with evaluation on and off over
the same held-out split. Evaluation must leave the training losses bit-identical (it reads no training data
and no RNG and changes no parameter), and its loss must agree across layouts as the training loss does
(tests/test_parity.py's tolerances)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from conftest import keel, train
from prometheus_client.parser import text_string_to_metric_families
from servers import wait_until
from streamlit.testing.v1 import AppTest
from test_alert_rules_e2e import exporter_ports
from test_dashboard import _charts, _run_page

from keel.monitor.store import read_steps
from keel.trainer.config import ConfigError, load_config, validate
from keel.trainer.data.validation import ValidationBatches, held_out
from keel.trainer.step_metrics import perplexity

SPLIT = ("--config", "tiny", "--training.steps=8", "--data.val_fraction=0.05")
EVAL = ("--eval.every=3", "--eval.batches=2")  # evaluated at steps 3, 6 and 8 (the last)
LAYOUTS = {"single": ("--pp=1", "--dp=1", "--tp=1"), "dp2-tp2": ("--dp=2", "--tp=2"), "pp2": ("--pp=2",)}
# tests/test_parity.py's measured loss differences from the single-process run, times 10 (pp alone changes no sum).
LOSS_RTOL = {"dp2-tp2": 1.1e-6, "pp2": 1e-12}


# --- the data: fast ----------------------------------------------------------------------------------


def test_the_held_out_split_depends_on_the_fraction_only_and_training_never_reads_it():
    tokens = np.arange(1000, dtype=np.uint16)
    training, validation = held_out(tokens, 0.05)
    assert len(training) == 950 and training[-1] == 949 and validation[0] == 950 and len(validation) == 50
    assert np.shares_memory(training, tokens) and np.shares_memory(validation, tokens)  # views: no copy
    assert len(held_out(tokens, 0.0)[1]) == 0


def test_validation_batches_are_consecutive_windows_the_same_every_time_split_over_dp():
    tokens = np.arange(10_000, dtype=np.uint16)
    whole = ValidationBatches(tokens, 16, 8, 0, 1, 3, 65536, "v")
    halves = [ValidationBatches(tokens, 16, 8, r, 2, 3, 65536, "v") for r in range(2)]
    for index in range(3):
        inputs, targets = whole.batch(index)
        assert inputs.shape == (8, 16) and inputs.dtype == np.int64
        assert inputs[0, 0] == index * 8 * 16 and (targets == inputs + 1).all()  # arange: each target is the next id
        np.testing.assert_array_equal(np.concatenate([h.batch(index)[0] for h in halves]), inputs)
        np.testing.assert_array_equal(whole.batch(index)[0], inputs)


@pytest.mark.parametrize(
    "tokens, vocab, message",
    [
        (np.arange(100, dtype=np.uint16), 256, "need 385 validation tokens and v holds 100; lower eval.batches"),
        (np.full(1000, 300, dtype=np.uint16), 256, "holds the token id 300, outside the model's vocabulary of 256"),
    ],
)
def test_validation_data_too_short_or_outside_the_vocabulary_is_refused_naming_the_fix(tokens, vocab, message):
    with pytest.raises(ConfigError, match=message):
        ValidationBatches(tokens, 16, 8, 0, 1, 3, vocab, "v")


def test_perplexity_is_exp_of_the_loss_inf_past_float_range_and_nan_for_nan():
    assert perplexity(2.0) == math.exp(2.0) and perplexity(1000.0) == math.inf
    assert math.isnan(perplexity(math.nan))  # a NaN validation loss (a poisoned model) is no perplexity at all


def test_evaluation_without_validation_data_is_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"eval.every=5: there is no validation data; hold some out with --data.val_fraction=0.01"):
        validate(load_config("tiny", ["eval.every=5"]))
    with pytest.raises(ConfigError, match=r"data.val_fraction=0.9: must be in \[0, 0.5\]"):
        validate(load_config("tiny", ["data.val_fraction=0.9"]))
    for flags, field in (
        (["--eval.every=-1"], "eval.every=-1"),
        (["--eval.every=2", "--eval.source=missing.bin"], "eval.source=missing.bin: file not found"),
    ):
        proc = keel("train", "--config", "tiny", *flags)
        assert proc.returncode == 2 and f"error: {field}" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- real runs: slow -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(layout, evaluated): run dir}: every layout with evaluation on; dp2·tp2 and pp2 also with it off."""
    root = tmp_path_factory.mktemp("eval")
    dirs = {}
    for name, layout in LAYOUTS.items():
        for evaluated in (True, False) if name != "single" else (True,):
            dirs[name, evaluated] = root / f"{name}-{'on' if evaluated else 'off'}"
            train(dirs[name, evaluated], *SPLIT, *layout, *(EVAL if evaluated else ()))
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2-tp2", "pp2"])
def test_training_losses_are_bit_identical_with_evaluation_on_and_off(runs, layout):
    on, off = (read_steps(runs[layout, evaluated], effective=True) for evaluated in (True, False))
    assert on.loss.tolist() == off.loss.tolist()  # exact: not a tolerance
    assert on.grad_norm.tolist() == off.grad_norm.tolist()
    assert off.validation_loss.isna().all()
    assert on.step[on.validation_loss.notna()].tolist() == [3, 6, 8]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2-tp2", "pp2"])
def test_the_validation_loss_agrees_across_layouts(runs, layout):
    single, run = (read_steps(runs[name, True], effective=True) for name in ("single", layout))
    ref, got = (r.dropna(subset=["validation_loss"]) for r in (single, run))
    np.testing.assert_allclose(got.validation_loss, ref.validation_loss, rtol=LOSS_RTOL[layout], atol=0)
    np.testing.assert_allclose(got.validation_perplexity, np.exp(got.validation_loss), rtol=1e-12)
    # The model learns, and it is measured on text it never trained on: the loss falls, and stays above 0.
    assert got.validation_loss.iloc[-1] < got.validation_loss.iloc[0] and (got.validation_loss > 0).all()


@pytest.mark.slow
def test_evaluation_time_is_not_counted_in_the_step_time(runs):
    steps = read_steps(runs["single", True], effective=True)
    evaluated = steps[steps.validation_loss.notna() & (steps.step > 1)]
    others = steps[steps.validation_loss.isna() & (steps.step > 1)]
    # Two validation batches are two forward passes of a global batch, most of a training step: counted in
    # the step time, evaluated steps would take about twice as long as the others.
    assert evaluated.step_time_s.median() < 1.5 * others.step_time_s.median(), steps[["step", "step_time_s"]]


@pytest.mark.slow
def test_the_validation_loss_is_on_metrics(tmp_path):
    """Scraped from a real run's exporter while it lingers after its last step: the stored last validation loss."""
    [port] = exporter_ports(1)
    run_dir = tmp_path / "live"
    cmd = [sys.executable, "-m", "keel.cli", "train", "--run-dir", str(run_dir), "--run.run_id=live", *SPLIT, *EVAL, "--training.steps=4",
           "--monitor.wandb=false", f"--monitor.prometheus_port={port}", "--monitor.prometheus_linger_s=30"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
        try:
            families = wait_until(lambda: _ended_run_metrics(port), 240, "the ended run's /metrics")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=60)
    stored = read_steps(run_dir, effective=True).set_index("step").validation_loss
    assert stored.dropna().index.tolist() == [3, 4]
    [sample] = families["keel_validation_loss"]
    assert sample.labels == {"run_id": "live"} and sample.value == stored[4]
    [perplexity] = families["keel_validation_perplexity"]
    assert math.isclose(perplexity.value, math.exp(sample.value), rel_tol=1e-12)


def _ended_run_metrics(port: int) -> dict | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    return families if [s.value for s in families.get("keel_run_ended", [])] == [1.0] else None


@pytest.mark.slow
def test_the_dashboard_draws_the_validation_loss_on_the_run_and_compare_pages(runs, monkeypatch):
    run_dir = runs["dp2-tp2", True]
    stored = read_steps(run_dir, effective=True).dropna(subset=["validation_loss"])
    app = _run_page(run_dir.parent, run_dir.name, monkeypatch)
    assert not app.exception and not app.error, (app.exception, app.error)
    drawn = _charts(app)["validation loss"]["lines"]
    assert drawn.step.tolist() == stored.step.tolist() and drawn.value.tolist() == stored.validation_loss.tolist()
    # Compare offers it among the metrics and draws each run's evaluated steps.
    app = AppTest.from_string("from keel.dashboard.compare_page import render_compare\nrender_compare()", default_timeout=60)
    app.query_params["run"] = [run_dir.name, runs["pp2", True].name]
    app.query_params["metric"] = "validation_loss"
    app.run()
    assert not app.exception and not app.error, (app.exception, app.error)
    [title] = [t for t in _charts(app) if t.startswith("validation loss")]
    drawn = _charts(app)[title]["lines"]
    assert set(drawn.run) == {run_dir.name, runs["pp2", True].name} and drawn.groupby("run").size().tolist() == [3, 3], drawn
