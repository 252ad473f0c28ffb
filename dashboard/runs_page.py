"""The Runs page: every run under the dashboard's folders, one row each, worst news first."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.monitor.runs import summarize_runs

RUNS_ENV = "KEEL_DASHBOARD_RUNS"  # the folders to search, os.pathsep-separated (set by `keel dashboard`)
REFRESH_S = 5.0
# Shown as these headers, in this order; the rest of the summary stays in the data.
_SHOWN = {
    "link": "run", "run_id": "run id", "status": "status", "layout": "layout", "progress": "step", "loss": "loss",
    "tokens_per_s": "tokens/s", "mfu": "MFU", "comm_share": "comm share", "goodput": "goodput",
    "rollbacks": "rollbacks", "restarts": "restarts", "alerts": "alerts", "problem": "problem",
}  # fmt: skip


def run_folders() -> list[Path]:
    return [Path(p) for p in os.environ.get(RUNS_ENV, "runs").split(os.pathsep) if p]


def runs_table(summaries: pd.DataFrame) -> pd.DataFrame:
    """The summaries as a person reads them: progress as "step / total", shares in percent."""
    table = summaries.copy()
    total = table.total_steps.map(lambda t: "?" if pd.isna(t) else f"{int(t):,}")
    table["progress"] = [("-" if pd.isna(s) else f"{int(s):,}") + f" / {t}" for s, t in zip(table.step, total)]
    for share in ("mfu", "comm_share", "goodput"):
        table[share] = table[share].astype(float) * 100
    table["problem"] = table.problem.fillna("")
    # The Run page's deep link; it names the run by its folder, as the Run page's chooser does.
    table["link"] = [f"run?run={urllib.parse.quote(Path(d).name)}" for d in table.run_dir]
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
    percent = st.column_config.NumberColumn(format="%.1f%%")
    columns = {"MFU": percent, "comm share": percent, "goodput": percent, "loss": st.column_config.NumberColumn(format="%.4f"),
               "tokens/s": st.column_config.NumberColumn(format="%,.0f"),
               "run": st.column_config.LinkColumn(display_text=r"run\?run=(.*)")}  # fmt: skip
    st.dataframe(runs_table(summaries), hide_index=True, column_config=columns)
