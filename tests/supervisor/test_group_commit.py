"""A runner's events in the journal: what one read brought, one commit (group commit).

``Lifecycle.on_events`` stages the events of one read of the runner's output and
``RunBook.flush`` writes them in one transaction (``Journal.append_run_events``), then
sends them to watchers; before, each event cost two commits (its tool-call record's and
its own) and ~1 ms of the daemon's CPU.
"""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from subagent.events import BadLine, Event, EventKind
from supervisor.core._book import STAGED_MAX, RunBook
from supervisor.core._lifecycle import Lifecycle
from supervisor.core._run import Run
from supervisor.core.token import CancelToken
from supervisor.store.journal import EventWrite, Journal


class _Tree:
    """What ``on_event`` tells a run's tree of its process groups."""

    def __init__(self) -> None:
        self.groups: list[int] = []

    def add_group(self, pgid: int) -> None:
        self.groups.append(pgid)

    def set_interruptible(self, pgid: int, interruptible: bool) -> None:
        pass


class _Watcher:
    """A run's subscriber that checks, as each event reaches it, that another connection
    to the journal sees that event committed already."""

    def __init__(self, db: Path, run_id: str) -> None:
        self.db = db
        self.run_id = run_id
        self.got: list[dict[str, Any]] = []
        self.uncommitted: list[int] = []

    def send_nowait(self, msg: dict[str, Any]) -> None:
        conn = sqlite3.connect(self.db)
        try:
            (last,) = conn.execute(
                "SELECT coalesce(max(seq), 0) FROM events WHERE run_id = ?", (self.run_id,)
            ).fetchone()
        finally:
            conn.close()
        if last < msg["seq"]:
            self.uncommitted.append(msg["seq"])
        self.got.append(msg)


def _call(i: int, state: str) -> Event:
    record = {"id": f"c{i}", "name": "run_command", "arguments": "{}", "step": 1, "state": state}
    return Event(kind=EventKind.TOOL_CALL, ts=time.time(), data={"record": record})


async def _book_and_run(journal: Journal) -> tuple[RunBook, Run]:
    book = RunBook(journal)
    run = Run(run_id="r", session_id=None, spec={"task": "t"}, timeout_s=None, token=CancelToken("r"))
    await book.create(run, created_at=time.time())
    return book, run


async def test_a_reads_runner_events_are_journaled_in_a_commit_per_read_each_committed_before_a_watcher_sees_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "j.db"
    async with await Journal.open(db) as journal:
        book, run = await _book_and_run(journal)
        lifecycle = Lifecycle(None, book, None, None, cancel=None)  # type: ignore[arg-type]  # (events only)
        watcher = _Watcher(db, "r")
        run.subscribers.add(watcher)  # type: ignore[arg-type]  # (send_nowait only)
        tree = _Tree()
        n = 2 * STAGED_MAX + 10
        items: list[Event | BadLine] = [_call(i, "running") for i in range(n)]
        items[7:7] = [
            Event(kind=EventKind.PROCESS_GROUP, ts=time.time(), data={"pgid": 4242, "kind": "command", "name": "x"}),
            BadLine(text="not json", problem="bad line"),
            Event(kind=EventKind.PROCESS_GROUP, ts=time.time(), data={"pgid": 4242, "alive": False}),
        ]
        items.append(_call(0, "succeeded"))
        before = journal.commit_counts()
        await lifecycle.on_events(run, tree, items)  # type: ignore[arg-type]  # (a fake tree)
        commits, durable = (a - b for a, b in zip(journal.commit_counts(), before, strict=True))
        events = await journal.events_after("r", 1, limit=10_000)  # (after its `queued` event)
        calls = await journal.tool_calls("r")
        row = await journal.get_run("r")
    # One commit per STAGED_MAX events (two commits an event before): one of them FULL,
    # the one that holds the group's start, as `add_group` alone was.
    assert commits == math.ceil(len(items) / STAGED_MAX), commits
    assert durable == 1, durable
    # In the order read, numbered without gaps, each seen by the watcher once committed.
    assert [e["seq"] for e in events] == list(range(2, len(items) + 2))
    assert [e["kind"] for e in events] == [
        "stderr" if isinstance(i, BadLine) else str(i.kind)
        for i in items  # type: ignore[union-attr]
    ]
    assert watcher.uncommitted == []
    assert [m["seq"] for m in watcher.got] == [e["seq"] for e in events]
    assert [c["id"] for c in calls] == [f"c{i}" for i in range(n)]
    assert calls[0]["state"] == "succeeded" and {c["state"] for c in calls[1:]} == {"running"}
    assert row is not None and [(g["pgid"], g["alive"]) for g in row["groups"]] == [(4242, False)]
    assert tree.groups == [4242] and run.staged == []


async def test_a_quiet_runners_single_event_is_written_and_sent_at_once(tmp_path: Path) -> None:
    # No timer, no waiting for more: a read of one event is one commit, sent as it returns.
    db = tmp_path / "j.db"
    async with await Journal.open(db) as journal:
        book, run = await _book_and_run(journal)
        lifecycle = Lifecycle(None, book, None, None, cancel=None)  # type: ignore[arg-type]
        watcher = _Watcher(db, "r")
        run.subscribers.add(watcher)  # type: ignore[arg-type]
        before = journal.commit_counts()[0]
        await lifecycle.on_events(run, _Tree(), [_call(1, "running")])  # type: ignore[arg-type]
        assert journal.commit_counts()[0] - before == 1
        assert watcher.uncommitted == [] and [m["data"]["record"]["id"] for m in watcher.got] == ["c1"]


async def test_append_run_events_writes_all_or_nothing_in_one_commit_and_the_runs_row_once(tmp_path: Path) -> None:
    async with await Journal.open(tmp_path / "j.db") as journal:
        await journal.create_run("r", session_id=None, spec={"task": "t"}, created_at=time.time(), timeout_s=None)
        good = [
            EventWrite("tool_call", {"n": i}, time.time(), tool_call={"id": f"c{i}", "state": "running"})
            for i in range(5)
        ]
        bad = EventWrite("tool_call", {}, time.time(), tool_call={"id": "x", "state": "nonsense"})
        with pytest.raises(ValueError):
            await journal.append_run_events("r", [*good, bad])
        assert await journal.events_after("r") == [] and await journal.tool_calls("r") == []
        snaps = [{"_id": "r", "step": 1, "progress": p, "tool_calls": []} for p in ("p", "pq")]
        cps = [EventWrite("step_snapshot", snap, time.time(), checkpoint=snap) for snap in snaps]
        store = journal._worker.store
        assert store is not None
        before, changed = journal.commit_counts(), store.changes()
        seqs = await journal.append_run_events("r", [cps[0], *good, cps[1]])
        after, changed = journal.commit_counts(), store.changes() - changed
        row = await journal.get_run("r")
    assert seqs == [1, 2, 3, 4, 5, 6, 7]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)  # one commit, NORMAL (no group started)
    # 5 records, 7 events, the run's row once for its event counter and once for the last
    # checkpoint: the row (its checkpoint megabytes on a long run) was rewritten an event.
    assert changed == 5 + 7 + 1 + 1, changed
    assert row is not None and row["partial_snapshot"] == snaps[1]
