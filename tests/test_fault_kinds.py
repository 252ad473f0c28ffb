"""The fault kind registry (keel.chaos.kinds): docs/chaos.md's tables follow it row by row, every hook it
names exists, and a kind added through it alone is injected, drilled and reported by a real `keel drill`."""

from __future__ import annotations

import importlib
import itertools
import os
import re
from dataclasses import replace

import pytest
from conftest import REPO, drill

from keel.chaos.drill import DRILLS
from keel.chaos.faults import FaultPlan
from keel.chaos.kinds import KINDS, PLUGINS_ENV, POINTS, register

DOC = REPO / "docs" / "chaos.md"


def _table(header: str) -> list[list[str]]:
    """The rows of docs/chaos.md's table under `header`, as cells (an escaped `\\|` is not a border)."""
    lines = DOC.read_text().splitlines()
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(header) + 2 :])
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_table_of_kinds_follows_the_registry():
    """Every kind once, in the registry's order, with its fields and the events that detect and recover it."""
    rows = _table("| kind | what it does | fields | what catches it |")
    assert [name for row in rows for name in _ticked(row[0])] == list(KINDS)
    for names, _, fields, caught in rows:
        for kind in map(KINDS.get, _ticked(names)):
            assert {field.split("=")[0] for field in _ticked(fields)} == set(kind.takes) - {"rank"}, names
            assert set(kind.expect.detect + kind.expect.recover) <= set(_ticked(caught)), names


def test_the_table_of_drills_follows_the_registry():
    """Every drill once, in order, with its faults as the templates read, and what its kind expects."""
    rows = _table("| drill | faults | detected by | recovered by | loss compared with |")
    assert [row[0] for row in rows] == list(DRILLS)
    for name, faults, detected, recovered, loss in rows:
        d = DRILLS[name]
        assert [spec for spec in _ticked(faults) if "@" in spec] == [re.sub(r"[{}]", "", f) for f in d.faults], name
        assert (tuple(_ticked(detected)), tuple(_ticked(recovered))) == (d.expect.detect, d.expect.recover), name
        rtol = re.search(r"relative ([0-9.e-]+)", loss)
        assert (float(rtol[1]) if rtol else 0.0) == d.expect.rtol, name
        assert ("same" in loss, "bit-identical" in loss) == (d.expect.compare == "skip", d.expect.bit_identical), name


def test_every_hook_is_a_function_at_a_point_the_trainer_calls():
    assert all(callable(getattr(FaultPlan, point)) for point in POINTS)
    for name, kind in KINDS.items():
        module = importlib.import_module(kind.module)
        assert set(kind.hooks) <= set(POINTS) and all(callable(getattr(module, f, None)) for f in kind.hooks.values()), name


def test_register_refuses_a_name_taken_or_a_hook_at_no_point():
    with pytest.raises(ValueError, match="exists already"):
        register("crash", KINDS["crash"])
    with pytest.raises(ValueError, match=r"hooks at \['at_step_end'\]"):
        register("melt", replace(KINDS["crash"], hooks={"at_step_end": "crash"}))
    assert "melt" not in KINDS


@pytest.fixture
def mark_kind(monkeypatch) -> str:
    """The test-only kind `mark` (tests/fault_kind_plugin.py), added as a site adds one: named in
    KEEL_FAULT_KINDS and importable by every process the drill starts (they inherit both variables)."""
    monkeypatch.setenv(PLUGINS_ENV, "fault_kind_plugin")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
    return "mark"


@pytest.mark.slow
def test_a_kind_added_through_the_registry_alone_is_drilled_and_reported(tmp_path, mark_kind):
    """One drill of the kind's own (the reference and one run, a few steps): its hook ran in the worker,
    the drill saw its event, and the loss is the reference's bit for bit."""
    code, report, folder, output = drill(
        tmp_path / "job", "--config", "tiny", "--faults", mark_kind, "--drill-steps=8", "--fault-step=5", "--checkpoint-every=2"
    )
    [r] = report["results"]
    assert code == 0 and r["status"] == "pass", output[-3000:]
    assert r["faults"] == ["mark@step=5,rank=0"] and r["detected_by"] == "fault_injected" and r["loss_max_rel_diff"] == 0, r
    assert (folder / "runs" / "mark" / "marked-step5-rank0").exists()
    assert "| mark | PASS |" in (folder / "report.md").read_text()
