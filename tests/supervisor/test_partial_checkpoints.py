"""A run's partial result is checkpointed, not rewritten whole at each snapshot.

The daemon folds each ``step_snapshot`` delta into the run's partial result in memory and
journals the whole of it only as a checkpoint (``supervisor.core.progress.checkpoint_due``);
every reader of the journal (``status``, a restart's recovery, a lost run's result) gets the
checkpoint with the deltas after it folded in, and a run's end stores it whole. Rewritten
whole at each snapshot, a 150-step run with 1,000-character texts wrote its partial result
~300 times, ~11 MB for a 50 KB result. Real daemons and runners; the journal's migration.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.events import SnapshotDeltas
from supervisor.states import RunState
from supervisor.store import _schema as _journal_schema
from supervisor.store._ops import Store
from supervisor.store.journal import SCHEMA_VERSION, Journal
from tests.supervisor.test_restart_stop import daemon, kill9, wait_call_running
from tests.supervisor.test_snapshots import (
    all_events,
    all_events_over,
    folded,
    in_process_daemon,
    kill_runner,
    snapshot_bytes,
)


def many_steps(n: int, chars: int, *, last: str) -> dict[str, Any]:
    turns = [
        {
            "text": f"step {i}: " + "x" * chars,
            "tool_calls": [{"name": "run_command", "arguments": {"command": f"echo out-{i}"}}],
        }
        for i in range(1, n)
    ]
    turns.append(
        {"text": f"step {n}: waiting", "tool_calls": [{"name": "run_command", "arguments": {"command": last}}]}
    )
    return {"turns": turns, "chunk_size": 4096}


async def test_the_bytes_written_for_a_runs_partial_result_grow_with_its_length_not_its_square(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[int] = []
    real = Store.set_partial

    def counting(self: Store, run_id: str, snapshot_id: object, snapshot: str, seq: int | None = None) -> bool:
        written.append(len(snapshot))
        return real(self, run_id, snapshot_id, snapshot, seq)

    monkeypatch.setattr(Store, "set_partial", counting)
    n = 80
    spec = {
        "task": "t",
        "limits": {"max_steps": n + 2},
        "model": {"provider": "scripted", "script": many_steps(n, 1000, last="true")},
    }
    async with in_process_daemon(tmp_path, monkeypatch) as m:
        with trio.fail_after(90):
            rid = (await m.spawn(spec))["run_id"]
            st = await m.wait_terminal(rid)
            events = await all_events(m, rid)
    assert st["state"] == "completed", st
    deltas = snapshot_bytes(events)
    whole = len(json.dumps(folded(events)))
    # Checkpoints cost about what the deltas do (each is written once the deltas since the
    # last one are as big as it was): linear. Whole at each snapshot, ~n/2 times a whole one.
    assert sum(written) <= 2 * deltas + 64 * 1024, (sum(written), deltas, whole, len(written))
    assert len(written) <= 12, written


async def test_after_a_daemon_kill_9_mid_run_the_partial_result_is_the_fold_of_all_its_events(
    tmp_path: Path,
) -> None:
    """Many steps, the last checkpoint well behind the last snapshot; the daemon is
    SIGKILLed; the new daemon's status and, the runner then SIGKILLed, the run's partial
    result are the fold of every snapshot event the journal holds."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir()
    go = shared / "go"
    n = 40
    script = many_steps(n, 1000, last=f"while [ ! -e {go} ]; do sleep 0.02; done; echo last")
    script["turns"].append(
        {"text": "after the restart", "tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 300"}}]}
    )
    spec = {
        "task": "t",
        "limits": {"max_steps": n + 3},
        "model": {"provider": "scripted", "script": script},
        "sandbox": {"write": [str(shared)]},
    }
    with trio.fail_after(90):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, f"call_{n}_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            await kill9(d1, c)
        # What the journal holds as the checkpoint: behind the snapshots journaled after it.
        conn = sqlite3.connect(state / "agentd.sqlite3")
        cp_text, cp_seq = conn.execute("SELECT partial_snapshot, partial_seq FROM runs WHERE id = ?", (rid,)).fetchone()
        conn.close()
        async with daemon(state, grace_s=5.0) as (d2, c):
            recovered = await c.call("status", run_id=rid)
            events_then = await all_events_over(c, rid)
            go.touch()
            await wait_call_running(c, rid, f"call_{n + 1}_1")
            before = await c.call("status", run_id=rid)
            kill_runner(runner)
            assert await c.wait_for(rid) == "failed"
            final = await c.call("status", run_id=rid)
            events = await all_events_over(c, rid)
    checkpoint = json.loads(cp_text)
    assert cp_seq is not None and checkpoint["snapshot_n"] < folded(events_then)["snapshot_n"]  # type: ignore[index]
    assert recovered["partial_snapshot"] == folded(events_then)
    assert [x["id"] for x in recovered["partial_snapshot"]["tool_calls"]] == [f"call_{i}_1" for i in range(1, n + 1)]
    result = final["result"]
    assert (final["reason"], final["partial"]) == ("runner_died", True)
    assert result["progress"] == "\n\n".join(t["text"] for t in script["turns"])
    assert folded(events) == result == before["partial_snapshot"]


async def test_a_journal_of_schema_5_is_migrated_and_its_partial_result_is_rebuilt_from_its_snapshots(
    tmp_path: Path,
) -> None:
    """A live run an older daemon journaled (its partial written whole, no checkpoint
    number), then more snapshot events: read after the migration, its partial result is
    the fold of them all; the new column is guarded once the run is terminal."""
    db = tmp_path / "agentd.sqlite3"
    deltas = SnapshotDeltas()
    sent = [
        {**deltas.next(step=i, progress="\n\n".join(f"said {k}" for k in range(1, i + 1)), records=[]), "_id": "old"}
        for i in range(1, 4)
    ]
    conn = _journal_schema.connect(str(db), target=5)
    conn.execute(
        "INSERT INTO runs (id, session_id, state, created_at, spec, last_seq, partial_snapshot) "
        "VALUES ('old', NULL, 'running', 1.0, '{}', 3, ?)",
        (json.dumps({"step": 1, "progress": "said 1", "tool_calls": [], "_id": "old", "snapshot_n": 1}),),
    )
    for i, d in enumerate(sent, 1):
        conn.execute("INSERT INTO events VALUES ('old', ?, 1.0, 'step_snapshot', ?)", (i, json.dumps(d)))
    conn.close()
    async with await Journal.open(db) as j:
        run = await j.get_run("old")
        assert run is not None
        assert run["partial_snapshot"] == {
            "step": 3,
            "progress": "said 1\n\nsaid 2\n\nsaid 3",
            "tool_calls": [],
            "_id": "old",
            "snapshot_n": 3,
        }
        assert await j.finish("old", RunState.LOST, reason="x", result=None, partial=True)
        run = await j.get_run("old")
        assert run is not None and run["result"] is not None
        assert run["result"]["progress"] == "said 1\n\nsaid 2\n\nsaid 3"
    conn = sqlite3.connect(db, isolation_level=None)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
    stored = conn.execute("SELECT partial_snapshot, partial_seq FROM runs WHERE id = 'old'").fetchone()
    assert json.loads(stored[0])["snapshot_n"] == 3 and stored[1] == 3  # stored whole at its end
    with pytest.raises(sqlite3.IntegrityError, match="terminal run is final"):
        conn.execute("UPDATE runs SET partial_seq = 1 WHERE id = 'old'")
    conn.close()
