"""The run store: a run's step metrics, per-rank metrics, events and metadata in RUN_DIR/run.sqlite.

The trainer writes it through `RunStore`, once per step on the hot path; the dashboard, drills, tests and
`keel metrics` read it with `read_steps`, `read_rank_steps`, `read_events` and `read_meta`, also while
a trainer is still writing; a reader that follows a live run reads only what was committed since its last
read with `read_appended`. The database is in WAL mode, so readers never block the writer and every
committed step survives the writer being killed.

Steps can repeat: a rollback or a restart runs the same step numbers again under a higher `attempt`.
All attempts are kept; `read_steps(run_dir, effective=True)` gives the trajectory that counts.

The metrics a user's own code reports under names of its choosing (keel.monitor.custom_metrics) sit in
a table of their own, `custom_metrics`, a row per step, attempt and name, written with their step row;
`read_custom_metrics` reads them, by the same rule for what counts.

A run on a blend of token sources (data.sources) records the tokens each step read from each source in
`data_tokens`, and its sources in the meta (`data_sources`); `read_data_sources` adds them up per source, by
the same rule.

pandas is imported by the readers only, when they first read: the writer is imported by every trainer
process, to which pandas would add 0.5 s of CPU at each start.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time as _time
from collections.abc import Iterable, Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.monitor import metric_registry
from keel.monitor.custom_metrics import CUSTOM_KEY
from keel.monitor.run_dir import STORE_FILE

if TYPE_CHECKING:
    import pandas as pd

SLOWEST_RANKS = 3  # the ranks a step row names in `slowest_ranks`


def _step_types() -> dict[str, type]:
    """The `steps` table's column -> Python type, in table order: its DDL, binding and readers' dtypes all
    come from here. Read from keel.monitor.metric_registry at each call, never at import (see there)."""
    return {m.column: m.dtype for m in metric_registry.STEP_METRICS}


def step_columns() -> tuple[str, ...]:
    """The `steps` table's columns, in table order."""
    return tuple(_step_types())


# Column -> Python type, in table order, as for the steps.
# Kept on sampled steps only unless the trainer is told otherwise (metrics.rank_rows): see keel.trainer.step_metrics.
_RANK_TYPES: dict[str, type] = {
    "step": int,
    "attempt": int,
    "rank": int,
    "step_time_s": float,
    "comm_time_s": float,  # NULL on steps where communication was not measured
    "data_time_s": float,
    "mem_peak_bytes": int,
}
_STEP_KEY = ("step", "attempt")
_RANK_KEY = ("step", "attempt", "rank")

RANK_COLUMNS: tuple[str, ...] = tuple(_RANK_TYPES)

# The user's own metrics, a row per name. Keyed by an id that is never reused (AUTOINCREMENT), not by
# (step, attempt, name): a step written again deletes its rows before writing its new ones, and a plain
# rowid would then hand a later row a rowid a reader following the run (read_appended) has passed already.
_CUSTOM_TYPES: dict[str, type] = {"step": int, "attempt": int, "name": str, "value": float}
CUSTOM_COLUMNS: tuple[str, ...] = tuple(_CUSTOM_TYPES)
_CUSTOM_TABLE = "custom_metrics"

# The tokens each step read from each source of a blend, by its index in the meta's `data_sources`.
_DATA_TOKEN_TYPES: dict[str, type] = {"step": int, "attempt": int, "source": int, "tokens": int}
_DATA_TOKEN_KEY = ("step", "attempt", "source")
_DATA_TOKEN_TABLE = "data_tokens"
DATA_SOURCES_META = "data_sources"  # the meta key of a blend's sources: [{source, weight, version, description}]


_SQL_TYPES = {int: "INTEGER", float: "REAL", str: "TEXT"}


def _table_ddl(table: str, types: dict[str, type], key: tuple[str, ...]) -> str:
    # SQLite lets primary key columns hold NULL unless told otherwise.
    columns = [f"{c} {_SQL_TYPES[t]}{' NOT NULL' if c in key else ''}" for c, t in types.items()]
    return f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)}, PRIMARY KEY ({', '.join(key)}))"


def _schema(step_types: dict[str, type]) -> str:
    return ";\n".join(
        [
            _table_ddl("steps", step_types, _STEP_KEY),
            _table_ddl("rank_steps", _RANK_TYPES, _RANK_KEY),
            "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL, step INTEGER,"
            " attempt INTEGER, rank INTEGER, kind TEXT, severity TEXT, message TEXT, data TEXT)",
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
            f"CREATE TABLE IF NOT EXISTS {_CUSTOM_TABLE} (id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL,"
            " attempt INTEGER NOT NULL, name TEXT NOT NULL, value REAL, UNIQUE (step, attempt, name))",
            _table_ddl(_DATA_TOKEN_TABLE, _DATA_TOKEN_TYPES, _DATA_TOKEN_KEY),
        ]
    )


def _insert_sql(table: str, columns: Iterable[str]) -> str:
    columns = list(columns)
    return f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_INSERT_RANK = _insert_sql("rank_steps", RANK_COLUMNS)
_EVENT_COLUMNS = ("time", "step", "attempt", "rank", "kind", "severity", "message", "data")
_INSERT_EVENT = _insert_sql("events", _EVENT_COLUMNS)
_INSERT_META = _insert_sql("meta", ("key", "value"))
_INSERT_CUSTOM = _insert_sql(_CUSTOM_TABLE, CUSTOM_COLUMNS)
_DELETE_CUSTOM = f"DELETE FROM {_CUSTOM_TABLE} WHERE step = ? AND attempt = ?"
_INSERT_DATA_TOKENS = _insert_sql(_DATA_TOKEN_TABLE, _DATA_TOKEN_TYPES)

# A writer waits this long for another writer (another rank writing an event) before giving up.
_LEAVE_WAL_WAIT_MS = 1000  # how long closing waits for a reader to finish before it leaves WAL mode
_BUSY_TIMEOUT_S = 10.0


def _row_values(table: str, types: dict[str, type], key: tuple[str, ...], row: Mapping[str, Any]) -> tuple:
    unknown = row.keys() - types.keys()
    if unknown:
        raise ValueError(f"unknown {table} column(s) {sorted(unknown)}; the columns are {', '.join(types)}")
    missing = [c for c in key if row.get(c) is None]
    if missing:
        raise ValueError(f"{table} row is missing {', '.join(missing)}")
    # int()/float() accept numpy and torch scalars, which sqlite3 cannot bind, and turn bools into 0/1.
    return tuple(None if (v := row.get(c)) is None else t(v) for c, t in types.items())


def _custom_values(key: tuple[int, int], custom: Any) -> list[tuple]:
    """The rows of a step's custom metrics ({name: number}); a NaN or None is stored as NULL."""
    if not isinstance(custom, Mapping):
        raise ValueError(f"the step row's {CUSTOM_KEY!r} is a {type(custom).__name__}: pass a dict of metric name -> number")
    rows = []
    for name, value in custom.items():
        try:
            number = None if value is None else float(value)  # numpy and torch scalars too, as for the step columns
        except (TypeError, ValueError):
            raise ValueError(f"custom metric {name!r} of step {key[0]} is {value!r}: pass a number") from None
        if not isinstance(name, str):
            raise ValueError(f"custom metric name {name!r} of step {key[0]} is not a string")
        rows.append((*key, name, None if number != number else number))
    return rows


def _json_default(value: Any) -> Any:
    # numpy and torch scalars carry .item(); anything else is kept readable rather than failing the write.
    return value.item() if hasattr(value, "item") else str(value)


def _create_store(path: Path, step_types: dict[str, type]) -> None:
    """A new store, its tables made under a temporary name and renamed into place: a reader that finds
    the store (the dashboard, a test polling a starting run) never sees it without its tables."""
    tmp = path.with_name(f"{path.name}.tmp")
    with closing(sqlite3.connect(tmp)) as conn:
        conn.executescript(_schema(step_types))
    os.replace(tmp, path)


def _add_missing_columns(conn: sqlite3.Connection, step_types: dict[str, type]) -> None:
    """A store written by an earlier Keel (a run resumed after an upgrade) gets the columns added since,
    NULL in its earlier rows."""
    for table, types in (("steps", step_types), ("rank_steps", _RANK_TYPES)):
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column in types.keys() - present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {_SQL_TYPES[types[column]]}")


class RunStore:
    """Writer for one run's store. Create it once per process and reuse it; safe to share between threads."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / STORE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Built once: write_step is on the hot path.
        self._step_types = _step_types()
        self._insert_step = _insert_sql("steps", self._step_types)
        if not self.path.exists():
            _create_store(self.path, self._step_types)
        # Our lock, not sqlite's, keeps one thread's transaction from taking in another thread's rows.
        self._conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL skips the fsync per commit; a committed step still survives the process being
        # killed, and only an OS crash or power loss can take back the last few.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_schema(self._step_types))
        _add_missing_columns(self._conn, self._step_types)

    def write_step(self, step: Mapping[str, Any], rank_rows: Iterable[Mapping[str, Any]] = ()) -> None:
        """Write one step's row and its per-rank rows in one committed transaction.

        Keys are column names from step_columns() / RANK_COLUMNS; `step` and `attempt` are required, a
        missing optional key is stored as NULL. Rank rows take `step` and `attempt` from the step row.
        The step row's CUSTOM_KEY, when present, holds the user's own metrics ({name: number}, names
        checked by the caller: keel.monitor.custom_metrics), written in the same transaction.
        Writing the same (step, attempt) again replaces it, its custom metrics included.
        """
        custom = step.get(CUSTOM_KEY) or {}
        if CUSTOM_KEY in step:
            step = {c: v for c, v in step.items() if c != CUSTOM_KEY}
        step_values = _row_values("steps", self._step_types, _STEP_KEY, step)
        key = {"step": step_values[0], "attempt": step_values[1]}
        custom_values = _custom_values(step_values[:2], custom)
        rank_values = []
        for row in rank_rows:
            if any(c in row and row[c] != v for c, v in key.items()):
                raise ValueError(f"rank row {dict(row)} does not belong to step {key}")
            rank_values.append(_row_values("rank_steps", _RANK_TYPES, _RANK_KEY, {**row, **key}))
        with self._lock, self._conn:
            self._conn.execute(self._insert_step, step_values)
            self._conn.executemany(_INSERT_RANK, rank_values)
            # A step written again keeps none of the names it had before.
            self._conn.execute(_DELETE_CUSTOM, step_values[:2])
            self._conn.executemany(_INSERT_CUSTOM, custom_values)

    def write_event(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        step: int | None = None,
        attempt: int | None = None,
        rank: int | None = None,
        data: Mapping[str, Any] | None = None,
        time: float | None = None,
    ) -> None:
        """Record an event (alert, rollback, checkpoint_saved, hang, ...). `time` defaults to now."""
        values = (
            _time.time() if time is None else time,
            step,
            attempt,
            rank,
            kind,
            severity,
            message,
            json.dumps(dict(data or {}), default=_json_default),
        )
        with self._lock, self._conn:
            self._conn.execute(_INSERT_EVENT, values)

    def write_data_tokens(self, step: int, attempt: int, tokens: Iterable[int]) -> None:
        """The tokens step `step` of `attempt` read from each source of the run's blend, in the order of the
        meta's `data_sources`. Written again for the same step and attempt (the step run again after an
        out-of-memory), they replace the earlier ones."""
        rows = [(int(step), int(attempt), source, int(n)) for source, n in enumerate(tokens)]
        with self._lock, self._conn:
            self._conn.executemany(_INSERT_DATA_TOKENS, rows)

    def set_meta(self, key: str, value: Any) -> None:
        """Store one piece of run metadata (run_id, resolved config, MFU basis, ...) as JSON."""
        encoded = json.dumps(value, default=_json_default)
        with self._lock, self._conn:
            self._conn.execute(_INSERT_META, (key, encoded))

    def flush(self) -> bool:
        """Nothing to wait for: each write is committed when it returns (see keel.monitor.store_writer)."""
        return True

    def close(self) -> None:
        """Closes the writer, leaving WAL mode first: a finished store is then one self-contained file.
        Readers open the store read-only, and a read-only connection can neither check a WAL back into the
        database nor delete it, so each read of a store still in WAL mode would leave run.sqlite-wal and
        -shm behind. If a reader is connected just now the store stays in WAL mode (it is read the same)."""
        with self._lock:
            try:
                self._conn.execute(f"PRAGMA busy_timeout={_LEAVE_WAL_WAIT_MS}")
                self._conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError:
                pass
            self._conn.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _connect_read_only(run_dir: str | Path) -> sqlite3.Connection:
    path = Path(run_dir) / STORE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no run store at {path}: pass a run directory written by `keel train`")
    # mode=ro: a reader can neither create a store nor write to the one a trainer is writing.
    mode = "mode=ro"
    if not os.access(path.parent, os.W_OK) and not path.with_name(f"{STORE_FILE}-shm").exists():
        # A folder this reader cannot write (another user's run, a read-only mount) and no writer's WAL
        # index in it: SQLite cannot create that index, so it would refuse a WAL store. With no index no
        # writer is active, and the file can be read as immutable.
        mode = "immutable=1"
    return sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True, timeout=_BUSY_TIMEOUT_S)


def _frame(conn: sqlite3.Connection, sql: str, params: tuple | dict = ()) -> pd.DataFrame:
    # Plain sqlite3 rather than pd.read_sql_query, so that errors stay sqlite3.Error for callers.
    import pandas as pd

    cursor = conn.execute(sql, params)
    return pd.DataFrame(cursor.fetchall(), columns=[d[0] for d in cursor.description])


def _query(run_dir: str | Path, sql: str, params: tuple | dict = ()) -> pd.DataFrame:
    with closing(_connect_read_only(run_dir)) as conn:
        return _frame(conn, sql, params)


def _typed(df: pd.DataFrame, types: dict[str, type], key: tuple[str, ...]) -> pd.DataFrame:
    # Fixed dtypes, also for an empty table: key columns are never NULL, other integers may be (pandas Int64).
    # SQLite stores a NaN as NULL, so a non-finite float reads back as NaN either way.
    # A store written by an earlier Keel may lack the newer columns: they read as missing values.
    dtypes = {c: "int64" if c in key else "Int64" if t is int else "float64" if t is float else "object" for c, t in types.items()}
    return df.reindex(columns=list(types)).astype(dtypes)


def _read_table(run_dir: str | Path, sql: str, types: dict[str, type], key: tuple[str, ...], params: tuple = ()) -> pd.DataFrame:
    return _typed(_query(run_dir, sql, params), types, key)


# A rollback or restart that runs step s again under a later attempt abandons every earlier attempt's
# rows from step s on, including steps the new attempt has not reached yet. So a row counts when no
# later attempt started at or before its step.
_CUTOFFS = """
WITH starts AS (SELECT attempt, MIN(step) AS first_step FROM steps GROUP BY attempt),
     cutoffs AS (SELECT attempt, MIN(first_step) OVER (ORDER BY attempt DESC
                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS next_start FROM starts)
"""
_EFFECTIVE_STEPS = f"""{_CUTOFFS}
SELECT steps.* FROM steps JOIN cutoffs USING (attempt)
WHERE (next_start IS NULL OR step < next_start) AND step BETWEEN ? AND ?
ORDER BY step, attempt
"""
_ALL_STEPS = "SELECT * FROM steps WHERE step BETWEEN ? AND ? ORDER BY step, attempt"
_EVERY_STEP = (-(2**63), 2**63 - 1)


def read_steps(run_dir: str | Path, *, effective: bool = False, steps: tuple[int, int] = _EVERY_STEP) -> pd.DataFrame:
    """Step metrics ordered by (step, attempt), one column per step_columns(); only the steps in the
    inclusive range `steps` when given.

    effective=True keeps the trajectory that counts: the last attempt of each step, without the rows
    an attempt left behind when a later one rolled back or restarted before them.
    """
    sql = _EFFECTIVE_STEPS if effective else _ALL_STEPS
    return _read_table(run_dir, sql, _step_types(), _STEP_KEY, (int(steps[0]), int(steps[1])))


_CUSTOM_SELECT = f"SELECT {', '.join(CUSTOM_COLUMNS)} FROM {_CUSTOM_TABLE}"
# The attempts' starts come from the step rows, not the custom ones: a later attempt abandons the custom
# rows from its first step on even when it has reported no custom metric yet.
_EFFECTIVE_CUSTOM = f"""{_CUTOFFS}
{_CUSTOM_SELECT} JOIN cutoffs USING (attempt) WHERE next_start IS NULL OR step < next_start ORDER BY step, attempt, name
"""
_ALL_CUSTOM = f"{_CUSTOM_SELECT} ORDER BY step, attempt, name"


def read_custom_metrics(run_dir: str | Path, *, effective: bool = False) -> pd.DataFrame:
    """The user's own metrics (keel.monitor.custom_metrics), a row per step, attempt and name, ordered so;
    columns CUSTOM_COLUMNS: step, attempt, name, value (NaN where the value was NaN or None). Empty for
    a store written before they existed.

    effective=True keeps the rows of the trajectory that counts, by the rule of read_steps(effective=True).
    """
    with closing(_connect_read_only(run_dir)) as conn:
        found = _has_table(conn, _CUSTOM_TABLE)
        df = _frame(conn, _EFFECTIVE_CUSTOM if effective else _ALL_CUSTOM) if found else None
    return _typed_custom(df)


def _typed_custom(df: pd.DataFrame | None) -> pd.DataFrame:
    """Custom metric rows with their dtypes; None (no table) as no rows."""
    if df is None:
        import pandas as pd

        df = pd.DataFrame()
    return _typed(df, _CUSTOM_TYPES, _STEP_KEY)  # step and attempt are never NULL


# Only the rows of steps that were recorded: a step that died before its row leaves its data row behind.
_EFFECTIVE_DATA_TOKENS = f"""{_CUTOFFS}
SELECT source, SUM({_DATA_TOKEN_TABLE}.tokens) AS tokens FROM {_DATA_TOKEN_TABLE} JOIN steps USING (step, attempt) JOIN cutoffs USING (attempt)
WHERE next_start IS NULL OR step < next_start GROUP BY source
"""


def read_data_sources(run_dir: str | Path) -> pd.DataFrame:
    """The sources of a run on a blend (data.sources), a row each in the blend's order: source (as the config
    names it), weight (normalized), version, tokens and share. `tokens` are those the run's steps read from
    the source, counted by the rule of read_steps(effective=True) (the steps that count, each once), so the
    sources' tokens add up to the last step's `tokens`; `share` is their fraction. No rows for a run of one
    source (data.source) or a store written before blends."""
    import pandas as pd

    with closing(_connect_read_only(run_dir)) as conn:
        found = conn.execute("SELECT value FROM meta WHERE key = ?", (DATA_SOURCES_META,)).fetchone()
        counted = dict(conn.execute(_EFFECTIVE_DATA_TOKENS).fetchall()) if found and _has_table(conn, _DATA_TOKEN_TABLE) else {}
    sources = pd.DataFrame(json.loads(found[0]) if found else [], columns=["source", "weight", "version"])
    sources["tokens"] = [int(counted.get(i, 0)) for i in range(len(sources))]
    total = sources["tokens"].sum()
    sources["share"] = sources["tokens"] / total if total else 0.0
    return sources.astype({"weight": "float64", "tokens": "int64", "share": "float64"})


def _has_table(conn: sqlite3.Connection, table: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


def read_attempt_starts(run_dir: str | Path) -> pd.Series:
    """Each attempt's first step over the whole run (index: attempt), for `abandoned_mask` on a step range."""
    df = _query(run_dir, "SELECT attempt, MIN(step) AS first_step FROM steps GROUP BY attempt ORDER BY attempt")
    return df.set_index("attempt").first_step.astype("int64")


def abandoned_mask(steps: pd.DataFrame, attempt_starts: pd.Series | None = None) -> pd.Series:
    """True for the step rows a later attempt abandoned: the rule of read_steps(effective=True), in pandas.

    A row of attempt a is abandoned when some later attempt started at or before its step, which also
    covers rows past the point the later attempt has reached so far. `attempt_starts` (from
    read_attempt_starts) is needed when `steps` holds only part of the run, such as a step range.
    """
    if "step" not in steps or "attempt" not in steps or steps.empty:
        import pandas as pd  # loaded already: `steps` is a DataFrame

        return pd.Series(False, index=steps.index)
    first_step = (steps.groupby("attempt")["step"].min() if attempt_starts is None else attempt_starts).sort_index()
    # Minimum first step over the attempts after each one; NaN for the last attempt.
    next_start = first_step[::-1].cummin()[::-1].shift(-1)
    return steps["step"] >= steps["attempt"].map(next_start)


def read_rank_steps(run_dir: str | Path) -> pd.DataFrame:
    """Per-rank step metrics ordered by (step, attempt, rank), one column per RANK_COLUMNS."""
    sql = "SELECT * FROM rank_steps ORDER BY step, attempt, rank"
    return _read_table(run_dir, sql, _RANK_TYPES, _RANK_KEY)


def store_version(run_dir: str | Path) -> tuple[int, ...]:
    """A key that changes whenever a writer commits: the size and modification time of the store and of
    its write-ahead log. Readers that cache what they read key it on this."""
    path = Path(run_dir) / STORE_FILE
    version = []
    for file in (path, path.with_name(f"{STORE_FILE}-wal")):
        try:
            stat = file.stat()
        except FileNotFoundError:
            stat = None
        # An empty log is no log: readers create one on opening and remove it on closing.
        version += [stat.st_size, stat.st_mtime_ns] if stat and stat.st_size else [0, 0]
    return tuple(version)


def step_bounds(run_dir: str | Path) -> tuple[int, int] | None:
    """The first and last step recorded (any attempt), or None before the first step."""
    with closing(_connect_read_only(run_dir)) as conn:
        first, last = conn.execute("SELECT MIN(step), MAX(step) FROM steps").fetchone()
    return None if first is None else (first, last)


def last_event(run_dir: str | Path, kinds: Iterable[str]) -> tuple[str, dict] | None:
    """The kind and data of the newest event of one of `kinds`, or None: read without pandas, for the
    launcher's last look at a run (importing pandas would cost every `keel train` half a second)."""
    kinds = list(kinds)
    sql = f"SELECT kind, data FROM events WHERE kind IN ({', '.join('?' * len(kinds))}) ORDER BY id DESC LIMIT 1"
    with closing(_connect_read_only(run_dir)) as conn:
        row = conn.execute(sql, kinds).fetchone()
    return None if row is None else (row[0], json.loads(row[1]))


# Bin b holds the steps s with (s - origin) / width == b (SQLite's integer division).
_RANK_BINS = """
SELECT rank, MIN(step) AS first_step, MAX(step) AS last_step, AVG(step_time_s) AS step_time_s,
       AVG(comm_time_s) AS comm_time_s, AVG(step_time_s - comm_time_s) AS busy_time_s,
       MAX(mem_peak_bytes) AS mem_peak_bytes, COUNT(*) AS rows
FROM rank_steps WHERE step BETWEEN :lo AND :hi
GROUP BY rank, (step - :origin) / :width
ORDER BY rank, first_step
"""


def read_rank_bins(run_dir: str | Path, steps: tuple[int, int], width: int, origin: int | None = None) -> pd.DataFrame:
    """Per-rank step metrics over the inclusive step range `steps` in bins of `width` steps counted from
    `origin` (by default the range's first step; never after it): a heatmap's columns, summed up in
    SQLite so that a long run is never loaded row by row. Per rank and bin: the first and last step, the
    mean step, communication and busy (step minus communication) time, the peak memory, and the number
    of rows (all attempts). A bin's figures do not depend on the range beyond it, so a reader can read
    again only the bins that new rows fall in (`origin` set to the first range's start)."""
    origin = steps[0] if origin is None else origin
    if width < 1 or origin > steps[0]:
        raise ValueError(f"width={width}, origin={origin}: the width must be at least 1, the origin at most {steps[0]}")
    df = _query(run_dir, _RANK_BINS, {"lo": int(steps[0]), "hi": int(steps[1]), "origin": int(origin), "width": int(width)})
    dtypes = {"rank": "int64", "first_step": "int64", "last_step": "int64", "rows": "int64", "mem_peak_bytes": "Int64"}
    return df.astype(dtypes | {c: "float64" for c in ("step_time_s", "comm_time_s", "busy_time_s")})


def read_events(run_dir: str | Path) -> pd.DataFrame:
    """Events in the order they were written; the `data` column holds dicts."""
    return _typed_events(_query(run_dir, "SELECT * FROM events ORDER BY id"))


def _typed_events(df: pd.DataFrame) -> pd.DataFrame:
    df = df.astype({"id": "int64", "time": "float64", "step": "Int64", "attempt": "Int64", "rank": "Int64"})
    df["data"] = df["data"].map(json.loads)
    return df


@dataclass(frozen=True)
class StoreMark:
    """Where a reader of a store left off: the last rowid it saw in each table, and the store it read.
    SQLite gives a new row the highest rowid yet and writers commit one at a time, so what was committed
    since is exactly the rows past the mark; a row written again (INSERT OR REPLACE) is deleted and
    inserted anew, so it is past the mark too."""

    steps: int = 0
    rank_steps: int = 0
    events: int = 0
    custom_metrics: int = 0  # its ids (0 while a store written before custom metrics has no such table)
    # The store read: its file, and (step, attempt, time) of its first step row. A store made anew in the
    # folder may get the deleted one's inode, not its first step's time.
    file: tuple[int, int] = (0, 0)
    first_step: tuple | None = None


@dataclass(frozen=True)
class Appended:
    """What `read_appended` found committed since a mark."""

    fresh: bool  # read from the start (no mark, or not this store's): whatever was read before is void
    steps: pd.DataFrame  # as read_steps; a step row written again comes again, to replace the one read before
    events: pd.DataFrame  # as read_events
    first_rank_step: int | None  # the lowest step of the rank rows written since the mark; None: none were
    mark: StoreMark  # where this read left off
    # As read_custom_metrics. A step written again comes again in `steps` with its custom rows as they are
    # now: those read before for that (step, attempt) are void, even when none come.
    custom: pd.DataFrame


_TABLES = ("steps", "rank_steps", "events", _CUSTOM_TABLE)
# The last id handed out, not the highest id left: deleting a step's custom rows (the step written again)
# must not move the mark back, which would read as another store.
_END = {_CUSTOM_TABLE: f"SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name = '{_CUSTOM_TABLE}'"}


def read_appended(run_dir: str | Path, since: StoreMark | None = None) -> Appended:
    """The rows committed to a store since `since` (from a previous read_appended), read in one
    snapshot, so that a reader following a live run reads each row once rather than the whole run at
    every refresh. Without a mark, or with one from another store, the whole store (fresh=True)."""
    path = Path(run_dir) / STORE_FILE
    file = _file_id(path)
    with closing(_connect_read_only(run_dir)) as conn:
        conn.execute("BEGIN")  # one snapshot for every table
        tables = _TABLES if _has_table(conn, _CUSTOM_TABLE) else _TABLES[:-1]
        ends = [conn.execute(_END.get(t, f"SELECT COALESCE(MAX(rowid), 0) FROM {t}")).fetchone()[0] for t in tables]
        mark = StoreMark(*ends, file=file, first_step=conn.execute(_FIRST_STEP).fetchone())
        fresh = since is None or not _grown_from(since, mark)
        since = StoreMark() if fresh else since
        spans = dict(zip(tables, zip((since.steps, since.rank_steps, since.events, since.custom_metrics), ends)))
        steps = _frame(conn, "SELECT * FROM steps WHERE rowid > ? AND rowid <= ? ORDER BY step, attempt", spans["steps"])
        events = _frame(conn, "SELECT * FROM events WHERE id > ? AND id <= ? ORDER BY id", spans["events"])
        # NOT INDEXED: by rowid, not by scanning the step index until a new row turns up.
        sql = "SELECT MIN(step) FROM rank_steps NOT INDEXED WHERE rowid > ? AND rowid <= ?"
        first_rank_step = conn.execute(sql, spans["rank_steps"]).fetchone()[0]
        sql = f"{_CUSTOM_SELECT} WHERE id > ? AND id <= ? ORDER BY step, attempt, name"
        custom = _frame(conn, sql, spans[_CUSTOM_TABLE]) if _CUSTOM_TABLE in spans else None
    if _file_id(path) != file:  # a store made anew while this one was read: read that one
        return read_appended(run_dir)
    steps, events = _typed(steps, _step_types(), _STEP_KEY), _typed_events(events)
    return Appended(fresh, steps, events, first_rank_step, mark, _typed_custom(custom))


_FIRST_STEP = "SELECT step, attempt, time FROM steps ORDER BY rowid LIMIT 1"


def _grown_from(before: StoreMark, now: StoreMark) -> bool:
    """Whether the store read now is the one read before, grown by appending only."""
    same = before.file == now.file and before.first_step in (None, now.first_step)
    grown = now.steps >= before.steps and now.rank_steps >= before.rank_steps and now.events >= before.events
    return same and grown and now.custom_metrics >= before.custom_metrics


def _file_id(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """Run metadata as a dict of decoded values."""
    with closing(_connect_read_only(run_dir)) as conn:
        return {key: json.loads(value) for key, value in conn.execute("SELECT key, value FROM meta")}
