"""A resume loads only a checkpoint of the same model and data: anything else is refused in one line that
names each changed field, by `keel train` before any worker starts and by the workers themselves when
torchrun starts them directly. A new parallel layout is allowed, and said and recorded
(tests/test_resume_layouts.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import keel, plain_torchrun, train
from test_config_errors import assert_one_line_error

from keel.monitor.exits import EXIT_CONFIG
from keel.monitor.run_dir import CONFIG_FILE
from keel.monitor.store import read_events, read_steps
from keel.trainer.checkpoint.manifest import config_record, resume_differences, vet_resume
from keel.trainer.config import ConfigError, load_config
from keel.trainer.data.loader import write_token_file

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

CHECKPOINT = "step-00000006"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Six tiny steps in one process with checkpoints at steps 3 and 6. Tests that resume it work on a copy."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    train(run_dir, "--config", "tiny", "--dp", "1", "--steps", "6", "--checkpoint.interval_steps=3", "--monitor.prometheus=false")
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


def test_another_model_shape_is_refused_before_any_worker(trained):
    proc = keel("train", "--resume", str(trained), "--model.dim=128", timeout=60)
    assert_one_line_error(proc, [CHECKPOINT, "model.dim: 64 in the checkpoint, 128 now", "start a new run with --run-dir"])
    assert "processes" not in proc.stdout, "a worker was started"


def test_other_data_is_refused_before_any_worker(trained, tmp_path):
    data = tmp_path / "other.bin"
    write_token_file(data, [Path(__file__)])
    proc = keel("train", "--resume", str(trained), f"--data.source={data}", timeout=60)
    assert_one_line_error(proc, [CHECKPOINT, "data version: sha256:", "(data.source=builtin)", f"now (data.source={data})"])
    assert "model." not in proc.stderr


def test_workers_refuse_another_model_without_the_launcher(trained, tmp_path):
    """torchrun started directly: rank 0 finds the mismatch when it loads, and the run stops with the same
    line (exit code 2 in the run store) instead of loading; the run's config.toml stays its own."""
    run_dir = copy_of(trained, tmp_path)
    config = (run_dir / CONFIG_FILE).read_text()
    args = ("--config=tiny", f"--run-dir={run_dir}", "--run.resume=true", "--model.dim=128", "--steps=9", "--monitor.prometheus=false")
    proc = plain_torchrun(1, *args, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "keel train: error" in line]
    assert len(errors) == 1 and "model.dim: 64 in the checkpoint, 128 now" in errors[0], proc.stderr[-3000:]
    events = read_events(run_dir)
    stopped = events[events.kind == "run_stopped"]
    assert len(stopped) == 1 and stopped.iloc[0]["data"]["exit_code"] == EXIT_CONFIG
    assert (events.kind == "checkpoint_loaded").sum() == 0
    assert read_steps(run_dir).step.max() == 6
    assert (run_dir / CONFIG_FILE).read_text() == config


def test_comparison_names_each_change_and_reads_old_manifests():
    cfg = load_config("tiny")
    now = config_record(cfg, "sha256:aaaa")
    other = load_config("tiny", ["model.dim=128", "data.seq_len=64", "parallel.dp=2", "optim.lr=1e-4"])
    refusals, layout = resume_differences(config_record(other, "sha256:bbbb"), now)
    assert refusals == [
        "model.dim: 128 in the checkpoint, 64 now",
        "data.seq_len: 64 in the checkpoint, 32 now",
        "data version: sha256:bbbb in the checkpoint (data.source=builtin), sha256:aaaa now (data.source=builtin)",
    ]
    assert layout == "parallel layout: pp1 dp2 tp1 in the checkpoint, pp1 dp1 tp1 now"

    # The layout and the optimizer may change: same config hash, nothing refused.
    moved = load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=GPipe", "training.microbatches=2", "optim.lr=1e-4"])
    assert config_record(moved, "sha256:aaaa")["config_hash"] == now["config_hash"]
    refusals, layout = resume_differences(config_record(moved, "sha256:aaaa"), now)
    assert refusals == [] and layout == "parallel layout: pp2 dp1 tp1 pp_schedule=GPipe in the checkpoint, pp1 dp1 tp1 pp_schedule=1F1B now"

    # A manifest from before these fields: its data version is all there is to compare.
    old = {"step": 6, "config_hash": "0123456789abcdef", "data_version": "sha256:aaaa", "code_version": "keel 0.1.0", "files": {}}
    assert resume_differences(old, now) == ([], None)
    assert resume_differences({**old, "data_version": "sha256:cccc"}, now)[0] == [
        "data version: sha256:cccc in the checkpoint, sha256:aaaa now (data.source=builtin)"
    ]

    with pytest.raises(ConfigError, match=r"^checkpoint run/step-00000006 holds another model or data: model\.dim: 128 .* --run-dir$"):
        vet_resume(config_record(load_config("tiny", ["model.dim=128"]), "sha256:aaaa"), Path("run/step-00000006"), now)
