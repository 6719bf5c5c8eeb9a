"""The agent loop in-process: honest records and a whole history on every path."""

from __future__ import annotations

import json
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
from supervisor.protocol import ApproveRequest, decode_request


def make_loop(tmp_path: Path, script: dict[str, Any], emitter: Emitter | None = None, **limits: Any) -> AgentLoop:
    """A loop on the scripted model; its events go to ``emitter`` (default: a file in ``tmp_path``)."""
    spec = RunSpec.from_dict({"task": "t", "limits": limits, "model": {"script": script}}, env={})
    if emitter is None:
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


async def test_every_call_id_the_runner_keeps_can_be_answered_and_the_history_uses_it(tmp_path: Path) -> None:
    # approve/deny name a call by its id, and the protocol refuses blank ids and ids over
    # 256 characters: a call the model named so would wait, unanswerable, until its timeout.
    chosen = [" ", "x" * 300, "x" * 300, "y" * 256, "y" * 256, "\u00e9t\u00e9\u0001", "call_1", "call_1"]
    script = {"turns": [{"tool_calls": [{"name": "nope", "id": cid, "arguments": {}} for cid in chosen]}]}
    loop = make_loop(tmp_path, script)
    outcome = await loop.run()
    assert outcome.status == RunStatus.COMPLETED
    ids = [r.id for r in loop.records]
    assert len(set(ids)) == len(chosen)
    assert ids[-2:] == ["call_1", "call_1_2"]  # a safe id stays as the model chose it
    for cid in ids:
        assert cid.isascii() and cid.isprintable() and cid.strip() == cid, cid
        request = decode_request(json.dumps({"id": 1, "op": "approve", "run_id": "r", "call_id": cid}), max_bytes=4096)
        assert isinstance(request, ApproveRequest) and request.call_id == cid, request
    (asked,) = [m for m in loop.messages if m.get("tool_calls")]
    assert [c["id"] for c in asked["tool_calls"]] == ids
    assert [m["tool_call_id"] for m in loop.messages if m["role"] == "tool"] == ids


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


async def test_a_steer_is_not_applied_once_a_sigterm_came_as_the_step_began(tmp_path: Path) -> None:
    # The step's start is emitted on the daemon's pipe, which a busy daemon can hold for
    # half a second; a SIGTERM then, and the queued steer was applied (reported so) though
    # no model turn carried it.
    from subagent.events import EventKind
    from subagent.steering import SteeringQueue

    loop = make_loop(tmp_path, {"turns": [], "final": "done"})
    steered: list[dict[str, Any]] = []
    loop.steering = SteeringQueue(emit=lambda **kw: steered.append(kw))
    loop.steering.push("also check the disk", 0)
    emit = loop.emitter.emit

    def emit_then_sigterm(kind: Any, **data: Any) -> None:
        emit(kind, **data)
        if kind == EventKind.STEP_STARTED:
            loop.stop.note_signal()  # what the SIGTERM handler does, as the emit returns

    loop.emitter.emit = emit_then_sigterm  # type: ignore[method-assign]
    outcome = await loop.run()
    assert outcome.status == RunStatus.CANCELLED
    assert [s["state"] for s in steered] == ["queued"] and loop.steering.pending == ["also check the disk"]
    assert not any(m["content"] == "also check the disk" for m in loop.messages if m["role"] == "user")


async def test_a_steer_during_the_answer_of_the_last_allowed_step_keeps_the_answer(tmp_path: Path) -> None:
    # A steer queued while the model gave its answer at step max_steps asked for a step
    # that could not be taken: the run failed max_steps ("the model did not answer"),
    # its answer dropped. The answer stands; the steer is left pending (reported unapplied).
    from subagent.events import EventKind
    from subagent.steering import SteeringQueue

    loop = make_loop(tmp_path, {"turns": ["The answer is 42."], "final": "unused"}, max_steps=1)
    steered: list[dict[str, Any]] = []
    loop.steering = SteeringQueue(emit=lambda **kw: steered.append(kw))
    emit = loop.emitter.emit

    def emit_then_steer(kind: Any, **data: Any) -> None:
        emit(kind, **data)
        if kind == EventKind.ASSISTANT_TEXT:
            assert loop.steering is not None
            loop.steering.push("also say hi", loop.steps)  # came while the answer streamed

    loop.emitter.emit = emit_then_steer  # type: ignore[method-assign]
    outcome = await loop.run()
    assert (outcome.status, outcome.final_text) == (RunStatus.COMPLETED, "The answer is 42.")
    assert loop.steering.pending == ["also say hi"]
    assert [s["state"] for s in steered] == ["queued"]


async def test_calls_beyond_the_steps_limit_are_refused_said_and_never_run(tmp_path: Path) -> None:
    # One model turn of thousands of calls flooded the daemon (an event, a record and
    # journal writes per call): a step runs at most limits.max_tool_calls_per_step.
    from subagent.events import EventKind
    from subagent.model.fake_openai import history_problem

    calls = [{"name": "run_command", "arguments": {"command": f"touch {tmp_path}/ran{i}"}} for i in range(5)]
    script = {"turns": [{"tool_calls": [*calls, {"name": "nope", "arguments": {}}]}], "final": "ok"}
    loop = make_loop(tmp_path, script, max_tool_calls_per_step=2)
    outcome = await loop.run()
    assert outcome.status == RunStatus.COMPLETED and outcome.final_text == "ok"
    assert sorted(p.name for p in tmp_path.glob("ran*")) == ["ran0", "ran1"]  # the rest never ran
    assert [r.state for r in loop.records] == [ToolCallState.SUCCEEDED] * 2  # no record for the refused
    result = loop.result(outcome)
    assert result["refused_calls"] == [
        {"step": 1, "asked": 6, "limit": 2, "refused": 4, "names": ["nope", "run_command"]}
    ]
    # Said once in the record (a log event with its code), and to the model after the
    # turn's results, in a history the API takes.
    events = [json.loads(line) for line in (tmp_path / "events").read_text().splitlines()]
    (said,) = [e for e in events if e.get("code") == "too_many_calls"]
    assert (
        said["event"] == str(EventKind.LOG)
        and said["refused"] == 4
        and "limits.max_tool_calls_per_step" in said["message"]
    )
    assert sum(e["event"] == str(EventKind.TOOL_CALL) for e in events) == 6  # two calls: announced, running, done
    assert history_problem(loop.messages) is None
    (asked,) = [m for m in loop.messages if m.get("tool_calls")]
    assert len(asked["tool_calls"]) == 2
    note = loop.messages[loop.messages.index(asked) + 3]
    assert note["role"] == "user" and "asked for 6 tool calls" in note["content"] and "never ran" in note["content"]


def test_a_spec_bounds_the_calls_per_step() -> None:
    from subagent.spec import DEFAULT_MAX_TOOL_CALLS_PER_STEP, SpecError

    assert RunSpec.from_dict({"task": "t"}, env={}).limits.max_tool_calls_per_step == DEFAULT_MAX_TOOL_CALLS_PER_STEP
    assert RunSpec.from_dict({"task": "t"}, env={}).limits.to_dict()["max_tool_calls_per_step"] == 256
    for bad in (0, 10**6, True, "5"):
        with pytest.raises(SpecError, match="limits.max_tool_calls_per_step"):
            RunSpec.from_dict({"task": "t", "limits": {"max_tool_calls_per_step": bad}}, env={})


class _CountingSet(set[str]):
    looked = 0

    def __contains__(self, item: object) -> bool:
        _CountingSet.looked += 1
        return super().__contains__(item)


async def test_thousands_of_calls_of_one_id_are_renamed_with_a_lookup_or_two_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model that gave every call the same id cost a scan of every suffix taken so far
    # per call: 15,000 such calls took the runner 29 s.
    import subagent.loop as loop_module

    real = loop_module._call_id

    def counted(raw: str, used: set[str], *rest: Any) -> str:
        return real(raw, _CountingSet(used), *rest)  # the ids taken, their look-ups counted

    monkeypatch.setattr(loop_module, "_call_id", counted)
    calls = [{"name": "nope", "id": "x", "arguments": {}} for _ in range(1000)]
    loop = make_loop(tmp_path, {"turns": [{"tool_calls": calls}]}, max_tool_calls_per_step=1000)
    assert (await loop.run()).status == RunStatus.COMPLETED
    ids = [r.id for r in loop.records]
    assert len(set(ids)) == 1000 and ids[:3] == ["x", "x_2", "x_3"]
    assert _CountingSet.looked <= 3 * 1000


async def test_a_snapshot_looks_only_at_the_records_changed_since_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each snapshot encoded every record of the run so far: a run of many steps of many
    # calls cost the square of its length (40 steps of 256 calls: 21 s, now 2.5 s).
    import subagent.loop as loop_module

    seen = 0
    real = loop_module._snapshot_record

    def counting(rec: Any) -> dict[str, Any]:
        nonlocal seen
        seen += 1
        return real(rec)

    monkeypatch.setattr(loop_module, "_snapshot_record", counting)
    turns = [{"tool_calls": [{"name": "nope", "arguments": {"s": s, "i": i}} for i in range(10)]} for s in range(12)]
    loop = make_loop(tmp_path, {"turns": turns, "final": "done"}, max_steps=20)
    outcome = await loop.run()
    assert outcome.status == RunStatus.COMPLETED and len(loop.records) == 120
    assert seen <= 2 * 120  # each record in the snapshot of its turn and of its batch at most
