"""Several "hosts" on one Linux machine, for multi-node tests: each a network namespace with an address of
its own on a private bridge, and its commands in a UTS namespace of their own with the host's hostname.

Not a test module (nothing here is named test_*): import it from tests, e.g.

    from hosts import hosts

    with hosts(2, "kt") as (node0, node1):
        server = node0.popen([sys.executable, "-m", "http.server", "8000"])
        node1.run(["curl", f"http://{node0.hostname}:8000/"])
        node0.kill()  # the node dies: SIGKILL to the process group of everything started on it

Needs root and iproute2's `ip` and util-linux's `unshare` (Debian: apt-get install iproute2 util-linux);
`missing()` says what is missing, for a skip. The machine's own network is never touched: the bridge
lives in a namespace of its own too (BRIDGE_NS below), and every veth pair is created there with its
other end straight in a host's namespace, so no link ever appears in the root namespace. Two runs at
once never collide: the namespaces are named by a prefix, this process's pid and a counter, and the
same subnet on two private bridges is two separate networks.

Names resolve on every host: `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts when
that file exists, and each host gets one listing every host's hostname and address (and localhost).
The filesystem is otherwise shared: a run directory under /tmp is the same on every host.

Everything is undone on exit, after a failure too: the processes started on the hosts (SIGKILL to each
one's process group), the namespaces (their links go with them) and the /etc/netns folders. Namespaces
a killed test left behind (its pid no longer alive) are removed by the next hosts() with the same prefix.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # where `ip netns exec` looks for files to bind over /etc
SUBNET = "10.213.0"  # host k (0-based) is SUBNET.(k+1)/24
BRIDGE = "br0"  # the bridge's name inside its own namespace
BRIDGE_NS = "br"  # suffix of the bridge's namespace name
STOP_TIMEOUT_S = 30.0  # for a killed process group to be reaped

_sequence = itertools.count()
_live: dict[str, _Network] = {}  # networks not torn down yet: torn down at interpreter exit at the latest


def missing() -> str:
    """Why hosts() cannot work here ('' when it can): not root, or `ip` / `unshare` not installed."""
    if os.geteuid() != 0:
        return "hosts() needs root (network namespaces)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"hosts() needs `{tool}` (Debian: apt-get install iproute2 util-linux hostname)"
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


@dataclass(eq=False)
class Host:
    """One host: its network namespace `name`, its address `addr` and its `hostname` (as its commands see it)."""

    name: str
    addr: str
    hostname: str
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run on this host: in its network namespace, and in a UTS namespace of its own whose
        hostname is this host's (`unshare` without --fork and the shell's exec keep one pid throughout)."""
        if isinstance(cmd, str):
            raise TypeError("pass the command as a list of arguments, e.g. ['sh', '-c', '...']")
        script = 'hostname "$1" && shift && exec "$@"'
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c", script, "sh", self.hostname, *cmd]

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """subprocess.Popen of `cmd` on this host, in a session (and process group) of its own unless the
        caller says otherwise: kill() ends it with everything it started."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(cmd), **kw)
        self.processes.append(proc)
        return proc

    def run(self, cmd: Sequence[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of `cmd` on this host (text output captured unless told otherwise); on a timeout
        its process group is killed before TimeoutExpired is raised."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        proc = self.popen(cmd, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The node dies: `sig` to the process group of every process started here, then each is reaped."""
        for proc in self.processes:
            _kill_group(proc, sig)

    def alive(self) -> list[subprocess.Popen]:
        return [proc for proc in self.processes if proc.poll() is None]


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """`sig` to the process's group (its session, as popen starts it), or to the process alone when it
    shares this process's group; then waits for it."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    try:
        if pgid is not None and pgid != os.getpgrp():
            os.killpg(pgid, sig)
        elif proc.poll() is None:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class _Network:
    bridge_ns: str
    hosts: list[Host]
    made: list[str] = field(default_factory=list)  # namespaces created, in order

    def teardown(self) -> list[str]:
        """Kills what runs on the hosts and deletes the namespaces and /etc/netns folders; returns what
        could not be undone (empty when everything was)."""
        problems = []
        for host in self.hosts:
            host.kill()
            problems += [f"pid {p.pid} on {host.name} did not end" for p in host.alive()]
        for ns in reversed(self.made):
            result = _ip("netns", "del", ns, check=False)
            if result.returncode != 0 and ns in _namespaces():
                problems.append(f"ip netns del {ns}: {result.stderr.strip()}")
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self.made.clear()
        _live.pop(self.bridge_ns, None)
        try:
            NETNS_ETC.rmdir()  # only when no other namespace has files there
        except OSError:
            pass
        return problems


def _namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_stale(prefix: str) -> list[str]:
    """Deletes the namespaces (and /etc/netns folders) an earlier hosts() with this prefix left behind in a
    process that is gone (SIGKILL, a crash: no cleanup ran). Returns their names. Names of live processes
    are never touched."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)x\d+-(?:\d+|{BRIDGE_NS})")
    swept = []
    for ns in sorted(_namespaces()):
        match = pattern.fullmatch(ns)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            swept.append(ns)
    return swept


def _hosts_file(hosts: list[Host]) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.addr}\t{h.hostname}" for h in hosts]
    return "\n".join(lines) + "\n"


@contextmanager
def hosts(n: int, prefix: str = "keel", subnet: str = SUBNET, hostnames: Sequence[str] | None = None) -> Iterator[list[Host]]:
    """n hosts on one private bridge: host k (0-based) has address SUBNET.(k+1)/24 and hostname `nodek`
    (or hostnames[k]). Yields the Host list; tears everything down on exit, raising if it could not."""
    if n < 1 or n > 250:
        raise ValueError(f"hosts({n}): 1 to 250 hosts on one /24")
    reason = missing()
    if reason:
        raise RuntimeError(reason)
    if not re.fullmatch(r"[a-z][a-z0-9]*", prefix):
        raise ValueError(f"prefix {prefix!r}: lower-case letters and digits, starting with a letter")
    sweep_stale(prefix)
    base = f"{prefix}{os.getpid()}x{next(_sequence)}"
    names = list(hostnames) if hostnames is not None else [f"node{k}" for k in range(n)]
    if len(names) != n or len(set(names)) != n:
        raise ValueError(f"hostnames {names}: need {n} distinct names")
    net = _Network(f"{base}-{BRIDGE_NS}", [Host(f"{base}-{k}", f"{subnet}.{k + 1}", names[k]) for k in range(n)])
    _live[net.bridge_ns] = net
    try:
        _ip("netns", "add", net.bridge_ns)
        net.made.append(net.bridge_ns)
        br = ("-n", net.bridge_ns)
        _ip(*br, "link", "add", BRIDGE, "type", "bridge")
        _ip(*br, "link", "set", BRIDGE, "up")
        _ip(*br, "link", "set", "lo", "up")
        hosts_file = _hosts_file(net.hosts)
        for k, host in enumerate(net.hosts):
            _ip("netns", "add", host.name)
            net.made.append(host.name)
            (NETNS_ETC / host.name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / host.name / "hosts").write_text(hosts_file)
            # Both ends are born in their namespaces: nothing appears in the machine's own.
            _ip(*br, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _ip(*br, "link", "set", f"v{k}", "master", BRIDGE, "up")
            ns = ("-n", host.name)
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip(*ns, "link", "set", "eth0", "up")
    except BaseException:
        net.teardown()
        raise
    try:
        yield net.hosts
    except BaseException:
        net.teardown()  # the body's failure is the one to report
        raise
    problems = net.teardown()
    if problems:
        raise RuntimeError("hosts() cleanup: " + "; ".join(problems))


@atexit.register
def _teardown_all() -> None:
    for net in list(_live.values()):
        net.teardown()
