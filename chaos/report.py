"""The drill report: report.md for people, report.json for scripts, plot.png to see each recovery.

The plot has one panel per drill: the reference loss in grey, every step the run computed (the
abandoned attempts as red crosses), the trajectory the run kept in blue, and vertical lines where the
fault hit (red) and where it was detected (orange); a green band covers the steps that ran again after
the recovery. For a slow rank, which leaves the loss alone, the step time is drawn on a second axis.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from keel.chaos.verdict import DrillResult  # noqa: E402
from keel.monitor.run_dir import STORE_FILE  # noqa: E402
from keel.monitor.store import abandoned_mask, read_steps  # noqa: E402

_COLUMNS = ("drill", "result", "detected", "recovered", "steps lost", "goodput", "loss vs reference")


def _row(r: DrillResult) -> tuple[str, ...]:
    if r.status == "n/a":
        return (r.name, "n/a", "-", "-", "-", "-", r.reasons[0])
    detected = (
        f"{r.detected_by} at step {r.detection_step} ({r.detection_latency_steps:+d} steps, {r.detection_latency_s:+.1f} s)"
        if r.detected
        else "no"
    )
    if not r.recovered:
        recovered = "no"
    elif r.recovered_step is None:
        recovered = "kept going (a slow rank is named, not fixed)"
    else:
        recovered = f"step {r.recovered_step} ({r.time_to_recover_s:.1f} s after the fault)"
    if r.loss_max_rel_diff is None:
        loss = r.loss_compared_with or "-"
    elif math.isinf(r.loss_max_rel_diff):
        loss = "differs"
    else:
        same = "identical" if r.loss_max_rel_diff == 0 else f"max rel. diff {r.loss_max_rel_diff:.1e}"
        loss = f"{same} ({r.loss_compared_with})"
    goodput = f"{r.goodput:.0%}" if r.goodput is not None else "-"
    return (r.name, r.status.upper(), detected, recovered, str(r.steps_lost), goodput, loss)


def table(results: list[DrillResult]) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in results]
    return "\n".join(lines)


def write_report(setup, results: list[DrillResult]) -> dict:
    """Writes report.md, report.json and plot.png into setup.folder; returns their paths and the table."""
    folder, cfg = setup.folder, setup.cfg
    passed = sum(r.status == "pass" for r in results)
    failed = [r for r in results if r.status == "fail"]
    layout = f"pp{cfg.parallel.pp} dp{cfg.parallel.dp} tp{cfg.parallel.tp}"
    summary = f"{passed} passed, {len(failed)} failed, {sum(r.status == 'n/a' for r in results)} not applicable at {layout}"
    md = [
        f"# Keel drill {folder.name}",
        "",
        f"Job: model {cfg.model.preset}, {layout} ({cfg.world_size} processes), {setup.steps} steps per run, "
        f"a checkpoint every {setup.checkpoint_every} steps; faults at step {setup.fault_step} on rank {setup.fault_rank}. "
        f"Reference: `runs/reference`, the same job without faults.",
        "",
        f"**{'PASS' if not failed else 'FAIL'}**: {summary}.",
        "",
        table(results),
        "",
    ]
    if failed:
        md += ["## Why drills failed", ""] + [f"- **{r.name}**: {'; '.join(r.reasons)}" for r in failed] + [""]
    md += ["## Faults injected", ""] + [
        f"- **{r.name}**: `{'`, `'.join(r.faults)}`" + (f"; skipped batches {r.batches_skipped}" if r.batches_skipped else "")
        for r in results
    ]
    md += [
        "",
        "Detected: the first event that reports the fault, and its delay after the fault fired. Recovered: the first "
        "step of the kept trajectory after the recovery. Steps lost: steps computed and thrown away (rolled back or "
        "lost to a restart) plus steps skipped without an update. Loss: the kept trajectory against the reference, "
        "or against a reference that skipped the same batches when the recovery skipped data.",
        "",
        "![loss per drill](plot.png)",
        "",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"md": folder / "report.md", "json": folder / "report.json", "png": folder / "plot.png"}
    paths["md"].write_text("\n".join(md))
    doc = {
        "drill_id": folder.name,
        "passed": not failed,
        "summary": summary,
        "layout": {"pp": cfg.parallel.pp, "dp": cfg.parallel.dp, "tp": cfg.parallel.tp},
        "steps": setup.steps,
        "fault_step": setup.fault_step,
        "fault_rank": setup.fault_rank,
        "results": [_finite(r.to_dict()) for r in results],
    }
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, folder / "runs" / "reference", paths["png"])
    return {**paths, "summary": summary, "table": f"{table(results)}\n\n{'PASS' if not failed else 'FAIL'}: {summary}"}


def _finite(d: dict) -> dict:
    """JSON has no Infinity: an unmeasurable difference is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def plot(results: list[DrillResult], reference_dir: Path, out: Path) -> None:
    fig = figure(results, reference_dir)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def figure(results: list[DrillResult], reference_dir: Path) -> plt.Figure:
    """One panel per drill that ran (see the module's docstring), each with its legend below it."""
    shown = [r for r in results if r.status != "n/a" and r.run_dir and (Path(r.run_dir) / STORE_FILE).exists()]
    cols = min(3, max(1, len(shown)))
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows), squeeze=False)
    reference = read_steps(reference_dir, effective=True) if (reference_dir / STORE_FILE).exists() else None
    for ax in axes.flat[len(shown) :]:
        ax.axis("off")
    for ax, r in zip(axes.flat, shown):
        _draw_panel(ax, r, reference)
    fig.suptitle("Keel drill: the loss of each fault's run against its reference")
    fig.tight_layout()
    return fig


def _draw_panel(ax, r: DrillResult, reference: pd.DataFrame | None) -> None:
    """One drill's panel: its kept trajectory against the reference it was compared with, the steps it
    threw away, the fault, its detection and recovery (and the step time for a slow rank)."""
    run_dir = Path(r.run_dir)
    every = read_steps(run_dir)
    abandoned = abandoned_mask(every)  # the whole run: the store's effective-trajectory rule
    kept, dropped = every[~abandoned], every[abandoned]
    compared = run_dir.parent / str(r.loss_compared_with)
    if r.loss_compared_with and r.loss_compared_with != "reference" and (compared / STORE_FILE).exists():
        base, base_label = read_steps(compared, effective=True), "reference that skipped the same batches"
    else:
        base, base_label = reference, "reference (no fault)"
    if base is not None:
        ax.plot(base.step, base.loss, color="0.6", lw=3, label=base_label)
    top = _ceiling(every, reference)
    ax.plot(kept.step, kept.loss, color="tab:blue", lw=1.2, label="the run: kept trajectory")
    # Every step thrown away is drawn; a loss off the scale (a NaN, an overflow) sits on the top edge.
    ax.scatter(dropped.step, dropped.loss.fillna(top).clip(upper=top), marker="x", color="tab:red", s=22, zorder=3,
               label="the run: steps thrown away (off scale: top edge)")  # fmt: skip
    _mark_fault_and_recovery(ax, r, dropped)
    if r.recovered and r.recovered_step is None:
        # A slow rank leaves the loss alone: what changes is the step time, so draw that too.
        slow = ax.twinx()
        if reference is not None:
            slow.plot(reference.step, reference.step_time_s, color="tab:purple", lw=0.8, ls=":", label="reference step time")
        slow.plot(kept.step, kept.step_time_s, color="tab:purple", lw=1.2, label="the run's step time")
        slow.set_ylabel("step time (s)", color="tab:purple")
        slow.set_ylim(bottom=0)
        legend_on = slow  # drawn last, so its legend lies above both axes' lines
    else:
        legend_on = ax
    ax.set_ylim(top=top * 1.05)
    ax.set_title(f"{r.name}: {r.status.upper()}", color="tab:green" if r.status == "pass" else "tab:red", fontweight="bold")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles = [h for a in dict.fromkeys([ax, legend_on]) for h in a.get_legend_handles_labels()[0]]
    # Below the panel, never over it: a spike's points are exactly where an in-panel legend sits.
    legend_on.legend(handles=handles, fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def _mark_fault_and_recovery(ax, r: DrillResult, dropped: pd.DataFrame) -> None:
    """Vertical marks at the fault and its detection; the steps that ran again after the recovery shaded."""
    if r.fault_step is not None:
        ax.axvline(r.fault_step, color="tab:red", lw=1.5, label=f"fault (step {r.fault_step})")
    if r.detected and r.detection_step is not None:
        ax.axvline(
            r.detection_step + 0.3, color="tab:orange", lw=1.5, ls="--", label=f"detected: {r.detected_by} ({r.detection_latency_s:+.1f} s)"
        )
    if r.recovered_step is not None and len(dropped):
        # The recovery went back in steps (a rollback or a restart from a checkpoint): shade what ran again.
        end = int(dropped.step.max())
        ax.axvspan(
            r.recovered_step - 0.5,
            end + 0.5,
            color="tab:green",
            alpha=0.15,
            label=f"recovered: steps {r.recovered_step}-{end} ran again ({r.time_to_recover_s:.1f} s)",
        )
    elif r.recovered_step is not None:
        ax.axvline(
            r.recovered_step - 0.3,
            color="tab:green",
            lw=1.5,
            ls=":",
            label=f"recovered: step {r.recovered_step} ({r.time_to_recover_s:.1f} s)",
        )


def _ceiling(every, reference) -> float:
    """The top of a panel: the highest finite loss, run or reference, but at most 3x the start of training,
    so a 1e6 loss does not flatten the curves (higher points are drawn on the top edge)."""
    curves = [every.loss] + ([reference.loss] if reference is not None else [])
    finite = [c[c.abs() < float("inf")] for c in curves]  # NaN compares False too
    finite = [c for c in finite if len(c)]
    if not finite:
        return 1.0
    start = max(float(c.iloc[:5].max()) for c in finite)
    return min(max(float(c.max()) for c in finite), 3 * start)
