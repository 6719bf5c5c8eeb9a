"""A send cancelled from outside while its frame is half written (the client reads slowly).

trio's ``send_all``, cancelled, may have written part of its data, and trio-websocket goes
on using the connection: the next message was written inside the half frame, and the
client read garbage (or, its frame's length still to come, waited forever) and lost the
replies after it. A slow client's ``unsubscribe`` cancelled its subscription in the middle
of a large event: the event's frame was cut, and the unsubscribe's reply was lost in it.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from wsproto.events import CloseConnection, TextMessage

from supervisor.control import server as control
from tests.supervisor.test_control import WAIT_S, Server, start_server
from tests.supervisor.test_control_bad_frames import BAD_FRAMES, RawPeer, text

# Larger than all a stalled connection can hold in flight (the server's send buffer, at
# most net.ipv4.tcp_wmem's 4 MiB, and the client's small receive buffer): its send stops
# in the middle of the frame.
BIG_EVENT_CHARS = 8 * 1024 * 1024
CLIENT_RCVBUF = 16 * 1024


@asynccontextmanager
async def slow_peer(port: int) -> AsyncIterator[RawPeer]:
    """A raw client whose receive buffer is small (set before connecting: no autotuning)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    await sock.connect(("127.0.0.1", port))
    async with trio.SocketStream(sock) as stream:
        peer = RawPeer(stream)
        await peer.handshake("test-token-123")
        yield peer


class Messages:
    """The client's side: whole messages assembled from wsproto's chunks."""

    def __init__(self, peer: RawPeer) -> None:
        self.peer = peer
        self.done: list[Any] = []  # parsed messages, or ("not json", text[:80]), or a CloseConnection
        self.partial = ""

    async def read_once(self) -> bool:
        """One receive; whether the stream is still open."""
        data = await self.peer.stream.receive_some(64 * 1024)
        if not data:
            return False
        self.peer.ws.receive_data(data)
        for e in self.peer.ws.events():
            if isinstance(e, TextMessage):
                self.partial += e.data
                if e.message_finished:
                    try:
                        self.done.append(json.loads(self.partial))
                    except ValueError:
                        self.done.append(("not json", self.partial[:80]))
                    self.partial = ""
            elif isinstance(e, CloseConnection):
                self.done.append(e)
        return True

    async def subscribe_and_stall(self, run: str) -> str:
        """Subscribe after event 1, read the ack and the first bytes of event 2, and stop
        there: the server is in the middle of that frame, and stays there while the client
        reads nothing. The subscription's id."""
        await self.peer.stream.send_all(text({"id": 1, "op": "subscribe", "run_id": run, "after_seq": 1}))
        with trio.fail_after(WAIT_S):
            while self.reply(1) is None or not self.partial:
                assert await self.read_once(), self.done
        ack = self.reply(1)
        assert ack["ok"] is True, ack
        return str(ack["result"]["sub"])

    def bad(self) -> list[Any]:
        """What was not a whole json message."""
        return [m for m in self.done if not isinstance(m, dict)]

    def events(self) -> list[dict[str, Any]]:
        events = [m for m in self.done if isinstance(m, dict) and m.get("op") == "event"]
        assert all(len(e["data"]["message"]) == BIG_EVENT_CHARS for e in events)
        return events

    def reply(self, rid: int) -> Any:
        return next((m for m in self.done if isinstance(m, dict) and m.get("id") == rid), None)


async def test_an_unsubscribe_in_the_middle_of_a_large_event_cuts_no_frame_and_loses_no_reply(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path)
    run = big_run(srv)
    async with slow_peer(srv.port) as peer:
        got = Messages(peer)
        sub = await got.subscribe_and_stall(run)
        # Still reading nothing: unsubscribe (it cancels the subscription's send), then ping.
        await peer.stream.send_all(text({"id": 2, "op": "unsubscribe", "sub": sub}) + text({"id": 3, "op": "ping"}))
        with trio.fail_after(WAIT_S):
            await trio.testing.wait_all_tasks_blocked()  # the server has read both
        # Now read again: whole messages only, and both replies.
        with trio.move_on_after(WAIT_S):
            while got.reply(3) is None and await got.read_once():
                pass
        assert got.bad() == [], got.bad()
        assert got.reply(3) is not None, (
            f"the ping's reply never came; {len(got.partial)} chars of a message pending, "
            f"received: {[(m.get('id'), m.get('seq')) for m in got.done]}"
        )
        assert got.reply(2) == {"id": 2, "ok": True, "result": {"sub": sub, "was_active": True}}
        assert [e["seq"] for e in got.events()] in ([2], [2, 3])
        assert got.reply(3)["ok"] is True


async def test_a_frame_breaking_the_protocol_in_the_middle_of_a_large_event_gets_a_clean_close(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path)
    run = big_run(srv)
    async with slow_peer(srv.port) as peer:
        got = Messages(peer)
        await got.subscribe_and_stall(run)
        frames, code = BAD_FRAMES["unmasked"]
        await peer.stream.send_all(frames)  # the subscription ends (``_Connection.run``)
        with trio.fail_after(WAIT_S):
            await trio.testing.wait_all_tasks_blocked()  # the server has read it
            while await got.read_once():
                pass
    # The event whole, then the close frame that says why: nothing inside the event's frame.
    assert [m.code for m in got.bad()] == [code], got.bad()
    assert [e["seq"] for e in got.events()] in ([2], [2, 3])
    assert isinstance(got.done[-1], CloseConnection)


@pytest.mark.parametrize("bad_frame", [False, True], ids=["stalled", "stalled after a bad frame"])
async def test_a_stopping_server_does_not_wait_for_a_client_stalled_in_the_middle_of_a_frame(
    nursery: trio.Nursery, tmp_path: Path, bad_frame: bool
) -> None:
    """A started send is shielded (it finishes its frame), but the connection's own end,
    the daemon stopping, closes the stream at once: the stop is not ``send_s`` longer.
    Also once a bad frame has ended the connection's reading (its subscriptions still
    sending, the daemon waited ``send_s`` for them)."""
    stopped = trio.Event()

    async def daemon(task_status: trio.TaskStatus[tuple[Server, trio.CancelScope]]) -> None:
        async with trio.open_nursery() as inner:
            srv = await start_server(inner, tmp_path, limits=control.Limits(send_s=100 * WAIT_S))
            task_status.started((srv, inner.cancel_scope))
        stopped.set()

    srv, scope = await nursery.start(daemon)
    run = big_run(srv)
    async with slow_peer(srv.port) as peer:
        got = Messages(peer)
        await got.subscribe_and_stall(run)
        if bad_frame:
            await peer.stream.send_all(BAD_FRAMES["unmasked"][0])
            with trio.fail_after(WAIT_S):
                await trio.testing.wait_all_tasks_blocked()  # the server has read it
        scope.cancel()
        with trio.fail_after(WAIT_S):
            await stopped.wait()
            while await got.read_once():  # then the end of the stream, inside the frame
                pass
    assert got.bad() == [] and got.events() == [], got.done


def big_run(srv: Server) -> str:
    """A run whose events 2 and 3 are each larger than a stalled connection holds."""
    run = srv.backend.add_run()  # event 1: its state
    for _ in range(2):
        srv.backend.emit(run, "log", {"message": "x" * BIG_EVENT_CHARS})
    return run
