"""A call's hand-off to its MCP server's transport is one step with the check that no stop
came (``_OutboundTap``): the SDK's path from the loop's check to its write yields to the
loop, where a stop may arrive. Through the SDK's own message types and an anyio memory
stream, as the stdio transport's writer reads it; then through a real runner and server,
the record of the hand-off (``sent_at``) that tests wait for before they stop a call."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCNotification, JSONRPCRequest

from subagent.events import Event, EventKind, ExitCode
from subagent.stop import StopControl
from subagent.tools.mcp_tools import StoppedBeforeSend, _OutboundTap
from tests.subagent.harness import CHILDREN, RunnerProc, spec, start_runner


def call(rid: int) -> SessionMessage:
    return SessionMessage(
        message=JSONRPCRequest(jsonrpc="2.0", id=rid, method="tools/call", params={"name": "write_file"})
    )


@pytest.fixture
def streams() -> Iterator[tuple[Any, Any]]:
    send, receive = anyio.create_memory_object_stream[SessionMessage](0)  # as the stdio client makes it
    with send, receive:
        yield send, receive


async def test_a_call_is_handed_over_when_no_stop_came(streams: tuple[Any, Any]) -> None:
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = StopControl()
    told: list[object] = []
    tap.on_sent = lambda: told.append(tap.in_flight)
    async with trio.open_nursery() as n:
        got: list[SessionMessage] = []

        async def writer() -> None:
            got.append(await receive.receive())

        n.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits, as the transport's does
        await tap.send(call(7))
    assert [m.message.id for m in got] == [7] and tap.in_flight == 7
    assert told == [7]  # told once, with the request handed over


async def test_a_call_a_stop_reached_on_the_sdks_way_to_the_transport_is_never_sent(streams: tuple[Any, Any]) -> None:
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = stop = StopControl()
    told: list[object] = []
    tap.on_sent = lambda: told.append(tap.in_flight)
    stop.request("user")  # after the loop's check, before the SDK's write
    with pytest.raises(StoppedBeforeSend):
        await tap.send(call(1))
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()
    assert tap.in_flight is None and told == []


async def test_a_call_waiting_for_a_busy_writer_is_not_sent_once_the_stop_comes(
    streams: tuple[Any, Any], autojump_clock: Any
) -> None:
    # The writer is still writing an earlier message: the call waits for it, and a stop
    # meanwhile keeps it from ever being handed over (a cancelled waiting send could
    # have handed it over all the same).
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = stop = StopControl()
    told: list[object] = []
    tap.on_sent = lambda: told.append(tap.in_flight)
    raised: list[BaseException] = []

    async def caller() -> None:
        try:
            await tap.send(call(2))
        except StoppedBeforeSend as exc:
            raised.append(exc)

    async with trio.open_nursery() as n:
        n.start_soon(caller)
        await trio.sleep(1.0)  # the writer stays busy a while
        stop.request("user")
    assert raised and tap.in_flight is None and told == []
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()


async def test_a_stop_does_not_hold_back_what_is_not_a_call(streams: tuple[Any, Any]) -> None:
    # notifications/cancelled is how a stop reaches a call in flight: it must go out.
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = stop = StopControl()
    stop.request("user")
    note = SessionMessage(
        message=JSONRPCNotification(jsonrpc="2.0", method="notifications/cancelled", params={"requestId": 3})
    )
    async with trio.open_nursery() as n:
        got: list[SessionMessage] = []

        async def writer() -> None:
            got.append(await receive.receive())

        n.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        await tap.send(note)
    assert [m.message.method for m in got] == ["notifications/cancelled"]


async def test_a_call_waiting_for_a_busy_writer_still_ends_at_its_timeout(
    streams: tuple[Any, Any], autojump_clock: Any
) -> None:
    # The wait is polled in shielded sleeps: without a checkpoint between them, a server
    # that never read its stdin held the call past its timeout, for good.
    send, _receive = streams
    tap = _OutboundTap(send)
    tap.stop = StopControl()
    with trio.move_on_after(5.0) as timer:
        await tap.send(call(4))
    assert timer.cancelled_caught and tap.in_flight is None


# ------------------------------------------------------------------ the hand-off, observed
# A real runner and a real stdio server: the record's ``sent_at`` (and the ``tool_call``
# event that carries it) exists exactly when the request was handed to the transport.

WEDGE_SERVER = str(CHILDREN / "mcp_wedge_server.py")


def wedge_spec(tmp_path: Path, calls: list[dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    shared = tmp_path / "shared"  # the server's log: granted (the run's sandbox reaches its own dir)
    shared.mkdir(exist_ok=True)
    log = shared / "server.log"
    servers = {"wedge": {"command": sys.executable, "args": [WEDGE_SERVER], "env": {"MCP_WEDGE_LOG": str(log)}}}
    script = {"turns": [{"text": "calling", "tool_calls": calls}], "final": "done"}
    return spec(script=script, mcpServers=servers, sandbox={"write": [str(shared)]}), log


def records_of(r: RunnerProc, name: str) -> list[dict[str, Any]]:
    return [e.data["record"] for e in r.of(EventKind.TOOL_CALL) if e.data["record"]["name"] == name]


def sent(name: str) -> Callable[[Event], bool]:
    return lambda e: e.data["record"]["name"] == name and e.data["record"].get("sent_at") is not None


async def test_a_call_stopped_after_its_hand_off_is_recorded_sent_and_gets_its_stop_policy(tmp_path: Path) -> None:
    runner_spec, log = wedge_spec(tmp_path, [{"name": "hold", "arguments": {}}])
    async with start_runner(runner_spec, tmp_path) as r:
        with trio.fail_after(20):
            handed = await r.wait_event(EventKind.TOOL_CALL, sent("hold"))
        r.signal()  # no other wait: the record alone says the request is out
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    (call,) = result["tool_calls"]
    assert (call["state"], call["on_stop"], call["stop_effect"]) == ("cancelled", "abandon", "abandoned")
    assert call["sent_at"] == handed.data["record"]["sent_at"] and call["started_at"] <= call["sent_at"]
    # One record more than before: running, running and sent, then its outcome.
    states = [(rec["state"], rec["sent_at"] is not None) for rec in records_of(r, "hold")]
    assert states[:3] == [("not_started", False), ("running", False), ("running", True)] and states[-1][1]
    # Where it arrived: the server read that request, and was told to cancel it.
    lines = log.read_text().splitlines()
    rid = next(ln.split(" ", 2)[2] for ln in lines if ln.startswith("call hold "))
    assert f"cancelled {rid}" in lines


async def test_a_call_stopped_before_its_hand_off_is_never_recorded_sent(tmp_path: Path) -> None:
    # The first call's request is longer than the server reads: it answers from its start
    # and reads no more, so the transport's writer stays busy with it and the second call
    # can never be handed over. A stop while it waits leaves it unsent.
    runner_spec, log = wedge_spec(
        tmp_path,
        [{"name": "swallow", "arguments": {"text": "x" * 300_000}}, {"name": "hold", "arguments": {}}],
    )
    async with start_runner(runner_spec, tmp_path) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.TOOL_CALL, sent("swallow"))
            await r.wait_event(
                EventKind.TOOL_CALL,
                lambda e: e.data["record"]["name"] == "hold" and e.data["record"]["state"] == "running",
            )
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    swallow, hold = result["tool_calls"]
    assert swallow["state"] == "succeeded" and swallow["sent_at"] is not None
    assert (hold["state"], hold["stop_effect"], hold["sent_at"]) == ("not_started", "stopped_before_start", None)
    assert not any(rec.get("sent_at") for rec in records_of(r, "hold"))
    assert [ln.split(" ")[:2] for ln in log.read_text().splitlines()] == [["wedged", "swallow"]]
