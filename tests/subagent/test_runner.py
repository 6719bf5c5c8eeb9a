"""Acceptance tests of ``python -m subagent.runner`` with the scripted model (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio

from subagent.emit import record_paths
from subagent.events import EventKind, ExitCode, ToolCallState, decode_result
from subagent.stopmark import make_marker, write_marker
from tests.subagent.harness import runner_env, spec, start_runner

TWO_COMMANDS = {
    "turns": [
        {"text": "first", "tool_calls": [{"name": "run_command", "arguments": {"command": "echo one"}}]},
        {"text": "second", "tool_calls": [{"name": "run_command", "arguments": {"command": "echo two; echo err >&2"}}]},
    ],
    "final": "answer: {{last_output}}",
}


async def test_scripted_run_calls_run_command_twice_and_completes(tmp_path: Path) -> None:
    async with start_runner(spec(script=TWO_COMMANDS), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    assert result["status"] == "completed"
    states = [t["state"] for t in result["tool_calls"]]
    assert states == ["succeeded", "succeeded"]
    assert "one" in result["tool_calls"][0]["output"]
    assert "two" in result["tool_calls"][1]["output"] and "err" in result["tool_calls"][1]["output"]
    assert result["final_text"].startswith("answer: [exit code 0]")
    assert result["steps"] == 3
    assert result["progress"].split("\n\n")[:2] == ["first", "second"]
    # Every stderr line was a valid event (finish() asserts it); the shape is right too.
    kinds = [e.kind for e in r.events]
    assert kinds[0] == EventKind.RUNNER_STARTED
    # One snapshot after each model turn that said something (its text and its announced
    # calls), one after each tool batch.
    snaps = r.snapshots()
    assert [s["progress"] for s in snaps] == [
        "first",
        "first",
        "first\n\nsecond",
        "first\n\nsecond",
        result["progress"],
    ]
    assert [t["state"] for t in snaps[0]["tool_calls"]] == ["not_started"]
    assert snaps[0]["tool_calls"][0]["on_stop"] == "interrupt"
    assert [t["state"] for t in snaps[-1]["tool_calls"]] == ["succeeded", "succeeded"]
    # Each is sent as a delta: only the text said since, only the records changed since.
    deltas = [s.data for s in r.of(EventKind.STEP_SNAPSHOT)]
    assert [d["progress_added"] for d in deltas][:4] == ["first", "", "\n\nsecond", ""]
    assert [len(d["tool_calls_changed"]) for d in deltas] == [1, 1, 1, 1, 0]
    # Each call is announced (not started, no reason) before it runs.
    first_id = result["tool_calls"][0]["id"]
    states = [e.data["record"]["state"] for e in r.of(EventKind.TOOL_CALL) if e.data["record"]["id"] == first_id]
    assert states == ["not_started", "running", "succeeded"]
    groups = r.of(EventKind.PROCESS_GROUP)
    assert [g.data["alive"] for g in groups] == [True, False, True, False]
    assert all(g.data["kind"] == "command" for g in groups)
    # The result is also in its result file (beside the run dir), identical.
    on_disk = decode_result(record_paths(r.run_dir)[1].read_bytes())
    assert on_disk == result
    assert not r.of(EventKind.LOG), [e.data for e in r.of(EventKind.LOG)]  # a clean run is quiet
    # The history gives every tool call a result.
    tool_msgs = [m for m in result["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [t["id"] for t in result["tool_calls"]]


async def test_default_script_runs_without_any_configuration(tmp_path: Path) -> None:
    async with start_runner({"task": "look around"}, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    assert result["provider"] == "scripted"
    assert [t["state"] for t in result["tool_calls"]] == ["succeeded", "succeeded"]
    assert "entries" in result["final_text"]


async def test_a_scripted_run_without_mcp_imports_neither_openai_nor_mcp(tmp_path: Path) -> None:
    async with start_runner(spec(script={"turns": [], "final": "hi"}), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    assert result["imported"] == {"openai": False, "mcp": False}


async def wait_asleep(pid: int) -> None:
    """Until the process's one thread is asleep (``S``: blocked in a wait, not running or
    runnable). With one thread no lock or GIL can put it there: only a blocking call can."""
    with trio.fail_after(10):
        while True:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            if fields["Threads"].strip() == "1" and fields["State"].strip().startswith("S"):
                return
            await trio.sleep(0.005)


async def test_sigterm_while_the_model_streams_cancels_at_once(tmp_path: Path) -> None:
    script = {"turns": [{"text": "thinking", "chunk_size": 2, "chunk_delay_s": 5}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED)
            # `step_started` comes just before the model request: a SIGTERM read before the
            # loop enters it is a stop during no work ("idle"), and the stream never began.
            # From that event to the scripted model's first delay (its first chunk is fed
            # before it) the runner never blocks: asleep now, it is in that delay, inside
            # the model request, with "th" streamed.
            await wait_asleep(r.proc.pid)
        t0 = trio.current_time()
        r.signal()
        rc, result = await r.finish()
        elapsed = trio.current_time() - t0
    assert rc == ExitCode.CANCELLED
    assert result["status"] == "cancelled" and result["reason"] == "signal"
    assert elapsed < 1.0
    stop = r.of(EventKind.STOP_REQUESTED)
    assert len(stop) == 1 and stop[0].data == {"reason": "signal", "during": "model"}
    # The partial text is kept as progress, marked incomplete.
    assert result["progress"] == "th"
    assert r.of(EventKind.ASSISTANT_TEXT)[0].data["complete"] is False


def _marked_run_dir(tmp_path: Path) -> Path:
    """The run dir the harness uses, with the stop marker a daemon makes beside it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    make_marker(run_dir)
    return run_dir


async def test_a_sigterm_from_the_runs_own_command_is_not_the_daemons_stop(tmp_path: Path) -> None:
    # The runner has a stop marker (a daemon made it) and it is empty: the SIGTERM its own
    # command sends it is nobody's stop. The run stops, but it fails "signalled": not
    # cancelled, and not "interrupted by the stop" in what the model and the record say.
    _marked_run_dir(tmp_path)
    script = {
        "turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "kill -TERM $PPID; sleep 30"}}]}]
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert (result["status"], result["reason"]) == ("failed", "signalled"), result
    assert rc == ExitCode.SIGNALLED, result
    assert result["error"]["code"] == "signalled" and "agentd's stop did not send" in result["error"]["message"]
    assert "stop_reason" not in result
    stop = r.of(EventKind.STOP_REQUESTED)
    assert [e.data["reason"] for e in stop] == ["signalled"] and stop[0].data["during"] == "tool", stop
    assert "stop_reason" not in stop[0].data
    [call] = result["tool_calls"]
    assert call["state"] == "cancelled" and call["stop_effect"] == "interrupted", call
    assert "not sent by agentd's stop" in call["reason"] and "interrupted by the stop" not in call["reason"], call
    told = [m["content"] for m in result["messages"] if m.get("role") == "tool"]
    assert len(told) == 1 and "interrupted by the stop" not in told[0] and "not sent by agentd's stop" in told[0], told
    # Its record files say the same (the daemon keeps the result file's).
    events_file, result_file = record_paths(tmp_path / "run")
    assert json.loads(result_file.read_text())["reason"] == "signalled"


async def test_a_sigterm_after_the_daemon_marked_its_stop_is_that_stop(tmp_path: Path) -> None:
    # The daemon writes the stop's reason in the marker, then signals: the runner reads it
    # after the signal, and its stop is the daemon's, with the reason.
    run_dir = _marked_run_dir(tmp_path)
    script = {"turns": [{"text": "thinking", "chunk_size": 2, "chunk_delay_s": 5}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED)
        assert write_marker(run_dir, "user")
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "user"), result
    stop = r.of(EventKind.STOP_REQUESTED)
    assert len(stop) == 1 and (stop[0].data["reason"], stop[0].data["stop_reason"]) == ("signal", "user"), stop


@pytest.mark.parametrize("marked", [False, True])
async def test_a_sigterm_before_the_spec_is_a_stop_only_if_the_daemon_marked_it(tmp_path: Path, marked: bool) -> None:
    run_dir = _marked_run_dir(tmp_path)
    async with start_runner(b"", tmp_path, args=("--warm",), stdin_close=False) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.LOG, lambda e: e.data.get("warm") is True)
        if marked:
            assert write_marker(run_dir, "shutdown")
        r.signal()
        rc, result = await r.finish(timeout_s=30)
    if marked:
        assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "shutdown")
        assert rc == ExitCode.CANCELLED
    else:
        assert (result["status"], result["reason"]) == ("failed", "signalled"), result
        assert rc == ExitCode.SIGNALLED


FINISH_COMMANDS = {"run_command": "finish"}


async def test_sigterm_during_a_command_interrupts_it_and_keeps_its_output(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "text": "working",
                "tool_calls": [
                    {"name": "run_command", "arguments": {"command": "echo started; sleep 300"}},
                    {"name": "run_command", "arguments": {"command": "echo must-not-run"}},
                ],
            },
        ]
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            group = await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
            await r.wait_event(EventKind.TOOL_CALL, lambda e: e.data["record"]["state"] == "running")
        # The output printed so far reaches the pipe before the stop: wait until it can.
        await wait_output_file_free(group.data["pgid"])
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    assert group.data["on_stop"] == "interrupt"
    first, second = result["tool_calls"]
    assert first["state"] == "cancelled" and first["on_stop"] == "interrupt"
    assert first["stop_effect"] == "interrupted" and first["reason"].startswith("interrupted: interrupted by the stop")
    assert "SIGTERM" in first["reason"] and first["stop_to_end_s"] < 10
    assert "started" in first["output"] and "[killed by SIGTERM]" in first["output"]
    assert second["state"] == "not_started" and second["stop_effect"] == "stopped_before_start"
    stop = r.of(EventKind.STOP_REQUESTED)[0].data
    assert stop["during"] == "tool" and stop["tool"] == {
        "id": first["id"],
        "name": "run_command",
        "on_stop": "interrupt",
    }
    # The record said at once that the stop reached the call, before it ended.
    noted = [e.data["record"] for e in r.of(EventKind.TOOL_CALL) if e.data["record"]["id"] == first["id"]]
    assert [(n["state"], n["stop_requested_at"] is not None) for n in noted][-2:] == [
        ("running", True),
        ("cancelled", True),
    ]
    history = [m for m in result["messages"] if m["role"] == "tool"]
    assert history[0]["content"].startswith("interrupted by the stop; output known before the interruption:\n")
    assert "\nstarted" in history[0]["content"]
    assert history[1]["content"].startswith("not executed: stopped_before_start")
    assert (
        not psutil.pid_exists(group.data["pgid"]) or psutil.Process(group.data["pgid"]).status() == psutil.STATUS_ZOMBIE
    )


async def wait_output_file_free(pgid: int) -> None:
    """Until the command's shell runs ``sleep``: its ``echo started`` is in the pipe by then."""
    with trio.fail_after(10):
        while True:
            try:
                if any(c.name() == "sleep" for c in psutil.Process(pgid).children()):
                    return
            except psutil.NoSuchProcess:
                return
            await trio.sleep(0.01)


async def test_a_command_done_before_the_stop_is_not_recorded_as_finishing_after_it(tmp_path: Path) -> None:
    # Its shell exited (exit 0) before the SIGTERM; a child it left, holding its output and
    # ignoring SIGTERM, was still being drained. The call was recorded "finished_after_stop:
    # it answered the stop; it ended 2.4 s after the stop", and the model told it finished
    # after the stop: it had finished before it.
    from subagent.history import HISTORY_FINISHED_BEFORE_STOP

    command = "(trap '' TERM; exec sleep 300) & echo done"
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}]}
    async with start_runner(spec(script=script, stop_policy={"command_grace_s": 0.2}), tmp_path) as r:
        with trio.fail_after(10):
            group = await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
            while os.path.exists(f"/proc/{group.data['pgid']}"):  # reaped: the runner saw it exit
                await trio.sleep(0.005)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    (call,) = result["tool_calls"]
    assert call["state"] == "succeeded" and call["output"].endswith("done\n"), call
    assert call["stop_effect"] is None and call["stop_requested_at"] is None, call
    told = next(m["content"] for m in result["messages"] if m["role"] == "tool")
    assert told.endswith(HISTORY_FINISHED_BEFORE_STOP), told


async def test_a_stop_gives_the_runs_background_commands_its_command_grace(tmp_path: Path) -> None:
    # A background command that ignores SIGTERM got the 2 s of a run's normal end after a
    # stop too, not the stop's command grace (`stop_policy.command_grace_s`, 0.2 s here).
    from subagent.tools.commands import COMMAND_KILL_GRACE_S

    background = {"command": "trap '' TERM; sleep 300", "background": True}
    turns = [
        {"tool_calls": [{"name": "run_command", "arguments": background}]},
        {"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 300"}}]},
    ]
    async with start_runner(spec(script={"turns": turns}, stop_policy={"command_grace_s": 0.2}), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"] and e.data["name"] == "sleep 300")
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    stopped = r.of(EventKind.STOP_REQUESTED)[0].ts
    (gone,) = [
        e for e in r.of(EventKind.PROCESS_GROUP) if not e.data["alive"] and e.data["name"].startswith("[background]")
    ]
    assert 0.2 <= gone.ts - stopped < COMMAND_KILL_GRACE_S, gone.ts - stopped


async def test_a_command_the_spec_lets_finish_finishes_after_sigterm_then_stops(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "text": "working",
                "tool_calls": [
                    {"name": "run_command", "arguments": {"command": "sleep 2; echo slept"}},
                    {"name": "run_command", "arguments": {"command": "echo must-not-run"}},
                ],
            },
            {
                "text": "must not be asked",
                "tool_calls": [{"name": "run_command", "arguments": {"command": "echo nope"}}],
            },
        ]
    }
    async with start_runner(spec(script=script, stop_policy=FINISH_COMMANDS), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    first, second = result["tool_calls"]
    assert first["state"] == "succeeded" and "slept" in first["output"]
    assert first["on_stop"] == "finish" and first["stop_effect"] == "finished_after_stop"
    assert first["reason"].startswith("finished_after_stop: it was allowed to finish")
    assert second["state"] == "not_started" and second["reason"].startswith("stopped_before_start")
    assert result["steps"] == 1  # no further model call
    assert r.of(EventKind.STOP_REQUESTED)[0].data["during"] == "tool"
    snaps = r.snapshots()
    assert snaps[-1]["progress"] == "working"
    assert [t["state"] for t in snaps[-1]["tool_calls"]] == ["succeeded", "not_started"]
    assert snaps[-1]["_id"] == "run-test"
    # Only one command ever started.
    assert len([g for g in r.of(EventKind.PROCESS_GROUP) if g.data["alive"]]) == 1
    assert r.of(EventKind.PROCESS_GROUP)[0].data["on_stop"] == "finish"  # path A must spare it
    history = [m for m in result["messages"] if m["role"] == "tool"]
    assert "[finished after the stop: this call was allowed to finish" in history[0]["content"]
    assert history[1]["content"].startswith("not executed: stopped_before_start")


async def test_repeated_sigterm_changes_nothing_the_command_still_finishes(tmp_path: Path) -> None:
    # The daemon's path A and path B both send SIGTERM: the second must not escalate.
    flag = tmp_path / "run" / "go"
    command = f"while [ ! -e {flag} ]; do sleep 0.02; done; echo finished"
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}]}
    async with start_runner(spec(script=script, stop_policy=FINISH_COMMANDS), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
        r.signal()
        r.signal()
        r.signal()
        with trio.fail_after(10):
            await r.wait_event(EventKind.STOP_REQUESTED)
        flag.touch()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    (rec,) = result["tool_calls"]
    assert rec["state"] == "succeeded" and "finished" in rec["output"]
    assert len(r.of(EventKind.STOP_REQUESTED)) == 1


async def test_a_repeated_sigint_interrupts_the_running_command(tmp_path: Path) -> None:
    flag = tmp_path / "run" / "started"
    command = f"echo started; touch {flag}; sleep 30"
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            group = await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
            while not flag.exists():  # its shell has written its line (a SIGINT before would cut it)
                await trio.sleep(0.01)
        r.signal(signal.SIGINT)
        with trio.fail_after(10):
            await r.wait_event(EventKind.STOP_REQUESTED)
        r.signal(signal.SIGINT)
        rc, result = await r.finish(timeout_s=10)
    assert rc == ExitCode.CANCELLED
    (rec,) = result["tool_calls"]
    assert rec["state"] == "cancelled" and rec["reason"].startswith("interrupted")
    assert "started" in rec["output"]
    assert (
        not psutil.pid_exists(group.data["pgid"]) or psutil.Process(group.data["pgid"]).status() == psutil.STATUS_ZOMBIE
    )


async def test_a_call_cut_inside_its_arguments_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "run" / "ran"
    script = {
        "turns": [
            {
                "text": "let me",
                "tool_calls": [{"name": "run_command", "arguments": {"command": f"touch {marker}"}, "cut_after": 13}],
            },
        ],
        "final": "after the cut: {{last_output}}",
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert not marker.exists()
    rec = result["tool_calls"][0]
    assert rec["state"] == ToolCallState.NOT_STARTED
    assert rec["reason"].startswith("arguments_incomplete")
    assert rec["arguments"] == '{"command":"t'  # as streamed, not repaired
    assert rc == ExitCode.COMPLETED
    # The model was told, and the history stays valid JSON for the next request.
    assert "not executed: arguments_incomplete" in result["final_text"]
    call = next(m for m in result["messages"] if m.get("tool_calls"))
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {}
    assert not r.of(EventKind.PROCESS_GROUP)


async def test_stop_inside_streamed_arguments_aborts_and_never_runs_the_call(tmp_path: Path) -> None:
    marker = tmp_path / "run" / "ran"
    call = {"name": "run_command", "arguments": {"command": f"touch {marker}"}, "hang_after": 14}
    async with start_runner(spec(script={"turns": [{"tool_calls": [call]}]}), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    rec = result["tool_calls"][0]
    assert rec["state"] == "not_started" and rec["reason"].startswith("arguments_incomplete")
    assert rec["arguments"] == '{"command":"to'
    assert not marker.exists()


async def test_unknown_tool_fails_that_call_and_the_model_is_told(tmp_path: Path) -> None:
    script = {"turns": [{"tool_calls": [{"name": "no_such_tool", "arguments": {}}]}], "final": "told: {{last_output}}"}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    rec = result["tool_calls"][0]
    assert rec["state"] == "failed" and rec["reason"] == "unknown_tool"
    assert "run_command" in rec["error"]
    assert result["final_text"].startswith("told: error: unknown tool 'no_such_tool'")


async def test_invalid_arguments_fail_the_call_without_running_it(tmp_path: Path) -> None:
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": "{not json"}]}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    rec = result["tool_calls"][0]
    assert rec["state"] == "failed" and rec["reason"].startswith("invalid_arguments")


@pytest.mark.parametrize(
    "stdin, field",
    [
        (b"this is not json\n", ""),
        (b"[1, 2]\n", ""),
        (b'{"model": {"provider": "scripted"}}\n', "task"),
        (b'{"task": "x", "colour": "red"}\n', "colour"),
        (b'{"task": "x", "limits": {"max_steps": 0}}\n', "limits.max_steps"),
        (b'{"task": "x", "model": {"script": {"turns": [{"txet": "typo"}]}}}\n', "model.script.turns[0]"),
        (b"", ""),
    ],
)
async def test_a_bad_spec_exits_bad_spec_with_one_clear_line(tmp_path: Path, stdin: bytes, field: str) -> None:
    async with start_runner(stdin, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.BAD_SPEC
    (event,) = r.events
    assert event.kind == EventKind.LOG and event.data["level"] == "error"
    assert event.data["message"].startswith("error: bad run spec:")
    assert event.data["field"] == field
    assert result["status"] == "failed" and result["reason"] == "bad_spec"


async def test_a_spec_spread_over_lines_is_read_until_eof(tmp_path: Path) -> None:
    text = json.dumps(spec(script={"final": "multi"}), indent=2).encode()
    async with start_runner(text, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED and result["final_text"] == "multi"


async def test_the_first_line_is_enough_when_stdin_stays_open(tmp_path: Path) -> None:
    async with start_runner(spec(script={"final": "one line"}), tmp_path, stdin_close=False) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED and result["final_text"] == "one line"


async def test_a_model_error_fails_the_run_with_model_error(tmp_path: Path) -> None:
    script = {"turns": [{"text": "partial", "error": "rate limited"}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR
    assert result["status"] == "failed" and result["error"]["message"] == "scripted model error: rate limited"
    assert result["progress"] == "partial"
    # No stop had reached it: its own failure, which a cancel racing it does not make a cancel.
    assert result["failed_before_stop"] is True


async def test_max_steps_without_an_answer_fails(tmp_path: Path) -> None:
    loop_turn = {"tool_calls": [{"name": "run_command", "arguments": {"command": "true"}}]}
    script = {"turns": [loop_turn] * 5}
    async with start_runner(spec(script=script, limits={"max_steps": 2}), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.FAILED and result["reason"] == "max_steps"
    assert result["steps"] == 2 and len(result["tool_calls"]) == 2
    assert result["failed_before_stop"] is True


async def test_deadline_stops_the_run_with_reason_timeout(tmp_path: Path) -> None:
    script = {"turns": [{"text": "slow", "delay_s": 30}]}
    async with start_runner(spec(script=script, limits={"deadline_s": 0.5}), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    assert result["status"] == "cancelled" and result["reason"] == "timeout"
    assert r.of(EventKind.STOP_REQUESTED)[0].data["reason"] == "timeout"
    assert "failed_before_stop" not in result


async def test_command_timeout_and_output_bound_are_enforced(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "tool_calls": [
                    {"name": "run_command", "arguments": {"command": "head -c 5000 /dev/zero | tr '\\0' x; echo"}},
                    {"name": "run_command", "arguments": {"command": "echo before; sleep 30", "timeout_s": 1.5}},
                ]
            }
        ]
    }
    async with start_runner(spec(script=script, limits={"max_output_bytes": 100}), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    big, slow = result["tool_calls"]
    assert big["state"] == "succeeded" and big["output_truncated"] is True
    assert slow["state"] == "failed" and slow["reason"] == "timeout" and "before" in slow["output"]


async def test_a_command_leaves_nothing_behind(tmp_path: Path) -> None:
    pidfile = tmp_path / "run" / "bg.pid"
    cmd = f"(sleep 300 & echo $! > {pidfile}); (setsid sleep 301 &); echo done"
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": cmd}}]}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED and result["tool_calls"][0]["state"] == "succeeded"
    pid = int(pidfile.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # The setsid escaper is found by its marker; conftest fails the test if anything is left.


async def test_events_go_to_the_events_file_when_stderr_is_broken(tmp_path: Path) -> None:
    flag = tmp_path / "run" / "go"
    command = f"while [ ! -e {flag} ]; do sleep 0.02; done; echo ok"
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}]}
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.PROCESS_GROUP)
        # The daemon "dies": its end of the stderr pipe closes.
        assert r.proc.stderr is not None
        await r.proc.stderr.aclose()
        flag.touch()
        with trio.fail_after(20):
            await r.proc.wait()
            await r.stdout_eof.wait()
    assert r.proc.returncode == ExitCode.COMPLETED
    events, result = record_paths(r.run_dir)
    lines = events.read_text().splitlines()
    kinds = [json.loads(line)["event"] for line in lines]
    assert "step_snapshot" in kinds
    assert decode_result(result.read_bytes())["status"] == "completed"


async def test_warm_runner_waits_for_its_spec_then_runs(tmp_path: Path) -> None:
    async with start_runner(spec(script={"final": "warm"}), tmp_path, args=("--warm",)) as r:
        rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.COMPLETED and result["final_text"] == "warm"
    assert result["imported"] == {"openai": True, "mcp": True}


async def test_sigterm_before_any_spec_ends_a_warm_runner(tmp_path: Path) -> None:
    async with start_runner(b"", tmp_path, args=("--warm",), stdin_close=False) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.LOG, lambda e: e.data.get("warm") is True)
        r.signal()
        rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"


async def test_a_text_turn_cut_short_is_not_an_answer_and_the_model_is_asked_again(tmp_path: Path) -> None:
    script = {"turns": [{"text": "The answer is", "cut": True}], "final": "The answer is 42."}
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED and result["final_text"] == "The answer is 42."
    assert result["steps"] == 2
    assert [e.data["complete"] for e in r.of(EventKind.ASSISTANT_TEXT)] == [False, True]


async def test_an_empty_stream_is_a_model_error(tmp_path: Path) -> None:
    async with start_runner(spec(script={"turns": [{"cut": True}]}), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR and result["error"]["code"] == "model_stream"


async def test_even_a_broken_install_reports_as_json_with_exit_internal(tmp_path: Path) -> None:
    # Shadow trio with a module that fails to import: the runner must still speak JSON.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "trio.py").write_text("raise ImportError('trio is broken here')\n")
    run_dir = tmp_path / "run"
    env = runner_env(run_dir)
    env["PYTHONPATH"] = f"{shadow}{os.pathsep}{env['PYTHONPATH']}"
    async with start_runner(spec(), tmp_path, env=env) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.INTERNAL
    assert result["status"] == "failed" and result["reason"] == "internal"
    (event,) = r.events
    assert event.data["message"].startswith("error: internal error in the runner: ImportError: trio is broken here")


async def test_a_background_command_runs_on_is_readable_and_ends_with_the_run(tmp_path: Path) -> None:
    log = tmp_path / "run" / "command-bg1.log"
    wait_for_serving = f"for i in $(seq 1000); do grep -q serving '{log}' && exit 0; sleep 0.01; done; exit 1"
    script = {
        "turns": [
            {
                "tool_calls": [
                    {
                        "name": "run_command",
                        "arguments": {"command": "echo serving; exec sleep 300", "background": True},
                    }
                ]
            },
            {
                "tool_calls": [
                    # The command writes when its shell gets to it: the run waits for that
                    # (bounded), or it may end the command before a word is written.
                    {"name": "run_command", "arguments": {"command": wait_for_serving}},
                    {"name": "command_output", "arguments": {"id": "bg1"}},
                    {"name": "command_output", "arguments": {"id": "bg9"}},
                ]
            },
        ],
        "final": "done",
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    start, waited, read, unknown = result["tool_calls"]
    assert start["state"] == "succeeded" and start["output"].startswith("started in the background: id bg1")
    assert waited["state"] == "succeeded", waited
    assert read["state"] == "succeeded" and read["output"].startswith("[running]")
    assert read["output"].endswith("serving\n")
    assert unknown["state"] == "failed" and unknown["reason"] == "unknown_command_id"
    groups = [
        (g.data["name"], g.data["alive"]) for g in r.of(EventKind.PROCESS_GROUP) if "[background]" in g.data["name"]
    ]
    assert groups == [
        ("[background] echo serving; exec sleep 300", True),
        ("[background] echo serving; exec sleep 300", False),
    ]
    pgid = r.of(EventKind.PROCESS_GROUP)[0].data["pgid"]
    assert not psutil.pid_exists(pgid) or psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE
    assert (r.run_dir / "command-bg1.log").read_text() == "serving\n"


async def test_a_stop_ends_background_commands_too(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "tool_calls": [
                    {"name": "run_command", "arguments": {"command": "trap '' TERM; sleep 300", "background": True}}
                ]
            },
            {"text": "waiting", "hang": True},
        ]
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED, lambda e: e.data["step"] == 2)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    alive = [g.data["alive"] for g in r.of(EventKind.PROCESS_GROUP)]
    assert alive == [True, False]  # ended even though it ignores SIGTERM (SIGKILL after the grace)


async def test_a_deadline_during_a_command_lets_it_finish_like_a_stop(tmp_path: Path) -> None:
    flag = tmp_path / "run" / "go"
    script = {
        "turns": [
            {
                "tool_calls": [
                    {
                        "name": "run_command",
                        "arguments": {"command": f"while [ ! -e {flag} ]; do sleep 0.02; done; echo finished"},
                    }
                ]
            },
            {"tool_calls": [{"name": "run_command", "arguments": {"command": "echo never"}}]},
        ]
    }
    runner_spec = spec(script=script, limits={"deadline_s": 1.0}, stop_policy=FINISH_COMMANDS)
    async with start_runner(runner_spec, tmp_path) as r:
        with trio.fail_after(15):
            stop = await r.wait_event(EventKind.STOP_REQUESTED)
        flag.touch()  # the command may end now
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and result["reason"] == "timeout"
    assert stop.data["reason"] == "timeout"
    if stop.data["during"] == "tool":
        (rec,) = result["tool_calls"]
        assert rec["state"] == "succeeded" and "finished" in rec["output"]
    else:  # a machine so slow the deadline came before the command: it never starts
        assert all(t["state"] == "not_started" for t in result["tool_calls"])
        assert not r.of(EventKind.PROCESS_GROUP)


REHEARSAL = """
import os, signal, sys, threading
from subagent import runner
env, handlers = dict(os.environ), [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)]
fds = sorted(os.listdir("/proc/self/fd"))
runner.rehearse()
assert dict(os.environ) == env, "the environment changed"
assert handlers == [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)]
assert sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
assert sorted(os.listdir("/proc/self/fd")) == fds, "a descriptor was left open"
assert threading.active_count() == 1, "a thread was left behind"
assert signal.set_wakeup_fd(-1) == -1, "the wake-up fd was left set"
"""


def test_a_spares_rehearsal_writes_nothing_and_changes_nothing_of_its_process(tmp_path: Path) -> None:
    """``runner.rehearse`` (a parked spare's, in the zygote's ``_park``) only reads:
    no output, no file, no environment or signal handler changed, no descriptor or
    thread left behind."""
    env = runner_env(tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    out = subprocess.run(
        [sys.executable, "-c", REHEARSAL], capture_output=True, env=env, cwd=tmp_path, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stderr == b"" and out.stdout == b""
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


REHEARSAL_SIGTERM = """
import signal, sys, trio
from subagent import runner
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a parked spare's (the zygote's _reset_signals)
real = trio.lowlevel.FdStream
def fd_stream(fd):
    signal.raise_signal(signal.SIGTERM)  # lands while the rehearsal's receiver holds SIGTERM
    return real(fd)
trio.lowlevel.FdStream = fd_stream
runner.rehearse()
print("survived")
"""


def test_a_sigterm_during_a_spares_rehearsal_still_ends_the_spare(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", REHEARSAL_SIGTERM],
        capture_output=True,
        env=runner_env(tmp_path / "run"),
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr)
    assert b"survived" not in out.stdout
