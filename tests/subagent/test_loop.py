"""The agent loop in-process: honest records and a whole history on every path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.emit import Emitter
from subagent.events import ExitCode, RunStatus, ToolCallState
from subagent.loop import AgentLoop
from subagent.model.script import Script
from subagent.model.scripted import ScriptedProvider
from subagent.spec import RunSpec
from subagent.stop import StopControl
from subagent.tools.toolbox import ToolBox, ToolOutcome


def make_loop(tmp_path: Path, script: dict[str, Any], **limits: Any) -> AgentLoop:
    spec = RunSpec.from_dict({"task": "t", "limits": limits, "model": {"script": script}}, env={})
    fd = os.open(tmp_path / "events", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    emitter = Emitter(tmp_path, err_fd=fd, out_fd=fd)
    tools = ToolBox(builtins=spec.builtin_tools, limits=spec.limits, servers={}, on_group=lambda *a: None)
    return AgentLoop(
        spec=spec,
        provider=ScriptedProvider(Script.from_dict(script)),
        tools=tools,
        stop=StopControl(),
        emitter=emitter,
        run_id="r",
    )


def assert_history_whole(loop: AgentLoop) -> None:
    calls = [c["id"] for m in loop.messages if m.get("tool_calls") for c in m["tool_calls"]]
    answered = [m["tool_call_id"] for m in loop.messages if m["role"] == "tool"]
    assert sorted(calls) == sorted(answered)


TWO_CALLS = {
    "turns": [
        {
            "tool_calls": [
                {"name": "run_command", "arguments": {"command": "echo a"}},
                {"name": "run_command", "arguments": {"command": "echo b"}},
            ]
        }
    ]
}


async def test_a_bug_mid_batch_leaves_honest_records_and_a_whole_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = make_loop(tmp_path, TWO_CALLS)

    async def broken(*a: Any) -> ToolOutcome:
        raise RuntimeError("bug")

    monkeypatch.setattr(loop.tools, "execute", broken)
    with pytest.raises(RuntimeError):
        await loop.run()
    from subagent.loop import RunOutcome

    result = loop.result(RunOutcome(RunStatus.FAILED, ExitCode.INTERNAL, reason="internal"))
    states = [(t["state"], t["reason"].split(":")[0]) for t in result["tool_calls"]]
    assert states == [("unknown", "runner_failed"), ("not_started", "runner_failed")]
    assert_history_whole(loop)


async def test_a_stop_during_the_first_call_skips_the_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = make_loop(tmp_path, TWO_CALLS)
    real = loop.tools.execute

    async def run_then_stop(*a: Any) -> ToolOutcome:
        out = await real(*a)
        loop.stop.request("signal")  # as the first call ends
        return out

    monkeypatch.setattr(loop.tools, "execute", run_then_stop)
    outcome = await loop.run()
    assert outcome.status == RunStatus.CANCELLED and outcome.reason == "signal"
    assert [r.state for r in loop.records] == [ToolCallState.SUCCEEDED, ToolCallState.NOT_STARTED]
    assert_history_whole(loop)


async def test_a_stop_as_a_call_is_about_to_start_means_it_never_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    loop = make_loop(
        tmp_path, {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": f"touch {marker}"}}]}]}
    )
    real = loop.tools.execute

    async def stop_then_run(*a: Any) -> ToolOutcome:
        loop.stop.request("signal")  # after the loop's own check, before the spawn
        return await real(*a)

    monkeypatch.setattr(loop.tools, "execute", stop_then_run)
    outcome = await loop.run()
    assert outcome.status == RunStatus.CANCELLED
    (rec,) = loop.records
    assert (rec.state, rec.stop_effect, rec.started_at) == (ToolCallState.NOT_STARTED, "stopped_before_start", None)
    assert not marker.exists()
    assert_history_whole(loop)


async def test_a_deadline_during_the_model_turn_aborts_it(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    loop = make_loop(tmp_path, {"turns": [{"text": "slow", "delay_s": 100}]})
    async with trio.open_nursery() as nursery:

        async def deadline() -> None:
            await trio.sleep(5)
            loop.stop.request("timeout")

        nursery.start_soon(deadline)
        outcome = await loop.run()
        assert trio.current_time() == pytest.approx(5)
    assert outcome.status == RunStatus.CANCELLED and outcome.reason == "timeout"
