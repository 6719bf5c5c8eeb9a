"""The dashboard's HTTP server over real sockets: keep-alive, limits, bad clients."""

from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path

import pytest
import trio

from supervisor.config import Config
from supervisor.control import _dashlink
from supervisor.control.dashboard import Sessions, _server, serve_dashboard

TOKEN = "token-for-the-server-test"
WAIT_S = 5.0


class Served:
    def __init__(self, port: int, sessions: Sessions) -> None:
        self.port = port
        self.sessions = sessions

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def served(nursery: trio.Nursery, tmp_path: Path) -> Served:
    sessions = Sessions(TOKEN)
    port = await nursery.start(partial(serve_dashboard, Config(state_dir=tmp_path), sessions, control_port=4321))
    return Served(port, sessions)


async def read_response(
    stream: trio.SocketStream, buf: bytearray, *, head: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """One response off ``stream`` (``buf`` keeps what was read beyond it)."""
    with trio.fail_after(WAIT_S):
        while b"\r\n\r\n" not in buf:
            chunk = await stream.receive_some()
            assert chunk, bytes(buf)
            buf += chunk
        top, _, rest = bytes(buf).partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hs = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if head else int(hs.get("content-length", "0"))
        while len(rest) < length:
            chunk = await stream.receive_some()
            assert chunk
            rest += chunk
    buf[:] = rest[length:]
    return status, hs, rest[:length]


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        return await read_response(stream, bytearray())


async def test_the_server_signs_in_by_link_and_keeps_the_connection_alive(served: Served) -> None:
    login = _dashlink.mint_login_token(TOKEN)
    stream = await trio.open_tcp_stream("127.0.0.1", served.port)
    buf = bytearray()
    async with stream:
        await stream.send_all(f"GET /login?t={login} HTTP/1.1\r\nHost: {served.host}\r\n\r\n".encode())
        status, hs, body = await read_response(stream, buf)
        assert status == 200 and "set-cookie" not in hs
        found = re.search(rb'<meta name="agentd-session" content="([A-Za-z0-9_-]+)">', body)
        assert found is not None, body
        sid = found.group(1).decode()
        # Same connection, two requests pipelined.
        await stream.send_all(
            f"GET /api/session HTTP/1.1\r\nHost: {served.host}\r\nX-Agentd-Session: {sid}\r\n\r\n"
            f"HEAD /static/app.css HTTP/1.1\r\nHost: {served.host}\r\n\r\n".encode()
        )
        status, hs, body = await read_response(stream, buf)
        assert status == 200 and b'"signed_in": true' in body
        assert "content-security-policy" in hs
        status, hs, body = await read_response(stream, buf, head=True)
        assert status == 200 and body == b"" and int(hs["content-length"]) > 0 and buf == b""


async def test_garbage_gets_400_and_the_server_goes_on(served: Served) -> None:
    status, _, _ = await request(served.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400
    status, _, _ = await request(served.port, f"GET /api/session HTTP/1.1\r\nHost: {served.host}\r\n\r\n".encode())
    assert status == 401


async def test_a_method_in_lower_case_is_another_method_answered_not_a_failed_connection(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    # `head` was taken for HEAD (upper-cased), so no body was sent where h11 expected one:
    # the connection failed with a traceback in the log, as often as a client liked.
    caplog.set_level(logging.WARNING, logger=_server.logger.name)
    status, _, body = await request(served.port, b"head / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % served.port)
    assert status == 403 and body, body
    assert not [r for r in caplog.records if "connection failed" in r.getMessage()]


async def test_an_oversized_head_or_body_is_refused(served: Served) -> None:
    big = "x" * (_server.MAX_HEAD_BYTES + 10)
    status, _, _ = await request(served.port, f"GET / HTTP/1.1\r\nHost: {served.host}\r\nX-Big: {big}\r\n\r\n".encode())
    assert status == 431
    body = b"a" * (_server.MAX_BODY_BYTES + 1)
    status, _, _ = await request(
        served.port,
        f"POST /logout HTTP/1.1\r\nHost: {served.host}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body,
    )
    assert status == 413


async def test_a_client_that_sends_nothing_is_dropped_at_the_request_timeout(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_server, "REQUEST_TIMEOUT_S", 0.2)
    stream = await trio.open_tcp_stream("127.0.0.1", served.port)
    async with stream:
        await stream.send_all(b"GET / HTTP/1.1\r\n")  # and never the rest
        with trio.fail_after(WAIT_S):
            assert await stream.receive_some() == b""  # closed by the server


async def start_small(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, limit: int) -> int:
    """A second server with ``MAX_CONNECTIONS`` = ``limit`` (read at serve time): its port."""
    monkeypatch.setattr(_server, "MAX_CONNECTIONS", limit)
    port: int = await nursery.start(
        partial(serve_dashboard, Config(state_dir=Path("/nonexistent")), Sessions(TOKEN), control_port=1)
    )
    return port


def get(port: int) -> bytes:
    return f"GET /static/app.css HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


async def test_beyond_the_limit_a_newcomer_closes_the_connection_waiting_longest_logged_once_an_interval(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = await start_small(nursery, monkeypatch, 2)
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
    for s in held:  # each answered once, then idle (kept alive): held[0] has waited longest
        await s.send_all(get(port))
        assert (await read_response(s, bytearray()))[0] == 200
    caplog.set_level(logging.WARNING, logger=_server.logger.name)
    extra = []
    for _ in range(5):  # a client in a loop: each served, one log line for them all
        newcomer = await trio.open_tcp_stream("127.0.0.1", port)
        extra.append(newcomer)
        await newcomer.send_all(get(port))
        assert (await read_response(newcomer, bytearray()))[0] == 200
    for s in held:  # closed, oldest first, for the newcomers
        with trio.fail_after(WAIT_S):
            assert await s.receive_some() == b""
    lines = [r.getMessage() for r in caplog.records if "connections already" in r.getMessage()]
    assert len(lines) == 1 and "waiting longest" in lines[0], lines
    for s in [*held, *extra]:
        await s.aclose()


async def test_a_flood_of_slow_requests_without_a_session_does_not_lock_clients_out(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe's attack: every slot holds a request that never finishes arriving (a header
    # line now and then keeps it under REQUEST_TIMEOUT_S), each reopened once closed. Every
    # other client used to be closed at once.
    limit = 16
    port = await start_small(nursery, monkeypatch, limit)
    opened = 0
    flooding = trio.Event()

    async def slow() -> None:
        nonlocal opened
        while True:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                try:
                    await stream.send_all(b"GET / HTTP/1.1\r\n")
                    opened += 1
                    if opened >= limit:
                        flooding.set()
                    await stream.receive_some()  # until the server closes it
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async with trio.open_nursery() as flood:
        for _ in range(limit):
            flood.start_soon(slow)
        with trio.fail_after(WAIT_S):
            await flooding.wait()  # every slot taken (a newcomer is accepted after them)
        for _ in range(5):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(get(port))
                assert (await read_response(stream, bytearray()))[0] == 200
        flood.cancel_scope.cancel()


async def test_a_connection_being_answered_is_never_closed_for_a_newcomer() -> None:
    streams = [trio.SocketStream(trio.socket.socket()) for _ in range(4)]
    slots = _server._Slots(2)
    a, b = slots.take(streams[0]), slots.take(streams[1])
    assert a is not None and b is not None
    a.serving()
    b.serving()
    assert slots.take(streams[2]) is None  # both being answered: the newcomer is refused
    b.waiting()
    c = slots.take(streams[3])
    assert c is not None and b.evicted and not a.evicted and slots.open == {a, c}
    for stream in streams:
        stream.socket.close()


async def test_a_daemon_bound_by_name_publishes_the_address_it_bound_not_the_name(tmp_path: Path) -> None:
    # `--host localhost` published ws://localhost:... and http://localhost:...: the CLI (its
    # token) and the browser (the login link) could reach another process on the other
    # family's address and the same port (::1 beside 127.0.0.1).
    import json

    from supervisor.config import Config
    from supervisor.daemon import serve

    config = Config.load(state_dir=tmp_path / "state", host="localhost", environ={})
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        endpoint = json.loads(config.endpoint_path.read_text())
        stop.set()
    for url in (info["url"], endpoint["url"], info["dashboard_url"], endpoint["dashboard_url"]):
        assert "localhost" not in url and ("//127.0.0.1:" in url or "//[::1]:" in url), url
