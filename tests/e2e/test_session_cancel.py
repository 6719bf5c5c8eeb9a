"""Acceptance: a Stop meant for one turn of a session never stops the next turn.

Real daemon processes (``tests/children/daemon_main.py``), the real runner with the
scripted model, a real SQLite journal and websocket. A session's turns follow each other
(one live at a time); a ``cancel`` by session that names its turn (``run_id`` with
``session_id``) stops that turn or nothing, whatever turn is live when it arrives.
"""

from __future__ import annotations

import json
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
    """Turn 1 answers at once ("one"); turn 2 (the session's second model step) runs a
    command gated on ``shared/go2``, then answers "done"."""
    return reading([{"text": "one"}, gated("two", shared / "go2")], shared)


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
