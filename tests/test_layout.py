"""The repository's shape as the design card fixes it: trainer/, monitor/, chaos/, dashboard/ at the top,
installed as keel.trainer, keel.monitor, ...; the dependency rule between them; and a regular (not
editable) install that works from the repository root and from elsewhere."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

COMPONENTS = ("trainer", "monitor", "chaos", "dashboard")
PYTHON_FOLDERS = (*COMPONENTS, "cli", "tests", "bench", "scripts")
IMPORT_CHECK = "import keel.cli, keel.trainer, keel.monitor, keel.chaos, keel.dashboard; print(keel.trainer.__file__)"


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name the file imports, anywhere in it (functions included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
    return names


def test_top_level_holds_the_components():
    for name in COMPONENTS:
        assert (REPO / name / "__init__.py").is_file(), f"{name}/ is not a top-level package folder"
    # A local keel/ folder would shadow the installed namespace package when Python runs from the root.
    assert not (REPO / "keel").exists()


def test_no_code_imports_the_bare_component_names():
    bare = [
        f"{path.relative_to(REPO)}:{line} imports '{name}'"
        for folder in PYTHON_FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, name in _imported_names(path)
        if name.split(".")[0] in (*COMPONENTS, "cli")
    ]
    assert not bare, "import keel.<component>, never the bare folder name:\n" + "\n".join(bare)


def test_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts: monitor imports neither trainer nor chaos, the fault
    injectors import no trainer, the dashboard only monitor, nothing imports the command line; inside the
    trainer, config, data, the planner and estimate import no torch, and its folders never import the loop."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """Keel built as a wheel and installed, without dependencies, into a folder of its own."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the sources: setuptools writes build/ and *.egg-info beside them.
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(out / "dist")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (out / "dist").glob("keel-*.whl")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(out / "site"), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return out


@pytest.mark.slow
def test_wheel_holds_the_keel_namespace_and_package_data(installed_wheel):
    (wheel,) = (installed_wheel / "dist").glob("keel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "keel/trainer/train.py",
        "keel/monitor/store.py",
        "keel/chaos/drill.py",
        "keel/dashboard/app.py",
        "keel/cli/__init__.py",
        "keel/trainer/presets/small.toml",
        "keel/monitor/alerting/keel-rules.yml",
    ):
        assert expected in names
    assert "keel/__init__.py" not in names  # a namespace package
    assert not any(n.split("/")[0] in (*COMPONENTS, "cli", "tests") for n in names), "bare top-level packages in the wheel"


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_regular_install_imports_and_runs_from_anywhere(installed_wheel, tmp_path, where):
    site = installed_wheel / "site"
    cwd = REPO if where == "repository root" else tmp_path
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}
    imported = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(site / "keel" / "trainer")), imported.stdout
    # The `keel` command, the presets (a config error is only found after the preset loaded) and the alert rules.
    command = subprocess.run(
        [str(site / "bin" / "keel"), "train", "--config", "tiny", "--dp", "3"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert command.returncode == 2 and "training.global_batch_size=8 does not divide" in command.stderr, command.stderr
    rules = "from importlib import resources; print((resources.files('keel.monitor') / 'alerting' / 'keel-rules.yml').is_file())"
    assert subprocess.run([sys.executable, "-c", rules], cwd=cwd, env=env, capture_output=True, text=True).stdout.strip() == "True"


def test_the_modules_that_read_the_shared_drill_run_on_one_worker():
    """conftest.READ_THE_DRILL lists every test module whose tests or fixtures take the costly drill fixtures,
    so that the xdist scheduler keeps them on one worker and the drill runs once."""
    from conftest import READ_THE_DRILL, SHARED_ON_ONE_WORKER

    readers = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and {a.arg for a in node.args.args} & set(SHARED_ON_ONE_WORKER):
                readers.add(f"tests/{path.name}")
    assert readers == set(READ_THE_DRILL)
