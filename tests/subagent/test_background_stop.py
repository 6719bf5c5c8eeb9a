"""A background command the run's end ended is told as such: the call that started it stays
``succeeded`` (it did start it), and its record, amended at the run's end, says the stop
ended it (``stop_effect: background_ended``, how and when) or that it ended with the run;
the history the model sees next says it no longer runs. Its record was "succeeded:
started in the background" alone, so the next turn's model took it for still running.

Real runners (the scripted model, real background commands); the journal's part on a real
SQLite file.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from subagent.events import EventKind, ExitCode, StopEffect, ToolCallRecord, ToolCallState
from subagent.history import (
    HISTORY_BACKGROUND_ENDED_BY_STOP,
    HISTORY_BACKGROUND_ENDED_WITH_RUN,
    HISTORY_FINISHED_BEFORE_STOP,
    tool_result_text,
)
from supervisor.store.journal import Journal
from tests.subagent.harness import spec, start_runner

SERVING = {"command": "echo serving; exec sleep 300", "background": True}


def last_record(r: object, call_id: str) -> dict[str, object]:
    records = [e.data["record"] for e in r.of(EventKind.TOOL_CALL) if e.data["record"]["id"] == call_id]  # type: ignore[attr-defined]
    return records[-1]


async def test_a_background_command_the_stop_ended_is_recorded_so_and_told_so(tmp_path: Path) -> None:
    turns = [{"tool_calls": [{"name": "run_command", "arguments": SERVING}]}, {"text": "waiting", "hang": True}]
    async with start_runner(spec(script={"turns": turns}), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED, lambda e: e.data["step"] == 2)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    (call,) = result["tool_calls"]
    assert call["state"] == ToolCallState.SUCCEEDED  # it did start it
    assert call["output"].startswith("started in the background: id bg1")
    assert call["stop_effect"] == StopEffect.BACKGROUND_ENDED, call
    assert call["reason"].startswith(
        "background_ended: its background command bg1 was still running when the run was stopped; "
        "the stop ended it (killed by SIGTERM, "
    ), call
    assert isinstance(call["stop_to_end_s"], float) and 0 <= call["stop_to_end_s"] < 5
    assert call["stop_requested_at"] is not None
    assert last_record(r, call["id"]) == call  # sent again: the daemon's journal has it
    told = tool_result_text(call, stop_reason="user")
    assert HISTORY_BACKGROUND_ENDED_BY_STOP in told and HISTORY_FINISHED_BEFORE_STOP not in told, told


async def test_a_background_command_that_ended_before_the_stop_is_left_as_it_was(tmp_path: Path) -> None:
    turns = [
        {"tool_calls": [{"name": "run_command", "arguments": {"command": "echo quick", "background": True}}]},
        {"text": "waiting", "hang": True},
    ]
    async with start_runner(spec(script={"turns": turns}), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.PROCESS_GROUP, lambda e: not e.data["alive"])  # it ended by itself
            await r.wait_event(EventKind.STEP_STARTED, lambda e: e.data["step"] == 2)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    (call,) = result["tool_calls"]
    assert call["state"] == ToolCallState.SUCCEEDED and call["stop_effect"] is None and call["reason"] is None
    assert tool_result_text(call, stop_reason="user").endswith(HISTORY_FINISHED_BEFORE_STOP)


async def test_a_background_command_still_running_when_its_run_completed_is_told_ended_with_it(
    tmp_path: Path,
) -> None:
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": SERVING}]}], "final": "done"}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    (call,) = result["tool_calls"]
    assert call["state"] == ToolCallState.SUCCEEDED and call["stop_effect"] is None
    assert call["reason"].startswith(
        "background_ended_with_run: its background command bg1 was still running when the run ended; "
        "it was ended with the run (killed by SIGTERM"
    ), call
    assert HISTORY_BACKGROUND_ENDED_WITH_RUN in tool_result_text(call, stop_reason=None)


async def test_the_journal_keeps_the_amended_record_whichever_comes_last(tmp_path: Path) -> None:
    """The amended record replaces the first one (same state, ``succeeded``); the first one,
    sent again later (a result's records, an events file read again), does not undo it."""
    first = ToolCallRecord(
        id="c1", name="run_command", arguments="{}", step=1, state=ToolCallState.SUCCEEDED, output="started"
    ).to_dict()
    amended = {**first, "stop_effect": str(StopEffect.BACKGROUND_ENDED), "reason": "background_ended: ..."}
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        await journal.create_run("r1", session_id=None, spec={}, created_at=time.time(), timeout_s=None)
        await journal.upsert_tool_call("r1", first)
        await journal.upsert_tool_call("r1", amended)
        await journal.upsert_tool_call("r1", first)
        row = await journal.get_run("r1")
    assert row is not None
    (kept,) = row["tool_calls"]
    assert kept["stop_effect"] == StopEffect.BACKGROUND_ENDED and kept["reason"] == "background_ended: ..."


def test_the_stop_receipt_names_a_background_command_the_stop_ended() -> None:
    """Counted from its command's end (``stop_to_end_s``), not its call's, which came
    before the stop (it read "after 0 ms")."""
    from supervisor.core._stop_receipt import describe_tool_stops

    rec = {
        "id": "c1",
        "name": "run_command",
        "state": "succeeded",
        "stop_effect": str(StopEffect.BACKGROUND_ENDED),
        "finished_at": 1000.0,
        "stop_to_end_s": 0.05,
    }
    (entry,) = describe_tool_stops([rec], cancel_wall=1005.0)
    assert entry["text"] == "background command of `run_command` ended by the stop after 50 ms"
    assert entry["after_s"] == 0.05
