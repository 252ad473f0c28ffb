"""Several hosts on one machine (tests/hosts.py: network namespaces with addresses and host names of their
own): they reach each other over TCP by name and leave nothing behind; a job across them survives the loss
of a node that a replacement on another host takes over."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import NO_WANDB
from hosts import NETNS_ETC, _namespaces, hosts, missing

from keel.monitor.store import read_events, read_meta, read_steps
from keel.trainer.launch.restarts import furthest_step

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing()), reason=missing() or "hosts() can run")]

# Listens on every address of its host, prints its port, answers one client with
# "<its hostname> <the client's address> <what the client sent>".
SERVER = """
import socket
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
conn, (peer, _) = server.accept()
with conn:
    said = conn.recv(100).decode()
    conn.sendall(f"{socket.gethostname()} {peer} {said}".encode())
"""
# Connects to argv[1]:argv[2] by name, sends its own hostname, prints the answer.
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(socket.gethostname().encode())
    print(conn.recv(200).decode())
"""


def test_two_hosts_talk_over_tcp_and_leave_nothing_behind():
    own_hostname = socket.gethostname()
    with hosts(2, "kt") as (node0, node1):
        names = {node0.name, node1.name}
        assert names <= _namespaces()
        assert (node0.addr, node0.hostname, node1.addr, node1.hostname) == ("10.213.0.1", "node0", "10.213.0.2", "node1")
        server = node0.popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())
        client = node1.run([sys.executable, "-c", CLIENT, node0.hostname, str(port)], timeout=120)
        assert client.returncode == 0, client.stderr
        assert client.stdout.split() == ["node0", "10.213.0.2", "node1"]  # each its own hostname; node1 by its address
        assert server.wait(timeout=60) == 0
        sleeper = node1.popen(["sleep", "600"])  # still running at the end: killed with its host
    assert sleeper.poll() is not None
    assert not names & _namespaces()
    assert not any((NETNS_ETC / name).exists() for name in names)
    assert socket.gethostname() == own_hostname  # the machine's own hostname is untouched

    with pytest.raises(RuntimeError, match="the test failed"), hosts(1, "kt") as (node,):  # a failing test cleans up too
        failed = node.name
        raise RuntimeError("the test failed")
    assert failed not in _namespaces() and not (NETNS_ETC / failed).exists()


# -- a node lost and replaced ----------------------------------------------------------------------

TRAIN = ("--config=tiny", "--dp=2", "--steps=40", "--checkpoint.interval_steps=5", "--monitor.prometheus=false", NO_WANDB)


def test_a_node_killed_and_replaced_20_s_later_on_another_host_rejoins_the_job(tmp_path, tiny_dp2_40):
    """Two hosts train one job (c10d rendezvous on node0's address); node1 dies with every process on it
    (SIGKILL) at step 15 or later; 20 s later the same command starts on a third host. The survivor waits
    for it, the job goes on from the newest checkpoint and its losses are those of the job on one node."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with hosts(3, "kr") as (node0, node1, spare):
        endpoint = f"--rdzv-endpoint={node0.addr}:29400"
        cmd = [sys.executable, "-m", "keel.cli", "train", *TRAIN, f"--run-dir={run_dir}", "--nnodes=2", "--rdzv-backend=c10d", endpoint]
        out = {name: open(tmp_path / f"{name}.err", "w") for name in ("node0", "node1", "spare")}  # noqa: SIM115
        survivor = node0.popen([*cmd, "--node-rank=0"], env=env, stdout=subprocess.DEVNULL, stderr=out["node0"])
        node1.popen([*cmd, "--node-rank=1"], env=env, stdout=subprocess.DEVNULL, stderr=out["node1"])
        deadline = time.monotonic() + 180
        while furthest_step(run_dir) < 15:
            assert time.monotonic() < deadline and survivor.poll() is None, (tmp_path / "node0.err").read_text()[-3000:]
            time.sleep(0.05)
        node1.kill()
        killed_at = furthest_step(run_dir)
        time.sleep(20)
        replacement = spare.popen([*cmd, "--node-rank=1"], env=env, stdout=subprocess.DEVNULL, stderr=out["spare"])
        codes = [survivor.wait(timeout=400), replacement.wait(timeout=60)]
    logs = {name: (tmp_path / f"{name}.err").read_text() for name in out}
    assert codes == [0, 0], logs
    [lost] = read_events(run_dir).query("kind == 'node_loss'").itertuples()
    assert lost.data["host"] == "node1" and lost.data["rank"] is None and lost.data["down_s"] >= 20, lost.message
    assert lost.severity == "warning" and killed_at - 5 <= lost.data["last_step"] <= killed_at + 1
    assert "node1" in logs["node0"] and "Traceback" not in logs["node0"] + logs["spare"], logs
    assert read_meta(run_dir)["rank0_host"] == "node0"  # host names sort node0 < node2: rank 0 stayed
    np.testing.assert_array_equal(read_steps(run_dir, effective=True).loss.to_numpy(), tiny_dp2_40.loss.to_numpy())
