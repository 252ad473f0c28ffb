"""`keel dashboard [RUNS_DIR ...]`: checks its arguments and that it can listen on --host:--port, prints the
URL, and becomes the Streamlit server.

The dashboard's only writes are its actions (start a drill, inject a fault). They are on when it is bound
to loopback, and off with --read-only, or when it is bound to another address unless --allow-actions
is given: anyone who can reach the page could otherwise start processes on this machine.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

from keel.dashboard.actions import ACTIONS_ENV
from keel.dashboard.runs_page import RUNS_ENV
from keel.monitor.exits import EXIT_CONFIG

APP = Path(__file__).with_name("app.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel dashboard", description="Watch runs live in the browser (Streamlit).")
    p.add_argument("runs", nargs="*", default=["runs"], metavar="RUNS_DIR", help="folders holding run directories (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8501, help="port (default: 8501)")
    p.add_argument("--read-only", action="store_true", help="no actions: never start a drill or inject a fault")
    p.add_argument("--allow-actions", action="store_true", help="keep the actions on when --host is not a loopback address")
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def actions_state(host: str, read_only: bool, allow_actions: bool) -> tuple[bool, str]:
    """Whether the actions are on, and the line that tells the user why."""
    if read_only:
        return False, "actions off (--read-only)"
    if not is_loopback(host) and not allow_actions:
        return False, f"actions off: --host={host} is not a loopback address (add --allow-actions to turn them on)"
    return True, "actions on: the Drills page can start drills and inject faults"


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (one line naming the option to change), or None.
    Binds as Streamlit's server will (one socket on host, SO_REUSEADDR, IPv6 dual-stack) and lets go at
    once: a busy port is reported before the URL is printed, not by Streamlit after it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            probe.bind((host, port))
    except socket.gaierror as e:
        return f"--host={host}: {e.strerror}; pass an address or a name of this machine"
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"--port={port}: {host}:{port} is in use; choose another port with --port"
        return f"--host={host} --port={port}: cannot listen there ({e.strerror}); choose another --host or --port"
    return None


def server_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP), f"--server.address={host}", f"--server.port={port}",
            "--server.headless=true", "--browser.gatherUsageStats=false", "--client.toolbarMode=minimal"]  # fmt: skip


def main(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    missing = [f for f in opts.runs if not Path(f).is_dir()]
    if missing:
        print(f"keel dashboard: error: {missing[0]} is not a folder; pass folders that hold run directories", file=sys.stderr)
        return EXIT_CONFIG
    if not 0 < opts.port < 65536:
        print(f"keel dashboard: error: --port={opts.port}: choose a port in 1-65535", file=sys.stderr)
        return EXIT_CONFIG
    problem = port_problem(opts.host, opts.port)
    if problem:
        print(f"keel dashboard: error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    actions, why = actions_state(opts.host, opts.read_only, opts.allow_actions)
    env = {**os.environ, RUNS_ENV: os.pathsep.join(str(Path(f).resolve()) for f in opts.runs), ACTIONS_ENV: "1" if actions else "0"}
    print(f"keel dashboard: http://{opts.host}:{opts.port}/ ({why}; Ctrl-C stops it)", flush=True)
    # The server replaces this process: a signal to `keel dashboard` (Ctrl-C, kill PID) reaches it directly.
    cmd = server_command(opts.host, opts.port)
    os.execve(cmd[0], cmd, env)
