"""The control socket's limits against hostile clients, over real TCP and websockets.

Every hold a client can take has a bound with a named default (``control.Limits``): a
refused handshake is closed at once, connections per peer and in all, idleness,
subscriptions per connection, bytes buffered per subscriber, replay pages and ``events``
replies in bytes. What is over a limit is refused or closed; nothing else is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from supervisor import protocol
from supervisor.control import server as control
from supervisor.control._conn_limits import Gate, GatedStream, fd_connection_cap
from tests.supervisor.fake_backend import FakeBackend
from tests.supervisor.test_control import TOKEN, WAIT_S, Server, connect, start_server

UPGRADE = (
    "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
)


class PagedBackend(FakeBackend):
    """The fake backend with the optional byte-bounded page, recording what was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.pages: list[tuple[int, int]] = []  # (events returned, bytes of their data)

    async def events_page(
        self, run_id: str, after_seq: int, *, limit: int, max_bytes: int | None
    ) -> tuple[list[dict[str, Any]], bool]:
        events = await self.events_after(run_id, after_seq, limit + 1)
        page: list[dict[str, Any]] = []
        size = 0
        for e in events:
            size += len(json.dumps(e["data"]))
            if len(page) >= limit or (page and max_bytes is not None and size > max_bytes):
                break
            page.append(e)
        self.pages.append((len(page), sum(len(json.dumps(e["data"])) for e in page)))
        return page, len(page) < len(events)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(WAIT_S):
        while chunk := await stream.receive_some():
            data += chunk
    return data


async def test_a_refused_handshake_is_closed_at_once_not_when_the_client_likes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The handshake timeout is far away: only closing the refusal ends this connection.
    srv = await start_server(nursery, tmp_path, limits=control.Limits(handshake_s=600))
    for extra in ("", "Authorization: Bearer wrong\r\n", f"Authorization: Bearer {TOKEN}\r\nOrigin: http://evil\r\n"):
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        async with stream:
            await stream.send_all(UPGRADE.format(extra=extra).encode())
            with trio.fail_after(2):  # far below the 600 s handshake bound
                data = await read_until_closed(stream)
        assert data.split(b" ", 2)[1] in (b"401", b"403"), data
    async with connect(srv) as peer:
        assert (await peer.ok("ping"))["connection_limits"]["open"] == 1


async def upgrade_status(srv: Server) -> int | None:
    """The status of an authenticated upgrade over raw TCP; None when closed unanswered."""
    stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
    async with stream:
        await stream.send_all(UPGRADE.format(extra=f"Authorization: Bearer {TOKEN}\r\n").encode())
        data = b""
        with trio.fail_after(WAIT_S):
            while b"\r\n" not in data:
                chunk = await stream.receive_some()
                if not chunk:
                    return None
                data += chunk
    return int(data.split(b" ", 2)[1])


async def test_at_the_per_peer_limit_the_oldest_handshaking_connection_makes_room(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path, limits=control.Limits(per_peer=3, handshake_s=600))
    async with connect(srv) as peer:
        held = [await trio.open_tcp_stream("127.0.0.1", srv.port) for _ in range(2)]  # 3 with peer
        # A fourth: the oldest silent one is closed for it, not the newcomer (nor the
        # authenticated one).
        extra = await trio.open_tcp_stream("127.0.0.1", srv.port)
        assert await read_until_closed(held[0]) == b""
        info = (await peer.ok("ping"))["connection_limits"]
        assert info["evicted"] == 1 and info["refused"] == 0 and info["open"] == 3 and info["per_peer"] == 3
        # The newest silent one is still open; an authenticated newcomer evicts the oldest
        # (held[1]) and is served.
        status = await upgrade_status(srv)
        assert status == 101
        assert await read_until_closed(held[1]) == b""
        for s in [*held, extra]:
            await s.aclose()


async def test_when_every_slot_is_authenticated_a_newcomer_is_refused_and_none_evicted(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path, limits=control.Limits(per_peer=3, handshake_s=600))
    async with connect(srv) as a, connect(srv) as b, connect(srv) as c:
        extra = await trio.open_tcp_stream("127.0.0.1", srv.port)
        assert await read_until_closed(extra) == b""  # closed before a byte was read
        await extra.aclose()
        for peer in (a, b):
            await peer.ok("ping")
        info = (await c.ok("ping"))["connection_limits"]
        assert info["refused"] >= 1 and info["evicted"] == 0 and info["open"] == 3


async def test_a_flood_of_silent_connections_without_the_token_does_not_lock_clients_out(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The probe's attack: a local process with no token fills every slot with connections
    # that send nothing, and reopens each as soon as it is closed. Handshakes used to hold
    # their slots for handshake_s (here far away) and every newcomer was refused.
    slots = 32
    srv = await start_server(nursery, tmp_path, limits=control.Limits(per_peer=slots, handshake_s=600))
    async with connect(srv) as held:  # authenticated before the flood: never evicted
        reopened = 0
        flooding = trio.Event()

        async def silent() -> None:
            nonlocal reopened
            while True:
                stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
                async with stream:
                    if reopened >= slots:
                        flooding.set()
                    with contextlib.suppress(trio.BrokenResourceError):
                        await stream.receive_some()  # until the server closes it
                reopened += 1

        async with trio.open_nursery() as flood:
            for _ in range(slots):
                flood.start_soon(silent)
            with trio.fail_after(WAIT_S):
                await flooding.wait()  # the slots are full and churning
            for _ in range(5):
                async with connect(srv) as peer:  # a new client's handshake gets through
                    assert (await peer.ok("ping"))["pong"] is True
            info = (await held.ok("ping"))["connection_limits"]
            flood.cancel_scope.cancel()
        assert info["evicted"] >= slots and info["refused"] == 0, info


def test_the_connection_total_is_capped_by_the_fd_limit() -> None:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = fd_connection_cap(10**9)
    assert cap == max(8, (soft - 64) // 2) and fd_connection_cap(5) == 5


async def test_an_idle_authenticated_connection_is_closed_and_a_subscribed_one_is_not(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    srv = await start_server(nursery, tmp_path, limits=control.Limits(idle_s=0.3))
    run = srv.backend.add_run()
    async with connect(srv) as busy, connect(srv) as idle:
        await busy.ok("subscribe", run_id=run)
        assert (await busy.recv())["op"] == "event"
        await idle.ok("ping")
        with trio.fail_after(WAIT_S), pytest.raises(ConnectionClosed) as info:
            await idle.ws.get_message()
        assert info.value.reason.code == 1001
        await idle.ws._stream.aclose()  # trio-websocket 0.12's client keeps it after a server close
        # More than idle_s later, the one with a subscription is still served.
        assert (await busy.ok("ping"))["pong"] is True
        srv.backend.emit(run, "log", {"message": "still here"})
        assert (await busy.recv())["data"] == {"message": "still here"}


async def reply_to(peer: Any, rid: str) -> dict[str, Any]:
    while True:
        msg = await peer.recv()
        if msg.get("id") == rid:
            return msg


async def test_subscriptions_per_connection_are_capped(nursery: trio.Nursery, tmp_path: Path) -> None:
    srv = await start_server(nursery, tmp_path, limits=control.Limits(subscriptions=2))
    run = srv.backend.add_run()
    async with connect(srv) as peer:
        for rid in ("s1", "s2", "s3"):
            await peer.send({"id": rid, "op": "subscribe", "run_id": run})
        assert (await reply_to(peer, "s1"))["ok"] is True
        assert (await reply_to(peer, "s2"))["ok"] is True
        reply = await reply_to(peer, "s3")
        assert reply["ok"] is False and reply["error"]["code"] == "refused"
        assert "at most 2 subscriptions" in reply["error"]["message"]


async def test_a_slow_subscribers_buffer_is_bounded_in_bytes_and_it_still_gets_every_event_once(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = PagedBackend()
    srv = await start_server(nursery, tmp_path, backend, limits=control.Limits(subscriber_bytes=20_000))
    run = backend.add_run()
    caplog.set_level(logging.INFO, "supervisor.control.server")
    async with connect(srv) as peer:
        await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        for i in range(200):  # ~1 MB while the client reads nothing
            backend.emit(run, "log", {"message": f"{i:04d}" + "x" * 5000})
        backend.finish(run, "completed")
        seqs, end = await peer.events_until_end()
    assert seqs == list(range(2, 203)) and end["state"] == "completed"
    assert any("live events dropped for a slow client" in r.getMessage() for r in caplog.records)


async def test_replay_pages_and_events_replies_are_bounded_in_bytes(nursery: trio.Nursery, tmp_path: Path) -> None:
    backend = PagedBackend()
    limits = control.Limits(replay_page_bytes=50_000, events_reply_bytes=120_000)
    srv = await start_server(nursery, tmp_path, backend, limits=limits)
    run = backend.add_run()
    for _ in range(100):
        backend.emit(run, "log", {"message": "y" * 20_000})
    backend.finish(run, "completed")
    async with connect(srv) as peer:
        await peer.ok("subscribe", run_id=run)
        seqs, end = await peer.events_until_end()
        assert seqs == list(range(1, 103)) and end["state"] == "completed"
        assert max(size for _n, size in backend.pages) <= 50_000
        page = await peer.ok("events", run_id=run, limit=1000)
        assert page["more"] is True and 1 <= len(page["events"]) <= 6
        last = page["events"][-1]["seq"]
        rest = await peer.ok("events", run_id=run, after_seq=last, limit=1000)
        assert rest["events"][0]["seq"] == last + 1


class ShortPages(FakeBackend):
    """A backend whose pages are cut short by something else than the limit (a relay)."""

    async def events_after(self, run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
        return await super().events_after(run_id, after_seq, min(limit, 3))


async def test_a_backends_short_pages_are_read_on_until_an_empty_one(nursery: trio.Nursery, tmp_path: Path) -> None:
    backend = ShortPages()
    srv = await start_server(nursery, tmp_path, backend)
    run = backend.add_run()
    for i in range(20):
        backend.emit(run, "log", {"message": str(i)})
    backend.finish(run, "completed")
    async with connect(srv) as peer:
        await peer.ok("subscribe", run_id=run)
        seqs, end = await peer.events_until_end()
        assert seqs == list(range(1, 23)) and end["state"] == "completed"
        page = await peer.ok("events", run_id=run, after_seq=0, limit=1000)
        assert len(page["events"]) == 3 and page["more"] is True


async def test_a_large_message_is_decoded_off_the_event_loop_and_the_others_are_served_meanwhile(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A megabyte of nested brackets took ~1 s to check on the event loop, and four clients
    # sending such messages made another's status take 6-14 s. Here the decoding of the
    # large message waits until another connection's ping has been answered: it can only
    # be if the event loop goes on while that message is decoded.
    srv = await start_server(nursery, tmp_path)
    started, others_served = threading.Event(), threading.Event()
    waited: list[bool] = []
    real = protocol.decode_request

    def decode(message: str | bytes, *, max_bytes: int) -> protocol.Request | protocol.BadRequest:
        if len(message) > control.DECODE_IN_THREAD_CHARS:
            started.set()
            waited.append(others_served.wait(WAIT_S))
        return real(message, max_bytes=max_bytes)

    monkeypatch.setattr(protocol, "decode_request", decode)
    async with connect(srv) as big, connect(srv) as other:
        pad = "x" * (control.DECODE_IN_THREAD_CHARS + 1)
        await big.send({"id": 1, "op": "ping", "pad": pad})
        await big.send({"id": 2, "op": "ping"})  # taken after the large one, as ever
        assert await trio.to_thread.run_sync(started.wait, WAIT_S)
        assert (await other.ok("ping"))["pong"] is True
        others_served.set()
        assert [(await big.recv())["id"] for _ in range(2)] == [1, 2]
    assert waited == [True]


async def test_close_now_closes_a_connection_whose_send_is_stuck_mid_frame() -> None:
    # A send blocked on a client that reads nothing holds the stream's send side: a
    # ``send_eof`` then raised BusyResourceError, and close_now raised instead of closing.
    a, b = trio.socket.socketpair()
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")  # (the gate's; unused)
    gate = Gate(listener, per_peer=4, total=4)
    gate.open["peer"] += 1
    stream = GatedStream(trio.SocketStream(a), "peer", gate)
    ended: list[type[BaseException]] = []

    async def stuck() -> None:
        try:
            await stream.send_all(b"x" * (64 << 20))  # far beyond both socket buffers
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            ended.append(type(exc))

    with b, trio.fail_after(WAIT_S):
        async with trio.open_nursery() as n:
            n.start_soon(stuck)
            await trio.testing.wait_all_tasks_blocked()
            await stream.close_now()
        await listener.aclose()
    assert ended and gate.open["peer"] == 0
