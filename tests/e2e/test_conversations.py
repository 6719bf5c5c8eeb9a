"""Acceptance: a session is a conversation; its next turn starts from what really happened.

Real daemon processes (``tests/children/daemon_main.py``), the real runner, a real SQLite
journal and websocket. The model is the real ``openai`` client against
``subagent.model.fake_openai`` (which, like the real API, refuses a history with a tool call that
has no result), so the test reads the very request the next turn sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from subagent.model.fake_openai import FakeOpenAI
from tests.supervisor.test_restart_stop import daemon, kill9

# Bounds one scenario (daemon starts, runner starts with openai imported, a stop).
SCENARIO_S = 90.0
STOP_NOTE = "[The user stopped this turn before it finished.]"


class Session:
    """Requests on one websocket, and waits on a run's events by predicate."""

    def __init__(self, client: Any) -> None:
        self.c = client

    async def wait(self, run_id: str, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """Subscribe from the start; the first event ``pred`` accepts, or None at the run's end."""
        await self.c.call("subscribe", run_id=run_id, after_seq=0)
        while True:
            msg = json.loads(await self.c.ws.get_message())
            if msg.get("op") == "event" and msg["run_id"] == run_id and pred(msg):
                await self.c.call("unsubscribe", sub=msg["sub"])
                return msg
            if msg.get("op") == "end" and msg["run_id"] == run_id:
                return None

    async def reply(self, op: str, **args: Any) -> dict[str, Any]:
        """The whole reply to one request, an error reply included."""
        self.c.n += 1
        await self.c.ws.send_message(json.dumps({"id": self.c.n, "op": op, **args}))
        while True:
            msg = json.loads(await self.c.ws.get_message())
            if msg.get("id") == self.c.n and "ok" in msg:
                return msg

    async def end(self, run_id: str) -> dict[str, Any]:
        assert await self.wait(run_id, lambda m: False) is None
        return await self.c.call("status", run_id=run_id)


def model(fake: FakeOpenAI) -> dict[str, Any]:
    return {"provider": "openai", "name": "fake-model", "base_url": fake.base_url}


def tool_running(msg: dict[str, Any]) -> bool:
    return msg["kind"] == "tool_call" and msg["data"]["record"]["state"] == "running"


async def file_appears(path: Path) -> None:
    # A file the run's command writes: polled, bounded by the caller's fail_after.
    while not path.exists():
        await trio.sleep(0.02)


async def test_the_turn_after_a_stopped_one_gets_its_honest_history_through_the_openai_client_and_completes(
    tmp_path: Path,
) -> None:
    script = {
        "turns": [
            {
                "text": "Counting the logs first.",
                "tool_calls": [
                    {
                        "name": "run_command",
                        "id": "call_long",
                        "arguments": {"command": "echo first-line; echo second-line; touch printed; sleep 300"},
                    }
                ],
            }
        ],
        "final": "Picking up where you stopped me.",
    }
    fake = FakeOpenAI(script)
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(fake.serve)
            async with daemon(state, grace_s=5.0) as (d1, c):
                s = Session(c)
                first = await c.call(
                    "spawn", spec={"task": "count the log lines", "model": model(fake)}, session_id="chat-1"
                )
                await s.wait(first["run_id"], tool_running)
                run_dir = Path((await c.call("status", run_id=first["run_id"]))["run_dir"])
                await file_appears(run_dir / "printed")  # the output is printed before the stop
                refused = await s.reply("spawn", spec={"task": "x", "model": model(fake)}, session_id="chat-1")
                await c.call("cancel", run_id=first["run_id"])
                turn1 = await s.end(first["run_id"])
                second = await c.call("spawn", spec={"task": "go on", "model": model(fake)}, session_id="chat-1")
                turn2 = await s.end(second["run_id"])
                history = await c.call("history", session_id="chat-1")
                await kill9(d1, c)
            async with daemon(state, grace_s=5.0) as (d2, c):
                after_restart = await c.call("history", session_id="chat-1")
                sessions = await c.call("sessions")
            nursery.cancel_scope.cancel()
    assert refused["ok"] is False
    assert refused["error"]["code"] == "session_busy" and first["run_id"] in refused["error"]["message"]
    assert turn1["state"] == "cancelled" and turn1["reason"] == "user"
    assert turn2["state"] == "completed" and turn2["result"]["final_text"] == "Picking up where you stopped me."
    # What the server received for turn 2: the whole honest history, then the new task.
    assert [r.rejected for r in fake.chat_requests] == [None, None]
    messages = fake.chat_requests[-1].body["messages"]
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "system", "user"], messages
    assert messages[1]["content"] == "count the log lines" and messages[-1]["content"] == "go on"
    assistant = messages[2]
    assert assistant["content"] == "Counting the logs first."
    (call,) = assistant["tool_calls"]
    assert call["id"] == "call_long" and call["function"]["name"] == "run_command"
    assert json.loads(call["function"]["arguments"])["command"].startswith("echo first-line")
    result = messages[3]
    assert result["tool_call_id"] == "call_long"
    assert result["content"].startswith("interrupted by the stop; output known before the interruption:")
    assert "first-line\nsecond-line" in result["content"]
    assert messages[4]["content"] == STOP_NOTE
    # The transcript is the journal's: the same after a kill -9 and a restart.
    assert history["turns"] and after_restart == history
    assert [t["run_id"] for t in history["turns"]] == [first["run_id"], second["run_id"]]
    assert history["messages"] == [*messages[1:], {"role": "assistant", "content": "Picking up where you stopped me."}]
    (row,) = sessions["sessions"]
    assert row["session_id"] == "chat-1" and row["turns"] == 2 and row["last_state"] == "completed"


async def test_a_call_cut_mid_stream_is_not_in_the_next_turn_as_a_call(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "text": "Let me delete it.",
                "tool_calls": [
                    {"name": "run_command", "id": "call_cut", "arguments": {"command": "rm -rf data"}, "cut_after": 9}
                ],
            },
            "I could not finish that call.",
        ],
        "final": "Second turn done.",
    }
    fake = FakeOpenAI(script)
    with trio.fail_after(SCENARIO_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(fake.serve)
            async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
                s = Session(c)
                first = await c.call("spawn", spec={"task": "clean up", "model": model(fake)}, session_id="chat-2")
                turn1 = await s.end(first["run_id"])
                second = await c.call("spawn", spec={"task": "and now?", "model": model(fake)}, session_id="chat-2")
                turn2 = await s.end(second["run_id"])
                history = await c.call("history", session_id="chat-2")
            nursery.cancel_scope.cancel()
    assert turn1["state"] == "completed"
    (cut,) = turn1["tool_calls"]
    assert (
        cut["id"] == "call_cut" and cut["state"] == "not_started" and cut["reason"].startswith("arguments_incomplete")
    )
    assert turn2["state"] == "completed" and turn2["result"]["final_text"] == "Second turn done."
    sent = fake.chat_requests[-1].body["messages"]
    for messages in (sent, history["messages"]):
        assert not [m for m in messages if m.get("tool_calls") or m["role"] == "tool"], messages
        assert "call_cut" not in json.dumps(messages)
    # The cut turn's text stays: the model said it.
    assert [m["content"] for m in sent if m["role"] == "assistant"] == [
        "Let me delete it.",
        "I could not finish that call.",
    ]
