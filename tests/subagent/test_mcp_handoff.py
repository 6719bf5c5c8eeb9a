"""A call's hand-off to its MCP server's transport is one step with the check that no stop
came (``_OutboundTap``): the SDK's path from the loop's check to its write yields to the
loop, where a stop may arrive. Through the SDK's own message types and an anyio memory
stream, as the stdio transport's writer reads it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCNotification, JSONRPCRequest

from subagent.stop import StopControl
from subagent.tools.mcp_tools import StoppedBeforeSend, _OutboundTap


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
    async with trio.open_nursery() as n:
        got: list[SessionMessage] = []

        async def writer() -> None:
            got.append(await receive.receive())

        n.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits, as the transport's does
        await tap.send(call(7))
    assert [m.message.id for m in got] == [7] and tap.in_flight == 7


async def test_a_call_a_stop_reached_on_the_sdks_way_to_the_transport_is_never_sent(streams: tuple[Any, Any]) -> None:
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = stop = StopControl()
    stop.request("user")  # after the loop's check, before the SDK's write
    with pytest.raises(StoppedBeforeSend):
        await tap.send(call(1))
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()
    assert tap.in_flight is None


async def test_a_call_waiting_for_a_busy_writer_is_not_sent_once_the_stop_comes(
    streams: tuple[Any, Any], autojump_clock: Any
) -> None:
    # The writer is still writing an earlier message: the call waits for it, and a stop
    # meanwhile keeps it from ever being handed over (a cancelled waiting send could
    # have handed it over all the same).
    send, receive = streams
    tap = _OutboundTap(send)
    tap.stop = stop = StopControl()
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
    assert raised and tap.in_flight is None
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
