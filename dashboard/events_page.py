"""The Events page: one run's events and alerts as a timeline, newest first, filtered by kind,
severity, rank and attempt (the filters are in the URL, so a filtered view can be shared). Each event
with a step links to the Run page at the steps around it. Below the table, each hang of the view: the
rank that stopped and every rank's stack dump (keel.monitor.dumps)."""

from __future__ import annotations

import sqlite3
import time
import urllib.parse
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.run_page import choose_run
from keel.dashboard.runs_page import REFRESH_S
from keel.monitor.dumps import RankDump, hang_dumps
from keel.monitor.event_kinds import EventKind
from keel.monitor.run_dir import DUMP_DIR
from keel.monitor.store import read_events

FILTERS = ("kind", "severity", "rank", "attempt")
STEP_WINDOW = 25  # an event's link opens the Run page at this many steps either side of it
LINK = "open steps"  # the link column's header; its cells show the range (LinkColumn's display_text below)
# The newest hangs of the view get their dumps; each rank's (a few KiB each) is sent again at every refresh.
HANGS_SHOWN = 5


def render_events() -> None:
    st.title("Events and alerts")
    run_dir = choose_run()
    if run_dir is not None:
        _live_events(run_dir, chosen_run_name())


def chosen_run_name() -> str:
    """The name the run chooser (run_page.choose_run) knows the chosen run by, which the Run page's ?run=
    takes: the chooser writes it to the URL, whichever way it names runs (folder names, or unique ones from
    keel.dashboard.runs_page.run_names). The one place to change should it stop doing so."""
    return st.query_params["run"]


@st.fragment(run_every=REFRESH_S)
def _live_events(run_dir: Path, run: str) -> None:
    try:
        events = read_events(run_dir)
    except (sqlite3.Error, FileNotFoundError) as e:
        st.warning(f"{run_dir}: cannot read its run store ({type(e).__name__}: {e}).")
        return
    table = event_table(events, run)
    chosen = {}
    for column, name in zip(st.columns(len(FILTERS)), FILTERS):
        with column:
            choices = sorted(table[name].unique(), key=str)
            wanted = [v for v in st.query_params.get_all(name) if v in choices]
            chosen[name] = st.multiselect(name, choices, default=wanted, placeholder="all", key=f"filter-{name}")
            st.query_params[name] = chosen[name]
    shown = filter_events(table, chosen)
    st.caption(f"{len(shown)} of {len(table)} events; refreshed every {REFRESH_S:g} s.")
    link = st.column_config.LinkColumn(display_text=r"steps=(\d+-\d+)", help="The Run page at the steps around the event")
    height = min(36 * (len(shown) + 1) + 2, 900)  # whole up to ~24 rows, then it scrolls
    st.dataframe(shown, hide_index=True, height=height, column_config={LINK: link})
    # The hangs of the filtered view, as the table shows them: a shared link to one attempt shows its hang.
    _hangs(run_dir, events.set_index("id").loc[shown.index[shown.kind == EventKind.HANG]])


def event_table(events: pd.DataFrame, run: str) -> pd.DataFrame:
    """The events as text a person filters and reads: when, step, attempt, rank ("all" for the job), kind,
    severity, message, and the link to the Run page around the step; newest first, indexed by event id."""
    table = pd.DataFrame(
        {
            LINK: events.step.map(lambda step: step_link(run, step)),  # first: the step range a person opens
            "time": events.time.map(lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))),
            "step": events.step.astype("string").fillna("-"),
            "attempt": events.attempt.astype("string").fillna("-"),
            "rank": events["rank"].astype("string").fillna("all"),
            "kind": events.kind,
            "severity": events.severity,
            "message": events.message.fillna(""),
        }
    )
    return table.set_axis(events.id).iloc[::-1]


def step_link(run: str, step) -> str:
    """The Run page of `run` at STEP_WINDOW steps either side of `step`, from step 1 (the Run page clamps the
    range to the run's steps); "" for an event of no step, which a link column leaves empty."""
    if pd.isna(step):
        return ""
    return f"run?run={urllib.parse.quote(run, safe='')}&steps={max(1, int(step) - STEP_WINDOW)}-{int(step) + STEP_WINDOW}"


def filter_events(table: pd.DataFrame, chosen: dict[str, list[str]]) -> pd.DataFrame:
    """Rows matching every filter that has a choice (an empty choice lets everything through)."""
    keep = pd.Series(True, index=table.index)
    for name, values in chosen.items():
        if values:
            keep &= table[name].isin(values)
    return table[keep]


def _hangs(run_dir: Path, hangs: pd.DataFrame) -> None:
    """The newest HANGS_SHOWN of the hang events given (newest first), each with its dumps."""
    if hangs.empty:
        return
    st.subheader("Hangs")
    if len(hangs) > HANGS_SHOWN:
        st.caption(f"The newest {HANGS_SHOWN} of {len(hangs)} hangs; filter by attempt to see an earlier one.")
    for _, event in hangs.head(HANGS_SHOWN).iterrows():
        _hang(run_dir, event)


def _hang(run_dir: Path, event: pd.Series) -> None:
    data, dumps = event.data, hang_dumps(run_dir, event)
    st.markdown(
        f"**Step {_text(event.step)}, attempt {_text(event.attempt)}**: no progress in phase `{data.get('phase', '?')}` for "
        f"{data.get('stalled_s', '?')} s (allowed {data.get('timeout_s', '?')} s); reported by rank {data.get('rank', '?')}."
    )
    st.markdown(hung_ranks_line(dumps))
    for dump in dumps:
        with st.expander(f"rank {_text(dump.rank)}{' (hung)' if dump.stuck else ''}: {dump.name}", expanded=dump.stuck):
            if dump.note:
                st.caption(dump.note)
            if dump.text:
                st.code(dump.text, language=None)


def hung_ranks_line(dumps: list[RankDump]) -> str:
    """What the dumps say of who stopped, in one line."""
    stuck = [_text(d.rank) for d in dumps if d.stuck]
    if stuck:
        ranks = f"rank{'s' if len(stuck) > 1 else ''} {', '.join(stuck)}"
        return f"**Hung: {ranks}**, stopped outside any collective while the other ranks wait inside one."
    if not any(d.text for d in dumps):
        return f"No stack dump of this attempt in the run's `{DUMP_DIR}/` folder."
    return ("No rank stands out: every stack read waits inside a collective (a lost peer, or collectives "
            "entered in different orders).")  # fmt: skip


def _text(value) -> str:
    return "-" if value is None or pd.isna(value) else str(value)
