"""The control socket against an in-memory backend, over real websocket connections."""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from subagent.osedge import run_trio
from supervisor import protocol
from supervisor.config import Config
from supervisor.control import server as control
from supervisor.errors import RunNotFound
from tests.supervisor.fake_backend import FakeBackend

TOKEN = "test-token-123"
ORIGIN_OK = "http://app.example:3000"
WAIT_S = 5.0


@dataclass
class Server:
    backend: FakeBackend
    port: int
    config: Config

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"


async def start_server(
    nursery: trio.Nursery,
    tmp_path: Path,
    backend: FakeBackend | None = None,
    limits: control.Limits | None = None,
    **cfg: Any,
) -> Server:
    backend = backend or FakeBackend()
    backend.nursery = nursery
    config = Config(state_dir=tmp_path, port=0, allowed_origins=(ORIGIN_OK,), **cfg)
    port = await nursery.start(partial(control.serve_control, config, backend, token=TOKEN, limits=limits))
    return Server(backend, port, config)


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path) -> Server:
    return await start_server(nursery, tmp_path)


def auth(token: str = TOKEN) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", f"Bearer {token}".encode())]


@asynccontextmanager
async def connect(srv: Server, headers: list[tuple[bytes, bytes]] | None = None, path: str = "") -> AsyncIterator[Peer]:
    async with open_websocket_url(
        srv.url + path,
        extra_headers=auth() if headers is None else headers,
        max_message_size=64 * 1024 * 1024,
        connect_timeout=WAIT_S,
        disconnect_timeout=WAIT_S,
    ) as ws:
        yield Peer(ws)


class Peer:
    """A test-side client: numbered requests, pushed messages kept in arrival order."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def recv(self) -> dict[str, Any]:
        with trio.fail_after(WAIT_S):
            return json.loads(await self.ws.get_message())

    async def send(self, obj: Any) -> None:
        await self.ws.send_message(obj if isinstance(obj, str) else json.dumps(obj))

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        rid = next(self.ids)
        await self.send({"id": rid, "op": op, **args})
        reply = await self.recv()
        assert reply.get("id") == rid, reply
        return reply

    async def ok(self, op: str, **args: Any) -> Any:
        reply = await self.call(op, **args)
        assert reply["ok"] is True, reply
        return reply["result"]

    async def events_until_end(self) -> tuple[list[int], dict[str, Any]]:
        seqs: list[int] = []
        while True:
            msg = await self.recv()
            if msg.get("op") == "end":
                return seqs, msg
            assert msg.get("op") == "event", msg
            seqs.append(msg["seq"])


# --------------------------------------------------------------------------- access (8)


def test_check_access_accepts_the_token_by_header_or_query() -> None:
    assert control.check_access(auth(), "/", token=TOKEN, allowed_origins=()) is None
    assert control.check_access([], f"/?token={TOKEN}", token=TOKEN, allowed_origins=()) is None
    assert (
        control.check_access([(b"authorization", b"bearer " + TOKEN.encode())], "/", token=TOKEN, allowed_origins=())
        is None
    )


@pytest.mark.parametrize(
    ("headers", "target", "status"),
    [
        ([], "/", 401),
        (auth("wrong"), "/", 401),
        ([(b"Authorization", b"Basic " + TOKEN.encode())], "/", 401),
        ([], "/?token=wrong", 401),
        (auth() + [(b"Origin", b"http://evil.example")], "/", 403),
        (auth() + [(b"Origin", b"null")], "/", 403),
        ([], "//[", 400),  # urllib cannot split it: was a traceback in the log
    ],
)
def test_check_access_refuses(headers: list[tuple[bytes, bytes]], target: str, status: int) -> None:
    refusal = control.check_access(headers, target, token=TOKEN, allowed_origins=(ORIGIN_OK,))
    assert refusal is not None and refusal[0] == status


def test_check_access_refuses_everyone_while_there_is_no_token() -> None:
    refusal = control.check_access(auth(), "/", token=None, allowed_origins=())
    assert refusal is not None and refusal[0] == 401


async def handshake_status(srv: Server, headers: list[tuple[bytes, bytes]], path: str = "") -> int:
    """The HTTP status of a hand-made upgrade request (trio-websocket's client leaks its
    socket when refused, which the warnings-as-errors suite would report)."""
    lines = [
        f"GET /{path} HTTP/1.1",
        f"Host: 127.0.0.1:{srv.port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ] + [f"{k.decode()}: {v.decode()}" for k, v in headers]
    stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        with trio.fail_after(WAIT_S):
            while b"\r\n" not in data:
                chunk = await stream.receive_some()
                assert chunk, data
                data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("headers", "path", "status"),
    [
        ([], "", 401),
        (auth("not-the-token"), "", 401),
        ([], "?token=nope", 401),
        (auth() + [(b"Origin", b"http://evil.example")], "", 403),
        ([(b"Origin", b"http://evil.example")], f"?token={TOKEN}", 403),
        (auth(), "", 101),
        ([(b"Origin", ORIGIN_OK.encode())], f"?token={TOKEN}", 101),
    ],
)
async def test_the_server_refuses_the_handshake_without_the_token_or_from_a_foreign_origin(
    server: Server, headers: list[tuple[bytes, bytes]], path: str, status: int
) -> None:
    assert await handshake_status(server, headers, path) == status
    async with connect(server) as peer:  # and it still serves
        assert (await peer.ok("ping"))["pong"] is True


async def test_an_allowed_origin_and_a_query_token_are_accepted(server: Server) -> None:
    async with connect(server, [(b"Origin", ORIGIN_OK.encode())], f"?token={TOKEN}") as peer:
        assert (await peer.ok("ping"))["pong"] is True


async def test_without_a_fixed_token_the_server_reads_the_token_file_when_it_appears(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    config = Config(state_dir=tmp_path, port=0)
    port = await nursery.start(control.serve_control, config, FakeBackend())
    srv = Server(FakeBackend(), port, config)
    assert await handshake_status(srv, auth("anything")) == 401
    token = control.write_token(config.token_path)
    async with connect(srv, auth(token)) as peer:
        await peer.ok("ping")
    control.write_token(config.token_path)  # rotated: the old token no longer works
    assert await handshake_status(srv, auth(token)) == 401


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("{this is not json", "bad_json"),
        ("[1,2,3]", "bad_message"),
        ('{"id": 9, "op": "launch_missiles"}', "unknown_op"),
        ('{"id": 9, "op": "status", "run_id": 42}', "bad_args"),
        ('{"id": 9, "op": "spawn", "spec": {"task": "x"}, "pad": "' + "x" * (10 * 1024 * 1024) + '"}', "too_large"),
        ("[" * 100_000 + "]" * 100_000, "bad_json"),
    ],
)
async def test_a_bad_message_gets_an_error_reply_and_the_connection_and_server_live_on(
    server: Server, message: str, code: str
) -> None:
    async with connect(server) as peer:
        await peer.send(message)
        reply = await peer.recv()
        assert reply["ok"] is False and reply["error"]["code"] == code, reply
        assert reply["error"]["message"]
        if code in ("unknown_op", "bad_args", "too_large"):
            assert reply["id"] == 9
        assert (await peer.ok("ping"))["pong"] is True  # same connection
    async with connect(server) as peer:  # and a new one
        assert (await peer.ok("ping"))["pong"] is True


async def test_a_binary_frame_is_read_as_utf8_json(server: Server) -> None:
    async with connect(server) as peer:
        await peer.ws.send_message(b'{"id": 1, "op": "ping"}')
        assert (await peer.recv())["ok"] is True
        await peer.ws.send_message(b"\xff\xfe")
        assert (await peer.recv())["error"]["code"] == "bad_json"


async def test_a_frame_above_the_hard_cap_closes_with_1009_and_the_server_lives_on(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "HARD_CAP_MIN_BYTES", 0)
    srv = await start_server(nursery, tmp_path, max_message_bytes=1000)
    assert control.hard_message_cap(srv.config) == 16000
    async with connect(srv) as peer:
        await peer.send({"id": 1, "op": "ping", "pad": "x" * 5000})
        assert (await peer.recv())["error"]["code"] == "too_large"
        await peer.send({"id": 2, "op": "ping", "pad": "x" * 20000})
        with pytest.raises(ConnectionClosed) as info:
            await peer.recv()
        assert info.value.reason.code == 1009
        # trio-websocket 0.12's client keeps its TCP stream after a server-side close.
        await peer.ws._stream.aclose()
    async with connect(srv) as peer:
        assert (await peer.ok("ping"))["pong"] is True


async def test_a_handler_bug_becomes_an_internal_error_reply(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    async def broken(run_id: str) -> dict[str, Any]:
        raise KeyError("boom")

    server.backend.status = broken  # type: ignore[method-assign]
    async with connect(server) as peer:
        reply = await peer.call("status", run_id="r-1")
        assert reply["ok"] is False and reply["error"]["code"] == "internal"
        assert "boom" not in reply["error"]["message"]
        assert (await peer.ok("ping"))["pong"] is True
    assert any("status request" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_a_silent_connection_is_dropped_after_the_handshake_timeout(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = await start_server(nursery, tmp_path, limits=control.Limits(handshake_s=0.2))
    stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
    with trio.fail_after(WAIT_S):
        assert await stream.receive_some() == b""
    await stream.aclose()


async def test_a_client_that_stops_reading_is_dropped_and_its_run_goes_on(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "DISCONNECT_TIMEOUT_S", 0.3)
    srv = await start_server(nursery, tmp_path, limits=control.Limits(send_s=0.3))
    b = srv.backend
    run = b.add_run()
    for _ in range(2000):  # 32 MB: more than the socket buffers hold
        b.emit(run, "log", {"message": "x" * 16384})
    dropped = trio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "read nothing" in record.getMessage():
                dropped.set()

    handler = Watch()
    logging.getLogger("supervisor.control.server").addHandler(handler)
    try:
        async with connect(srv) as stalled:
            await stalled.ok("subscribe", run_id=run)
            # Now read nothing: trio-websocket's reader stops once its one-slot queue is full.
            with trio.fail_after(WAIT_S):
                await dropped.wait()
            async with connect(srv) as other:
                assert (await other.ok("status", run_id=run))["state"] == "running"
            # What it reads now are whole messages, then the end of the stream: no close
            # frame written inside a half-written one (read as "invalid utf-8").
            with trio.fail_after(WAIT_S), pytest.raises(ConnectionClosed) as closed:
                while True:
                    json.loads(await stalled.ws.get_message())
            assert closed.value.reason.code == 1006, closed.value.reason
            await stalled.ws._stream.aclose()  # trio-websocket leaves it after an abnormal end
    finally:
        logging.getLogger("supervisor.control.server").removeHandler(handler)
    assert b.cancels == []


async def test_a_client_leaving_mid_stream_is_not_an_error(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    b = server.backend
    run = b.add_run()
    for _ in range(500):
        b.emit(run, "log", {"message": "x" * 8192})
    async with connect(server) as peer:
        await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        await peer.ws._stream.aclose()  # the network goes away while the replay streams
    async with connect(server) as peer:  # the server noticed, and serves on
        assert (await peer.ok("status", run_id=run))["state"] == "running"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert b.cancels == []


# --------------------------------------------------------------------------- operations


async def test_spawn_status_list_and_cancel(server: Server) -> None:
    async with connect(server) as peer:
        spawned = await peer.ok("spawn", spec={"task": "hello"}, session_id="s1", timeout_s=5)
        run_id = spawned["run_id"]
        assert spawned["state"] == "running"
        assert server.backend.spawns[-1] == {"spec": {"task": "hello"}, "session_id": "s1", "timeout_s": 5.0}
        assert (await peer.ok("status", run_id=run_id))["state"] == "running"
        listed = await peer.ok("list", session_id="s1")
        assert [r["run_id"] for r in listed["runs"]] == [run_id] and listed["runs"][0]["summary"] is True
        assert (await peer.ok("list", state="completed"))["runs"] == []
        first = await peer.ok("cancel", run_id=run_id, reason="user")
        assert first == {"run_id": run_id, "was_active": True, "state": "cancelled"}
        again = await peer.ok("cancel", run_id=run_id)
        assert again["was_active"] is False and again["state"] == "cancelled"


async def test_unknown_runs_and_bad_specs_are_error_replies(server: Server) -> None:
    async with connect(server) as peer:
        for op in ("status", "cancel", "events", "subscribe"):
            reply = await peer.call(op, run_id="r-nope")
            assert reply["ok"] is False and reply["error"]["code"] == "not_found", (op, reply)
        reply = await peer.call("spawn", spec={"task": ""})
        assert reply["error"]["code"] == "bad_spec"


async def test_cancel_by_session_uses_the_optional_backend_method(server: Server) -> None:
    a = server.backend.add_run(session_id="s")
    server.backend.add_run(session_id="other")
    async with connect(server) as peer:
        result = await peer.ok("cancel", session_id="s")
    assert result["was_active"] is True
    assert server.backend.cancels == [(a, "user")]


async def test_status_without_a_run_describes_the_daemon_and_its_live_runs(server: Server) -> None:
    live = server.backend.add_run()
    done = server.backend.add_run()
    server.backend.finish(done)
    async with connect(server) as peer:
        result = await peer.ok("status")
    assert result["daemon"]["pid"] == os.getpid()
    assert result["daemon"]["connections"] == 1
    assert [r["run_id"] for r in result["live_runs"]] == [live]


async def test_events_pages_through_the_journal(server: Server) -> None:
    run = server.backend.add_run()
    for i in range(9):
        server.backend.emit(run, "log", {"i": i})
    async with connect(server) as peer:
        page = await peer.ok("events", run_id=run, after_seq=3, limit=4)
    assert [e["seq"] for e in page["events"]] == [4, 5, 6, 7]


async def test_a_request_in_flight_completes_after_its_client_disconnects(server: Server) -> None:
    gate = trio.Event()
    started = trio.Event()
    done = trio.Event()
    real_spawn = server.backend.spawn

    async def slow_spawn(spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
        started.set()
        await gate.wait()
        try:
            return await real_spawn(spec, **kw)
        finally:
            done.set()

    server.backend.spawn = slow_spawn  # type: ignore[method-assign]
    async with connect(server) as peer:
        await peer.send({"id": 1, "op": "spawn", "spec": {"task": "x"}})
        with trio.fail_after(WAIT_S):
            await started.wait()
    gate.set()
    with trio.fail_after(WAIT_S):
        await done.wait()
    assert len(server.backend.runs) == 1 and not server.backend.cancels


# --------------------------------------------------------------------------- subscriptions


async def test_subscribe_replays_then_streams_live_then_ends(server: Server) -> None:
    b = server.backend
    run = b.add_run()
    b.emit(run, "log", {"n": 1})
    async with connect(server) as peer:
        ack = await peer.ok("subscribe", run_id=run, after_seq=0)
        assert ack["run_id"] == run and ack["sub"]
        seen = [(await peer.recv())["seq"], (await peer.recv())["seq"]]
        assert seen == [1, 2]
        b.emit(run, "log", {"n": 2})
        msg = await peer.recv()
        assert msg == {
            "op": "event",
            "sub": ack["sub"],
            "run_id": run,
            "seq": 3,
            "ts": msg["ts"],
            "kind": "log",
            "data": {"n": 2},
        }
        b.finish(run, "completed")
        seqs, end = await peer.events_until_end()
    assert seqs == [4]
    assert end == {"op": "end", "sub": ack["sub"], "run_id": run, "state": "completed", "last_seq": 4}


async def test_subscribing_to_a_finished_run_replays_it_and_ends(server: Server) -> None:
    b = server.backend
    run = b.add_run()
    b.emit(run, "log")
    b.finish(run, "failed")
    async with connect(server) as peer:
        await peer.ok("subscribe", run_id=run, after_seq=1)
        seqs, end = await peer.events_until_end()
    assert seqs == [2, 3] and end["state"] == "failed" and end["last_seq"] == 3


async def test_an_end_says_the_runs_last_event_number_not_the_clients_after_seq(server: Server) -> None:
    # A client resuming past the run's end was told last_seq = its own after_seq, a
    # number the run never had.
    b = server.backend
    run = b.add_run()
    b.emit(run, "log")
    b.finish(run, "completed")
    async with connect(server) as peer:
        for after in (1_000_000, 3, 4):
            await peer.ok("subscribe", run_id=run, after_seq=after)
            seqs, end = await peer.events_until_end()
            assert seqs == [] and (end["state"], end["last_seq"]) == ("completed", 3), (after, end)


async def test_disconnect_mid_run_then_resume_gets_every_missed_event_once_in_order(server: Server) -> None:
    """Acceptance 7: a dropped client is not a cancel, and replay has no gap and no duplicate."""
    b = server.backend
    spawned: dict[str, Any]
    async with connect(server) as peer:
        spawned = await peer.ok("spawn", spec={"task": "long"})
        run = spawned["run_id"]
        await peer.ok("subscribe", run_id=run)
        for _ in range(3):
            b.emit(run, "step_started", {})
        got = [(await peer.recv())["seq"] for _ in range(4)]
        assert got == [1, 2, 3, 4]
    last_seen = got[-1]
    # While nobody listens the run goes on.
    for i in range(5):
        b.emit(run, "assistant_text", {"text": f"t{i}"})
    async with connect(server) as peer:
        status = await peer.ok("status", run_id=run)
        assert status["state"] == "running"
        await peer.ok("subscribe", run_id=run, after_seq=last_seen)
        replayed = [(await peer.recv())["seq"] for _ in range(5)]
        b.emit(run, "log", {})
        b.finish(run, "completed")
        live, end = await peer.events_until_end()
    assert replayed + live == list(range(last_seen + 1, 12))
    assert end["state"] == "completed"
    assert b.cancels == []


async def test_live_events_racing_the_replay_are_neither_lost_nor_duplicated(server: Server) -> None:
    b = server.backend
    run = b.add_run()
    for _ in range(1200):  # more than one journal page
        b.emit(run, "log")
    real_events_after = b.events_after

    async def events_after_with_traffic(run_id: str, after: int, limit: int) -> list[dict[str, Any]]:
        page = await real_events_after(run_id, after, limit)
        if b.runs[run_id].state == "running" and len(b.runs[run_id].events) < 1300:
            b.emit(run_id, "log")  # arrives live while the replay is under way
        return page

    b.events_after = events_after_with_traffic  # type: ignore[method-assign]
    async with connect(server) as peer:
        await peer.ok("subscribe", run_id=run)
        seqs = [(await peer.recv())["seq"] for _ in range(1203)]
        b.finish(run, "completed")
        rest, end = await peer.events_until_end()
    total = len(b.runs[run].events)
    assert seqs + rest == list(range(1, total + 1))
    assert end["last_seq"] == total


async def test_a_subscriber_dropped_by_the_backend_catches_up_from_the_journal(server: Server) -> None:
    b = server.backend
    run = b.add_run()
    async with connect(server) as peer:
        await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        b.drop_subscribers(run)  # as the run manager does to one that fell behind
        b.emit(run, "log")  # seq 2: never delivered live to the dropped channel
        b.emit(run, "log")
        b.finish(run, "completed")
        seqs, end = await peer.events_until_end()
    assert seqs == [2, 3, 4] and end["state"] == "completed"


async def test_a_gap_in_live_seqs_is_filled_from_the_journal(nursery: trio.Nursery, tmp_path: Path) -> None:
    srv = await start_server(nursery, tmp_path, FakeBackend(subscriber_buffer=1))
    b = srv.backend
    run = b.add_run()
    async with connect(srv) as peer:
        await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        for _ in range(50):
            b.emit(run, "log")
        b.finish(run, "completed")
        seqs, end = await peer.events_until_end()
    assert seqs == list(range(2, 53)) and end["last_seq"] == 52


async def test_a_run_vanishing_from_the_journal_mid_subscription_ends_it_with_an_error(server: Server) -> None:
    b = server.backend
    run = b.add_run()

    async def gone(run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
        raise RunNotFound(run_id)

    async with connect(server) as peer:
        await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        b.events_after = gone  # type: ignore[method-assign]
        # A live event past a gap makes the forwarder read the journal, which now fails.
        for send in b.runs[run].subscribers:
            send.send_nowait({"run_id": run, "seq": 5, "ts": 0.0, "kind": "log", "data": {}})
        end = await peer.recv()
    assert end["op"] == "end" and end["state"] is None and end["error"]["code"] == "not_found"


async def test_unsubscribe_stops_the_pushes(server: Server) -> None:
    b = server.backend
    run = b.add_run()
    async with connect(server) as peer:
        ack = await peer.ok("subscribe", run_id=run)
        assert (await peer.recv())["seq"] == 1
        assert await peer.ok("unsubscribe", sub=ack["sub"]) == {"sub": ack["sub"], "was_active": True}
        assert await peer.ok("unsubscribe", sub=ack["sub"]) == {"sub": ack["sub"], "was_active": False}
        b.emit(run, "log")
        # The next message is the ping reply, not an event.
        assert (await peer.ok("ping"))["pong"] is True
    assert not b.runs[run].subscribers


async def test_an_unsubscribe_overtaking_its_subscribe_still_answers_both(server: Server) -> None:
    run = server.backend.add_run()
    entered = trio.Event()
    real_subscribe = server.backend.subscribe

    @asynccontextmanager
    async def slow_subscribe(run_id: str) -> AsyncIterator[Any]:
        entered.set()
        await trio.sleep_forever()  # the backend is busy; only a cancel gets us out
        async with real_subscribe(run_id) as live:  # pragma: no cover
            yield live

    server.backend.subscribe = slow_subscribe  # type: ignore[method-assign]
    async with connect(server) as peer:
        await peer.send({"id": 1, "op": "subscribe", "run_id": run})
        with trio.fail_after(WAIT_S):
            await entered.wait()
        await peer.send({"id": 2, "op": "unsubscribe", "sub": "1"})
        replies = {m["id"]: m for m in (await peer.recv(), await peer.recv())}
        assert replies[2]["result"] == {"sub": "1", "was_active": True}
        assert replies[1]["ok"] is False and replies[1]["error"]["code"] == "refused"
        assert (await peer.ok("ping"))["pong"] is True


async def test_two_subscriptions_on_one_connection_are_told_apart(server: Server) -> None:
    b = server.backend
    r1, r2 = b.add_run(), b.add_run()
    async with connect(server) as peer:
        s1 = (await peer.ok("subscribe", run_id=r1))["sub"]
        assert (await peer.recv())["sub"] == s1
        s2 = (await peer.ok("subscribe", run_id=r2))["sub"]
        assert (await peer.recv())["sub"] == s2
        b.emit(r2, "log")
        b.emit(r1, "log")
        got = {(m["sub"], m["run_id"], m["seq"]) for m in (await peer.recv(), await peer.recv())}
    # Each subscription is ordered; across subscriptions there is no order to promise.
    assert got == {(s2, r2, 2), (s1, r1, 2)} and s1 != s2


# --------------------------------------------------------------------------- state files


def test_the_token_file_is_0600_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "token"
    token = control.write_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert control.read_token(path) == token and len(token) >= 40
    assert control.write_token(path) != token  # a fresh one each time


def test_the_endpoint_file_round_trips_and_is_removed_only_by_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    info = control.write_endpoint(path, host="127.0.0.1", port=4567, pid=123)
    assert info == {"url": "ws://127.0.0.1:4567/", "host": "127.0.0.1", "port": 4567, "pid": 123}
    assert control.read_endpoint(path) == info
    assert control.remove_endpoint(path, pid=999) is False and path.exists()
    assert control.remove_endpoint(path, pid=123) is True and not path.exists()


def test_endpoint_urls_dial_loopback_for_wildcard_binds() -> None:
    assert control.endpoint_url("0.0.0.0", 1) == "ws://127.0.0.1:1/"
    assert control.endpoint_url("::", 1) == "ws://[::1]:1/"
    assert control.endpoint_url("::1", 1) == "ws://[::1]:1/"


# --------------------------------------------------------------------------- property: resume


_steps = st.lists(
    st.tuples(st.sampled_from(["emit", "read", "reconnect", "drop_subs"]), st.integers(1, 6)),
    max_size=14,
)


@settings(max_examples=30, deadline=None, database=None)
@given(steps=_steps)
def test_any_mix_of_reads_disconnects_and_dropped_subscribers_sees_every_event_once_in_order(
    steps: list[tuple[str, int]],
) -> None:
    """Acceptance 7, generalised: whatever the interleaving, resuming from the last seq seen
    yields each event exactly once, in order, and nothing ever cancels the run."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            srv = await start_server(nursery, Path("/nonexistent-agentd-state"))
            b = srv.backend
            run = b.add_run()
            seen: list[int] = []

            def total() -> int:
                return len(b.runs[run].events)

            async def subscribe(stack: AsyncExitStack) -> Peer:
                peer = await stack.enter_async_context(connect(srv))
                await peer.ok("subscribe", run_id=run, after_seq=seen[-1] if seen else 0)
                return peer

            stack = AsyncExitStack()
            peer = await subscribe(stack)
            try:
                for kind, n in steps:
                    if kind == "emit":
                        for _ in range(n):
                            b.emit(run, "log", {})
                    elif kind == "read":
                        for _ in range(min(n, total() - len(seen))):
                            msg = await peer.recv()
                            assert msg["op"] == "event", msg
                            seen.append(msg["seq"])
                    elif kind == "reconnect":
                        await stack.aclose()
                        stack = AsyncExitStack()
                        peer = await subscribe(stack)
                    else:
                        b.drop_subscribers(run)
                b.finish(run, "completed")
                rest, end = await peer.events_until_end()
                seen.extend(rest)
            finally:
                await stack.aclose()
            assert seen == list(range(1, total() + 1))
            assert end["state"] == "completed" and b.cancels == []
            nursery.cancel_scope.cancel()

    run_trio(scenario)


def test_a_list_row_is_the_runs_summary_not_its_outputs() -> None:
    # A full record carries every tool output and the model's messages; a thousand of them
    # made a list reply of gigabytes. A row keeps what a list shows.
    big = "x" * 1_000_000
    record = {
        "id": "r-1",
        "state": "completed",
        "session_id": "s",
        "created_at": 1.0,
        "containment": "cgroup",
        "spec": {"task": "count the files", "model": {"provider": "scripted", "script": {"final": big}}},
        "result": {"status": "completed", "steps": 3, "final_text": "done", "messages": [{"content": big}]},
        "partial_snapshot": {"step": 2, "progress": big},
        "receipt": {"path_b": {"signals": [big]}},
        "tool_calls": [
            {"id": "c1", "name": "run_command", "state": "succeeded", "step": 1, "arguments": big, "output": big}
        ],
        "groups": [],
    }
    row = control.summary_row(record)
    assert len(json.dumps(row)) < 3000
    assert row["summary"] is True and "receipt" not in row
    assert row["spec"] == {"task": "count the files"}
    assert row["result"] == {"status": "completed", "steps": 3, "final_text": "done"}
    assert row["partial_snapshot"] == {"step": 2}
    (call,) = row["tool_calls"]
    assert "output" not in call and call["name"] == "run_command" and len(call["arguments"]) < 300
    assert {k: row[k] for k in ("id", "state", "session_id", "created_at", "containment")} == {
        k: record[k] for k in ("id", "state", "session_id", "created_at", "containment")
    }


def test_live_events_buffered_for_all_subscriptions_together_are_bounded() -> None:
    # Subscribers that never read held ~1 MiB each, 64 per connection, 128 connections a
    # peer. All of them together now hold at most the pool's bytes, plus one event each
    # (an empty buffer takes one: a client that reads sees the gap and fills it).
    pool = control.Subscriptions()
    a = control._Buffer(100, 1_000_000, pool, 10_000)
    b = control._Buffer(100, 1_000_000, pool, 10_000)
    event = "e" * 4000
    assert [a.offer(n, event) for n in (1, 2, 3)] == [True, True, False]  # 12,000 > 10,000
    assert [b.offer(n, event) for n in (1, 2)] == [True, False]  # empty: one, then the pool
    assert pool.buffered == 12_000
    a.taken(event)  # its client read both
    a.taken(event)
    assert b.offer(2, event) is True and pool.buffered == 8_000
    a.release()
    b.release()
    assert pool.buffered == 0


async def test_live_events_are_encoded_once_for_all_subscriptions_and_never_for_one_past_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 64 subscriptions past a run's end, never read, made the daemon encode each event of
    # the run 64 times (json.dumps was ~94% of its loop) and the run ~10x slower.
    encoded: list[int] = []
    real = protocol.encode_event_body

    def counting(event: Any) -> str:
        encoded.append(event["seq"])
        return real(event)

    monkeypatch.setattr(protocol, "encode_event_body", counting)
    texts = control._EventTexts()
    pool = control.Subscriptions()
    events = [{"seq": n, "ts": 1.0, "kind": "log", "data": {"text": "x" * 1000}} for n in range(1, 11)]
    buffers = []
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            for i, after in enumerate([0, 0, 0, 10**9]):
                send, live = trio.open_memory_channel[dict[str, Any]](100)
                buffer = control._Buffer(100, 1 << 20, pool, 1 << 24)
                buffers.append(buffer)
                n.start_soon(partial(control._drain, live, buffer, f"s{i}", "r-1", after=after, texts=texts))
                async with send:
                    for e in events:
                        send.send_nowait(e)
    assert encoded == list(range(1, 11))  # once each, for three subscriptions; none for the fourth
    got = [buffers[0].recv.receive_nowait() for _ in range(10)]
    assert [seq for seq, _ in got] == list(range(1, 11))
    msg = json.loads(got[3][1])
    assert msg == {"op": "event", "sub": "s0", "run_id": "r-1", **events[3]}
    assert json.loads(buffers[2].recv.receive_nowait()[1])["sub"] == "s2"
    with pytest.raises(trio.EndOfChannel):  # nothing buffered: it ended empty
        buffers[3].recv.receive_nowait()


async def test_refused_handshakes_are_logged_one_line_a_while_with_the_reason_cut_short(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    # A client with no token that kept asking, with a 12 KB Origin, wrote ~10 MB/s to the log.
    origin = [(b"Origin", b"http://" + b"e" * 12000)]
    with caplog.at_level(logging.WARNING, logger="supervisor.control.server"):
        for _ in range(20):
            assert await handshake_status(server, origin) == 403
        assert await handshake_status(server, []) == 401
    lines = [r.getMessage() for r in caplog.records if "control: refused" in r.getMessage()]
    assert len(lines) == 1 and len(lines[0]) < 400, lines
