"""The Hugging Face and Lightning adapters (keel.trainer.toolkit.hf, .lightning), through their examples run as
a user runs them (`python examples/hf_trainer.py`, on CPU, one process) with faults from Keel's chaos in KEEL_ARGS:

- an LR surge (a loss spike): the spike and its alert are recorded, and training stops cleanly (exit 0, no
  step after the stop) with a `run_stopped` that names the checkpoint to resume from and the data to step over;
- a NaN in the gradients: the step is recorded as skipped and training goes on; the steps before it match a
  fault-free run of the same example loss for loss.

Each framework's three runs (spike, NaN, fault-free) run once per session, all six side by side.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from keel.monitor.event_kinds import EventKind
from keel.monitor.store import read_events, read_steps

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"hf": ("transformers", "examples/hf_trainer.py"), "lightning": ("lightning", "examples/lightning_loop.py")}
STEPS = 32  # every run of a framework has as many, so that their LR schedules match
SPIKE_AT, NAN_AT = 25, 12
# The detector judges from step 10 on, once 16 losses fill its baseline: the surge at step 25 is confirmed three steps on.
FAULTS = {
    "spike": [f"--fault=spike@step={SPIKE_AT},steps=3,lr=100,data=0", "--spike.warmup_steps=10"],
    "nan": [f"--fault=nan@step={NAN_AT},into=grad"],
    "clean": [],
}


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr
    run_dir: Path
    output_dir: Path

    def events(self):
        return read_events(self.run_dir)

    def steps(self):
        return read_steps(self.run_dir).set_index("step")


def _start(framework: str, name: str, root: Path) -> tuple[subprocess.Popen, Path, Path]:
    run_dir, output_dir = root / name / "run", root / name / "out"
    keel_args = [f"--run-dir={run_dir}", "--monitor.wandb=false", "--monitor.prometheus=false", *FAULTS[name]]
    # One thread each: the runs are compared loss for loss, and three share the machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "KEEL_ARGS": " ".join(keel_args), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, EXAMPLES[framework][1], f"--max-steps={STEPS}", "--batch-size=8", f"--output-dir={output_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, run_dir, output_dir


@pytest.fixture(scope="session")
def all_runs(tmp_path_factory) -> dict[str, dict[str, Run]]:
    """The spike, NaN and fault-free runs of each installed framework's example, all started together: most
    of a run is importing its framework, which the machine's cores then share."""
    started = {
        framework: {name: _start(framework, name, tmp_path_factory.mktemp(framework)) for name in FAULTS}
        for framework, (package, _) in EXAMPLES.items()
        if importlib.util.find_spec(package) is not None
    }
    done: dict[str, dict[str, Run]] = {}
    for framework, procs in started.items():
        for name, (proc, run_dir, output_dir) in procs.items():
            try:
                stdout, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, _ = proc.communicate()
            done.setdefault(framework, {})[name] = Run(proc.returncode, stdout, run_dir, output_dir)
    return done


@pytest.fixture(params=list(EXAMPLES))
def runs(request, all_runs) -> dict[str, Run]:
    framework = request.param
    pytest.importorskip(EXAMPLES[framework][0])
    for name, run in all_runs[framework].items():
        assert run.returncode == 0, f"{framework} {name} run: exit {run.returncode}\n{run.output[-4000:]}"
    return all_runs[framework]


@pytest.mark.slow
def test_spike_stops_cleanly_with_what_to_do_next(runs):
    run = runs["spike"]
    events = run.events()
    kinds = set(events["kind"])
    assert EventKind.SPIKE in kinds, run.output[-3000:]
    alerts = {e["alert"] for e in events.loc[events["kind"] == EventKind.ALERT, "data"]}
    assert {"loss_spike", "run_stopped"} <= alerts
    assert EventKind.FAULT_INJECTED in kinds and EventKind.RUN_FINISHED not in kinds
    (stop,) = events.loc[events["kind"] == EventKind.RUN_STOPPED].itertuples()
    spike = events.loc[events["kind"] == EventKind.SPIKE].iloc[0]
    assert SPIKE_AT <= spike["data"]["start_step"] <= stop.step < STEPS
    assert run.steps().index.max() == stop.step  # nothing trained after the stop
    # What the user does next: the newest checkpoint saved before the spike (one every 10 steps), and the data.
    if "resume_from_checkpoint" in stop.message:
        assert f'resume_from_checkpoint="{run.output_dir / "checkpoint-20"}"' in stop.message and "data_seed" in stop.message
    else:
        assert f'ckpt_path="{run.output_dir / "checkpoints" / "epoch=0-step=20.ckpt"}"' in stop.message and "seed" in stop.message


@pytest.mark.slow
def test_nan_gradient_skips_the_step_and_training_goes_on(runs):
    run, clean = runs["nan"], runs["clean"]
    events = run.events()
    nonfinite = events.loc[events["kind"] == EventKind.NONFINITE]
    assert list(nonfinite["step"]) == [NAN_AT]
    assert EventKind.RUN_FINISHED in set(events["kind"]) and EventKind.RUN_STOPPED not in set(events["kind"])
    steps, reference = run.steps(), clean.steps()
    assert list(steps.index) == list(range(1, STEPS + 1)) == list(reference.index)
    assert steps["skipped"].to_dict() == {s: int(s == NAN_AT) for s in steps.index}
    assert math.isnan(steps.loc[NAN_AT, "grad_norm"])
    # The same run up to the fault, the step's own loss included (the NaN went in after its forward); the
    # skipped update shows in the next step's loss, and the steps after it are healthy.
    assert steps.loc[:NAN_AT, "loss"].tolist() == reference.loc[:NAN_AT, "loss"].tolist()
    assert steps.loc[NAN_AT + 1, "loss"] != reference.loc[NAN_AT + 1, "loss"]
    assert steps.loc[NAN_AT + 1 :, "loss"].map(math.isfinite).all() and steps.loc[NAN_AT + 1 :, "skipped"].eq(0).all()


def test_hf_resume_advice_names_the_newest_checkpoint_before_the_bad_steps(tmp_path):
    hf = pytest.importorskip("keel.trainer.toolkit.hf", exc_type=ImportError)
    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
    advice = hf.resume_advice(str(tmp_path), bad_from=26, step=29)
    assert f'resume_from_checkpoint="{tmp_path / "checkpoint-20"}"' in advice and "steps 26-29" in advice
    assert "no checkpoint" in hf.resume_advice(str(tmp_path), bad_from=10, step=12)


def test_lightning_resume_advice_names_the_newest_checkpoint_before_the_bad_steps(tmp_path):
    pl = pytest.importorskip("keel.trainer.toolkit.lightning", exc_type=ImportError)
    for step in (10, 20, 30):
        (tmp_path / f"epoch=0-step={step}.ckpt").touch()
    advice = pl.resume_advice([str(tmp_path)], bad_from=26, step=29)
    assert f'ckpt_path="{tmp_path / "epoch=0-step=20.ckpt"}"' in advice and "steps 26-29" in advice
    assert "ckpt_path=..." in pl.resume_advice([str(tmp_path)], bad_from=10, step=12)
