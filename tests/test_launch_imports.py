"""`keel train` checks its input without importing torch, so a mistake costs well under a second."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "args",
    [
        ["--dp", "3"],  # fails in validate(), after the model shape is checked
        ["--fault", "nan@step=2,rank=0", "--fault", "melt@step=3"],  # a good spec parsed, then a bad one
    ],
    ids=["bad layout", "bad fault"],
)
def test_a_config_error_ends_before_torch_is_imported(args):
    code = textwrap.dedent(f"""
        import sys
        import keel.cli
        code = keel.cli.main(["train", "--config", "tiny", *{args!r}])
        print(code, "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "keel train: error:" in proc.stderr
    assert proc.stdout.split() == ["2", "False"], "`keel train` imported torch before reporting a config error"


def test_a_worker_starts_without_pandas():
    """Every process of every run (and of every restart) pays for what the training module imports:
    pandas alone is 0.5 s of CPU, and only rank 0 needs it, once, at the end of a run (goodput)."""
    code = "import sys, keel.trainer.train; print('pandas' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"], "importing keel.trainer.train imported pandas"


def test_the_launcher_reads_the_run_s_ending_without_pandas(tmp_path):
    """`keel train` itself reads one event at the end of every run to choose its exit code: with pandas
    that was half a second on every run."""
    code = textwrap.dedent(f"""
        import sys
        import keel.cli
        code = keel.cli.main(["train", "--config", "tiny", "--steps", "1", "--monitor.wandb=false", "--run-dir", {str(tmp_path / "run")!r}])
        print(code, "pandas" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stdout[-2000:]
