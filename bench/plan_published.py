"""Keel's planner against published training runs: each run's layout put through `keel plan`, its predicted
speed and memory beside the published ones, and where the planner ranks the run's split of its GPUs.

    python bench/plan_published.py

The runs, their sources and the tolerances: keel.trainer.planning.published; the calibrated compute
efficiency: keel.trainer.planning.efficiency (a row marked "calibrates" is one of its points, so its
speed matches by construction). docs/planning.md holds the table this prints.
"""

from __future__ import annotations

from keel.trainer.planning.published import RUNS, calibrated_curves, compare, rank_split


def main() -> None:
    print("calibration curves (efficiency.CURVES keeps them):")
    for name, points in calibrated_curves().items():
        print(f"  {name}: " + ", ".join(f"{p.params / 1e9:.1f}B {p.efficiency:.3f}" for p in points))
    print(f"\n{'run':<48} {'layout':<44} {'published':>10} {'Keel':>9} {'ratio':>6} {'target':>7}  "
          f"{'GiB pub.':>8} {'Keel':>6} {'ratio':>6} {'target':>7}  {'rank':>8} {'of best':>7} fits")  # fmt: skip
    for run in RUNS:
        c, place = compare(run), rank_split(run)
        target = (
            "cal."
            if run.calibrates
            else "bracket"
            if run.bracketed
            else "FP8"
            if run.speed_tolerance is None
            else f"±{run.speed_tolerance:.0%}"
        )
        speed = f"{run.speed:>10,.3g} {c.speed:>9,.3g} {c.speed_ratio:>6.2f} {target:>7}"
        memory = (f"{run.memory_gib:>8.1f} {c.memory_gib:>6.1f} {c.memory_ratio:>6.2f} {f'±{run.memory_tolerance:.0%}':>7}"
                  if run.memory_gib else f"{'':>8} {c.memory_gib:>6.1f} {'':>6} {'':>7}")  # fmt: skip
        print(
            f"{run.name:<48} {run.layout:<44} {speed}  {memory}  {f'{place.place}/{place.splits}':>8} {place.share_of_best:>7.0%} {'yes' if c.plan.fits else 'NO'}"
        )
        print(f"{'':<48} {c.plan.label()}; {run.unit}; efficiency {c.efficiency:.3f} ({run.curve}); {run.activations} activations")


if __name__ == "__main__":
    main()
