"""The spawn path's commits: a run a spare takes at its spawn is created, queued and
started (its deadline and the spare's process record with it) in one fsynced commit, and
the spare gets its ``go`` only after that commit; the other starts take one more.

An in-process daemon (``serve``) with a real zygote and its spare, the real runner with the
scripted model, a real SQLite file (its COMMITs traced on the journal's connection).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.core._book import RunBook
from supervisor.core._run import Run
from supervisor.core.token import CancelToken
from supervisor.errors import JournalUnavailable
from supervisor.store.journal import Journal
from supervisor.trees import zygote as zygote_mod
from tests.supervisor.test_zygote import daemon, gated, wait_running_tool, zygote_state
from tests.supervisor.test_zygote_spare import spare_ready

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")


async def trace_commits(journal: Journal, seen: list[tuple[str, str]], *, writes_only: bool = False) -> None:
    """Every COMMIT on the journal's connection from now on, with its synchronous mode
    (``writes_only``: those of a transaction that changed a row, the ones that fsync)."""

    def on(store: Any) -> None:
        began = [0]

        def trace(sql: str) -> None:
            word = sql.strip().upper()
            if word.startswith("BEGIN"):
                began[0] = store._conn.total_changes
            elif word == "COMMIT" and not (writes_only and store._conn.total_changes == began[0]):
                seen.append(("commit", "FULL" if store.durable_mode else "NORMAL"))

        store._conn.set_trace_callback(trace)

    await journal._call(on)


def trace_go(monkeypatch: pytest.MonkeyPatch, seen: list[tuple[str, str]]) -> None:
    """Note ("go", spare pid) in ``seen`` as each spare is let go."""
    real_go = zygote_mod.Spare.go

    async def go(spare: zygote_mod.Spare, *args: Any, **kwargs: Any) -> Any:
        seen.append(("go", str(spare.pid)))
        return await real_go(spare, *args, **kwargs)

    monkeypatch.setattr(zygote_mod.Spare, "go", go)


async def test_a_run_a_spare_takes_is_created_and_started_in_one_fsynced_commit_before_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []
    trace_go(monkeypatch, seen)
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1, default_timeout_s=600) as m:
            await zygote_state(m)
            spare = await spare_ready(m)
            await trace_commits(m.journal, seen)
            r = await m.spawn(gated("echo by the spare"))
            assert r["state"] == "starting"  # started with its creation
            st = await m.wait_terminal(r["run_id"])
            events = await m.journal.events_after(r["run_id"])
    assert st["state"] == "completed" and st["pid"] == spare
    assert st["deadline"] == pytest.approx(st["started_at"] + 600) and st["started_at"] == st["created_at"]
    first_go = seen.index(("go", str(spare)))
    assert seen[:first_go] == [("commit", "FULL")]  # one commit, fsynced, before `go`
    assert [e["data"]["state"] for e in events if e["kind"] == "state"][:2] == ["queued", "starting"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))


async def test_a_sessions_turn_a_spare_takes_has_its_session_event_in_that_one_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's spec is prepared before its creation: its ``session`` event (the history it
    was given) is journaled in its creation's commit, right after ``starting``."""
    seen: list[tuple[str, str]] = []
    trace_go(monkeypatch, seen)
    turn = {"task": "t", "model": {"provider": "scripted", "script": {"final": "done"}}}
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1) as m:
            await zygote_state(m)
            first = await m.spawn(turn, session_id="chat")
            one = await m.wait_terminal(first["run_id"])
            spare = await spare_ready(m, other_than=one["pid"])
            del seen[:]  # the first turn's `go`
            await trace_commits(m.journal, seen, writes_only=True)  # not its history's read
            r = await m.spawn(turn, session_id="chat")
            st = await m.wait_terminal(r["run_id"])
            events = await m.journal.events_after(r["run_id"])
    assert st["state"] == "completed" and st["pid"] == spare
    first_go = seen.index(("go", str(spare)))
    assert seen[:first_go] == [("commit", "FULL")]  # its session's row was made by the first turn
    kinds = [(e["kind"], e["data"].get("state")) for e in events]
    assert kinds[:3] == [("state", "queued"), ("state", "starting"), ("session", None)], kinds
    assert events[2]["data"]["turns"] == 1 and events[2]["data"]["messages"] == 2


async def test_a_queued_run_a_spare_takes_later_is_started_in_one_fsynced_commit_before_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No place at its spawn (max_concurrent 1, taken): it is created and queued in one
    commit, then started with its spare's process record in one more, then let go."""
    seen: list[tuple[str, str]] = []
    trace_go(monkeypatch, seen)
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1, max_concurrent=1) as m:
            await zygote_state(m)
            first_spare = await spare_ready(m)
            first = await m.spawn(gated("sleep 60"))
            spare = await spare_ready(m, other_than=first_spare)
            # Until its command's group is journaled (its event follows the write; a commit
            # of its own, which a loaded machine let fall after the trace's start: the clean
            # CI run at c059c1c): from then on it writes nothing more meanwhile.
            await wait_running_tool(m, first["run_id"])
            seen.clear()
            await trace_commits(m.journal, seen)
            r = await m.spawn(gated("echo by the next spare"))
            assert r["state"] == "queued"
            seen.append(("spawned", ""))
            await m.cancel(first["run_id"])  # its place goes to the queued run
            await m.wait_terminal(first["run_id"])
            st = await m.wait_terminal(r["run_id"])
            run = await m.journal.get_run(r["run_id"])
    assert st["state"] == "completed" and st["pid"] == spare
    spawned, first_go = seen.index(("spawned", "")), seen.index(("go", str(spare)))
    assert seen[:spawned] == [("commit", "FULL")]
    # What the first run's end wrote meanwhile, then the start: its last commit before `go`.
    assert seen[first_go - 1] == ("commit", "FULL")
    assert run is not None and run["pid"] == spare


async def test_a_start_the_journal_cannot_take_whole_is_written_piece_by_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Degraded: the one-commit start fails as the store's condition; the start is then
    written as before (state, event, deadline, process record), nothing lost, in order."""
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        book = RunBook(journal)
        run = Run(run_id="r1", session_id=None, spec={}, timeout_s=30.0, token=CancelToken("r1"))
        await book.create(run, created_at=time.time())

        async def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise JournalUnavailable("journal: disk full (test)", path=journal.path)

        monkeypatch.setattr(Journal, "start_run", unavailable)
        assert await book.start(run, process={"pid": 4242, "tree_id": "t-1"})
        row = await journal.get_run("r1")
        events = await journal.events_after("r1")
    assert row is not None and (row["state"], row["pid"], row["tree_id"]) == ("starting", 4242, "t-1")
    assert row["deadline"] == run.deadline and run.deadline is not None
    assert run.deadline == pytest.approx(row["started_at"] + 30.0, abs=1.0)
    assert [(e["seq"], e["data"]["state"]) for e in events] == [(1, "queued"), (2, "starting")]
    assert run.state == "starting" and run.last_seq == 2
