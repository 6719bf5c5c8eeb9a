"""Acceptance: a run still ``queued`` when the daemon is SIGKILLed runs once it is back.

Real daemon processes (``tests/children/daemon_main.py``) on one state dir with
``max_concurrent`` 1, the real runner with the scripted model busy in a long command, a
real SQLite file and a real websocket. The first daemon is SIGKILLed with one run busy and
two queued behind it (one a session's turn; acknowledged, journaled, no runner); the next one re-adopts the busy
run, which keeps its place, and queues the two again, in their order, with their ids and
specs: each ends ``completed`` (they were ended ``lost``, "never started"). Then, at the
unit level (``supervisor.core._requeue``, a real journal): a queued run whose spec no
longer validates at the restart, or that had its own model key, ends ``failed`` saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.config import Config
from supervisor.core._book import RunBook
from supervisor.core._requeue import NOT_REQUEUED, OWN_MODEL_KEY, REQUEUED, requeue
from supervisor.core._run import Run
from supervisor.core.token import CancelToken
from supervisor.protocol import Secret
from supervisor.states import RunState
from supervisor.store.journal import Journal
from tests.supervisor.test_restart_stop import command_spec, daemon, kill9, wait_gone


async def test_runs_queued_at_a_sigkill_run_after_the_restart_in_their_order_not_lost(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with trio.fail_after(120):
        async with daemon(state, grace_s=5, max_concurrent="1") as (d1, c):
            busy = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await c.wait_for(busy, kind="process_group")  # its command runs: the one place taken
            second = await c.call("spawn", spec=command_spec("echo second"))
            third = await c.call("spawn", spec=command_spec("echo third"), session_id="s1")  # a session's turn
            assert (second["state"], third["state"]) == ("queued", "queued")  # acknowledged
            runner = (await c.call("status", run_id=busy))["pid"]
            await kill9(d1, c)
        assert psutil.pid_exists(runner)  # the busy run goes on with no daemon

        async with daemon(state, grace_s=5, max_concurrent="1") as (d2, c):
            waiting = await c.call("status", run_id=second["run_id"])
            assert waiting["state"] == "queued" and waiting["live"] is True, waiting
            assert (await c.call("status", run_id=busy))["state"] == "running"  # re-adopted
            assert (await c.call("cancel", run_id=busy))["was_active"] is True
            assert await c.wait_for(busy) == "cancelled"
            assert await c.wait_for(second["run_id"]) == "completed"
            assert await c.wait_for(third["run_id"]) == "completed"
            ends = [await c.call("status", run_id=r) for r in (busy, second["run_id"], third["run_id"])]
            events = {r: (await c.call("events", run_id=r))["events"] for r in (second["run_id"], third["run_id"])}
        await wait_gone(runner, 10)
    first, two, three = ends
    # One place: the re-adopted run kept it; the re-queued ones took it in their order.
    assert first["ended_at"] <= two["started_at"] and two["ended_at"] <= three["started_at"], ends
    for st, text in ((two, "second"), (three, "third")):
        assert (st["state"], st["reason"]) == ("completed", None), st
        (call,) = st["tool_calls"]
        assert call["state"] == "succeeded" and text in call["output"], call
        kinds = [e["kind"] for e in events[st["id"]]]
        states = [e["data"]["state"] for e in events[st["id"]] if e["kind"] == "state"]
        assert states == ["queued", "starting", "running", "completed"], states
        assert kinds.index(REQUEUED) < kinds.index("runner_started"), kinds  # said before it started
        assert ("session" in kinds) is (st["session_id"] == "s1"), kinds  # its turn prepared at its start
        (requeued,) = [e["data"] for e in events[st["id"]] if e["kind"] == REQUEUED]
        assert requeued["created_at"] == st["created_at"] < requeued["requeued_at"] <= st["started_at"]


# --------------------------------------------------------------------- unit level


async def queued_row(journal: Journal, run_id: str, spec: dict[str, Any], **queued: Any) -> Any:
    """A run as a killed daemon left it: its record and its ``queued`` event, nothing more."""
    await journal.create_run(
        run_id,
        session_id=None,
        spec={**spec, "run_id": run_id},
        created_at=1.0,
        timeout_s=None,
        events=[("state", {"state": "queued", **queued}, 1.0)],
    )
    (row,) = [r for r in await journal.live_runs() if r["id"] == run_id]
    return row


async def test_a_queued_run_whose_spec_no_longer_validates_at_the_restart_ends_failed_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Valid at its spawn (the daemon had a key); the restarted daemon has none (a config
    # change): the run cannot run, and says so, instead of failing in its runner or
    # taking the daemon's recovery down.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    config = Config(state_dir=tmp_path / "state")
    openai = {"task": "t", "model": {"provider": "openai", "name": "gpt-4o-mini"}}
    scripted = command_spec("echo fine")
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        book = RunBook(journal)
        bad = await requeue(book, config, await queued_row(journal, "r-bad", openai))
        keyed = await requeue(book, config, await queued_row(journal, "r-key", scripted, **{OWN_MODEL_KEY: True}))
        good = await requeue(book, config, await queued_row(journal, "r-good", scripted))
        rows = {r: await journal.get_run(r) for r in ("r-bad", "r-key", "r-good")}
        events = {r: await journal.events_after(r, 0) for r in rows}
    assert bad is None and keyed is None
    assert good is not None and (good.run_id, good.state, good.spec["run_id"]) == ("r-good", RunState.QUEUED, "r-good")
    failed = rows["r-bad"]
    assert failed is not None and (failed["state"], failed["reason"]) == ("failed", NOT_REQUEUED), failed
    error = failed["error"]
    assert error is not None and error["code"] == "bad_spec", error
    assert "no longer validates" in error["message"] and "API key" in error["message"], error
    keyless = rows["r-key"]
    assert keyless is not None and keyless["state"] == "failed", keyless
    assert keyless["error"] is not None and keyless["error"]["code"] == "model_key_gone", keyless
    assert [e["data"]["state"] for e in events["r-bad"] if e["kind"] == "state"] == ["queued", "failed"]
    assert REQUEUED not in [e["kind"] for e in events["r-bad"]]
    assert [e["kind"] for e in events["r-good"]] == ["state", REQUEUED]
    assert rows["r-good"] is not None and rows["r-good"]["state"] == "queued"


async def test_a_spawn_with_its_own_model_key_says_so_in_its_queued_event_never_the_key(tmp_path: Path) -> None:
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        book = RunBook(journal)
        for run_id, key in (("r-own", Secret("sk-never-journaled")), ("r-daemons", None)):
            run = Run(run_id=run_id, session_id=None, spec={}, timeout_s=None, token=CancelToken(run_id), model_key=key)
            await book.create(run, created_at=1.0)
        own, daemons = [(await journal.events_after(r, 0))[0]["data"] for r in ("r-own", "r-daemons")]
    assert own == {"state": "queued", OWN_MODEL_KEY: True} and daemons == {"state": "queued"}
    assert "sk-never" not in (tmp_path / "j.sqlite3").read_bytes().decode(errors="replace")
