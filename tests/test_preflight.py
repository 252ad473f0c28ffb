"""`keel preflight` as a user runs it: the job's processes under torchrun (gloo on CPU), a pass/fail
table, preflight.json, and exit codes 0 (all passed), 1 (a check failed), 2 (bad input, no worker started)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import keel

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


def table(stdout: str) -> dict[str, tuple[str, str]]:
    """{check: (RESULT, detail)} in the order printed; columns are separated by two spaces or more."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("keel preflight:"):
            break
        name, result, detail = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (result, detail)
    return rows


def number(pattern: str, text: str) -> float:
    return float(re.search(pattern, text).group(1))


def test_preflight_passes_for_a_pipeline_and_data_parallel_job(tmp_path):
    # Preflight's own options mixed with keel train's flags and a dotted override.
    proc = keel(
        "preflight", "--config=tiny", "--timeout=60", "--pp=2", "--dp=2", "--min-bandwidth-gbps=0.001", "--optim.lr=3e-3", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = table(proc.stdout)
    # A bandwidth row for each mesh dim larger than 1, and no other.
    assert list(rows) == ["ranks reachable", "bandwidth pp", "bandwidth dp", "checkpoint disk", "memory", "overfit"]
    assert all(result == "PASS" for result, _ in rows.values()), proc.stdout
    assert rows["ranks reachable"][1].startswith("4/4 ranks")
    for dim in ("pp", "dp"):
        detail = rows[f"bandwidth {dim}"][1]
        assert number(r"bus ([\d.e+-]+) GB/s", detail) > 0 and "over 2 ranks" in detail
        assert number(r"latency ([\d.e+-]+) ms", detail) > 0
    disk = rows["checkpoint disk"][1]
    assert number(r"write (\d+) MB/s", disk) > 0 and number(r"read (\d+) MB/s", disk) > 0
    memory = rows["memory"][1]
    assert 0 < number(r"need ([\d.]+) MB", memory) and "MemAvailable / 4 local ranks" in memory
    first, last = (float(x) for x in re.search(r"loss ([\d.]+) -> ([\d.]+) in 30 steps", rows["overfit"][1]).groups())
    assert last < 0.5 * first
    assert "all 6 checks passed" in proc.stdout
    # Without --run-dir it checks the disk where `keel train` would write, and leaves no half-made run there.
    assert not (tmp_path / "runs").exists()


def test_failing_checks_exit_1_name_the_checks_and_are_saved(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")  # a file where the checkpoints folder belongs (root can write anywhere else)
    # 1 PB/s: no link has it, so the bandwidth check must fail (its floor is enforced, not only printed).
    proc = keel("preflight", "--config", "tiny", "--dp", "2", "--run-dir", str(run_dir), "--memory-limit-bytes", "1000",
                "--min-bandwidth-gbps=1e6")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    rows = table(proc.stdout)
    assert {name: result for name, (result, _) in rows.items()} == {
        "ranks reachable": "PASS",
        "bandwidth dp": "FAIL",
        "checkpoint disk": "FAIL",
        "memory": "FAIL",
        "overfit": "SKIP",
    }
    assert "is a file, not a directory" in rows["checkpoint disk"][1]
    assert "but only 1 KB (--memory-limit-bytes" in rows["memory"][1]
    assert "(minimum 1e+06)" in rows["bandwidth dp"][1], rows["bandwidth dp"]
    assert "3 of 5 checks failed: bandwidth dp, checkpoint disk, memory" in proc.stdout

    saved = json.loads((run_dir / "preflight.json").read_text())
    assert saved["passed"] is False and saved["layout"]["dp"] == 2
    assert [(c["name"], c["result"]) for c in saved["checks"]] == [(n, r.lower()) for n, (r, _) in rows.items()]
    memory = next(c for c in saved["checks"] if c["name"] == "memory")["data"]
    assert memory["free_bytes"] == 1000 < memory["need_bytes"] == memory["state_bytes"] + memory["activation_bytes"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "preflight.json"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tp", "3"], ["parallel.tp=3", "choose tp from [1, 2, 4]"]),  # keel train's validation
        (["--overfit-steps", "1"], ["--overfit-steps=1", "at least 2"]),  # preflight's own
    ],
)
def test_bad_input_is_one_line_before_any_worker(tmp_path, args, expected):
    proc = keel("preflight", "--config", "tiny", *args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""  # the launcher announces the workers only once the input is good
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel preflight: error: "), proc.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    assert list(tmp_path.iterdir()) == []
