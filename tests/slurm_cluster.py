"""A real one-machine SLURM for tests: Debian's slurm-wlm (22.05) and munge, started from scratch in a
temporary folder and stopped by their own PIDs. Needs root (slurmd runs jobs as their user) and
`apt-get install slurm-wlm munge` (as .ci/run does); if a daemon does not come up, the fixture fails with its
log's tail, it never skips.

Not a test module: a test module imports the session fixture,

    from slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

    def test_x(slurm_cluster, tmp_path):
        job = slurm_cluster.submit(script, "--chdir", str(tmp_path))
        slurm_cluster.wait_for(job, {"COMPLETED"}, timeout=120)

Nothing of the machine's own SLURM or munge set-up is used or changed: munged runs as the `munge` user with
its own key, socket, PID and seed files in a folder of its own, and slurmctld and slurmd run as root with a
slurm.conf in pytest's temporary folder (every client command gets SLURM_CONF pointing at it) on ports that
were free, with their state, spool, PID and log files next to it.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 90.0  # 2 cores shared with training runs: slurmctld's start and slurmd's registration take seconds
KILL_WAIT_S = 30  # slurm.conf KillWait: a job's processes get SIGTERM, then SIGKILL this much later
# A requeued job may start again only once the job credentials of its last run have expired: SLURM sets its
# begin time to requeue + cred_expire + 1 s (Reason=BeginTime; 120 s by default). 20 s keeps a requeue test short
# and still leaves srun that long to launch a step with a fresh credential on a busy machine.
CRED_EXPIRE_S = 20
SCHED_INTERVAL_S = 2  # the main and backfill scheduling passes (60 s and 30 s by default): a job whose begin time
# has come starts within seconds, not up to a minute later
DAEMONS = ("munged", "slurmctld", "slurmd")
APT_HINT = "apt-get install slurm-wlm munge (as .ci/run does)"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no log: {e})"


def _binary(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)
    if not path:
        pytest.fail(f"{name} is not installed: {APT_HINT}")
    return path


@dataclass(frozen=True)
class JobState:
    """What `scontrol show job` says of a job: its state (PENDING, RUNNING, COMPLETED, FAILED, ...), why it
    waits (`reason`, e.g. BeginTime or JobHeldUser), how often it was requeued (`restarts`), and every field."""

    job_id: str
    state: str
    reason: str
    restarts: int
    fields: dict[str, str]

    @property
    def held(self) -> bool:
        # A held job has priority 0 (scontrol hold, requeuehold, or MaxBatchRequeue reached).
        return self.state == "PENDING" and (self.fields.get("Priority") == "0" or self.reason.startswith("JobHeld"))


# `scontrol show job -o` prints one line of Key=Value pairs; a value may hold spaces (Command=, WorkDir=, Comment=),
# so a value runs until the next " Key=" (keys are CamelCase words, some with a slash or colon: TRES/, OverSubscribe).
_FIELD = re.compile(r"(?:^|\s)([A-Z][A-Za-z/:_]*)=(.*?)(?=\s[A-Z][A-Za-z/:_]*=|$)")


def parse_job_line(line: str) -> dict[str, str]:
    return {key: value for key, value in _FIELD.findall(line.strip())}


class SlurmCluster:
    """A running one-node SLURM: `.conf` (slurm.conf), `.env` (os.environ with SLURM_CONF), `.node`,
    `.submit()`, `.state()`, `.requeue()`, `.release()`, `.wait_for()`, `.logs()`, `.stop()`."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.node = socket.gethostname().split(".")[0]  # `hostname -s`: slurmd finds its node by this name
        self.conf = workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_paths: dict[str, Path] = {}
        self.munge_dir: Path | None = None
        self.submitted: list[str] = []

    # -- client commands --------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs a SLURM client command (sinfo, squeue, scontrol, sbatch, ...) against this cluster."""
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})})
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}\n{self.logs(1500)}")
        return proc

    def submit(self, script: str | os.PathLike, *sbatch_args: str, env: dict | None = None) -> str:
        """`sbatch --parsable SBATCH_ARGS SCRIPT`; returns the job id. `env` adds to (and overrides) this
        process's environment, which sbatch passes on to the job (--export=ALL, its default)."""
        out = self.run("sbatch", "--parsable", *sbatch_args, str(script), env=env).stdout.strip()
        job_id = out.split(";")[0]  # "<id>" or "<id>;<cluster>"
        assert job_id.isdigit(), f"sbatch printed {out!r}"
        self.submitted.append(job_id)
        return job_id

    def state(self, job_id: str) -> JobState:
        """The job as `scontrol show job` has it; once slurmctld forgets it (MinJobAge after its end), its
        last line in the job completion log (jobcomp/filetxt: a line per end, a requeue's included)."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode == 0 and "JobState=" in proc.stdout:
            fields = parse_job_line(proc.stdout.splitlines()[0])
        else:
            lines = [ln for ln in _tail(self.workdir / "jobcomp.log", 10**7).splitlines() if ln.startswith(f"JobId={job_id} ")]
            assert lines, f"scontrol knows no job {job_id} and the completion log has none:\n{proc.stdout}{proc.stderr}"
            fields = {**parse_job_line(lines[-1]), "Restarts": str(len(lines) - 1)}
        return JobState(str(job_id), fields["JobState"], fields.get("Reason", ""), int(fields.get("Restarts", "0")), fields)

    def requeue(self, job_id: str) -> None:
        """`scontrol requeue`: slurmd signals the job (SIGCONT, SIGTERM, SIGKILL KillWait later) and the job
        goes back to PENDING, with a begin time a little in the future (see test_slurm.py)."""
        self.run("scontrol", "requeue", str(job_id))

    def release(self, job_id: str) -> None:
        self.run("scontrol", "release", str(job_id))

    def wait_for(self, job_id: str, states: str | Iterable[str], timeout: float, poll: float = 0.5) -> JobState:
        """Polls until the job is in one of `states`; returns its JobState. Fails early if it ends in another."""
        wanted = {states} if isinstance(states, str) else set(states)
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
        deadline = time.monotonic() + timeout
        while True:
            job = self.state(job_id)
            if job.state in wanted:
                return job
            if job.state in final - wanted:
                raise AssertionError(f"job {job_id} ended {job.state}, not {sorted(wanted)}: {job.fields}\n{self.logs(1500)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {sorted(wanted)} after {timeout:.0f} s: {job.fields}\n{self.logs(1500)}")
            time.sleep(poll)

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name} log ({path}):\n{_tail(path, chars)}" for name, path in self.log_paths.items())

    # -- start and stop ---------------------------------------------------------------------------------

    def start(self) -> None:
        if os.geteuid() != 0:
            pytest.fail("the SLURM tests start slurmd, which runs jobs as their user: run them as root (CI does)")
        try:  # a job script names its nodes by hostname (the rendezvous on the first node): it must resolve
            socket.getaddrinfo(self.node, None)
        except OSError as e:
            pytest.fail(f"this machine's name {self.node!r} does not resolve ({e}): add it to /etc/hosts")
        try:
            self._start_munge()
            self._write_conf()
            self._start("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0, "slurmctld to answer scontrol ping")
            self._start("slurmd", [_binary("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
            self._wait(self._node_idle, f"node {self.node} to be idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        try:
            munge_user = pwd.getpwnam("munge")
        except KeyError:
            pytest.fail(f"no `munge` user: {APT_HINT}")
        # Not under pytest's temporary folder: that is root's, mode 0700, and munged (as `munge`) must reach its
        # files; munged also refuses a socket or key in a folder that others may write to (/tmp is sticky: allowed).
        self.munge_dir = Path(tempfile.mkdtemp(prefix="keel-munge-"))
        os.chown(self.munge_dir, munge_user.pw_uid, munge_user.pw_gid)
        os.chmod(self.munge_dir, 0o755)  # clients (root, and job steps) connect to the socket inside
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
        os.chmod(key, 0o400)
        self.munge_socket = self.munge_dir / "munge.socket"
        # -F (foreground, so that its PID is the one started here) logs to stderr: munged.out.
        argv = [_binary("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={key}", f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}"]  # fmt: skip
        user, group = munge_user.pw_name, grp.getgrgid(munge_user.pw_gid).gr_name
        self._start("munged", argv, log_file=False, user=user, group=group, cwd=self.munge_dir)
        self._wait(lambda: self.munge_socket.is_socket(), "munged's socket")

    def _write_conf(self) -> None:
        w = self.workdir
        for d in ("state", "spool"):
            (w / d).mkdir(exist_ok=True)
        (w / "plugstack.conf").write_text("")  # not /etc/slurm's: no SPANK plugins
        ctld_port, slurmd_port = _free_port(), _free_port()
        while slurmd_port == ctld_port:
            slurmd_port = _free_port()
        conf = f"""\
ClusterName=keeltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={w / "state"}
SlurmdSpoolDir={w / "spool"}
SlurmctldPidFile={w / "slurmctld.pid"}
SlurmdPidFile={w / "slurmd.pid"}
SlurmctldLogFile={w / "slurmctld.log"}
SlurmdLogFile={w / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={w / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={w / "jobcomp.log"}
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval={SCHED_INTERVAL_S},bf_interval={SCHED_INTERVAL_S}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait={KILL_WAIT_S}
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)

    def _start(self, name: str, argv: list[str], log_file: bool = True, **popen) -> None:
        if log_file:  # slurm.conf names it
            self.log_paths[name] = self.workdir / f"{name}.log"
        out = self.workdir / f"{name}.out"  # what it prints before its log file is open (or all of it)
        self.log_paths[f"{name} output"] = out
        with open(out, "wb") as f:
            self.procs[name] = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                                start_new_session=True, **popen)  # fmt: skip

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with status {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.25)
        pytest.fail(f"timed out after {START_TIMEOUT_S:.0f} s waiting for {what}\n{self.logs()}")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        return out[:2] == [self.node, "idle"]

    def stop(self) -> None:
        """Cancels the jobs this cluster still has (their processes belong to slurmd's step daemons, not to
        this process), then stops slurmd, slurmctld and munged by their PIDs."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None and self.submitted:
            self.run("scancel", *self.submitted, check=False)
            deadline = time.monotonic() + KILL_WAIT_S + 30
            while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        if self.munge_dir:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM (this machine, all its CPUs, one partition `debug`), idle and ready for sbatch."""
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
