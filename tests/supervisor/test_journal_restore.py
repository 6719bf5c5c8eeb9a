"""A journal file removed or replaced under an open journal is put back at its path
(``supervisor.store._restore``), on real SQLite files in tmp_path."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.errors import JournalUnavailable
from supervisor.store import _restore
from supervisor.store import journal as journal_module
from supervisor.store.journal import Journal
from tests.conftest import mounted_tmpfs
from tests.supervisor.real_daemon import Client, Daemon, real_daemon
from tests.supervisor.test_fault_isolation import (
    fill,
    journal_state,
    running_pair,
    small_tmpfs,
    spec,
    stop_and_check,
    until,
)
from tests.supervisor.test_journal import new_run

__all__ = ["small_tmpfs"]  # a fixture, used by name


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "agentd.sqlite3"


@pytest.fixture
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker looks at its file (and tries a failed restore again) every 50 ms."""
    monkeypatch.setattr(journal_module, "CHECK_S", 0.05)


def stored(path: Path, table: str = "runs", column: str = "id") -> list[str]:
    """What a reader opening ``path`` (as a restarted daemon would) finds."""
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute(f"SELECT {column} FROM {table} ORDER BY {column}")]
    finally:
        conn.close()


def remove(db: Path, *, side_files: bool = True) -> None:
    for suffix in ("", "-wal", "-shm") if side_files else ("",):
        Path(f"{db}{suffix}").unlink()


async def retried(call: Callable[[], Awaitable[object]], timeout_s: float = 5.0) -> None:
    """``call`` until it is not ``JournalUnavailable`` (a failed restore is tried again
    after CHECK_S), with a deadline."""
    with trio.fail_after(timeout_s):
        while True:
            try:
                await call()
                return
            except JournalUnavailable:
                await trio.sleep(0.05)


async def wait_restored(j: Journal, timeout_s: float = 5.0) -> None:
    """The worker looks every CHECK_S when idle: poll for its work, with a deadline."""
    with trio.fail_after(timeout_s):
        while not j.restorations:
            await trio.sleep(0.02)


@pytest.mark.parametrize("how", ["removed", "main file removed", "replaced by a journal", "replaced by garbage"])
async def test_a_journal_removed_or_replaced_under_it_is_put_back_with_everything_in_it(db: Path, how: str) -> None:
    # It used to go on writing to the unlinked file (a restart found none of it), then to
    # fail every call, status included, until a restart that found no journal at all.
    async with await Journal.open(db) as j:
        await new_run(j, "r1")
        await j.append_event("r1", "note", {"n": 1})
        before = j.commit_counts()[0]
        remove(db, side_files=how != "main file removed")
        if how == "replaced by a journal":
            async with await Journal.open(db) as other:
                await new_run(other, "r-other")
        elif how == "replaced by garbage":
            db.write_bytes(b"not a journal" * 100)
        await new_run(j, "r2")  # accepted, and written where a restart will read it
        assert (await j.get_run("r1")) is not None
        restored = j.restorations
        assert len(restored) == 1, restored
        assert restored[0]["found"] == ("missing" if how in ("removed", "main file removed") else "another file")
        kept = restored[0]["kept_aside"]
        await j.append_event("r2", "note", {"n": 2})
        assert j.commit_counts()[0] >= before + 2  # status's counts go on across the restore
    assert stored(db) == ["r1", "r2"]
    assert sorted(stored(db, "events", "run_id")) == ["r1", "r2"]
    if how == "replaced by a journal":
        assert kept is not None and stored(Path(kept)) == ["r-other"]  # kept, whole
    elif how == "replaced by garbage":
        assert kept is not None and Path(kept).read_bytes() == b"not a journal" * 100
    else:
        assert kept is None
    assert not list(db.parent.glob("*.restoring*"))
    async with await Journal.open(db) as j:  # a restart reads it all
        assert [e["kind"] for e in await j.events_after("r1")] == ["note"]
        assert j.restorations == []


async def test_a_write_the_removal_raced_is_in_the_journal_at_the_path_when_the_call_returns(db: Path) -> None:
    # The file goes after the worker's look before the write: the write lands in the
    # unlinked file, and its caller must not hear of it before it is at the path.
    async with await Journal.open(db) as j:
        await new_run(j, "r1")

        def remove_then_write(store: object) -> None:
            remove(db)
            store.create_run("r2", "s1", "{}", 1.0, None, None)  # type: ignore[attr-defined]

        await j._call(remove_then_write)
        assert stored(db) == ["r1", "r2"]


async def test_an_idle_journal_puts_its_file_back_without_a_call(db: Path, quick_checks: None) -> None:
    # Nothing written since the removal: a daemon killed now lost everything at its restart.
    async with await Journal.open(db) as j:
        await new_run(j, "r1")
        remove(db)
        await wait_restored(j)
        assert stored(db) == ["r1"]
        assert [r["found"] for r in j.restorations] == ["missing"]


async def test_a_restore_that_cannot_copy_fails_calls_as_unavailable_then_succeeds(
    tmp_path: Path, quick_checks: None
) -> None:
    # No room for the copy: nothing is said written that would be lost, and the journal
    # is put back once there is room.
    with mounted_tmpfs(tmp_path, 1) as mnt:
        db = mnt / "agentd.sqlite3"
        async with await Journal.open(db) as j:
            await new_run(j, "r1")
            remove(db)
            filler = mnt / "filler"
            fill(filler)
            with pytest.raises(JournalUnavailable, match="removed or replaced"):
                await new_run(j, "r2")
            assert not db.exists() and j.restorations == []
            assert (await j.get_run("r1")) is not None  # read meanwhile: status goes on
            filler.unlink()
            await retried(lambda: new_run(j, "r2"))  # as the daemon's backlog does
            assert stored(db) == ["r1", "r2"]
            assert [r["found"] for r in j.restorations] == ["missing"]


async def test_a_write_the_removal_raced_is_not_said_written_while_it_cannot_be_put_back(
    tmp_path: Path, quick_checks: None
) -> None:
    # Written to the removed file, which cannot be copied back (no room): its caller hears
    # "unavailable" (the daemon keeps it in memory and writes it again), not "written".
    with mounted_tmpfs(tmp_path, 1) as mnt:
        db = mnt / "agentd.sqlite3"
        async with await Journal.open(db) as j:
            await new_run(j, "r1")

            def write_then_remove(store: object) -> None:
                store.create_run("r2", "s1", "{}", 1.0, None, None)  # type: ignore[attr-defined]
                remove(db)
                fill(mnt / "filler")

            with pytest.raises(JournalUnavailable, match="removed or replaced"):
                await j._call(write_then_remove)
            (mnt / "filler").unlink()
            await wait_restored(j)
            assert stored(db) == ["r1", "r2"]  # what it had written is not lost either


async def test_a_copy_left_by_a_restore_a_daemon_did_not_finish_is_the_journal(db: Path) -> None:
    # Killed between moving the other file aside and putting the copy in its place.
    async with await Journal.open(db) as j:
        await new_run(j, "r1")
    os.rename(db, f"{db}.restoring")
    async with await Journal.open(db) as j:
        assert (await j.get_run("r1")) is not None
    assert not Path(f"{db}.restoring").exists()


def test_a_copy_that_may_be_incomplete_is_not_taken(db: Path) -> None:
    Path(f"{db}.restoring").write_bytes(b"half")
    Path(f"{db}.restoring-journal").write_bytes(b"hot")
    assert _restore.take_interrupted(str(db)) is False
    assert not db.exists()


async def test_a_daemon_whose_journal_is_replaced_puts_it_back_keeps_the_other_file_and_loses_nothing(
    tmp_path: Path,
) -> None:
    # A real daemon, a real websocket client. It used to refuse every call, status
    # included, until a restart; the restart found garbage where its journal had been.
    state = tmp_path / "state"
    path = state / "agentd.sqlite3"
    with trio.fail_after(60):
        async with real_daemon(state) as d:
            a, b = await replace_under(d, path)
            d.proc.kill()  # what it said was written is at the path: a crash loses none of it
            await d.proc.wait()
        async with real_daemon(state) as d, d.connect() as c:
            for run in (a, b):
                assert (await c.ok("status", run_id=run))["state"] == "cancelled"
                events = (await c.ok("events", run_id=run))["events"]
                assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
                assert events[-1]["kind"] == "state" and events[-1]["data"]["state"] == "cancelled"
            assert (await c.ok("status"))["summary"]["journal"]["restored"] == []


async def replace_under(d: Daemon, path: Path) -> tuple[str, str]:
    """Two runs, the journal replaced by garbage between their spawns, both cancelled."""
    async with d.connect() as c:
        a = (await c.ok("spawn", spec=spec(snapshots=1)))["run_id"]
        assert (await c.wait_kind(a, "step_snapshot"))["op"] == "event"
        remove(path)
        path.write_bytes(b"garbage " * 64)
        b = (await c.ok("spawn", spec=spec(snapshots=1)))["run_id"]
        assert (await c.wait_kind(b, "step_snapshot"))["op"] == "event"
        journal = (await c.ok("status"))["summary"]["journal"]
        assert journal["writable"] is True, journal
        [restored] = journal["restored"]
        assert restored["found"] == "another file"
        kept = Path(restored["kept_aside"])
        assert kept.read_bytes() == b"garbage " * 64
        assert "kept as " + str(kept) in d.log_text()
        for run in (a, b):
            assert (await c.ok("cancel", run_id=run))["was_active"] is True
        for run in (a, b):
            assert (await c.wait_end(run))["state"] == "cancelled"
        return a, b


async def test_a_daemon_whose_journal_cannot_be_put_back_yet_is_degraded_answers_status_and_recovers(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    # Removed while the disk is full: no room for the copy. It answers status, keeps the
    # run's end in memory, and once there is room it puts the journal back, writes what
    # waited and is healthy again, with nothing lost at a restart.
    state = small_tmpfs / "state"
    env = {"AGENTD_RUNS_DIR": str(tmp_path / "runs")}
    filler = small_tmpfs / "filler"
    with trio.fail_after(60):
        async with real_daemon(state, env=env) as d, d.connect() as c:
            a, b = await running_pair(c)
            fill(filler)
            remove(state / "agentd.sqlite3")
            reply = await c.ok("cancel", run_id=a)
            assert reply["was_active"] is True and "not durable yet" in reply["warning"], reply
            assert (await c.wait_end(a))["state"] == "cancelled"
            journal = await journal_state(c)
            assert journal["writable"] is False and "removed or replaced" in journal["error"], journal
            assert journal["pending_writes"] > 0 and journal["restored"] == []
            assert (await c.ok("status", run_id=b))["state"] == "running"  # read from the open journal
            refused = await c.call("spawn", spec=spec(snapshots=1))
            assert refused["ok"] is False and refused["error"]["code"] == "refused", refused
            filler.unlink()
            journal = await until(lambda: writable(c))
            assert [r["found"] for r in journal["restored"]] == ["missing"] and journal["pending_writes"] == 0
            await stop_and_check(c, b)
        async with real_daemon(state, env=env) as d, d.connect() as c:
            for run in (a, b):
                events = (await c.ok("events", run_id=run))["events"]
                assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
                assert events[-1]["kind"] == "state" and events[-1]["data"]["state"] == "cancelled", events[-3:]


async def writable(c: Client) -> dict[str, Any] | None:
    journal = await journal_state(c)
    return journal if journal["writable"] else None
