"""A job across nodes, left alone: one fault is one failure, a lost node shrinks an elastic job, a preemption
saves and ends the run inside its grace, and the resume goes on where it stopped.

The nodes here are `keel train` launchers on loopback, one per node, sharing a run directory and a c10d
rendezvous, as on a cluster with a shared filesystem. Nodes with addresses and host names of their own
(network namespaces) are in tests/test_hosts.py; a real scheduler in tests/test_slurm.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from conftest import NO_WANDB, REPO, keel
from servers import free_port
from test_resume_layouts import LOSS_RTOL

from keel.monitor.exits import EXIT_PREEMPTED
from keel.monitor.store import read_events, read_meta, read_steps
from keel.trainer.launch.restarts import furthest_step, read_failures

pytestmark = pytest.mark.slow

TINY = ("--config=tiny", "--monitor.prometheus=false", NO_WANDB)
# An elastic job's rendezvous waits this long for more nodes once it has its minimum: long enough for the
# second launcher (started once the first serves the store) to make the first round on two loaded cores.
LAST_CALL_S = 15


def start_node(run_dir: Path, node: int, nnodes: str, port: int, *args: str) -> subprocess.Popen:
    """One node's `keel train`, in a session of its own (so that the test can kill the node's whole tree)."""
    cmd = [sys.executable, "-m", "keel.cli", "train", *TINY, f"--run-dir={run_dir}", *args, f"--nnodes={nnodes}",
           f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_nodes(run_dir: Path, nnodes: str, count: int, *args: str) -> tuple[list[subprocess.Popen], int]:
    """`count` nodes; node 0 first, and the others once its agent serves the rendezvous store: the node that
    hosts the store is node 0, whatever the order the others start in (on loopback every agent would try to
    host it). Losing that node ends the job (torch's store is not replicated; docs/cluster.md)."""
    port = free_port()
    nodes = [start_node(run_dir, 0, nnodes, port, *args)]  # and the port, for a node that joins later
    deadline = time.monotonic() + 120
    while not _listening(port):
        assert time.monotonic() < deadline and nodes[0].poll() is None, "node 0's agent never served the rendezvous store"
        time.sleep(0.1)
    return nodes + [start_node(run_dir, n, nnodes, port, *args) for n in range(1, count)], port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def finish(nodes: list[subprocess.Popen], timeout: float = 400) -> list[tuple[int, str]]:
    """Each node's (exit code, stderr); every node still running at the deadline is killed with its tree."""
    deadline, ended = time.monotonic() + timeout, []
    for node in nodes:
        try:
            _, err = node.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            _, err = node.communicate()
        ended.append((node.returncode, err))
    return ended


def wait_for_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while furthest_step(run_dir) < step:
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
        time.sleep(0.05)


# -- one fault, one failure ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory):
    """Four nodes (one process each, dp4), the default budget of 3, and crashes on three different nodes'
    ranks at three different steps: each a failure of its own, after progress."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    crashes = ("--fault=crash@step=9,rank=1", "--fault=crash@step=17,rank=3", "--fault=crash@step=25,rank=2")
    args = ("--dp=4", "--steps=30", "--checkpoint.interval_steps=4", *crashes)
    return run_dir, finish(start_nodes(run_dir, "4", 4, *args)[0])


def test_four_nodes_survive_three_crashes_each_counted_once(four_nodes):
    run_dir, ended = four_nodes
    assert [code for code, _ in ended] == [0, 0, 0, 0], "\n\n".join(err[-2000:] for _, err in ended)
    failures = read_failures(run_dir)
    assert [(f.rank, f.exit_code, f.fault_step, f.in_a_row, f.gave_up) for f in failures] == [
        (1, -signal.SIGKILL, 9, 1, False),
        (3, -signal.SIGKILL, 17, 1, False),
        (2, -signal.SIGKILL, 25, 1, False),
    ]
    assert all(f.host == socket.gethostname() and f.node is not None for f in failures)
    restarts = read_events(run_dir).query("kind == 'restart'")
    assert list(restarts["rank"]) == [1, 3, 2]
    assert all(f"rank {r} on {socket.gethostname()} ended by SIGKILL" in m for r, m in zip([1, 3, 2], restarts.message))


def test_each_failure_gets_one_console_line_on_one_node_and_nothing_blames_a_survivor(four_nodes):
    _, ended = four_nodes
    lines = [line for _, err in ended for line in err.splitlines() if " ended by " in line]
    assert len(lines) == 3, lines
    assert sorted(line.split(" on ")[0] for line in lines) == ["keel train: rank 1", "keel train: rank 2", "keel train: rank 3"]
    assert not any("rank 0" in line or "exit code 1 " in line for line in lines)


def test_every_node_names_the_same_run_and_ends_without_a_traceback(four_nodes):
    run_dir, ended = four_nodes
    assert read_meta(run_dir)["run_id"] == "job"  # the rendezvous id names the run, on every node
    for _, err in ended:
        assert "Traceback" not in err and "terminate called" not in err and "c10d" not in err, err[-3000:]


# -- preemption ------------------------------------------------------------------------------------


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    """The training processes under `keel train` (the fork server's children)."""
    servers = [p for p in launcher.children(recursive=True) if "forkserver" in " ".join(p.cmdline())]
    return [child for server in servers for child in server.children()]


def _preempt(run_dir: Path, target: str, at_step: int, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Starts or resumes the run, sends SIGTERM to `target` (the launcher, its process group, or one worker)
    once the run reached `at_step`, and returns the finished process and the seconds from the signal to its end."""
    start = ["--resume", str(run_dir)] if (run_dir / "config.toml").exists() else [f"--run-dir={run_dir}", *TINY, *args]
    cmd = [sys.executable, "-m", "keel.cli", "train", *start]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_step(run_dir, at_step)
        signalled = time.monotonic()
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        elif target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            random.choice(_workers(psutil.Process(proc.pid))).send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - signalled


@pytest.fixture(scope="module")
def preempted_thrice(tmp_path_factory):
    """A dp2 run with the default checkpoint settings (every 30 minutes: none in this run but the ones a
    preemption makes) preempted three times, at steps drawn at random: SIGTERM to the launcher, to its
    process group, to one worker; each time resumed, then run to its end."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    rng, stops = random.Random(), []
    for target in ("launcher", "group", "worker"):
        # A few steps past where the last preemption stopped (the signal may land some steps after the one
        # aimed at), so that each resumed start trains before its signal comes.
        step = furthest_step(run_dir) + rng.randint(3, 9)
        stops.append((target, step, *_preempt(run_dir, target, step, "--dp=2", "--steps=40")))
    last = keel("train", "--resume", str(run_dir))
    return run_dir, stops, last


def test_a_preemption_saves_the_step_and_ends_inside_the_grace(preempted_thrice):
    run_dir, stops, _ = preempted_thrice
    events = read_events(run_dir)
    preempted = events.query("kind == 'preempted'")
    assert len(preempted) == 3, events[["kind", "step", "message"]].to_string()
    for (target, step, proc, took), event in zip(stops, preempted.itertuples()):
        assert proc.returncode == EXIT_PREEMPTED, (target, proc.stderr[-3000:])
        assert took < 20, f"{target}: {took:.1f} s after SIGTERM, past the 20 s grace"
        assert event.step >= step and event.severity == "warning" and event.data["lost_steps"] == 0
        assert re.search(rf"preempted by SIGTERM on (rank \d|\S+): step {event.step} saved", proc.stderr), proc.stderr[-2000:]
    assert not list((run_dir / "checkpoints").glob(".tmp*")), "a partial checkpoint directory was left"


def test_each_resume_starts_at_the_saved_step_without_a_node_loss_or_a_page(preempted_thrice):
    run_dir, _, last = preempted_thrice
    assert last.returncode == 0, last.stderr[-3000:]
    events = read_events(run_dir)
    saved = list(events.query("kind == 'preempted'").step)
    assert list(events.query("kind == 'checkpoint_loaded'").step) == saved
    assert events.query("kind == 'node_loss'").empty
    assert not (events.severity == "critical").any(), events.query("severity == 'critical'").message.tolist()
    assert read_meta(run_dir)["goodput"]["lost_s"]["preempted"] > 0


def test_a_thrice_preempted_run_follows_the_uninterrupted_one_bit_for_bit(preempted_thrice, tiny_dp2_40):
    run_dir, _, _ = preempted_thrice
    uninterrupted = tiny_dp2_40
    resumed = read_steps(run_dir, effective=True)
    assert list(resumed.step) == list(range(1, 41))
    np.testing.assert_array_equal(resumed.loss.to_numpy(), uninterrupted.loss.to_numpy())


# -- elastic: a lost node, never replaced ----------------------------------------------------------


def test_an_elastic_job_that_loses_a_node_goes_on_at_half_the_dp(tmp_path, reference_run):
    """--nnodes 1:2: node 1 (and its launcher) killed at step 8 or later; after the rendezvous' last call the
    survivor trains on alone at dp 1 with twice the micro-batches, from the newest checkpoint, and follows the
    single-process run within the reshard tests' tolerance."""
    run_dir = tmp_path / "run"
    args = ("--dp=2", "--checkpoint.interval_steps=4", f"--rdzv-conf=last_call_timeout={LAST_CALL_S}")
    nodes, _ = start_nodes(run_dir, "1:2", 2, *args)
    wait_for_step(run_dir, 8)
    assert read_events(run_dir).message.iloc[0] == "2 processes, pp1 dp2 tp1"  # both nodes made the first round
    os.killpg(nodes[1].pid, signal.SIGKILL)
    (code, err), _ = finish(nodes)
    assert code == 0, err[-3000:]
    [changed] = read_events(run_dir).query("kind == 'layout_changed'").message
    assert "pp1 dp2 tp1 microbatches=2 in the checkpoint, pp1 dp1 tp1 microbatches=4 now" in changed, changed
    [failure] = read_failures(run_dir)
    # The lost node, not a rank of the survivor that saw it go. (Which group rank it had is the rendezvous'
    # choice: c10d orders nodes by host name, then pid, and ignores --node-rank.)
    assert failure.rank is None and failure.node in (0, 1) and failure.exit_code == -signal.SIGKILL
    assert f"the node on {socket.gethostname()} (its agent and every worker) ended by SIGKILL" in err, err[-3000:]
    run = read_steps(run_dir, effective=True)
    assert list(run.step) == list(reference_run.step)
    np.testing.assert_allclose(run.loss, reference_run.loss, rtol=LOSS_RTOL, atol=0)


def test_an_elastic_job_grows_back_at_its_next_checkpoint(tmp_path):
    """The shrunk job of the test above, and node 1 back with the same command: torchrun would restart the
    group at once, from the newest checkpoint; Keel holds the restart until the run saved its next one, so
    the job grows to dp 2 again from a checkpoint saved after the node came back."""
    run_dir = tmp_path / "run"
    # Checkpoints 40 steps apart: growing at once would train up to 39 steps again, at the next one a few.
    args = ("--dp=2", "--steps=400", "--checkpoint.interval_steps=40", f"--rdzv-conf=last_call_timeout={LAST_CALL_S}")
    nodes, port = start_nodes(run_dir, "1:2", 2, *args)
    wait_for_step(run_dir, 8)
    assert read_events(run_dir).message.iloc[0] == "2 processes, pp1 dp2 tp1"  # both nodes made the first round
    os.killpg(nodes[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while read_steps(run_dir).attempt.max() < 1:  # the survivor's own attempt, from step 1 (no checkpoint yet)
        assert time.monotonic() < deadline and nodes[0].poll() is None, "the survivor did not go on alone"
        time.sleep(0.1)
    back = start_node(run_dir, 1, "1:2", port, *args)
    (code, err), (back_code, back_err), _ = finish([nodes[0], back, nodes[1]])
    assert (code, back_code) == (0, 0), err[-3000:] + back_err[-3000:]
    assert "node(s) waiting to join: growing at the next checkpoint" in err, err[-3000:]
    events = read_events(run_dir)
    [grown] = events.query("kind == 'layout_changed'").itertuples()
    assert "pp1 dp1 tp1 microbatches=4 in the checkpoint, pp1 dp2 tp1 microbatches=2 now" in grown.message, grown.message
    last_alone = read_steps(run_dir).query("attempt == @grown.attempt - 1").step.max()
    assert 0 <= last_alone - grown.step <= 3, (last_alone, grown.step)  # it grew right after that checkpoint
    assert len(read_failures(run_dir)) == 1  # the loss; growing back is no failure
    assert list(read_steps(run_dir, effective=True).step) == list(range(1, 401))


def test_a_save_that_cannot_finish_in_the_grace_leaves_the_newest_checkpoint_and_says_what_it_cost(tmp_path):
    """A grace too short for the step to end: each worker ends itself at the grace, `keel train` records which
    checkpoint stands and how many steps since are lost, and the resume starts there."""
    run_dir = tmp_path / "run"
    args = ("--dp=2", "--steps=40", "--checkpoint.interval_steps=5", "--checkpoint.preempt_grace_s=0.001")
    proc, took = _preempt(run_dir, "launcher", 12, *args)
    assert proc.returncode == EXIT_PREEMPTED and took < 20, proc.stderr[-3000:]
    [event] = read_events(run_dir).query("kind == 'preempted'").itertuples()
    saved, lost = event.data["saved_step"], event.data["lost_steps"]
    assert saved % 5 == 0 and saved + lost == furthest_step(run_dir) and saved >= 10, event.message
    assert f"step {saved} stands, {lost} steps lost" in event.message and event.severity == "warning"
    assert not list((run_dir / "checkpoints").glob(".tmp*"))
    resumed = keel("train", "--resume", str(run_dir), "--steps=16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_events(run_dir).query("kind == 'checkpoint_loaded'").step.tolist() == [saved]


# -- recipes ---------------------------------------------------------------------------------------


def test_the_kubernetes_recipe_hands_keel_train_flags_it_takes(tmp_path):
    """examples/kubernetes/pytorchjob.yaml, checked without a cluster: it parses, and its container's command,
    run by a shell with the environment the training operator gives a pod (PET_*), calls `keel train` with
    flags `keel train`'s own parser accepts, a new run first and a resume once the run directory holds one."""
    from keel.trainer.launch.launcher import parse_train_args

    manifest = yaml.safe_load((REPO / "examples" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert manifest["kind"] == "PyTorchJob" and manifest["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode" and worker["template"]["spec"]["terminationGracePeriodSeconds"] >= 30
    [container] = worker["template"]["spec"]["containers"]
    fake = tmp_path / "bin" / "keel"  # records the arguments it was given
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    fake.chmod(0o755)
    run_dir = tmp_path / "run"
    env = {e["name"]: e["value"] for e in container["env"]} | {
        "PATH": f"{fake.parent}:{os.environ['PATH']}", "RUN_DIR": str(run_dir), "KEEL_ARGS": "--config=tiny --dp=2",
        "PET_NNODES": "2:4", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "keel-job-worker-0:29400", "PET_RDZV_ID": "keel-job",
    }  # fmt: skip
    for start in ("new", "resume"):
        subprocess.run([*container["command"], *container["args"]], env=env, check=True)
        argv = (tmp_path / "argv").read_text().splitlines()
        assert argv[0] == "train", argv
        if start == "new":
            cfg, opts = parse_train_args(argv[1:])
            assert (opts.min_nodes, opts.nnodes, opts.rdzv_endpoint, opts.rdzv_id) == (2, 4, "keel-job-worker-0:29400", "keel-job")
            assert cfg.parallel.elastic_dp == 2 and cfg.run.run_dir == str(run_dir)
            run_dir.mkdir()
            (run_dir / "config.toml").write_text("")
        else:
            assert argv[1:3] == ["--resume", str(run_dir)], argv
