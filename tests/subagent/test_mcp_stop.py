"""A stop reaches a running MCP call by the tool's nature (its MCP annotations), real processes.

The server (``tests/children/mcp_stop_server.py``, the official SDK's server side) logs
each call's request id as it starts and every ``notifications/cancelled`` it receives, so
what the stop sent is asserted where it arrived.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psutil
import trio

from subagent.events import EventKind, ExitCode
from tests.subagent.harness import CHILDREN, RunnerProc, spec, start_runner

STOP_SERVER = str(CHILDREN / "mcp_stop_server.py")


def shared_dir(tmp_path: Path) -> Path:
    """Where the server writes its log (and a tool its record): granted to the run, whose
    sandbox otherwise reaches only its own directory."""
    d = tmp_path / "shared"
    d.mkdir(exist_ok=True)
    return d


def stop_spec(tmp_path: Path, calls: list[dict[str, Any]], **more: Any) -> tuple[dict[str, Any], Path]:
    log = shared_dir(tmp_path) / "server.log"
    servers = {"stop": {"command": sys.executable, "args": [STOP_SERVER], "env": {"MCP_STOP_LOG": str(log)}}}
    script = {"turns": [{"text": "calling", "tool_calls": calls}], "final": "done"}
    grant = {"sandbox": {"write": [str(shared_dir(tmp_path))]}}
    return spec(script=script, mcpServers=servers, **grant, **more), log


async def wait_log(log: Path, prefix: str) -> str:
    """The first line of the server's log starting with ``prefix`` (polled, bounded)."""
    with trio.fail_after(20):
        while True:
            if log.exists():
                for line in log.read_text().splitlines():
                    if line.startswith(prefix):
                        return line
            await trio.sleep(0.01)


async def sent(r: RunnerProc, name: str) -> None:
    """Until the call's request has been handed to the server (its record's ``sent_at``):
    a stop before that leaves it unsent (``not_started``), not the case under test."""
    with trio.fail_after(30):
        await r.wait_event(
            EventKind.TOOL_CALL,
            lambda e: e.data["record"]["name"] == name and e.data["record"].get("sent_at") is not None,
        )


async def test_a_read_only_call_is_abandoned_at_once_and_the_server_told_its_request_id(tmp_path: Path) -> None:
    runner_spec, log = stop_spec(
        tmp_path,
        [
            {"name": "read_slowly", "arguments": {}},
            {"name": "echo", "arguments": {"text": "never"}},
        ],
    )
    async with start_runner(runner_spec, tmp_path) as r:
        await sent(r, "read_slowly")
        started = await wait_log(log, "start read_slowly ")
        t0 = trio.current_time()
        r.signal()
        rc, result = await r.finish()
        elapsed = trio.current_time() - t0
    request_id = started.split(" ", 2)[2]
    assert rc == ExitCode.CANCELLED
    read, echo = result["tool_calls"]
    assert read["on_stop"] == "abandon" and read["state"] == "cancelled" and read["stop_effect"] == "abandoned"
    assert echo["state"] == "not_started" and echo["stop_effect"] == "stopped_before_start"
    lines = log.read_text().splitlines()
    # Told once, for exactly that request; the server's handler was cancelled by it.
    assert [ln for ln in lines if ln.startswith("notifications/cancelled")] == [f"notifications/cancelled {request_id}"]
    assert f"handler-cancelled read_slowly {request_id}" in lines
    assert elapsed < 5.0  # not the 300 s the tool would take (the 1 s bound is the daemon test's)
    history = [m["content"] for m in result["messages"] if m["role"] == "tool"]
    assert history[0].startswith("interrupted by the stop; no output was known (abandoned:")


async def test_a_destructive_call_finishes_after_the_stop_and_the_next_never_starts(tmp_path: Path) -> None:
    record = shared_dir(tmp_path) / "record.txt"
    runner_spec, log = stop_spec(
        tmp_path,
        [
            {"name": "write_record", "arguments": {"path": str(record), "text": "one", "seconds": 1.0}},
            {"name": "write_record", "arguments": {"path": str(record), "text": "two", "seconds": 0.0}},
        ],
    )
    async with start_runner(runner_spec, tmp_path) as r:
        await sent(r, "write_record")
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    first, second = result["tool_calls"]
    assert first["on_stop"] == "finish" and first["state"] == "succeeded" and first["output"] == "written"
    assert first["stop_effect"] == "finished_after_stop" and first["reason"].startswith(
        "finished_after_stop: it was allowed to finish"
    )
    assert 0 < first["stop_to_end_s"] < 5
    assert second["state"] == "not_started" and second["stop_effect"] == "stopped_before_start"
    assert record.read_text() == "one\n"  # the real effect: one write, never the second
    assert not any(ln.startswith("notifications/cancelled") for ln in log.read_text().splitlines())
    history = [m["content"] for m in result["messages"] if m["role"] == "tool"]
    assert history[0] == "written\n[finished after the stop: this call was allowed to finish; the result above is real]"
    assert history[1].startswith("not executed: stopped_before_start")


async def test_a_cancellable_call_is_told_once_then_abandoned_after_a_short_wait(tmp_path: Path) -> None:
    runner_spec, log = stop_spec(tmp_path, [{"name": "tidy_up", "arguments": {}}], stop_policy={"cancel_wait_s": 0.2})
    async with start_runner(runner_spec, tmp_path) as r:
        await sent(r, "tidy_up")
        started = await wait_log(log, "start tidy_up ")
        r.signal()
        rc, result = await r.finish()
    request_id = started.split(" ", 2)[2]
    assert rc == ExitCode.CANCELLED
    (call,) = result["tool_calls"]
    assert call["on_stop"] == "cancel" and call["state"] == "cancelled" and call["stop_effect"] == "cancel_unanswered"
    assert "notifications/cancelled was sent" in call["reason"]
    # Ours first; the SDK's courtesy cancel when the call was then abandoned is not repeated.
    lines = log.read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("notifications/cancelled")] == [f"notifications/cancelled {request_id}"]
    assert call["stop_to_end_s"] >= 0.2


async def test_a_cancellable_call_on_a_server_the_run_stopped_is_abandoned_without_its_wait(tmp_path: Path) -> None:
    """Seen: a ``cancel``-policy call whose server the run's own command had SIGSTOPped held
    the stop for its whole ``cancel_wait_s``, waiting for an answer a stopped process cannot
    give. Now the wait is skipped and the record says why; the close then resumes the server."""
    wait_s = 10.0  # far longer than the stop takes: a wait would show in the record's time
    runner_spec, log = stop_spec(
        tmp_path, [{"name": "tidy_up", "arguments": {}}], stop_policy={"cancel_wait_s": wait_s}
    )
    async with start_runner(runner_spec, tmp_path) as r:
        group = await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["kind"] == "mcp_server")
        await sent(r, "tidy_up")
        await wait_log(log, "start tidy_up ")
        server = psutil.Process(group.data["pgid"])
        assert server.ppid() == r.proc.pid and STOP_SERVER in server.cmdline()  # the runner's own child
        server.suspend()
        with trio.fail_after(10):  # the signal is delivered, not yet acted on, at kill()'s return
            while server.status() != psutil.STATUS_STOPPED:
                await trio.sleep(0.01)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    (call,) = result["tool_calls"]
    assert call["on_stop"] == "cancel" and call["state"] == "cancelled" and call["stop_effect"] == "cancel_unanswered"
    assert "stopped (SIGSTOP) and could not answer" in call["reason"], call["reason"]
    assert call["stop_to_end_s"] < wait_s, call
    assert not server.is_running()  # resumed and closed with the run


async def test_the_spec_overrides_the_policy_per_server_and_per_tool(tmp_path: Path) -> None:
    policy = {"mcp": {"stop": "finish", "stop/read_slowly": "cancel"}}
    runner_spec, _log = stop_spec(
        tmp_path,
        [
            {"name": "read_slowly", "arguments": {"seconds": 0}},
            {"name": "tidy_up", "arguments": {"seconds": 0}},
            {"name": "run_command", "arguments": {"command": "true"}},
        ],
        stop_policy={**policy, "run_command": "finish"},
    )
    async with start_runner(runner_spec, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    assert [(c["name"], c["on_stop"], c["state"]) for c in result["tool_calls"]] == [
        ("read_slowly", "cancel", "succeeded"),
        ("tidy_up", "finish", "succeeded"),
        ("run_command", "finish", "succeeded"),
    ]
    assert all(c["stop_effect"] is None for c in result["tool_calls"])
