"""Acceptance: a Stop meant for one turn of a session never stops the next turn.

Real daemon processes (``tests/children/daemon_main.py``), the real runner with the
scripted model, a real SQLite journal and websocket. A session's turns follow each other
(one live at a time); a ``cancel`` by session that names its turn (``run_id`` with
``session_id``) stops that turn or nothing, whatever turn is live when it arrives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from tests.supervisor.test_restart_stop import daemon, reading, wait_call_running

# Bounds one scenario (a daemon start, two or three runner starts, a stop).
SCENARIO_S = 60.0


def gated(text: str, flag: Path) -> dict[str, Any]:
    """A model step whose command runs until ``flag`` exists."""
    command = f"while [ ! -e {flag} ]; do sleep 0.02; done; echo {text}"
    return {"text": text, "tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}


def turns_spec(shared: Path) -> dict[str, Any]:
    """The session's model steps: turn 1 answers at once ("one"); turn 2 runs a command
    gated on ``shared/go2``, then answers "done"; turn 3 runs one gated on ``shared/go3``."""
    steps = [{"text": "one"}, gated("two", shared / "go2"), {"text": "done"}, gated("three", shared / "go3")]
    return reading(steps, shared)


async def end_of(c: Any, run_id: str) -> dict[str, Any]:
    assert await c.wait_for(run_id) is not None
    return dict(await c.call("status", run_id=run_id))


async def test_a_bare_session_cancel_stops_whichever_turn_is_live_when_it_arrives(tmp_path: Path) -> None:
    # The race a bare ``cancel --session`` has (documented): the Stop a person pressed on
    # turn 1 that arrives once turn 2 has started stops turn 2.
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_, c):
            t1 = (await c.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            first = await end_of(c, t1)
            t2 = (await c.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            await wait_call_running(c, t2, "call_2_1")
            reply = await c.call("cancel", session_id="chat")
            second = await end_of(c, t2)
    assert first["state"] == "completed", first
    assert [r["run_id"] for r in reply["runs"]] == [t2] and reply["was_active"] is True, reply
    assert second["state"] == "cancelled" and second["reason"] == "user", second


async def test_a_session_cancel_naming_an_ended_turn_stops_nothing_and_says_which_turn_is_live(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_, c):
            t1 = (await c.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            await end_of(c, t1)
            t2 = (await c.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            await wait_call_running(c, t2, "call_2_1")
            # The Stop pressed on turn 1, arriving now: it names turn 1.
            late = await c.call("cancel", session_id="chat", run_id=t1)
            again = await c.call("cancel", session_id="chat", run_id=t1)
            (shared / "go2").touch()  # turn 2 goes on to its end: stopped, it would end cancelled
            second = await end_of(c, t2)
            # Naming the live turn stops it (a third turn, stopped by a cancel naming it).
            t3 = (await c.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            await wait_call_running(c, t3, "call_4_1")
            meant = await c.call("cancel", session_id="chat", run_id=t3)
            third = await end_of(c, t3)
            after = await c.call("cancel", session_id="chat", run_id=t3)
    ended = {"session_id": "chat", "was_active": False, "live_run": t2}
    assert late == {**ended, "runs": [{"run_id": t1, "was_active": False, "state": "completed"}]}, late
    assert again == late
    assert second["state"] == "completed" and second["result"]["final_text"] == "done", second
    assert second["cancel_reason"] is None, second
    assert meant["was_active"] is True and [r["run_id"] for r in meant["runs"]] == [t3], meant
    assert meant["live_run"] in (t3, None)  # stopping, or ended already (an interrupted command)
    assert third["state"] == "cancelled" and third["cancel_reason"] == "user", third
    assert third["tool_calls"][-1]["state"] == "cancelled", third  # stopped in its gated command
    assert after["was_active"] is False and after["runs"][0]["state"] == "cancelled" and after["live_run"] is None


async def test_a_session_cancel_naming_a_run_of_another_session_or_none_is_refused_and_stops_nothing(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_, c):
            other = (await c.call("spawn", spec=turns_spec(shared), session_id="other"))["run_id"]
            await end_of(c, other)
            gated_turn = reading([gated("solo", shared / "go")], shared)
            live = (await c.call("spawn", spec=gated_turn, session_id="chat"))["run_id"]
            await wait_call_running(c, live, "call_1_1")
            foreign = await reply(c, "cancel", session_id="chat", run_id=other)
            missing = await reply(c, "cancel", session_id="chat", run_id="r-never")
            with_many = await reply(c, "cancel", session_id="chat", run_ids=[live])
            (shared / "go").touch()
            final = await end_of(c, live)
    assert foreign["ok"] is False and foreign["error"]["code"] == "bad_args", foreign
    assert "not a turn of session 'chat'" in foreign["error"]["message"], foreign
    assert missing["ok"] is False and missing["error"]["code"] == "not_found", missing
    assert with_many["ok"] is False and with_many["error"]["code"] == "bad_args", with_many
    assert final["state"] == "completed" and final["cancel_reason"] is None, final


async def reply(c: Any, op: str, **args: Any) -> dict[str, Any]:
    """The whole reply to one request, an error reply included."""
    c.n += 1
    await c.ws.send_message(json.dumps({"id": c.n, "op": op, **args}))
    while True:
        msg = json.loads(await c.ws.get_message())
        if msg.get("id") == c.n and "ok" in msg:
            return dict(msg)


class Wire:
    """Requests on one websocket, every message kept: a reply that comes while another
    is awaited (a ``spawn`` with ``interrupt`` answers once the live turn ended) is not lost."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.n = 0
        self.seen: list[dict[str, Any]] = []

    async def send(self, op: str, **args: Any) -> str:
        self.n += 1
        rid = f"w{self.n}"
        await self.ws.send_message(json.dumps({"id": rid, "op": op, **args}))
        return rid

    async def until(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        i = 0
        while True:
            while i < len(self.seen):
                if pred(self.seen[i]):
                    return self.seen.pop(i)
                i += 1
            self.seen.append(json.loads(await self.ws.get_message()))

    async def reply(self, rid: str) -> Any:
        msg = await self.until(lambda m: m.get("id") == rid and "ok" in m)
        assert msg["ok"] is True, msg
        return msg["result"]

    async def call(self, op: str, **args: Any) -> Any:
        return await self.reply(await self.send(op, **args))

    async def event(self, run_id: str, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first of the run's events (replayed from its start) that ``pred`` accepts."""
        sub = (await self.call("subscribe", run_id=run_id, after_seq=0))["sub"]
        msg = await self.until(lambda m: m.get("sub") == sub and (m.get("op") == "end" or pred(m)))
        assert msg["op"] == "event", f"run {run_id} ended first: {msg}"
        await self.call("unsubscribe", sub=sub)
        return msg

    async def end(self, run_id: str) -> dict[str, Any]:
        sub = (await self.call("subscribe", run_id=run_id, after_seq=0))["sub"]
        await self.until(lambda m: m.get("sub") == sub and m.get("op") == "end")
        return dict(await self.call("status", run_id=run_id))


def command_alive(msg: dict[str, Any]) -> bool:
    data = msg.get("data") or {}
    return msg.get("kind") == "process_group" and data.get("kind") == "command" and data.get("alive") is True


async def test_a_session_cancel_naming_turn_1_leaves_the_queued_turn_2_to_start_and_finish(tmp_path: Path) -> None:
    # Turn 2 waits for a place (max_concurrent 1, taken by a run of no session) once turn 1
    # has ended: the Stop meant for turn 1 neither cancels it queued nor follows it later.
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0, max_concurrent="1") as (_, c):
            w = Wire(c.ws)
            t1 = (await w.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            first = await w.end(t1)
            hold = (await w.call("spawn", spec=reading([gated("held", shared / "free")], shared)))["run_id"]
            await w.event(hold, command_alive)
            t2 = (await w.call("spawn", spec=turns_spec(shared), session_id="chat"))["run_id"]
            queued = (await w.call("status", run_id=t2))["state"]
            late = await w.call("cancel", session_id="chat", run_id=t1)
            (shared / "free").touch()  # the place frees: turn 2 starts
            await w.event(t2, command_alive)
            (shared / "go2").touch()
            second = await w.end(t2)
    assert first["state"] == "completed", first
    assert queued == "queued"
    assert late["was_active"] is False and late["live_run"] == t2 and late["runs"][0]["state"] == "completed", late
    assert second["state"] == "completed" and second["cancel_reason"] is None, second


async def test_a_session_cancel_while_an_interrupting_spawn_waits_stops_the_old_turn_and_never_the_new(
    tmp_path: Path,
) -> None:
    # Not sticky: a cancel reaches the turns live when it is answered, never one made after.
    # Turn 1's command ignores SIGTERM, so its stop lasts until the test lets it end; the
    # spawn with interrupt waits for that end before it makes turn 2.
    shared = tmp_path / "shared"
    shared.mkdir()
    stubborn = f"trap '' TERM; while [ ! -e {shared / 'go1'} ]; do sleep 0.02; done; echo one"
    first_turn = reading(
        [{"text": "one", "tool_calls": [{"name": "run_command", "arguments": {"command": stubborn}}]}], shared
    )
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=30.0) as (_, c):
            w = Wire(c.ws)
            t1 = (await w.call("spawn", spec=first_turn, session_id="chat"))["run_id"]
            await w.event(t1, command_alive)
            # Turn 2's model steps follow turn 1's one (an assistant message in its history).
            nxt = await w.send("spawn", spec=turns_spec(shared), session_id="chat", interrupt=True)
            await w.event(t1, lambda m: m.get("kind") == "state" and m["data"].get("state") == "cancelling")
            during = await w.call("cancel", session_id="chat")
            (shared / "go1").touch()  # turn 1's command ends; so does turn 1, and turn 2 is made
            t2 = (await w.reply(nxt))["run_id"]
            first = await w.end(t1)
            await w.event(t2, command_alive)
            (shared / "go2").touch()
            second = await w.end(t2)
    assert [r["run_id"] for r in during["runs"]] == [t1] and during["live_run"] == t1, during
    assert first["state"] == "cancelled", first
    assert second["state"] == "completed" and second["cancel_reason"] is None, second
