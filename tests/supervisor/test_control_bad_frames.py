"""A frame that breaks the websocket protocol, over a raw socket (trio-websocket's client
only sends valid frames): the replies owed before it are sent, then a close frame says
why (1007 or 1002), and nothing else is touched.

trio-websocket 0.12 closed such a connection at once, with no close frame: a ``spawn``
just before the bad frame started its run and its client never learnt the run's id.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
import trio_websocket
from trio_websocket import WebSocketConnection, WebSocketServer
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Event, Request, TextMessage

from tests.supervisor.real_daemon import real_daemon, strict_loads
from tests.supervisor.test_control import TOKEN, WAIT_S, Server, connect, start_server


def frame(opcode: int, payload: bytes, *, fin: bool = True, masked: bool = True) -> bytes:
    """One client frame, written by hand (payload under 126 bytes)."""
    assert len(payload) < 126
    head = bytes([(0x80 if fin else 0) | opcode, (0x80 if masked else 0) | len(payload)])
    if not masked:
        return head + payload
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def text(obj: Any) -> bytes:
    return frame(0x1, json.dumps(obj).encode())


BAD_FRAMES = {
    "text not utf-8": (frame(0x1, b'{"id": 2, "op": "ping", "x": "\xff"}'), 1007),
    "text not utf-8 in its second fragment": (
        frame(0x1, b'{"id": 2, "op": "\xe2\x82', fin=False) + frame(0x0, b'\xff"}'),
        1007,
    ),
    "close reason not utf-8": (frame(0x8, struct.pack("!H", 1000) + b"\xff"), 1007),
    "unmasked": (frame(0x1, b'{"id": 2, "op": "ping"}', masked=False), 1002),
    "reserved opcode": (frame(0x3, b""), 1002),
}


class RawPeer:
    """A client speaking wsproto over a bare TCP stream, to send frames byte by byte."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)

    async def handshake(self, token: str) -> None:
        auth = [(b"authorization", f"Bearer {token}".encode())]
        await self.stream.send_all(self.ws.send(Request(host="127.0.0.1", target="/", extra_headers=auth)))
        with trio.fail_after(WAIT_S):
            while True:
                data = await self.stream.receive_some()
                assert data, "closed in the handshake"
                self.ws.receive_data(data)
                if any(isinstance(e, AcceptConnection) for e in self.ws.events()):
                    return

    async def events_until_eof(self) -> list[Event]:
        """Every event the server sends until it closes the TCP connection."""
        events: list[Event] = []
        with trio.fail_after(WAIT_S):
            while data := await self.stream.receive_some():
                self.ws.receive_data(data)
                events.extend(self.ws.events())
        return events


@asynccontextmanager
async def raw_peer(port: int, token: str = TOKEN) -> AsyncIterator[RawPeer]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        peer = RawPeer(stream)
        await peer.handshake(token)
        yield peer


@contextmanager
def failure_seen() -> Iterator[trio.Event]:
    """Set once the server has taken a frame for a protocol failure (its debug line)."""
    seen = trio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "broke the protocol" in record.getMessage():
                seen.set()

    log = logging.getLogger("supervisor.control._wsfail")
    handler, level = Watch(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def gate_spawns(srv: Server) -> tuple[trio.Event, trio.Event]:
    """(started, gate): the backend's spawns start, then wait for ``gate``."""
    started, gate = trio.Event(), trio.Event()
    real_spawn = srv.backend.spawn

    async def gated_spawn(spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
        started.set()
        await gate.wait()
        return await real_spawn(spec, **kw)

    srv.backend.spawn = gated_spawn  # type: ignore[method-assign]
    return started, gate


async def spawn_then(srv: Server, peer: RawPeer, bad: bytes, *, half_close: bool = False) -> tuple[list[Event], bool]:
    """A spawn, a bad frame and a ping in one write; the spawn answers once the server has
    seen the bad frame (or after WAIT_S). What the client gets, and whether it was seen."""
    started, gate = gate_spawns(srv)
    with failure_seen() as failed:
        await peer.stream.send_all(
            text({"id": 1, "op": "spawn", "spec": {"task": "x"}}) + bad + text({"id": 3, "op": "ping"})
        )
        if half_close:
            await peer.stream.send_eof()
        with trio.fail_after(WAIT_S):
            await started.wait()
        with trio.move_on_after(WAIT_S):
            await failed.wait()
        gate.set()  # regardless: what the client gets says what went wrong
        events = await peer.events_until_eof()
    return events, failed.is_set()


def check_reply_then_close(srv: Server, events: list[Event], failure_seen: bool, code: int) -> None:
    replies = [json.loads(e.data) for e in events if isinstance(e, TextMessage)]
    closes = [e for e in events if isinstance(e, CloseConnection)]
    (run_id,) = srv.backend.runs
    # The spawn's reply, nothing for the ping after the bad frame, then the close frame.
    assert [(r["id"], r["ok"], r["result"]["run_id"]) for r in replies] == [(1, True, run_id)], events
    assert [c.code for c in closes] == [code], events
    assert closes[0].reason, events
    assert isinstance(events[-1], CloseConnection), events
    assert failure_seen  # the reply was owed when the bad frame was read


@pytest.mark.parametrize("bad", BAD_FRAMES.values(), ids=list(BAD_FRAMES))
async def test_a_frame_breaking_the_protocol_gets_the_replies_owed_before_it_then_a_close_frame(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: tuple[bytes, int]
) -> None:
    caplog.set_level(logging.INFO, logger="supervisor.control.server")
    srv = await start_server(nursery, tmp_path)
    frames, code = bad
    async with connect(srv) as bystander:
        async with raw_peer(srv.port) as peer:
            events, seen = await spawn_then(srv, peer, frames)
        check_reply_then_close(srv, events, seen, code)
        assert (await bystander.ok("ping"))["pong"] is True  # another connection lives on
    async with connect(srv) as peer:  # and the server takes new ones
        assert (await peer.ok("status", run_id=next(iter(srv.backend.runs))))["state"] == "running"
    assert any("breaks the websocket protocol" in r.getMessage() for r in caplog.records)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_client_that_half_closes_after_a_bad_frame_still_gets_its_replies(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path)
    frames, code = BAD_FRAMES["text not utf-8"]
    async with raw_peer(srv.port) as peer:
        events, seen = await spawn_then(srv, peer, frames, half_close=True)
    check_reply_then_close(srv, events, seen, code)


async def test_a_subscription_not_started_when_a_frame_breaks_the_protocol_is_refused_not_dropped(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path)
    run = srv.backend.add_run()
    entered = trio.Event()
    real_subscribe = srv.backend.subscribe

    @asynccontextmanager
    async def stuck_subscribe(run_id: str) -> AsyncIterator[Any]:
        entered.set()
        await trio.sleep_forever()  # until the subscription is cancelled
        async with real_subscribe(run_id) as live:  # pragma: no cover
            yield live

    srv.backend.subscribe = stuck_subscribe  # type: ignore[method-assign]
    async with raw_peer(srv.port) as peer:
        with failure_seen() as failed:
            await peer.stream.send_all(text({"id": 1, "op": "subscribe", "run_id": run}) + BAD_FRAMES["unmasked"][0])
            with trio.fail_after(WAIT_S):
                await entered.wait()
                await failed.wait()
            events = await peer.events_until_eof()
    replies = [json.loads(e.data) for e in events if isinstance(e, TextMessage)]
    assert [(r["id"], r["ok"], r["error"]["code"]) for r in replies] == [(1, False, "refused")], events
    assert "broke the websocket protocol" in replies[0]["error"]["message"]
    assert [e.code for e in events if isinstance(e, CloseConnection)] == [1002], events
    assert srv.backend.runs[run].subscribers == []


async def test_a_real_daemon_answers_a_spawn_sent_before_a_frame_not_utf8_then_closes_1007(tmp_path: Path) -> None:
    spawn = {"id": 1, "op": "spawn", "spec": {"task": json.dumps({"wait": False})}}
    async with real_daemon(tmp_path / "state") as daemon:
        port = urlsplit(daemon.url).port
        assert port is not None
        async with raw_peer(port, daemon.token) as peer:
            await peer.stream.send_all(text(spawn) + BAD_FRAMES["text not utf-8"][0])
            events = await peer.events_until_eof()
        replies = [strict_loads(e.data) for e in events if isinstance(e, TextMessage)]
        assert [(r["id"], r["ok"]) for r in replies] == [(1, True)], events
        assert [e.code for e in events if isinstance(e, CloseConnection)] == [1007], events
        async with daemon.connect() as client:  # the daemon serves on, and the run ends on its own
            assert (await client.wait_end(replies[0]["result"]["run_id"]))["state"] == "completed"
        assert daemon.alive()


# What supervisor/control/_wsfail.py copies (handle_connection) or relies on (the reader
# task's dispatch, the close paths FailingConnection overrides or meets), in trio-websocket.
PINNED_VERSION = "0.12.2"
PINNED_SOURCES = (
    WebSocketServer._handle_connection,
    WebSocketConnection._reader_task,
    WebSocketConnection._handle_close_connection_event,
    WebSocketConnection._aclose,
    WebSocketConnection._abort_web_socket,
    WebSocketConnection._close_stream,
)
PINNED_DIGEST = "bd1cc0cd2038dd737421e3518586dcdd5ad173a8bfe7c96f19e4fbca0ba194d2"


def test_trio_websocket_is_the_version_failing_connection_was_written_for() -> None:
    digest = hashlib.sha256("".join(inspect.getsource(f) for f in PINNED_SOURCES).encode()).hexdigest()
    assert (trio_websocket.__version__, digest) == (PINNED_VERSION, PINNED_DIGEST), (
        "trio-websocket changed: check supervisor/control/_wsfail.py against it (handle_connection "
        "copies WebSocketServer._handle_connection; FailingConnection overrides "
        "_handle_close_connection_event and _aclose, and relies on the reader task ending on "
        "ConnectionClosed from a handler), then update the pin here"
    )


async def test_a_running_subscription_gets_its_end_when_a_frame_breaks_the_protocol(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path)
    run = srv.backend.add_run()
    async with raw_peer(srv.port) as peer:
        with failure_seen() as failed:
            await peer.stream.send_all(text({"id": 1, "op": "subscribe", "run_id": run}))
            events: list[Event] = []
            with trio.fail_after(WAIT_S):  # its reply: the subscription follows the run
                while not any(isinstance(e, TextMessage) and json.loads(e.data).get("id") == 1 for e in events):
                    data = await peer.stream.receive_some()
                    assert data, events
                    peer.ws.receive_data(data)
                    events.extend(peer.ws.events())
            await peer.stream.send_all(BAD_FRAMES["text not utf-8"][0])
            with trio.fail_after(WAIT_S):
                await failed.wait()
            events += await peer.events_until_eof()
    messages = [json.loads(e.data) for e in events if isinstance(e, TextMessage)]
    assert [(m.get("id"), m.get("ok")) for m in messages if "id" in m] == [(1, True)], events
    (end,) = [m for m in messages if m.get("op") == "end"]
    assert (end["sub"], end["run_id"], end["state"], end["error"]["code"]) == ("1", run, None, "refused"), end
    assert "broke the websocket protocol" in end["error"]["message"]
    assert isinstance(events[-1], CloseConnection) and events[-1].code == 1007, events
    assert srv.backend.runs[run].subscribers == []
