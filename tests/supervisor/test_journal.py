"""The durable store, on real SQLite files in tmp_path."""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.errors import JournalError, RunNotFound
from supervisor.states import LIVE_STATES, TERMINAL_STATES, RunState
from supervisor.store import _schema as _journal_schema
from supervisor.store.journal import SCHEMA_VERSION, Journal, RunStart

S = RunState
T0 = 1_700_000_000.0


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "agentd.sqlite3"


@pytest.fixture
async def journal(db: Path) -> AsyncIterator[Journal]:
    async with await Journal.open(db) as j:
        yield j


async def new_run(
    j: Journal,
    run_id: str = "r1",
    *,
    state: RunState = S.QUEUED,
    session_id: str = "s1",
    created_at: float = T0,
) -> str:
    await j.create_run(
        run_id,
        session_id=session_id,
        spec={"prompt": "hi"},
        created_at=created_at,
        timeout_s=30.0,
    )
    path = {
        S.QUEUED: [],
        S.STARTING: [S.STARTING],
        S.RUNNING: [S.STARTING, S.RUNNING],
        S.CANCELLING: [S.STARTING, S.RUNNING, S.CANCELLING],
    }[state]
    for step in path:
        assert await j.transition(run_id, step)
    return run_id


def raw(db: Path) -> sqlite3.Connection:
    """A second, independent connection, as another program would open the file."""
    return sqlite3.connect(db, isolation_level=None)


def tool_call(call_id: str, state: str, *, step: int = 1, **extra: Any) -> dict[str, Any]:
    return {"id": call_id, "name": "run_command", "arguments": "{}", "step": step, "state": state, **extra}


# -- opening, migrations, damaged files ----------------------------------------------


async def test_a_new_file_gets_the_latest_schema_in_wal_mode(db: Path) -> None:
    async with await Journal.open(db):
        pass
    conn = raw(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    assert {"runs", "events", "tool_calls", "process_groups"} <= tables
    conn.close()


async def test_reopening_keeps_everything_and_migrates_nothing(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with await Journal.open(db) as j:
        await new_run(j, state=S.RUNNING)
    caplog.set_level("INFO", logger=_journal_schema.__name__)
    async with await Journal.open(db) as j:
        run = await j.get_run("r1")
    assert run is not None and run["state"] is S.RUNNING
    assert not [r for r in caplog.records if "migrating" in r.getMessage()]


async def test_a_new_journal_is_private_to_its_owner(db: Path) -> None:
    async with await Journal.open(db) as j:
        await new_run(j)
        assert db.stat().st_mode & 0o777 == 0o600
        assert Path(f"{db}-wal").stat().st_mode & 0o777 == 0o600


async def test_a_journal_from_an_older_schema_is_migrated_and_keeps_its_runs(db: Path) -> None:
    conn = _journal_schema.connect(str(db), target=1)
    conn.execute(
        "INSERT INTO runs (id, session_id, state, created_at, spec, last_seq) "
        "VALUES ('old', 's', 'running', 1.0, '{}', 1)"
    )
    conn.execute("INSERT INTO events VALUES ('old', 1, 1.0, 'log', '{\"m\": 1}')")
    assert "tool_calls" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    conn.close()

    async with await Journal.open(db) as j:
        run = await j.get_run("old")
        assert run is not None and run["state"] is S.RUNNING and run["tool_calls"] == []
        assert await j.upsert_tool_call("old", tool_call("c1", "running"))
        assert await j.append_event("old", "log", {"m": 2}) == 2
        assert await j.finish("old", S.COMPLETED, reason=None, result={}, partial=False)
    conn = raw(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET state = 'running' WHERE id = 'old'")
    conn.close()


async def test_a_spawn_key_is_recorded_with_its_run_and_found_after_a_reopen(db: Path) -> None:
    async with await Journal.open(db) as j:
        await j.create_run("r1", session_id=None, spec={"task": "t"}, created_at=1.0, timeout_s=None, key="k-1")
        await j.create_run("r2", session_id=None, spec={"task": "t"}, created_at=2.0, timeout_s=None)
        assert await j.run_for_key("k-1") == "r1"
        assert await j.run_for_key("k-2") is None
    async with await Journal.open(db) as j:
        assert await j.run_for_key("k-1") == "r1"
        assert [r["id"] for r in await j.list_runs(key="k-1")] == ["r1"]
        assert await j.list_runs(key="k-2") == []


async def test_a_key_already_used_creates_no_second_run(db: Path) -> None:
    async with await Journal.open(db) as j:
        await j.create_run("r1", session_id=None, spec={}, created_at=1.0, timeout_s=None, key="k")
        with pytest.raises(JournalError, match="spawn key"):
            await j.create_run("r2", session_id=None, spec={}, created_at=2.0, timeout_s=None, key="k")
        assert await j.get_run("r2") is None  # one transaction: the run went with the key
        assert await j.run_for_key("k") == "r1"


async def test_a_version_4_journal_is_migrated_and_takes_spawn_keys(db: Path) -> None:
    conn = _journal_schema.connect(str(db), target=4)
    conn.execute("INSERT INTO runs (id, state, created_at, spec) VALUES ('old', 'completed', 1.0, '{}')")
    conn.close()
    async with await Journal.open(db) as j:
        assert await j.run_for_key("k") is None
        await j.create_run("new", session_id=None, spec={}, created_at=2.0, timeout_s=None, key="k")
        assert await j.run_for_key("k") == "new"
        old = await j.get_run("old")
        assert old is not None and old["state"] is S.COMPLETED


async def test_a_file_that_is_not_a_database_is_a_journal_error_naming_the_path(
    db: Path,
) -> None:
    db.write_bytes(b"this is not sqlite\n" * 500)
    with pytest.raises(JournalError) as info:
        await Journal.open(db)
    assert info.value.path == str(db)
    assert str(db) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


async def test_a_damaged_journal_is_a_journal_error_not_a_sqlite_exception(db: Path) -> None:
    async with await Journal.open(db) as j:
        await new_run(j)
        await j.append_events("r1", [("log", {"text": "x" * 2000}, None)] * 50)
    data = bytearray(db.read_bytes())
    assert len(data) > 4096 * 4
    data[4096 : len(data)] = b"\xa5" * (len(data) - 4096)  # every page after the header
    db.write_bytes(bytes(data))
    with pytest.raises(JournalError) as info:
        j = await Journal.open(db)
        try:
            await j.list_runs()
            await j.events_after("r1", 0)
        finally:
            await j.aclose()
    assert info.value.path == str(db)


async def test_a_journal_from_a_newer_agentd_is_refused(db: Path) -> None:
    async with await Journal.open(db):
        pass
    conn = raw(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(JournalError, match="newer"):
        await Journal.open(db)


async def test_a_foreign_sqlite_database_is_refused(db: Path) -> None:
    conn = raw(db)
    conn.execute("CREATE TABLE accounts (id INTEGER)")
    conn.close()
    with pytest.raises(JournalError, match="did not create"):
        await Journal.open(db)


async def test_an_unusable_location_is_a_journal_error(tmp_path: Path) -> None:
    with pytest.raises(JournalError) as info:
        await Journal.open(tmp_path / "missing-dir" / "j.sqlite3")
    assert "missing-dir" in str(info.value)


async def test_aclose_lets_calls_already_submitted_finish(db: Path) -> None:
    j = await Journal.open(db)
    await new_run(j)
    release = threading.Event()
    seqs: list[int] = []

    async def append(i: int) -> None:
        seqs.append(await j.append_event("r1", "log", {"i": i}))

    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(j._call, lambda store: release.wait(10))
            await trio.testing.wait_all_tasks_blocked()
            for i in range(3):
                nursery.start_soon(append, i)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(j.aclose)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(JournalError, match="closed"):
                await j.append_event("r1", "log", {"i": "after close"})
        finally:
            release.set()
    assert sorted(seqs) == [1, 2, 3]
    async with await Journal.open(db) as j:
        # Trio starts tasks in no set order: which append got which number varies.
        assert sorted(e["data"]["i"] for e in await j.events_after("r1", 0)) == [0, 1, 2]


async def test_aclose_is_idempotent_and_later_calls_are_refused(db: Path) -> None:
    j = await Journal.open(db)
    await j.aclose()
    await j.aclose()
    with pytest.raises(JournalError, match="closed"):
        await j.get_run("r1")


# -- runs: compare-and-set, terminal facts --------------------------------------------


async def test_a_new_run_is_queued_with_every_field_readable(journal: Journal) -> None:
    await journal.create_run("r1", session_id="s1", spec={"prompt": "hi", "n": [1, 2]}, created_at=T0, timeout_s=9.5)
    run = await journal.get_run("r1")
    assert run == {
        "id": "r1",
        "session_id": "s1",
        "state": S.QUEUED,
        "reason": None,
        "created_at": T0,
        "started_at": None,
        "ended_at": None,
        "timeout_s": 9.5,
        "spec": {"prompt": "hi", "n": [1, 2]},
        "result": None,
        "partial": False,
        "partial_snapshot": None,
        "error": None,
        "receipt": None,
        "pid": None,
        "pid_start_time": None,
        "pgid": None,
        "tree_id": None,
        "cgroup": None,
        "containment": None,
        "run_dir": None,
        "last_seq": 0,
        "cancel_reason": None,
        "cancel_requested_at": None,
        "stop_deadline": None,
        "deadline": None,
        "stop_detail": None,
        "groups": [],
        "tool_calls": [],
    }
    assert await journal.get_run("nope") is None
    with pytest.raises(JournalError, match="already exists"):
        await journal.create_run("r1", session_id=None, spec={}, created_at=T0, timeout_s=None)


async def test_transitions_follow_the_allowed_table(journal: Journal) -> None:
    await new_run(journal)
    assert not await journal.transition("r1", S.RUNNING)  # queued -> running skips starting
    assert not await journal.transition("r1", S.QUEUED)
    assert await journal.transition("r1", S.STARTING, at=T0 + 1)
    assert await journal.transition("r1", S.RUNNING, reason="spawned", at=T0 + 2)
    assert not await journal.transition("r1", S.RUNNING)
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["state"], run["reason"], run["started_at"]) == (S.RUNNING, "spawned", T0 + 1)
    with pytest.raises(ValueError, match="finish"):
        await journal.transition("r1", S.COMPLETED)
    with pytest.raises(ValueError, match="terminal"):
        await journal.finish("r1", S.RUNNING, reason=None, result=None, partial=False)


async def test_a_queued_run_cannot_complete_without_starting(journal: Journal) -> None:
    await new_run(journal)
    assert not await journal.finish("r1", S.COMPLETED, reason=None, result={}, partial=False)
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=False)


async def test_a_cancel_racing_a_completion_gives_one_terminal_fact(journal: Journal) -> None:
    await new_run(journal, state=S.CANCELLING)
    outcomes: list[tuple[RunState, bool]] = []

    async def end(state: RunState) -> None:
        ok = await journal.finish("r1", state, reason=str(state), result={"by": str(state)}, partial=False)
        outcomes.append((state, ok))

    async with trio.open_nursery() as nursery:
        for state in (S.COMPLETED, S.CANCELLED, S.CANCELLED, S.FAILED, S.LOST):
            nursery.start_soon(end, state)
    assert len(outcomes) == 5
    winners = [s for s, ok in outcomes if ok]
    assert len(winners) == 1
    run = await journal.get_run("r1")
    assert run is not None
    assert run["state"] is winners[0]
    assert run["result"] == {"by": str(winners[0])}


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES))
async def test_nothing_moves_a_run_out_of_a_terminal_state(journal: Journal, db: Path, terminal: RunState) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.finish("r1", terminal, reason="end", result={"r": 1}, partial=False)
    before = await journal.get_run("r1")
    for state in LIVE_STATES:
        assert not await journal.transition("r1", state, reason="late")
    for state in TERMINAL_STATES:
        assert not await journal.finish("r1", state, reason="late", result={"r": 2}, partial=True, receipt={"x": 1})
    assert not await journal.mark_lost("r1", reason="late", partial_result={"r": 3})
    assert not await journal.set_partial("r1", {"_id": "r1", "p": 1})
    assert not await journal.record_process("r1", pid=42)
    after = await journal.get_run("r1")
    assert after == before

    # The database refuses too, whoever writes to it.
    conn = raw(db)
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET state = 'running' WHERE id = 'r1'")
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET result = NULL WHERE id = 'r1'")
    conn.close()


async def test_the_where_clause_alone_keeps_a_terminal_run_final(journal: Journal, db: Path) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=False)
    conn = raw(db)
    conn.execute("DROP TRIGGER runs_terminal_is_final")
    conn.close()
    for state in LIVE_STATES:
        assert not await journal.transition("r1", state)
    assert not await journal.finish("r1", S.COMPLETED, reason=None, result={}, partial=False)
    run = await journal.get_run("r1")
    assert run is not None and (run["state"], run["result"]) == (S.CANCELLED, None)


async def test_unknown_runs_are_run_not_found(journal: Journal) -> None:
    calls = [
        journal.transition("nope", S.STARTING),
        journal.finish("nope", S.CANCELLED, reason=None, result=None, partial=False),
        journal.mark_lost("nope", reason="gone"),
        journal.append_event("nope", "log", {}),
        journal.events_after("nope", 0),
        journal.set_partial("nope", {"_id": "nope"}),
        journal.set_receipt("nope", {}),
        journal.record_process("nope", pid=1),
        journal.add_group("nope", 1, "command", "sh"),
        journal.remove_group("nope", 1),
        journal.upsert_tool_call("nope", tool_call("c1", "running")),
        journal.tool_calls("nope"),
    ]
    for call in calls:
        with pytest.raises(RunNotFound) as info:
            await call
        assert info.value.run_id == "nope"


async def test_a_call_submitted_before_a_cancel_still_completes(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    release = threading.Event()
    blocker = trio.Event()

    async def hold_worker() -> None:
        await journal._call(lambda store: release.wait(10))
        blocker.set()

    returned: list[bool] = []
    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(hold_worker)
            await trio.testing.wait_all_tasks_blocked()
            scope = trio.CancelScope()
            nursery.start_soon(_finish_in, journal, scope, returned)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel(reason="test: stop while the terminal write is queued")
            await trio.testing.wait_all_tasks_blocked()
            assert returned == []  # still waiting for the worker, cancel or not
        finally:
            release.set()
    assert returned == [True]
    run = await journal.get_run("r1")
    assert run is not None and run["state"] is S.COMPLETED

    with trio.CancelScope() as scope:
        scope.cancel()
        await journal.transition("r1", S.CANCELLING)  # cancelled before submission
    assert scope.cancelled_caught


async def _finish_in(journal: Journal, scope: trio.CancelScope, out: list[bool]) -> None:
    with scope:
        out.append(await journal.finish("r1", S.COMPLETED, reason=None, result={}, partial=False))
        await trio.lowlevel.checkpoint()
        out.append(False)  # not reached: the cancel lands at the next checkpoint


# -- partial results, receipts, processes, groups ---------------------------------------


async def test_partial_snapshots_are_guarded_by_id_and_by_the_terminal_result(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.set_partial("r1", {"_id": "r1", "progress": "step 1"})
    assert not await journal.set_partial("r1", {"_id": "r0", "progress": "stale run"})
    assert not await journal.set_partial("r1", {"progress": "no id"})
    run = await journal.get_run("r1")
    assert run is not None and run["partial_snapshot"] == {"_id": "r1", "progress": "step 1"}

    assert await journal.finish("r1", S.COMPLETED, reason=None, result={"final_text": "done"}, partial=False)
    assert not await journal.set_partial("r1", {"_id": "r1", "progress": "late snapshot"})
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["result"], run["partial"]) == ({"final_text": "done"}, False)
    assert run["partial_snapshot"] == {"_id": "r1", "progress": "step 1"}


async def test_finishing_without_a_result_takes_the_last_snapshot_marked_partial(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.CANCELLING)
    await journal.set_partial("r1", {"_id": "r1", "progress": "one"})
    await journal.set_partial("r1", {"_id": "r1", "progress": "two"})
    assert await journal.finish(
        "r1",
        S.CANCELLED,
        reason="user",
        result=None,
        partial=True,
        receipt={"escalated": True},
        error=None,
        ended_at=T0 + 5,
    )
    run = await journal.get_run("r1")
    assert run is not None
    assert run["result"] == {"_id": "r1", "progress": "two"}
    assert (run["partial"], run["ended_at"], run["receipt"]) == (True, T0 + 5, {"escalated": True})


async def test_a_partial_results_calls_are_their_records_not_the_snapshots_stale_copies(journal: Journal) -> None:
    # The snapshot was taken at its step's start: a call that ran since, then was killed at
    # the grace, still said `not_started` in the result a client reads.
    await new_run(journal, state=S.CANCELLING)
    await journal.set_partial("r1", {"_id": "r1", "tool_calls": [tool_call("busy", "not_started")]})
    await journal.upsert_tool_call("r1", tool_call("busy", "running"))
    await journal.upsert_tool_call("r1", tool_call("busy", "unknown", reason="grace_ran_out"))
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=True, error=None)
    run = await journal.get_run("r1")
    assert run is not None and run["partial"] is True
    assert [(c["id"], c["state"], c.get("reason")) for c in run["result"]["tool_calls"]] == [
        ("busy", "unknown", "grace_ran_out")
    ]
    assert run["result"]["tool_calls"] == run["tool_calls"]


async def test_mark_lost_uses_the_last_snapshot_and_settles_open_tool_calls(
    journal: Journal,
) -> None:
    await new_run(journal, "a", state=S.RUNNING)
    await journal.set_partial("a", {"_id": "a", "progress": "so far"})
    await journal.upsert_tool_call("a", tool_call("done", "succeeded", output="ok"))
    await journal.upsert_tool_call("a", tool_call("busy", "running"))
    await journal.upsert_tool_call("a", tool_call("next", "not_started", step=2))
    assert await journal.mark_lost("a", reason="daemon restarted; process gone")
    run = await journal.get_run("a")
    assert run is not None
    assert (run["state"], run["partial"]) == (S.LOST, True)
    assert run["result"] == {"_id": "a", "progress": "so far"}
    states = {c["id"]: (c["state"], c.get("reason")) for c in run["tool_calls"]}
    assert states == {
        "done": ("succeeded", None),
        "busy": ("unknown", "daemon restarted; process gone"),
        "next": ("not_started", "daemon restarted; process gone"),
    }
    assert not await journal.mark_lost("a", reason="again")

    await new_run(journal, "b", state=S.STARTING)
    assert await journal.mark_lost("b", reason="gone", partial_result={"progress": "mine"})
    run = await journal.get_run("b")
    assert run is not None and run["result"] == {"progress": "mine"} and run["partial"]


async def test_a_receipt_can_be_filled_in_once_after_the_end(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.set_receipt("r1", {"path_a": "sent"})
    assert await journal.set_receipt("r1", {"path_a": "sent", "path_b": "reaped"})
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=False)
    run = await journal.get_run("r1")
    assert run is not None and run["receipt"] == {"path_a": "sent", "path_b": "reaped"}
    assert not await journal.set_receipt("r1", {"other": 1})

    await new_run(journal, "r2", state=S.RUNNING)
    assert await journal.finish("r2", S.CANCELLED, reason="user", result=None, partial=False)
    assert await journal.set_receipt("r2", {"latency_s": 0.2})
    assert not await journal.set_receipt("r2", {"latency_s": 9})
    run = await journal.get_run("r2")
    assert run is not None and run["receipt"] == {"latency_s": 0.2}


async def test_process_facts_are_recorded_in_steps_and_frozen_at_the_end(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.STARTING)
    assert await journal.record_process(
        "r1", tree_id="t-1", run_dir="/runs/r1", cgroup="/sys/fs/cgroup/x", containment="cgroup"
    )
    assert await journal.record_process("r1", pid=4242, pid_start_time=123.5, pgid=4242)
    run = await journal.get_run("r1")
    assert run is not None
    facts = {
        k: v
        for k, v in run.items()
        if k in {"pid", "pid_start_time", "pgid", "tree_id", "cgroup", "containment", "run_dir"}
    }
    assert facts == {
        "pid": 4242,
        "pid_start_time": 123.5,
        "pgid": 4242,
        "tree_id": "t-1",
        "cgroup": "/sys/fs/cgroup/x",
        "containment": "cgroup",
        "run_dir": "/runs/r1",
    }
    assert await journal.finish("r1", S.FAILED, reason="spawn", result=None, partial=False)
    assert not await journal.record_process("r1", pid=1, run_dir="/elsewhere")
    run = await journal.get_run("r1")
    assert run is not None and (run["pid"], run["run_dir"]) == (4242, "/runs/r1")


async def test_process_groups_are_known_until_they_end(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    await journal.add_group("r1", 100, "mcp_server", "playwright", at=T0)
    await journal.add_group("r1", 200, "command", "sh -c make", at=T0 + 1)
    assert await journal.remove_group("r1", 200, at=T0 + 2)
    assert not await journal.remove_group("r1", 200)
    assert not await journal.remove_group("r1", 999)
    run = await journal.get_run("r1")
    assert run is not None
    assert run["groups"] == [
        {
            "pgid": 100,
            "kind": "mcp_server",
            "name": "playwright",
            "alive": True,
            "added_at": T0,
            "ended_at": None,
            "on_stop": None,
        },
        {
            "pgid": 200,
            "kind": "command",
            "name": "sh -c make",
            "alive": False,
            "added_at": T0 + 1,
            "ended_at": T0 + 2,
            "on_stop": None,
        },
    ]
    await journal.add_group("r1", 200, "command", "second use of the pgid", at=T0 + 3)
    run = await journal.get_run("r1")
    assert run is not None and run["groups"][1]["alive"] and run["groups"][1]["ended_at"] is None


async def test_a_groups_stop_policy_is_kept_and_follows_a_reused_pgid(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    await journal.add_group("r1", 300, "command", "sleep 300", at=T0, on_stop="interrupt")
    run = await journal.get_run("r1")
    assert run is not None and run["groups"][0]["on_stop"] == "interrupt"
    await journal.remove_group("r1", 300)
    await journal.add_group("r1", 300, "command", "make install", at=T0 + 1, on_stop="finish")
    run = await journal.get_run("r1")
    assert run is not None and (run["groups"][0]["on_stop"], run["groups"][0]["alive"]) == ("finish", True)


# -- stop intent and deadlines -------------------------------------------------------------


async def test_the_first_cancel_is_recorded_once_and_frozen_at_the_end(journal: Journal, db: Path) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.record_cancel("r1", reason="user", at=T0, stop_deadline=T0 + 10)
    assert not await journal.record_cancel("r1", reason="timeout", at=T0 + 1, stop_deadline=T0 + 11)
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["cancel_reason"], run["cancel_requested_at"], run["stop_deadline"]) == ("user", T0, T0 + 10)
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=False)
    await new_run(journal, "r2", state=S.RUNNING)
    assert await journal.finish("r2", S.COMPLETED, reason=None, result={}, partial=False)
    assert not await journal.record_cancel("r2", reason="user", at=T0, stop_deadline=T0 + 10)
    conn = raw(db)
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET cancel_reason = 'late' WHERE id = 'r1'")
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET deadline = 1.0 WHERE id = 'r2'")
    conn.close()
    with pytest.raises(RunNotFound):
        await journal.record_cancel("nope", reason="user", at=T0, stop_deadline=T0)


async def test_a_stops_detail_is_recorded_with_its_intent_once_and_frozen_at_the_end(
    journal: Journal, db: Path
) -> None:
    # What the disk guard measured lived in the daemon's memory only: a daemon restarted
    # mid-stop wrote a receipt without it. It is written with the intent now.
    detail = {"reason": "disk_full", "held_bytes": 123, "message": "m"}
    await new_run(journal, state=S.RUNNING)
    assert await journal.record_cancel("r1", reason="disk_full", at=T0, stop_deadline=T0 + 10, detail=detail)
    assert not await journal.record_cancel("r1", reason="user", at=T0 + 1, stop_deadline=T0 + 11, detail={"x": 1})
    (live,) = await journal.live_runs()
    assert (live["cancel_reason"], live["stop_detail"]) == ("disk_full", detail)
    await new_run(journal, "r2", state=S.RUNNING)
    assert await journal.record_cancel("r2", reason="user", at=T0, stop_deadline=T0 + 10)
    run = await journal.get_run("r2")
    assert run is not None and run["stop_detail"] is None  # a stop without one
    assert await journal.finish("r1", S.CANCELLED, reason="disk_full", result=None, partial=False)
    conn = raw(db)
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET stop_detail = NULL WHERE id = 'r1'")
    conn.close()


async def test_a_version_6_journal_is_migrated_and_keeps_its_stop_intent(db: Path) -> None:
    conn = _journal_schema.connect(str(db), target=6)
    conn.execute(
        "INSERT INTO runs (id, state, created_at, spec, cancel_reason, cancel_requested_at, stop_deadline) "
        "VALUES ('old', 'cancelling', 1.0, '{}', 'user', 1.0, 11.0)"
    )
    conn.close()
    async with await Journal.open(db) as j:
        (old,) = await j.live_runs()
        assert (old["id"], old["cancel_reason"], old["stop_detail"]) == ("old", "user", None)
        assert await j.finish("old", S.CANCELLED, reason="user", result=None, partial=False)
    conn = raw(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("""UPDATE runs SET stop_detail = '{"late": 1}' WHERE id = 'old'""")
    conn.close()


async def test_a_deadline_is_recorded_once_and_a_cancel_before_acknowledging_is_fsynced(journal: Journal) -> None:
    await new_run(journal, state=S.STARTING)
    assert await journal.record_deadline("r1", T0 + 8)
    assert not await journal.record_deadline("r1", T0 + 80)
    run = await journal.get_run("r1")
    assert run is not None and run["deadline"] == T0 + 8
    await journal.append_event("r1", "log", {})  # a NORMAL commit first
    assert await journal.record_cancel("r1", reason="timeout", at=T0 + 8, stop_deadline=T0 + 18)
    mode = await journal._call(lambda store: store._conn.execute("PRAGMA synchronous").fetchone()[0])
    assert mode == 2  # FULL: durable before the daemon acknowledges the stop


async def test_settling_under_a_stop_says_which_calls_never_started(journal: Journal) -> None:
    await new_run(journal, state=S.CANCELLING)
    await journal.upsert_tool_call("r1", tool_call("a", "succeeded", output="ok"))
    await journal.upsert_tool_call("r1", tool_call("b", "running"))
    await journal.upsert_tool_call("r1", tool_call("c", "not_started"))
    n = await journal.settle_tool_calls(
        "r1",
        reason="grace ran out",
        pending_reason="stopped_before_start: never ran",
        stop_effects=("grace_ran_out", "stopped_before_start"),
    )
    assert n == 2
    calls = {c["id"]: (c["state"], c.get("reason"), c.get("stop_effect")) for c in await journal.tool_calls("r1")}
    assert calls == {
        "a": ("succeeded", None, None),
        "b": ("unknown", "grace ran out", "grace_ran_out"),
        "c": ("not_started", "stopped_before_start: never ran", "stopped_before_start"),
    }


async def test_settling_a_call_that_awaited_approval_ends_its_wait(journal: Journal) -> None:
    # A lost run's call that awaited approval kept "approval: pending" and its deadline.
    await new_run(journal)
    await journal.upsert_tool_call(
        "r1", {**tool_call("w", "not_started"), "approval": "pending", "approval_deadline": T0 + 300}
    )
    await journal.upsert_tool_call("r1", {**tool_call("a", "succeeded", output="ok"), "approval": "approved"})
    assert await journal.settle_tool_calls("r1", reason="the runner was gone") == 1
    calls = {
        c["id"]: (c["state"], c.get("approval"), c.get("approval_deadline")) for c in await journal.tool_calls("r1")
    }
    assert calls == {"w": ("not_started", "rejected", None), "a": ("succeeded", "approved", None)}


async def test_a_version_2_journal_gains_the_stop_columns_and_keeps_its_runs(db: Path) -> None:
    conn = _journal_schema.connect(str(db), target=2)
    conn.execute(
        "INSERT INTO runs (id, session_id, state, created_at, spec, last_seq) "
        "VALUES ('old', 's', 'running', 1.0, '{}', 0)"
    )
    conn.execute("INSERT INTO process_groups VALUES ('old', 77, 'command', 'sh', 1, 1.0, NULL)")
    conn.close()
    async with await Journal.open(db) as j:
        run = await j.get_run("old")
        assert run is not None and run["state"] is S.RUNNING
        assert (run["cancel_reason"], run["stop_deadline"], run["deadline"]) == (None, None, None)
        assert run["groups"][0]["on_stop"] is None
        assert await j.record_cancel("old", reason="user", at=2.0, stop_deadline=12.0)


# -- tool calls ----------------------------------------------------------------------------


async def test_tool_call_records_only_move_forward(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    up = journal.upsert_tool_call
    assert await up("r1", tool_call("c1", "not_started"))
    assert await up("r1", tool_call("c1", "running", started_at=1.0))
    assert await up("r1", tool_call("c1", "running", started_at=1.0, output="partial"))
    assert await up("r1", tool_call("c1", "succeeded", output="all"))
    assert not await up("r1", tool_call("c1", "running", output="late"))
    assert not await up("r1", tool_call("c1", "cancelled", output="late"))
    assert not await up("r1", tool_call("c1", "unknown"))

    # Outcome unknown can learn the truth; a decided not-started call stays not started.
    assert await up("r1", tool_call("c2", "unknown", step=2))
    assert not await up("r1", tool_call("c2", "running", step=2))
    assert await up("r1", tool_call("c2", "failed", step=2, error="boom"))
    assert await up("r1", tool_call("c3", "not_started", step=2, reason="arguments cut"))
    assert not await up("r1", tool_call("c3", "running", step=2))

    calls = await journal.tool_calls("r1")
    assert [(c["id"], c["state"]) for c in calls] == [("c1", "succeeded"), ("c2", "failed"), ("c3", "not_started")]
    assert calls[0]["output"] == "all"
    with pytest.raises(ValueError):
        await up("r1", {"state": "running"})
    with pytest.raises(ValueError):
        await up("r1", tool_call("c4", "exploded"))


async def test_tool_calls_are_kept_after_the_run_ends_without_touching_it(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.CANCELLING)
    await journal.upsert_tool_call("r1", tool_call("c1", "running"))
    assert await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=True)
    assert await journal.upsert_tool_call("r1", tool_call("c1", "cancelled", output="half"))
    assert await journal.settle_tool_calls("r1", reason="run ended") == 0
    run = await journal.get_run("r1")
    assert run is not None and run["state"] is S.CANCELLED
    assert run["tool_calls"][0]["state"] == "cancelled"


# -- events --------------------------------------------------------------------------------


async def test_event_numbers_start_at_one_and_only_appends_take_them(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.RUNNING)
    assert await journal.append_event("r1", "log", {"message": "hello"}, T0 + 3) == 1
    await journal.set_partial("r1", {"_id": "r1"})
    await journal.finish("r1", S.COMPLETED, reason=None, result={}, partial=False)
    assert await journal.append_event("r1", "state", {"state": "completed"}) == 2
    events = await journal.events_after("r1", 0)
    assert events[0] == {"seq": 1, "ts": T0 + 3, "kind": "log", "data": {"message": "hello"}}
    assert [e["seq"] for e in events] == [1, 2]


async def test_sequence_numbers_are_gapless_per_run_and_survive_a_reopen(db: Path) -> None:
    async with await Journal.open(db) as j:
        await new_run(j, "a")
        await new_run(j, "b")
        assert await j.append_event("a", "log", {"i": 0}) == 1
        assert await j.append_events("a", [("log", {"i": i}, None) for i in (1, 2, 3)]) == [2, 3, 4]
        assert await j.append_event("b", "log", {"i": 0}) == 1
        assert await j.append_events("a", []) == []
    async with await Journal.open(db) as j:
        assert await j.append_event("a", "log", {"i": 4}) == 5
        events = await j.events_after("a", 0)
        assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
        assert [e["data"]["i"] for e in events] == [0, 1, 2, 3, 4]
        run = await j.get_run("a")
        assert run is not None and run["last_seq"] == 5


async def test_events_after_replays_from_any_point_in_pages(journal: Journal) -> None:
    await new_run(journal)
    await journal.append_events("r1", [("log", {"i": i}, T0 + i) for i in range(1, 26)])
    assert [e["seq"] for e in await journal.events_after("r1", 20)] == [21, 22, 23, 24, 25]
    assert await journal.events_after("r1", 25) == []
    seen: list[int] = []
    after = 0
    while page := await journal.events_after("r1", after, limit=7):
        seen += [e["seq"] for e in page]
        after = page[-1]["seq"]
    assert seen == list(range(1, 26))


async def test_events_after_the_end_are_history_and_never_reopen_the_run(
    journal: Journal,
) -> None:
    await new_run(journal, state=S.RUNNING)
    await journal.finish("r1", S.CANCELLED, reason="user", result=None, partial=False)
    seq = await journal.append_event("r1", "step_snapshot", {"_id": "r1", "step": 9})
    await journal.append_events("r1", [("state", {"state": "running"}, None)])
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["state"], run["last_seq"], run["partial_snapshot"]) == (S.CANCELLED, seq + 1, None)


async def test_concurrent_appends_from_many_tasks_keep_sequences_gapless(
    journal: Journal,
) -> None:
    runs = ["a", "b", "c"]
    for run_id in runs:
        await new_run(journal, run_id)
    got: dict[str, list[int]] = {r: [] for r in runs}

    async def writer(n: int) -> None:
        run_id = runs[n % len(runs)]
        mine: list[int] = []
        for i in range(10):
            if i % 3 == 0:
                mine += await journal.append_events(run_id, [("log", {"w": n, "i": i, "k": k}, None) for k in range(3)])
            else:
                mine.append(await journal.append_event(run_id, "log", {"w": n, "i": i}))
            await trio.lowlevel.checkpoint()
        assert mine == sorted(mine)
        got[run_id] += mine

    async with trio.open_nursery() as nursery:
        for n in range(30):
            nursery.start_soon(writer, n)
    for run_id in runs:
        # 10 writers per run, each 4 batches of 3 and 6 singles: 18 events.
        assert sorted(got[run_id]) == list(range(1, 1 + 10 * 18))
        events = await journal.events_after(run_id, 0, limit=10_000)
        assert [e["seq"] for e in events] == list(range(1, 1 + 10 * 18))


async def test_ten_thousand_events_append_in_batches_quickly_enough(
    journal: Journal, capsys: pytest.CaptureFixture[str]
) -> None:
    await new_run(journal)
    batch = [("step_snapshot", {"progress": "x" * 200, "step": i}, None) for i in range(100)]
    start = time.perf_counter()
    for _ in range(100):
        await journal.append_events("r1", batch)
    batched = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(500):
        await journal.append_event("r1", "log", {"i": i})
    single = (time.perf_counter() - start) / 500
    start = time.perf_counter()
    for i in range(50):  # a durable (fsynced) write each
        await journal.create_run(f"d{i}", session_id=None, spec={}, created_at=T0, timeout_s=None)
    durable = (time.perf_counter() - start) / 50
    run = await journal.get_run("r1")
    assert run is not None and run["last_seq"] == 10_000 + 500
    with capsys.disabled():
        print(
            f"\njournal: 10k events in 100 batches {batched * 1000:.0f} ms; "
            f"one event per call {single * 1e6:.0f} us; durable write {durable * 1e6:.0f} us"
        )


async def test_data_json_cannot_encode_is_kept_as_text(journal: Journal) -> None:
    await new_run(journal, state=S.RUNNING)
    seq = await journal.append_event("r1", "log", {"path": Path("/x"), "nan": float("nan")})
    (event,) = await journal.events_after("r1", seq - 1)
    assert event["data"]["path"] == "/x" and event["data"]["nan"] != event["data"]["nan"]
    await journal.upsert_tool_call("r1", tool_call("c1", "running", started_at=float("nan")))
    assert await journal.mark_lost("r1", reason="gone")
    (call,) = await journal.tool_calls("r1")
    assert call["state"] == "unknown"
    with pytest.raises(ValueError, match="limit"):
        await journal.events_after("r1", 0, limit=0)


# -- listing and recovery --------------------------------------------------------------


async def test_list_and_live_runs(journal: Journal) -> None:
    await new_run(journal, "q", created_at=T0 + 1)
    await new_run(journal, "r", state=S.RUNNING, session_id="s2", created_at=T0 + 2)
    await new_run(journal, "done", state=S.RUNNING, created_at=T0 + 3)
    await journal.finish("done", S.COMPLETED, reason=None, result={}, partial=False)
    await new_run(journal, "c", state=S.CANCELLING, created_at=T0 + 4)
    await journal.add_group("c", 7, "command", "sleep")

    assert [r["id"] for r in await journal.list_runs()] == ["c", "done", "r", "q"]
    assert [r["id"] for r in await journal.list_runs(limit=2)] == ["c", "done"]
    assert [r["id"] for r in await journal.list_runs(states=[S.COMPLETED, S.QUEUED])] == ["done", "q"]
    assert [r["id"] for r in await journal.list_runs(session_id="s2")] == ["r"]
    live = await journal.live_runs()
    assert [r["id"] for r in live] == ["q", "r", "c"]
    assert live[2]["groups"][0]["pgid"] == 7


# -- durability ----------------------------------------------------------------------------


async def test_facts_recovery_needs_are_committed_fsynced_and_the_stream_is_not(
    journal: Journal,
) -> None:
    async def mode_of_last_commit() -> int:
        # The mode is set before each BEGIN and left as is: it is the last commit's mode.
        return int(await journal._call(lambda store: store._conn.execute("PRAGMA synchronous").fetchone()[0]))

    full, normal = 2, 1
    writes: list[tuple[Callable[[], Awaitable[object]], int]] = [
        (lambda: new_run(journal), full),
        (lambda: journal.append_event("r1", "log", {}), normal),
        (lambda: journal.transition("r1", S.STARTING), full),
        (lambda: journal.record_process("r1", pid=10, pgid=10), full),
        (lambda: journal.transition("r1", S.RUNNING), full),
        (lambda: journal.upsert_tool_call("r1", tool_call("c1", "running")), normal),
        (lambda: journal.add_group("r1", 11, "command", "sh"), full),
        (lambda: journal.set_partial("r1", {"_id": "r1"}), normal),
        (lambda: journal.remove_group("r1", 11), normal),
        (lambda: journal.set_receipt("r1", {"a": 1}), full),
        (lambda: journal.append_events("r1", [("log", {}, None)]), normal),
        (lambda: journal.finish("r1", S.COMPLETED, reason=None, result={}, partial=False), full),
        (lambda: journal.append_event("r1", "log", {}), normal),
    ]
    got = []
    for write, _ in writes:
        await write()
        got.append(await mode_of_last_commit())
    assert got == [mode for _, mode in writes]

    await new_run(journal, "r2", state=S.RUNNING)
    await journal.append_event("r2", "log", {})
    assert await journal.mark_lost("r2", reason="gone")
    assert await mode_of_last_commit() == full


# -- group commit --------------------------------------------------------------------------


async def hold_the_worker(journal: Journal, nursery: trio.Nursery) -> threading.Event:
    """Keep the journal's worker busy until the returned event is set: whatever is asked
    meanwhile queues up behind it, and goes as one group commit."""
    running, release = threading.Event(), threading.Event()

    def block(store: Any) -> None:
        running.set()
        assert release.wait(30)

    nursery.start_soon(journal._call, block)
    await trio.to_thread.run_sync(running.wait, 30)
    return release


async def test_calls_queued_together_share_one_transaction_and_one_fsync(journal: Journal) -> None:
    results: dict[str, Any] = {}

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        results[name] = await fn()

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            release = await hold_the_worker(journal, n)
            for i in range(20):  # durable writes: alone, 20 commits, each fsynced
                n.start_soon(call, f"create {i}", lambda i=i: new_run(journal, f"g{i}"))
                await trio.lowlevel.checkpoint()
            n.start_soon(call, "in a group", lambda: journal._call(lambda store: store.in_group))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert results["in a group"] is True
    assert [results[f"create {i}"] for i in range(20)] == [f"g{i}" for i in range(20)]
    assert [r["id"] for r in await journal.list_runs(limit=100)] == [f"g{i}" for i in reversed(range(20))]
    # The group carried durable facts: it committed FULL (fsynced).
    assert await journal._call(lambda store: store._conn.execute("PRAGMA synchronous").fetchone()[0]) == 2


async def test_a_call_that_fails_in_a_group_writes_nothing_and_the_others_stand(journal: Journal) -> None:
    await new_run(journal, "dup")
    outcomes: dict[str, Any] = {}

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            outcomes[name] = await fn()
        except JournalError as exc:
            outcomes[name] = exc

    async def insert_then_fail() -> None:
        def op(store: Any) -> None:
            with store._tx(durable=True) as conn:
                conn.execute("UPDATE runs SET reason = 'half-done' WHERE id = 'dup'")
            raise JournalError("a failure after a write", path=journal.path)

        await journal._call(op)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            release = await hold_the_worker(journal, n)
            n.start_soon(call, "before", lambda: new_run(journal, "a"))
            await trio.lowlevel.checkpoint()
            n.start_soon(
                call,
                "duplicate",
                lambda: journal.create_run("dup", session_id=None, spec={}, created_at=T0, timeout_s=None),
            )
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "half", insert_then_fail)
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "after", lambda: new_run(journal, "b"))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert outcomes["before"] == "a" and outcomes["after"] == "b"
    assert isinstance(outcomes["duplicate"], JournalError) and "already exists" in str(outcomes["duplicate"])
    assert isinstance(outcomes["half"], JournalError)
    row = await journal.get_run("dup")
    assert row is not None and row["reason"] is None  # the failed call's write was rolled back
    assert {r["id"] for r in await journal.list_runs()} == {"dup", "a", "b"}


async def test_a_durable_call_after_stream_writes_in_a_group_still_commits_fsynced(journal: Journal) -> None:
    await new_run(journal, "r1", state=S.RUNNING)
    await journal.append_event("r1", "log", {})  # the connection commits NORMAL now
    done: list[str] = []

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        await fn()
        done.append(name)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            release = await hold_the_worker(journal, n)
            for i in range(3):
                n.start_soon(call, f"event {i}", lambda i=i: journal.append_event("r1", "log", {"i": i}))
                await trio.lowlevel.checkpoint()
            n.start_soon(call, "stop", lambda: journal.record_cancel("r1", reason="user", at=T0, stop_deadline=T0 + 5))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "event 3", lambda: journal.append_event("r1", "log", {"i": 3}))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert sorted(done) == ["event 0", "event 1", "event 2", "event 3", "stop"]
    assert await journal._call(lambda store: store._conn.execute("PRAGMA synchronous").fetchone()[0]) == 2
    run = await journal.get_run("r1")
    assert run is not None and run["cancel_reason"] == "user"
    assert [e["data"].get("i") for e in await journal.events_after("r1", 0)] == [None, 0, 1, 2, 3]


async def test_a_group_rolled_back_under_it_fails_the_calls_it_held_and_no_others(journal: Journal) -> None:
    outcomes: dict[str, Any] = {}

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            outcomes[name] = await fn()
        except JournalError as exc:
            outcomes[name] = exc

    def lose_the_transaction(store: Any) -> None:  # as SQLite does on a full disk or an I/O error
        store._conn.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            release = await hold_the_worker(journal, n)
            n.start_soon(call, "held", lambda: new_run(journal, "a"))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "failing", lambda: journal._call(lose_the_transaction))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "after", lambda: new_run(journal, "b"))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert isinstance(outcomes["held"], JournalError) and isinstance(outcomes["failing"], JournalError)
    assert outcomes["after"] == "b"
    assert [r["id"] for r in await journal.list_runs()] == ["b"]  # "a" was never committed


_CHILD = """
import os, signal, sys, trio
from supervisor.store.journal import Journal
from supervisor.states import RunState as S

async def main(path):
    j = await Journal.open(path)
    await j.create_run("r1", session_id="s", spec={}, created_at=1.0, timeout_s=None)
    await j.transition("r1", S.STARTING)
    await j.transition("r1", S.RUNNING)
    await j.set_partial("r1", {"_id": "r1", "progress": "p"})
    ok = await j.finish("r1", S.CANCELLED, reason="user", result=None, partial=True)
    assert ok
    seq = await j.append_event("r1", "log", {"after": "finish"})
    assert seq == 1, seq
    # No aclose, no flush, no atexit: the process dies the instant the call returned.
    os.kill(os.getpid(), signal.SIGKILL)

trio.run(main, sys.argv[1])
"""


async def test_a_terminal_fact_survives_a_sigkill_right_after_the_call_returns(
    db: Path,
) -> None:
    with trio.fail_after(30):
        proc = await trio.run_process([sys.executable, "-c", _CHILD, str(db)], check=False, capture_stderr=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert Path(f"{db}-wal").exists()  # nothing checkpointed or cleaned up: a real crash
    async with await Journal.open(db) as j:
        run = await j.get_run("r1")
        assert run is not None
        assert (run["state"], run["reason"], run["partial"]) == (S.CANCELLED, "user", True)
        assert run["result"] == {"_id": "r1", "progress": "p"}
        events = await j.events_after("r1", 0)
        assert events[-1]["seq"] == 1 and events[-1]["data"] == {"after": "finish"}


# --------------------------------------------------------------------------- degraded mode (issue 10)


async def test_text_sqlite_cannot_bind_is_stored_escaped_not_refused(journal: Journal) -> None:
    await new_run(journal, "r-\ud800")
    assert await journal.transition("r-\ud800", RunState.STARTING, reason="why \udfff")
    row = await journal.get_run("r-\ud800")
    assert row is not None and row["id"] == "r-\\ud800" and row["reason"] == "why \\udfff"
    await journal.add_group("r-\ud800", 77, "mcp\ud800", "n")
    assert (await journal.get_run("r-\ud800"))["groups"][0]["kind"] == "mcp\\ud800"  # type: ignore[index]


def test_store_conditions_are_unavailable_and_statement_errors_are_not() -> None:
    from supervisor.errors import JournalUnavailable
    from supervisor.store import journal as journal_mod

    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]
    readonly = sqlite3.OperationalError("attempt to write a readonly database")
    readonly.sqlite_errorcode = 8 | (1 << 8)  # type: ignore[attr-defined]  # an extended code
    constraint = sqlite3.IntegrityError("UNIQUE constraint failed")
    constraint.sqlite_errorcode = 19  # type: ignore[attr-defined]
    assert isinstance(journal_mod._journal_error("j", full), JournalUnavailable)
    assert isinstance(journal_mod._journal_error("j", readonly), JournalUnavailable)
    error = journal_mod._journal_error("j", constraint)
    assert isinstance(error, JournalError) and not isinstance(error, JournalUnavailable)


async def test_events_kept_in_memory_are_put_back_with_their_numbers_idempotently(journal: Journal) -> None:
    await new_run(journal, "r-1")
    assert await journal.append_event("r-1", "a", {"n": 1}) == 1
    assert await journal.put_events("r-1", [(2, "b", {"n": 2}, 2.0), (3, "c", {"n": 3}, 3.0)]) == 2
    assert await journal.put_events("r-1", [(3, "c", {"n": 3}, 3.0)]) == 0  # a replay changes nothing
    assert await journal.append_event("r-1", "d", {"n": 4}) == 4  # the counter moved past them
    assert [e["seq"] for e in await journal.events_after("r-1", 0)] == [1, 2, 3, 4]


async def test_an_events_page_is_bounded_in_bytes_and_says_whether_more_follow(journal: Journal) -> None:
    await new_run(journal, "r-1")
    await journal.append_events("r-1", [("log", {"m": "x" * 1000}, None) for _ in range(10)])
    page, more = await journal.events_page("r-1", 0, limit=100, max_bytes=3500)
    assert [e["seq"] for e in page] == [1, 2, 3] and more
    page, more = await journal.events_page("r-1", 0, limit=100, max_bytes=10)  # at least one
    assert [e["seq"] for e in page] == [1] and more
    page, more = await journal.events_page("r-1", 8, limit=100, max_bytes=None)
    assert [e["seq"] for e in page] == [9, 10] and not more
    page, more = await journal.events_page("r-1", 0, limit=10)
    assert len(page) == 10 and not more


async def test_a_terminal_fact_kept_in_memory_is_written_from_whatever_live_state_was_stored(
    journal: Journal,
) -> None:
    await new_run(journal, "r-1")  # stored: queued; in memory it went on to running
    assert not await journal.finish("r-1", RunState.COMPLETED, reason=None, result={}, partial=False)
    assert await journal.finish(
        "r-1", RunState.COMPLETED, reason=None, result={"ok": 1}, partial=False, from_any_live_state=True
    )
    assert not await journal.finish(  # and still only once
        "r-1", RunState.CANCELLED, reason="user", result=None, partial=False, from_any_live_state=True
    )
    assert (await journal.get_run("r-1"))["state"] == RunState.COMPLETED  # type: ignore[index]


async def test_groups_end_with_the_terminal_fact_when_the_tree_was_seen_dead(journal: Journal) -> None:
    await new_run(journal, "r-1")
    await journal.transition("r-1", RunState.STARTING)
    await journal.add_group("r-1", 100, "mcp_server", "a", at=10.0)
    await journal.add_group("r-1", 101, "command", "b", at=11.0)
    await journal.remove_group("r-1", 101, at=12.0)
    assert await journal.finish(
        "r-1", RunState.CANCELLED, reason="user", result=None, partial=False, groups_ended_at=20.0
    )
    groups = {g["pgid"]: g for g in (await journal.get_run("r-1"))["groups"]}  # type: ignore[index]
    assert (groups[100]["alive"], groups[100]["ended_at"]) == (False, 20.0)
    assert (groups[101]["alive"], groups[101]["ended_at"]) == (False, 12.0)  # its own end kept


async def test_a_v3_journal_gains_awaiting_approval_and_sessions_and_keeps_its_runs_and_guards(db: Path) -> None:
    conn = _journal_schema.connect(str(db), target=3)
    for n, state in enumerate(["running", "completed"]):
        conn.execute(
            "INSERT INTO runs (id, session_id, state, created_at, spec, last_seq) VALUES (?, 's', ?, ?, '{}', 1)",
            (f"r{n}", state, float(n)),
        )
        conn.execute("INSERT INTO events VALUES (?, 1, 1.0, 'log', '{}')", (f"r{n}",))
    with pytest.raises(sqlite3.IntegrityError):  # version 3 does not know the state
        conn.execute("UPDATE runs SET state = 'awaiting_approval' WHERE id = 'r0'")
    conn.close()
    async with await Journal.open(db) as j:
        assert await j.transition("r0", S.AWAITING_APPROVAL)
        assert [r["id"] for r in await j.list_runs()] == ["r1", "r0"]
        assert (await j.events_after("r1"))[0]["seq"] == 1
        assert await j.open_session("s") is None
    conn = raw(db)
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET state = 'running' WHERE id = 'r1'")
    with pytest.raises(sqlite3.IntegrityError, match="live run cannot be deleted"):
        conn.execute("DELETE FROM runs WHERE id = 'r0'")
    conn.execute("PRAGMA foreign_keys = ON")
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("INSERT INTO events VALUES ('nobody', 1, 1.0, 'log', '{}')")
    conn.close()


# -- the spawn path: fewer commits in a row --------------------------------------------------


async def commits_of(journal: Journal, write: Callable[[], Awaitable[Any]]) -> tuple[Any, list[str]]:
    """``write``'s value, and the COMMITs (each with its synchronous mode) it made."""
    seen: list[str] = []

    def trace(sql: str) -> None:
        if sql.strip().upper() == "COMMIT":
            seen.append("FULL" if store_ref[0]._full else "NORMAL")

    store_ref: list[Any] = []

    def on(store: Any) -> None:
        store_ref.append(store)
        store._conn.set_trace_callback(trace)

    await journal._call(on)
    try:
        value = await write()
    finally:
        await journal._call(lambda store: store._conn.set_trace_callback(None))
    return value, seen


async def test_a_new_run_and_its_queued_event_are_one_fsynced_commit(journal: Journal) -> None:
    seqs, commits = await commits_of(
        journal,
        lambda: journal.create_run(
            "r1", session_id=None, spec={}, created_at=T0, timeout_s=None, events=[("state", {"state": "queued"}, T0)]
        ),
    )
    assert seqs == [1] and commits == ["FULL"]
    (event,) = await journal.events_after("r1")
    assert (event["seq"], event["kind"], event["data"], event["ts"]) == (1, "state", {"state": "queued"}, T0)
    # A duplicate id writes nothing, its events included.
    with pytest.raises(JournalError):
        await journal.create_run("r1", session_id=None, spec={}, created_at=T0, timeout_s=None, events=[("x", {}, T0)])
    assert len(await journal.events_after("r1")) == 1


async def test_a_run_that_starts_at_once_is_created_queued_and_started_in_one_fsynced_commit(
    journal: Journal,
) -> None:
    start = RunStart(T0, [("state", {"state": "starting"}, T0)], T0 + 30, {"pid": 7, "tree_id": "t-7"})
    seqs, commits = await commits_of(
        journal,
        lambda: journal.create_run(
            "r1",
            session_id=None,
            spec={},
            created_at=T0,
            timeout_s=30.0,
            events=[("state", {"state": "queued"}, T0)],
            start=start,
        ),
    )
    assert seqs == [1, 2] and commits == ["FULL"]
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["state"], run["started_at"], run["deadline"], run["pid"], run["tree_id"]) == (
        "starting",
        T0,
        T0 + 30,
        7,
        "t-7",
    )
    assert [e["data"]["state"] for e in await journal.events_after("r1")] == ["queued", "starting"]
    # A bad process record is refused before anything is written.
    with pytest.raises(ValueError):
        await journal.create_run(
            "r2", session_id=None, spec={}, created_at=T0, timeout_s=None, start=RunStart(T0, [], None, {"x": 1})
        )
    assert await journal.get_run("r2") is None


async def test_a_runs_start_its_event_deadline_and_process_record_are_one_fsynced_commit(journal: Journal) -> None:
    await new_run(journal)
    process = {"pid": 4242, "pid_start_time": 123.5, "pgid": 4242, "tree_id": "t-1", "run_dir": "/runs/r1"}
    got, commits = await commits_of(
        journal,
        lambda: journal.start_run(
            "r1", at=T0 + 1, events=[("state", {"state": "starting"}, T0 + 1)], deadline=T0 + 31, process=process
        ),
    )
    assert got == (True, [1]) and commits == ["FULL"]
    run = await journal.get_run("r1")
    assert run is not None
    assert (run["state"], run["started_at"], run["deadline"]) == ("starting", T0 + 1, T0 + 31)
    assert {k: run[k] for k in process} == process  # type: ignore[literal-required]
    # Compare-and-set: a run that may not start does not, and gets no event.
    assert await journal.start_run("r1", at=T0 + 2, events=[("state", {"state": "starting"}, T0 + 2)]) == (False, [])
    assert [e["seq"] for e in await journal.events_after("r1")] == [1]
    # A bad field, or a run that is not there, writes nothing.
    await new_run(journal, "r2")
    with pytest.raises(ValueError):
        await journal.start_run("r2", at=T0, events=[("state", {}, T0)], process={"pid = 1, state": 1})
    with pytest.raises(RunNotFound):
        await journal.start_run("nope", at=T0, events=[("state", {}, T0)], deadline=T0)
    run2 = await journal.get_run("r2")
    assert run2 is not None and (run2["state"], run2["last_seq"], run2["deadline"]) == ("queued", 0, None)


async def test_a_runs_start_in_a_group_after_stream_writes_still_commits_fsynced(journal: Journal) -> None:
    await new_run(journal)
    await new_run(journal, "r2", state=S.RUNNING)
    results: dict[str, Any] = {}

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        results[name] = await fn()

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await journal.append_event("r2", "log", {})  # the connection commits NORMAL now
            release = await hold_the_worker(journal, n)
            n.start_soon(call, "log", lambda: journal.append_event("r2", "log", {}))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "start", lambda: journal.start_run("r1", at=T0, events=[("state", {}, T0)], deadline=T0))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert results == {"log": 2, "start": (True, [1])}
    assert await journal._call(lambda store: store._conn.execute("PRAGMA synchronous").fetchone()[0]) == 2


async def test_a_read_in_a_group_that_could_not_be_committed_is_answered_alone(journal: Journal) -> None:
    # A full disk fails the group's commit: a read grouped with the writes failed with
    # "database or disk is full" too (a `status` while the journal was degraded).
    await new_run(journal, "r0")
    outcomes: dict[str, Any] = {}

    async def call(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            outcomes[name] = await fn()
        except JournalError as exc:
            outcomes[name] = exc

    def lose_the_transaction(store: Any) -> None:  # as SQLite does on a full disk or an I/O error
        store._conn.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            release = await hold_the_worker(journal, n)
            n.start_soon(call, "write", lambda: new_run(journal, "a"))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "read", lambda: journal.get_run("a"))  # sees "a", never committed
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "read r0", lambda: journal.get_run("r0"))
            await trio.lowlevel.checkpoint()
            n.start_soon(call, "failing", lambda: journal._call(lose_the_transaction))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert isinstance(outcomes["write"], JournalError) and isinstance(outcomes["failing"], JournalError)
    assert outcomes["read"] is None  # answered alone: "a" is not in the journal
    assert outcomes["read r0"] is not None and outcomes["read r0"]["id"] == "r0"
