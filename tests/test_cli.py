"""The commands as a user runs them: the run directory, `keel metrics`, torchrun started directly, multi-node flags."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import NO_WANDB, REPO, keel, plain_torchrun
from servers import wait_until

from keel.monitor.checkpoints import verify
from keel.monitor.exits import EXIT_INTERRUPTED
from keel.monitor.run_dir import STORE_FILE, list_checkpoints, wandb_offline_runs
from keel.monitor.runs import summarize_run
from keel.monitor.store import read_events, read_steps
from keel.trainer.config import load_config
from keel.trainer.launch.launcher import next_commands, parse_train_args, torchrun_command

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


def test_run_directory_contract(reference_dir):
    assert (reference_dir / "run.sqlite").is_file()
    assert load_config(str(reference_dir / "config.toml")).training.steps == 20
    assert (reference_dir / "logs" / "rank-0.log").is_file()
    # A checkpoint is saved after the last step (so `keel train --resume` can extend the run) and
    # verifies against its manifest.
    assert [s for s, _ in list_checkpoints(reference_dir)] == [20]
    assert verify(list_checkpoints(reference_dir)[0][1]) is None
    events = read_events(reference_dir)
    assert list(events.kind) == ["run_started", "checkpoint_saved", "run_finished", "goodput", "sinks_closed"]
    goodput = events[events.kind == "goodput"].iloc[0].data
    assert 0 < goodput["goodput"] <= 1 and goodput["lost_s"]["recomputed"] == 0
    prometheus = events.iloc[-1].data["prometheus"]  # the exporter is on by default
    assert prometheus["dropped"] == 0 and prometheus["failures"] == 0 and prometheus["cpu_s"] > 0


def test_keel_metrics_table_and_csv(reference_dir, reference_run):
    table = keel("metrics", str(reference_dir))
    assert table.returncode == 0, table.stderr
    assert len(table.stdout.strip().splitlines()) == 21  # header + 20 steps
    assert "grad_norm" in table.stdout.splitlines()[0]
    csv = keel("metrics", str(reference_dir), "--csv")
    frame = pd.read_csv(io.StringIO(csv.stdout))
    assert list(frame.step) == list(range(1, 21))
    assert frame.loss.tolist() == reference_run.loss.tolist()


def test_train_module_under_plain_torchrun(tmp_path):
    """`torchrun -m keel.trainer.train` works without `keel train`: rank 0 names the run for all."""
    proc = plain_torchrun(2, "--config=tiny", "--dp=2", "--steps=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    assert list(read_steps(runs[0]).step) == [1, 2, 3]
    assert sorted(p.name for p in (runs[0] / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]


def test_ctrl_c_stops_a_run_started_in_the_background(tmp_path):
    """A script's background job ignores SIGINT from birth; Ctrl-C (SIGINT to the process group) must still
    stop `keel train` with 130, as torchrun stops its workers whatever it inherited, and leave no process.
    The run reads stopped, not killed, however long after: its record ends with `run_stopped`."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "keel.cli", "train", "--config=tiny", "--steps=100000", f"--run-dir={run_dir}", NO_WANDB]
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 (what `cmd &` in a script does)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = tmp_path / "train.log"
    with subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                          preexec_fn=ignore_sigint) as proc:  # fmt: skip
        try:
            wait_until(lambda: (run_dir / STORE_FILE).exists() and len(read_steps(run_dir)), 120, "the first step")
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, log.read_text()[-3000:]
    wait_until(lambda: not _group_alive(proc.pid), 15, "torchrun and its workers to end")
    assert len(read_steps(run_dir)) >= 1  # the store is readable after it
    stopped = read_events(run_dir).query("kind == 'run_stopped'")
    assert [d["exit_code"] for d in stopped.data] == [EXIT_INTERRUPTED]
    assert summarize_run(run_dir, now=time.time() + 3600)["status"] == "stopped"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_multi_node_flags_pass_through_to_torchrun():
    # Written as a user types them on each node (values after a space).
    argv = "--config tiny --pp 2 --dp 4 --nnodes 2 --node-rank 1 --rdzv-endpoint head:29500 --rdzv-id job7 --max-restarts 3"
    cfg, opts = parse_train_args(argv.split())
    cmd = torchrun_command(cfg, opts, ["--config", "tiny"])
    assert "--nproc-per-node=4" in cmd and "--nnodes=2" in cmd and "--node-rank=1" in cmd
    assert "--rdzv-endpoint=head:29500" in cmd and "--rdzv-id=job7" in cmd and "--max-restarts=3" in cmd
    assert "--standalone" not in cmd
    assert cmd[cmd.index("-m", 3) :][:2] == ["-m", "keel.trainer.train"]


def test_an_elastic_node_range_passes_through_and_a_bad_one_is_one_line(capsys):
    cfg, opts = parse_train_args("--config tiny --dp 2 --nnodes 1:2 --rdzv-endpoint head:29500 --rdzv-id job7".split())
    cmd = torchrun_command(cfg, opts, ["--config", "tiny"])
    assert "--nnodes=1:2" in cmd and "--nproc-per-node=1" in cmd  # one process a node at the full size
    assert cfg.parallel.elastic_dp == 2 and cfg.parallel.dp == 2  # the launcher plans the full job
    for bad in ("0:2", "3:2", "a:b", "2:"):
        with pytest.raises(SystemExit):
            parse_train_args(["--config", "tiny", "--nnodes", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("keel train: error: argument --nnodes: ") and bad in err, err


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text().splitlines()
    block = readme[readme.index("```bash") + 1 : readme.index("```bash") + 3]
    install_and_train, install_and_test = block
    assert install_and_train.endswith("keel train")
    assert install_and_test in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.fixture(scope="module")
def main_layout_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The main job (`keel train`: the small preset at pp2·dp2·tp2) for 2 steps, with the default monitoring
    (W&B offline: no API key reaches a test) and library warnings not silenced, as a user runs it."""
    run_dir = tmp_path_factory.mktemp("main") / "run"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    cmd = [sys.executable, "-m", "keel.cli", "train", "--steps=2", f"--run-dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


def test_the_main_layout_prints_no_warnings(main_layout_run):
    """What a user sees of `keel train` at pp2·dp2·tp2: progress and the goodput line, no library warnings
    (torch's FSDP2 warned on every rank about a view that Keel never changes in place), nothing from W&B."""
    proc, _ = main_layout_run
    assert "Warning" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert "wandb" not in proc.stderr.lower() and "W&B" not in proc.stderr, proc.stderr[-3000:]


def test_wandb_is_on_by_default_in_auto_mode():
    cfg, _ = parse_train_args([])
    assert cfg.monitor.wandb and cfg.monitor.wandb_mode == "auto"


def test_train_ends_with_the_commands_that_show_and_upload_the_run(main_layout_run):
    proc, run_dir = main_layout_run
    [offline] = wandb_offline_runs(run_dir)
    assert list(offline.glob("run-*.wandb")), "no offline W&B run was written"
    watch, upload = f"Watch it:   keel dashboard {run_dir.parent.resolve()}", f"Upload it:  wandb sync {offline.resolve()}"
    assert proc.stdout.splitlines()[-2:] == [watch, upload]


def test_next_commands_are_paths_to_paste(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs", "r1")
    assert next_commands(run_dir) == []  # no run store on this node: rank 0 ran elsewhere
    run_dir.mkdir(parents=True)
    (run_dir / "run.sqlite").touch()
    assert next_commands(run_dir) == ["Watch it:   keel dashboard runs"]  # no offline W&B run: nothing to sync
    first, restarted = "runs/r1/wandb/offline-run-20260101_000000-r1", "runs/r1/wandb/offline-run-20260101_000900-r1"
    Path(first).mkdir(parents=True)
    Path(restarted).mkdir()
    assert next_commands(run_dir)[1] == f"Upload it:  wandb sync {first} {restarted}"
    # A run right in the working directory is shown alone, not with everything below `.` (a .venv, say).
    Path("exp 1").mkdir()
    Path("exp 1", "run.sqlite").touch()
    assert next_commands(Path("exp 1")) == ["Watch it:   keel dashboard 'exp 1'"]
