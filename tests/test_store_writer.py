"""keel.monitor.store_writer against a real SQLite store whose write lock another connection holds, as a
backup or a second writer would: while the store keeps up each write is committed when its call returns;
a blocked store never keeps the caller more than `wait_s`, the writes wait in memory (or are dropped and
counted beyond the queue) and the stall is one `store_stalled` event; a row the store refuses still raises."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from keel.monitor.event_kinds import EventKind
from keel.monitor.store import RunStore, read_events, read_steps
from keel.monitor.store_writer import BackgroundStore

WAIT_S = 0.2


def row(step: int) -> dict:
    return {"step": step, "attempt": 0, "loss": 1.0 / step, "time": time.time()}


def hold_write_lock(store_path, seconds: float) -> threading.Thread:
    """Another connection takes the store's write lock and holds it for `seconds`; returns once it holds it."""
    taken = threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(store_path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        taken.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
        conn.close()

    thread = threading.Thread(target=hold)
    thread.start()
    taken.wait()
    return thread


def test_each_write_is_committed_when_its_call_returns(tmp_path):
    store = BackgroundStore(RunStore(tmp_path), wait_s=WAIT_S)
    for step in range(1, 4):
        store.write_step(row(step))
        assert read_steps(tmp_path).step.tolist() == list(range(1, step + 1))
    store.write_event(EventKind.NOTE, "written")
    assert read_events(tmp_path).message.tolist() == ["written"]
    store.close()


def test_a_locked_store_keeps_no_caller_waiting_and_its_stall_is_one_event(tmp_path):
    store = BackgroundStore(RunStore(tmp_path), wait_s=WAIT_S)
    store.write_step(row(1))
    holder = hold_write_lock(store.path, 2.0)
    started, wall = time.monotonic(), time.time()
    for step in range(2, 12):
        store.write_step(row(step))
        store.write_event(EventKind.NOTE, f"step {step}", step=step)
    assert time.monotonic() - started < WAIT_S + 0.5  # one write waited wait_s; the rest queued at once
    assert read_steps(tmp_path).step.tolist() == [1]
    holder.join()
    assert store.flush(timeout=30)
    assert read_steps(tmp_path).step.tolist() == list(range(1, 12))  # nothing lost, in order
    events = read_events(tmp_path)
    [stall] = events[events.kind == EventKind.STORE_STALLED].itertuples()
    assert stall.data["stalled_s"] >= 1.5 and stall.data["queued"] == 20 and stall.data["dropped"] == 0
    # Each event keeps the time it happened, not the time the store took it.
    notes = events[events.kind == EventKind.NOTE]
    assert (notes.time < wall + WAIT_S + 0.5).all()
    store.close()


def test_writes_beyond_the_queue_are_dropped_and_counted(tmp_path):
    store = BackgroundStore(RunStore(tmp_path), wait_s=WAIT_S, queue_size=3)
    holder = hold_write_lock(store.path, 1.5)
    for step in range(1, 11):
        store.write_step(row(step))
    holder.join()
    assert store.flush(timeout=30)
    kept = read_steps(tmp_path).step.tolist()
    [stall] = read_events(tmp_path).query("kind == 'store_stalled'").itertuples()
    assert len(kept) + stall.data["dropped"] == 10 and stall.data["dropped"] >= 6
    assert kept == sorted(kept) and kept[0] == 1
    store.close()


def test_a_row_the_store_refuses_raises_to_the_caller(tmp_path):
    store = BackgroundStore(RunStore(tmp_path), wait_s=WAIT_S)
    with pytest.raises(ValueError, match="does not belong to step"):
        store.write_step(row(1), [{"step": 2, "attempt": 0, "rank": 0}])
    store.close()
