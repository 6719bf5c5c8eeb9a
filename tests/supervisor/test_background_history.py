"""A session's next turn is told that a background command its stopped turn started no
longer runs: the call's amended record (``background_ended``) is the one the journal keeps,
and the history the daemon rebuilds from it says the stop ended the command.

An in-process daemon (``serve``), real runners with the scripted model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from subagent.events import StopEffect
from subagent.history import HISTORY_BACKGROUND_ENDED_BY_STOP
from supervisor.core.runs import RunManager
from tests.supervisor.test_zygote import daemon


def turn(*turns: dict[str, Any], final: str | None = None) -> dict[str, Any]:
    script: dict[str, Any] = {"turns": list(turns)}
    if final is not None:
        script["final"] = final
    return {"task": "t", "model": {"provider": "scripted", "script": script}}


async def until_step(m: RunManager, run_id: str, step: int) -> None:
    async with m.subscribe(run_id) as events:
        async for ev in events:
            if ev.get("kind") == "step_started" and ev["data"].get("step") == step:
                return


async def test_the_next_turn_is_told_its_background_command_did_not_survive_the_stop(tmp_path: Path) -> None:
    serving = {"command": "echo serving; exec sleep 300", "background": True}
    with trio.fail_after(90):
        async with daemon(tmp_path) as m:
            first = await m.spawn(
                turn({"tool_calls": [{"name": "run_command", "arguments": serving}]}, {"text": "w", "hang": True}),
                session_id="chat",
            )
            await until_step(m, first["run_id"], 2)
            await m.cancel(first["run_id"])
            one = await m.wait_terminal(first["run_id"])
            second = await m.spawn(turn(final="done"), session_id="chat")
            two = await m.wait_terminal(second["run_id"])
    assert one["state"] == "cancelled"
    (call,) = one["tool_calls"]  # as the journal keeps it
    assert call["state"] == "succeeded" and call["stop_effect"] == StopEffect.BACKGROUND_ENDED, call
    assert two["state"] == "completed"
    told = [m["content"] for m in two["result"]["messages"] if m["role"] == "tool"]
    assert len(told) == 1 and HISTORY_BACKGROUND_ENDED_BY_STOP in told[0], told
