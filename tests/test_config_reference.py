"""docs/config.md is generated from the JobConfig dataclasses (keel.trainer.config_reference): it must be what
the generator writes today, hold every field, and give each one a description."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from conftest import REPO

from keel.trainer.config import JobConfig
from keel.trainer.config_reference import COMMAND, field_comments, render, sections

DOC = REPO / "docs" / "config.md"


def test_docs_config_md_is_what_the_generator_writes():
    assert DOC.read_text() == render(), f"docs/config.md is out of date with the config dataclasses; regenerate it: {COMMAND}"


def test_every_field_of_jobconfig_has_its_row():
    text = DOC.read_text()
    keys = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(JobConfig)
        for f in dataclasses.fields(section.default_factory().__class__)
    ]
    missing = [key for key in keys if f"| `{key}` |" not in text]
    assert not missing, f"docs/config.md lacks {missing}; regenerate it: {COMMAND}"
    # The hand-written table the README had left these out.
    for key in ("parallel.sequence_parallel", "parallel.loss_parallel", "metrics.rank_rows", "metrics.plan"):
        assert f"| `{key}` |" in text


def test_every_field_has_a_description():
    bare = [d.key for _, _, docs in sections() for d in docs if not d.description]
    assert not bare, f"give these fields a comment on their line in their section's dataclass (it is their description): {bare}"


def test_a_row_shows_the_type_the_choices_and_the_default():
    rows = {d.key: d for _, _, docs in sections() for d in docs}
    assert rows["parallel.pp_schedule"].type == "one of `GPipe`, `1F1B`, `Interleaved1F1B`"
    assert rows["parallel.pp_schedule"].default == '`"1F1B"`'
    assert rows["model.preset"].type.startswith("`str`: one of `tiny`, `small`, `1b`")
    assert rows["model.dim"].type == "`int`, or unset" and rows["model.dim"].default == "unset"
    assert rows["chaos.random_kinds"].default == '`["nan", "crash", "hang", "oom"]`'
    assert rows["checkpoint.interval_minutes"].default == "`30.0`"


def test_descriptions_come_from_the_comments_beside_and_above_a_field():
    @dataclasses.dataclass
    class Section:
        plain: int = 1  # on its own line
        # Above, on two
        # lines.
        above: int = 2
        # A note on the group.
        both: int = 3  # its own words
        bare: int = 4

    comments = field_comments(Section)
    assert comments["plain"] == "on its own line"
    assert comments["above"] == "Above, on two lines."
    assert comments["both"] == "its own words. A note on the group."
    assert comments["bare"] == ""


def test_the_generator_imports_no_torch():
    code = "import sys, keel.trainer.config_reference as m; m.render(); sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr or "keel.trainer.config_reference imported torch"
