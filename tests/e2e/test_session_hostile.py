"""Acceptance: what a run's model sends cannot break its session's later turns.

Real daemon processes (``tests/children/daemon_main.py``), the real runner with the
scripted model, a real journal and websocket. The scripted model sends a call's arguments
as a raw string, as a hostile (prompt-injected) model can.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.e2e.test_conversations import Session
from tests.supervisor.test_restart_stop import daemon

SCENARIO_S = 60.0


def scripted(turns: list[Any], final: str = "done") -> dict[str, Any]:
    return {"provider": "scripted", "script": {"turns": turns, "final": final}}


async def test_a_call_with_arguments_nested_too_deep_to_decode_leaves_its_session_usable(tmp_path: Path) -> None:
    # 5,000 levels of brackets (10 KB): the runner refuses the call (invalid_arguments, not
    # decodable), but the daemon rebuilt the session's history with json.loads on the
    # record's text, whose RecursionError was no ValueError: `history` and every later
    # turn's spawn of the session were refused "internal error", for good.
    deep = '{"command": "true", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    call = {"name": "run_command", "id": "call_deep", "arguments": deep}
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            spec = {"task": "go deep", "model": scripted([{"text": "deep", "tool_calls": [call]}])}
            first = await c.call("spawn", spec=spec, session_id="chat-deep")
            turn1 = await s.end(first["run_id"])
            history = await s.reply("history", session_id="chat-deep")
            second = await s.reply("spawn", spec={"task": "and now?", "model": scripted([])}, session_id="chat-deep")
            assert second["ok"] is True, second
            turn2 = await s.end(second["result"]["run_id"])
    (rec,) = turn1["tool_calls"]
    assert rec["state"] == "failed" and rec["reason"].startswith("invalid_arguments: not decodable JSON"), rec
    assert history["ok"] is True, history
    messages = history["result"]["messages"]
    (asked,) = [m for m in messages if m.get("tool_calls")]
    assert asked["tool_calls"][0]["id"] == "call_deep" and asked["tool_calls"][0]["function"]["arguments"] == "{}"
    (told,) = [m for m in messages if m["role"] == "tool"]
    assert told["content"].startswith("error: invalid_arguments: not decodable JSON"), told
    assert turn2["state"] == "completed", turn2
