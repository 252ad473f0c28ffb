"""`keel dashboard [RUNS_DIR ...]`: starts the Streamlit server on loopback and prints its URL."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from keel.dashboard.runs_page import RUNS_ENV
from keel.monitor.exits import EXIT_CONFIG, EXIT_INTERRUPTED

APP = Path(__file__).with_name("app.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel dashboard", description="Watch runs live in the browser (Streamlit).")
    p.add_argument("runs", nargs="*", default=["runs"], metavar="RUNS_DIR", help="folders holding run directories (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8501, help="port (default: 8501)")
    return p


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
    env = {**os.environ, RUNS_ENV: os.pathsep.join(str(Path(f).resolve()) for f in opts.runs)}
    print(f"keel dashboard: http://{opts.host}:{opts.port}/ (Ctrl-C stops it)", flush=True)
    try:
        return subprocess.call(server_command(opts.host, opts.port), env=env)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
