"""The Runs page: every run under the dashboard's folders, one row each, worst news first; and the name
each run goes by in the pages' URLs (run_names)."""

from __future__ import annotations

import os
import urllib.parse
from collections import Counter
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.monitor.runs import find_runs, summarize_runs

RUNS_ENV = "KEEL_DASHBOARD_RUNS"  # the folders to search, os.pathsep-separated (set by `keel dashboard`)
REFRESH_S = 5.0
_NUMBER_PX = 62  # a number column's width: "100.0%" and "12,345" fit, as the headers do
_STEP_PX = 112  # the step column's: "123,456 / 500,000" fits (sized by its first rows, "490 / 100,000" was cut)
_RUN_ID_PX = 150  # the run id column's: "20261205-070123-8a29" (keel's own ids) fits; "small" cut it after the hour
MISSING = ""  # what a cell without a value shows (Streamlit's own default is the text "None")
_STATUS_HELP = (
    "running; finished; stopped (on purpose: the rollback cap, Ctrl-C); killed (its trainer ended without a word: kill -9, the OOM "
    "killer, a lost node, a crash); hung (stuck: the watchdog said so, or it is stuck beyond the watchdog's reach); failed "
    "(silent too long, and whether its trainer lives cannot be told: a trainer on another host); unreadable"
)
# Shown as these headers, in this order (what tells how a run goes first, its names for finding it last); the
# rest of the summary stays in the data. Short headers and narrow numbers: at 800 px, 11 of the 14 fit.
_SHOWN = {
    "link": "run", "status": "status", "progress": "step", "loss": "loss", "tokens_per_s": "tok/s", "mfu": "MFU",
    "comm_share": "comm", "goodput": "goodput", "rollbacks": "rollbacks", "restarts": "restarts", "alerts": "alerts",
    "layout": "layout", "run_id": "run id", "problem": "problem",
}  # fmt: skip


def run_folders() -> list[Path]:
    return [Path(p) for p in os.environ.get(RUNS_ENV, "runs").split(os.pathsep) if p]


def run_names(folders: list[Path]) -> dict[str, Path]:
    """A name for each run found under the folders, unique among them, the same at every call while the
    same runs are there: its folder's name; when another run has that name too (A/exp and B/exp), with
    its parent folder's name before it; when even those clash, its whole path. Pages name runs in their
    URLs by it."""
    runs = find_runs(folders)
    names = {run: run.name for run in runs}
    for longer in (lambda run: f"{run.parent.name}/{run.name}", str):
        clashing = {name for name, count in Counter(names.values()).items() if count > 1}
        names |= {run: longer(run) for run, name in names.items() if name in clashing}
    return {name: run for run, name in names.items()}


def runs_table(summaries: pd.DataFrame, names: dict[str, Path]) -> pd.DataFrame:
    """The summaries as a person reads them: progress as "step / total", shares in percent, a missing value
    (a single process's comm share, a user loop's layout, an unreadable run's all) as None or NaN, which
    the page shows as an empty cell (MISSING), and a link to the Run page by the run's name in `names`
    (run_names)."""
    table = summaries.copy()
    total = table.total_steps.map(lambda t: "?" if pd.isna(t) else f"{int(t):,}")
    table["progress"] = [("-" if pd.isna(s) else f"{int(s):,}") + f" / {t}" for s, t in zip(table.step, total)]
    table.loc[table.status == "unreadable", "progress"] = None
    for number in ("loss", "tokens_per_s", "rollbacks", "restarts", "alerts"):
        table[number] = pd.to_numeric(table[number]).astype(float)
    for share in ("mfu", "comm_share", "goodput"):
        table[share] = pd.to_numeric(table[share]).astype(float) * 100
    # A run that appeared since run_names looked has no name yet: its folder's, until the next refresh.
    by_dir = {str(run): name for name, run in names.items()}
    table["link"] = [f"run?run={urllib.parse.quote(by_dir.get(d, Path(d).name))}" for d in table.run_dir]
    return table[list(_SHOWN)].rename(columns=_SHOWN)


def render_runs() -> None:
    st.title("Runs")
    folders = run_folders()
    st.caption("Runs under " + ", ".join(f"`{f}`" for f in folders) + f"; refreshed every {REFRESH_S:g} s.")
    _live_table(folders)


@st.fragment(run_every=REFRESH_S)
def _live_table(folders: list[Path]) -> None:
    summaries = summarize_runs(folders)
    if summaries.empty:
        st.info("No runs found yet. Start one with `keel train --run-dir " + str(folders[0] / "my-run") + "`.")
        return
    for problem in summaries[summaries.status == "unreadable"].itertuples():
        st.warning(f"{problem.run_dir}: cannot read its run store ({problem.problem}); the other runs are shown.")
    st.dataframe(runs_table(summaries, run_names(folders)), hide_index=True, column_config=_columns(), placeholder=MISSING)


def _columns() -> dict[str, dict]:
    """How each column is drawn: the numbers in narrow columns, each header's full meaning in its tooltip."""

    def number(format: str, help: str | None = None) -> dict:
        return st.column_config.NumberColumn(format=format, width=_NUMBER_PX, help=help)

    percent, count = "%.1f%%", "%d"
    return {
        "run": st.column_config.LinkColumn(display_text=r"run\?run=(.*)", help="the run on the Run page"),
        "status": st.column_config.TextColumn(help=_STATUS_HELP),
        "step": st.column_config.TextColumn(help="the last step / the steps the run is to train", width=_STEP_PX),
        "loss": number("%.4f", "loss at the last step"), "tok/s": number("%,.0f", "tokens per second at the last step"),
        "MFU": number(percent, "model FLOPs utilization at the last step"),
        "comm": number(percent, "comm share: the step's time spent in communication, last measured"),
        "goodput": number(percent, "productive step time / wall time"), "rollbacks": number(count, "rollbacks"),
        "restarts": number(count, "restarts"), "alerts": number(count, "alerts sent"),
        "run id": st.column_config.TextColumn(width=_RUN_ID_PX),
    }  # fmt: skip
