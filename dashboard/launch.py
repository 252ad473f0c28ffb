"""`keel dashboard [RUNS_DIR ...]`: checks its arguments, prints the URL, and becomes the Streamlit server.

The dashboard's only writes are its actions (start a drill, inject a fault). They are on when it is bound
to loopback, and off with --read-only, or when it is bound to another address unless --allow-actions
is given: anyone who can reach the page could otherwise start processes on this machine.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
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
    actions, why = actions_state(opts.host, opts.read_only, opts.allow_actions)
    env = {**os.environ, RUNS_ENV: os.pathsep.join(str(Path(f).resolve()) for f in opts.runs), ACTIONS_ENV: "1" if actions else "0"}
    print(f"keel dashboard: http://{opts.host}:{opts.port}/ ({why}; Ctrl-C stops it)", flush=True)
    # The server replaces this process: a signal to `keel dashboard` (Ctrl-C, kill PID) reaches it directly.
    cmd = server_command(opts.host, opts.port)
    os.execve(cmd[0], cmd, env)
