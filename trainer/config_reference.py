"""docs/config.md, generated from the JobConfig dataclasses so that it cannot drift from them.

    python -m keel.trainer.config_reference > docs/config.md

One table per section of JobConfig, one row per field: its dotted key, its type (a Literal's choices
spelled out), its default, and what it does. The description is read from the source with ast and
tokenize: the comment on the field's own line, followed by the comment block just above the field when
there is one (a block above a field with no comment of its own is that field's description). Comments
stay the single place a setting is explained: a new field with no comment shows up as a row without a
description, and tests/test_config_reference.py fails until it has one. No torch: it runs anywhere the
config loads.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
from typing import Any, Literal, get_args, get_origin, get_type_hints

from keel.trainer.config import JobConfig, _toml_value, preset_names
from keel.trainer.model_args import MODEL_PRESETS

COMMAND = "python -m keel.trainer.config_reference > docs/config.md"

# Where each section is explained at length (links relative to docs/).
SECTION_DOCS = {
    "model": "[training.md](training.md)",
    "data": "[data.md](data.md)",
    "training": "[training.md](training.md)",
    "optim": "[training.md](training.md)",
    "parallel": "[training.md](training.md)",
    "metrics": "[monitoring.md](monitoring.md), [planning.md](planning.md) (`plan`)",
    "monitor": "[monitoring.md](monitoring.md), [alerting.md](alerting.md)",
    "checkpoint": "[stability.md](stability.md#checkpoints-checkpoint)",
    "recovery": "[stability.md](stability.md#naninf-guard-and-rollback-recovery)",
    "spike": "[stability.md](stability.md#loss-spike-detector)",
    "watchdog": "[stability.md](stability.md#hang-watchdog-watchdog)",
    "stragglers": "[stability.md](stability.md#stragglers-stragglers)",
    "chaos": "[chaos.md](chaos.md)",
    "run": "[training.md](training.md)",
}

# Fields whose values are checked against a table rather than a Literal: their choices, read from that table.
CHOICES = {"model.preset": lambda: list(MODEL_PRESETS)}

_PRAGMAS = ("noqa", "type:", "fmt:", "pragma")


@dataclasses.dataclass
class FieldDoc:
    key: str  # section.field
    type: str
    default: str
    description: str


def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` -> its description, read from the comments of its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}  # line -> the comment after code on it
    whole: dict[int, str] = {}  # line -> a line that is only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if text.startswith(_PRAGMAS):
            continue
        line, col = tok.start
        (whole if not lines[line - 1][:col].strip() else trailing)[line] = text
    [node] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    comments = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        own = " ".join(trailing[line] for line in range(stmt.lineno, stmt.end_lineno + 1) if line in trailing)
        block, line = [], stmt.lineno - 1
        while line in whole:
            block.insert(0, whole[line])
            line -= 1
        above = " ".join(block)
        if own and above:
            own = own if own.endswith((".", ":")) else own + "."
        comments[stmt.target.id] = " ".join(part for part in (own, above) if part)
    return comments


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `int | None`, one of `"a"`, `"b"`."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if isinstance(annotation, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        shown = " or ".join(type_name(arg) for arg in inner)
        return shown + ", or unset" if len(inner) < len(get_args(annotation)) else shown
    if isinstance(annotation, type) and not get_args(annotation):
        return f"`{annotation.__name__}`"
    return f"`{annotation}`".replace("typing.", "")


def default_of(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return "unset" if value is None else f"`{_toml_value(value)}`"


def source_path(cls: type) -> str:
    """The file a section is declared in, as the repository names it (keel.monitor.detectors -> monitor/detectors.py)."""
    return cls.__module__.removeprefix("keel.").replace(".", "/") + ".py"


def sections() -> list[tuple[str, type, list[FieldDoc]]]:
    """(section name, its dataclass, its fields) in JobConfig's order."""
    out = []
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory().__class__
        hints, comments = get_type_hints(cls), field_comments(cls)
        docs = []
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            kind = type_name(hints[f.name])
            if key in CHOICES:
                kind += ": one of " + ", ".join(f"`{choice}`" for choice in CHOICES[key]())
            docs.append(FieldDoc(key, kind, default_of(f), comments.get(f.name, "")))
        out.append((section.name, cls, docs))
    return out


def _cell(text: str) -> str:
    """A comment as a Markdown table cell: a pipe would end the cell (inside code too); outside code, an
    asterisk could start emphasis and `<name>` would be taken for an HTML tag."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("*", "\\*").replace("<", "\\<")
    return "`".join(parts)


def render() -> str:
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from the dataclasses by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every setting of a job, generated from the `JobConfig` dataclasses (`trainer/config.py`; the `spike` and",
        "`stragglers` sections are the monitor's, `monitor/detectors.py` and `monitor/stragglers.py`) and the",
        "comments beside their fields, so it says what the code does: a field's comment is its description here.",
        "",
        "A job is a TOML file, or a preset shipped with Keel (" + ", ".join(f"`{name}`" for name in preset_names()) + "), whose",
        "`[section]` tables set `key = value`; then the command line's overrides, `--section.key=value`, and the",
        "short flags `--pp --dp --tp --steps --seed --run-dir`. A list is a TOML list, or `a;b` on the command line.",
        "An unknown section or key is an error that names the closest one, never ignored, and every value is checked",
        "against its type (a Literal's choices) before any worker starts. The run keeps what it ran with, secrets",
        "removed, in `RUN_DIR/config.toml`. How to run a job: [training.md](training.md).",
        "",
        "| section | fields |",
        "|---|---|",
    ]
    table = sections()
    for name, _, docs in table:
        out.append(f"| [`{name}`](#{name}) | " + ", ".join(d.key.split(".", 1)[1] for d in docs) + " |")
    for name, cls, docs in table:
        out += ["", f"## {name}", ""]
        where = f"`{cls.__name__}` in `{source_path(cls)}`"
        out.append(f"{where}; explained in {SECTION_DOCS[name]}." if name in SECTION_DOCS else f"{where}.")
        out += ["", "| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{d.key}` | {d.type} | {d.default} | {_cell(d.description)} |" for d in docs]
    return "\n".join(out) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
