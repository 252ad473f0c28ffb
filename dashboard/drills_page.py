"""The Drills page: every drill report found (verdict table, detection and recovery times, the plot), and,
when the dashboard's actions are on, a form that starts `keel drill` and follows it live, and a button
that injects a fault into a running run after a confirmation (keel.dashboard.actions)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.actions import ActionRefused, actions_enabled, inject_fault, start_drill
from keel.dashboard.runs_page import REFRESH_S, run_folders
from keel.monitor.runs import find_drills, summarize_runs

REPORT, PLOT = "report.json", "plot.png"
_STARTED = "started-drills"  # session state: the drills this browser session started
_PENDING = "pending-injection"  # session state: an injection waiting for its confirmation
_VERDICT_COLUMNS = {
    "name": "drill", "status": "result", "detected_by": "detected by", "detection_latency_steps": "detection (steps)",
    "detection_latency_s": "detection (s)", "recovered_step": "recovered at step", "time_to_recover_s": "recovery (s)",
    "steps_lost": "steps lost", "goodput": "goodput", "loss_max_rel_diff": "loss vs reference (max rel. diff)",
}  # fmt: skip


def drill_name(folder: Path) -> str:
    """How a drill is named in the table and the URL: the job's run directory, then the drill's id."""
    return f"{folder.parents[1].name}/{folder.name}"


def read_report(folder: Path) -> dict | None:
    """A drill's report.json, or None while it runs (or when the report is damaged)."""
    try:
        return json.loads((folder / REPORT).read_text())
    except (OSError, ValueError):
        return None


def drills_table(folders: list[Path]) -> pd.DataFrame:
    rows = []
    for folder in folders:
        report = read_report(folder)
        result = "running" if report is None else "PASS" if report.get("passed") else "FAIL"
        layout = (report or {}).get("layout") or {}
        rows.append({"drill": drill_name(folder), "result": result, "summary": (report or {}).get("summary", ""),
                     "layout": " ".join(f"{k}{v}" for k, v in layout.items())})  # fmt: skip
    return pd.DataFrame(rows, columns=["drill", "result", "summary", "layout"]).iloc[::-1]


def verdict_table(report: dict) -> pd.DataFrame:
    table = pd.DataFrame(report["results"]).reindex(columns=list(_VERDICT_COLUMNS))
    table["goodput"] = table.goodput.astype(float) * 100
    return table.rename(columns=_VERDICT_COLUMNS)


def render_drills() -> None:
    st.title("Drills")
    _reports()
    st.divider()
    if actions_enabled():
        _start_drill_form()
        _live_started_drills()
        st.divider()
        _inject_form()
    else:
        st.caption("Actions are off on this dashboard (--read-only, or bound to a non-loopback address without --allow-actions): "
                   "start drills with `keel drill` and inject faults with `keel inject`.")  # fmt: skip


def _reports() -> None:
    drills = {drill_name(f): f for f in find_drills(run_folders())}
    if not drills:
        st.info("No drill yet. Run one with `keel drill --config job.toml` (or start one below).")
        return
    st.dataframe(drills_table(list(drills.values())), hide_index=True, key="drills")
    wanted = st.query_params.get("drill")
    if wanted is not None and wanted not in drills:  # looked up among the drills found, never joined to a path
        st.error(f"No drill named '{wanted}' here; choose one of the drills found.")
    names = sorted(drills, reverse=True)
    name = st.selectbox("drill", names, index=names.index(wanted) if wanted in drills else 0)
    st.query_params["drill"] = name
    report = read_report(drills[name])
    if report is None:
        st.info(f"{name} is still running (or ended without a report): its runs are in {drills[name] / 'runs'}.")
        return
    st.markdown(f"**{'PASS' if report['passed'] else 'FAIL'}**: {report['summary']}; {report['steps']} steps per run, "
                f"faults at step {report['fault_step']} on rank {report['fault_rank']}.")  # fmt: skip
    percent = st.column_config.NumberColumn(format="%.0f%%")
    seconds = st.column_config.NumberColumn(format="%.1f")
    columns = {"goodput": percent, "detection (s)": seconds, "recovery (s)": seconds}
    st.dataframe(verdict_table(report), hide_index=True, column_config=columns, key="verdicts")
    for r in report["results"]:
        if r.get("reasons"):
            st.warning(f"{r['name']}: {'; '.join(r['reasons'])}")
    if (drills[name] / PLOT).is_file():
        st.image(str(drills[name] / PLOT), caption="loss per drill against the reference")


def _start_drill_form() -> None:
    with st.form("start-drill"):
        st.subheader("Start a drill")
        name = st.text_input("run directory name", value="drill-job", help=f"created under {run_folders()[0]}")
        config = st.text_input("config", value="tiny", help="a preset (tiny, small, ...) or the path of a job's TOML file")
        pp, dp, tp = (c.number_input(n, min_value=1, value=1, step=1) for c, n in zip(st.columns(3), ("pp", "dp", "tp")))
        faults = st.text_input("faults", value="nan;spike", help="drills or fault specs separated by ';' (empty: the standard suite)")
        if st.form_submit_button("Start the drill"):
            try:
                started = start_drill(run_folders()[0], name, config, (int(pp), int(dp), int(tp)), faults)
            except ActionRefused as e:
                st.error(str(e))
                return
            st.session_state.setdefault(_STARTED, []).append(started)


@st.fragment(run_every=REFRESH_S)
def _live_started_drills() -> None:
    for started in st.session_state.get(_STARTED, []):
        code = started.proc.poll()
        lines = started.log.read_text(errors="replace").splitlines() if started.log.is_file() else []
        state = "running" if code is None else "passed" if code == 0 else f"ended with exit code {code}"
        st.markdown(f"**Drill on `{started.run_dir.name}`**: {state}")
        st.code("\n".join(lines[-12:]) or "(starting)", language=None)
        reports = sorted((started.run_dir / "drills").glob(f"drill-*/{REPORT}"))
        if code is not None and reports and st.button("Open its report", key=f"open-{started.proc.pid}"):
            st.query_params["drill"] = drill_name(reports[-1].parent)
            st.rerun()


def _inject_form() -> None:
    st.subheader("Inject a fault into a running run")
    summaries = summarize_runs(run_folders())
    running = {Path(r.run_dir).name: Path(r.run_dir) for r in summaries.itertuples() if r.status == "running"}  # named as on the Run page
    if not running:
        st.caption("No run is running now.")
        return
    run = st.selectbox("run", sorted(running), key="inject-run")
    fault = st.text_input("fault", value="nan", help="KIND or KIND@FIELD=VALUE,... as for `keel inject` (e.g. hang@seconds=30)")
    rank = st.number_input("rank (empty: every rank)", min_value=0, value=None, step=1)
    if st.button("Inject…"):
        st.session_state[_PENDING] = (run, fault, rank)
    pending = st.session_state.get(_PENDING)
    if pending is None:
        return
    run, fault, rank = pending
    if run not in running:
        del st.session_state[_PENDING]
        st.info(f"{run} is no longer running; nothing was injected.")
        return
    st.warning(f"Inject `{fault}` into the running run **{run}**" + (f" on rank {rank}" if rank is not None else " on every rank") + "?")
    confirm, cancel = st.columns(2)
    if cancel.button("Cancel"):
        del st.session_state[_PENDING]
        st.rerun()
    if confirm.button("Confirm the injection", type="primary"):
        del st.session_state[_PENDING]
        try:
            ok, said = inject_fault(running[run], fault, None if rank is None else int(rank))
        except ActionRefused as e:
            ok, said = False, str(e)
        (st.success if ok else st.error)(said)
