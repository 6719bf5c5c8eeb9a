"""The control socket lets the dashboard's page in by the session it offers, and no one else.

The one addition to ``supervisor.control.server`` for the dashboard: ``session_ok`` (here the real
``dashboard.Sessions.handshake_ok``) accepts a browser handshake that offers a signed-in
session as a ``Sec-WebSocket-Protocol`` entry from the dashboard's own origin, instead of the
token. Everything else about access stays as it was: a foreign origin is refused even with a
valid session. A cookie is no credential: a browser sends it to any port of the host, so
another server on 127.0.0.1 could take it and forge the Origin.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from supervisor.config import Config
from supervisor.control import _dashlink
from supervisor.control import server as control
from supervisor.control.dashboard import Sessions
from tests.supervisor.fake_backend import FakeBackend

TOKEN = "control-token-for-the-session-test"
DASH_PORT = 45678
DASH_ORIGIN = f"http://127.0.0.1:{DASH_PORT}"
WAIT_S = 5.0


def signed_in_sessions() -> tuple[Sessions, str]:
    sessions = Sessions(TOKEN)
    sessions.bind(DASH_PORT)
    sid = sessions.redeem(_dashlink.mint_login_token(TOKEN))
    return sessions, f"agentd-dashboard, agentd-session.{sid}"


def as_the_page(port: int, sid: str, offered: list[str] | None = None) -> Any:
    """A websocket to the control socket as the dashboard's page opens it: its origin, its
    session offered as a subprotocol entry (``offered``: beside which; the page's own)."""
    return open_websocket_url(
        f"ws://127.0.0.1:{port}/",
        subprotocols=[*(["agentd-dashboard"] if offered is None else offered), f"agentd-session.{sid}"],
        extra_headers=headers(DASH_ORIGIN, None),
        connect_timeout=WAIT_S,
        disconnect_timeout=WAIT_S,
    )


def headers(origin: str | None, protocols: str | None) -> list[tuple[bytes, bytes]]:
    out = []
    if origin is not None:
        out.append((b"Origin", origin.encode()))
    if protocols is not None:
        out.append((b"Sec-WebSocket-Protocol", protocols.encode()))
    return out


def test_check_access_takes_a_dashboard_session_from_the_dashboard_origin_instead_of_the_token() -> None:
    sessions, offered = signed_in_sessions()
    check = partial(control.check_access, token=TOKEN, allowed_origins=(), session_ok=sessions.handshake_ok)
    assert check(headers(DASH_ORIGIN, offered), "/") is None
    assert check(headers(f"http://localhost:{DASH_PORT}", offered), "/") is not None  # a name: refused


def test_check_access_refuses_a_session_from_a_foreign_origin_or_without_one() -> None:
    sessions, offered = signed_in_sessions()
    check = partial(control.check_access, token=TOKEN, allowed_origins=(), session_ok=sessions.handshake_ok)
    for origin in ("http://evil.example", f"http://127.0.0.1:{DASH_PORT + 1}", "null"):
        refusal = check(headers(origin, offered), "/")
        assert refusal is not None and refusal[0] == 403, origin
    for bad in (None, "agentd-dashboard, agentd-session.forged", "agentd-dashboard"):
        refusal = check(headers(DASH_ORIGIN, bad), "/")
        assert refusal is not None and refusal[0] == 403, bad  # the dashboard origin is not an allowed origin
    # A session alone (no Origin: not a browser) is no credential.
    refusal = check(headers(None, offered), "/")
    assert refusal is not None and refusal[0] == 401
    # An ended session is refused.
    sessions.end(offered.rsplit(".", 1)[1])
    assert check(headers(DASH_ORIGIN, offered), "/") is not None


def test_check_access_is_unchanged_without_a_session_check() -> None:
    _, offered = signed_in_sessions()
    refusal = control.check_access(headers(DASH_ORIGIN, offered), "/", token=TOKEN, allowed_origins=())
    assert refusal is not None and refusal[0] == 403
    assert (
        control.check_access([(b"Authorization", f"Bearer {TOKEN}".encode())], "/", token=TOKEN, allowed_origins=())
        is None
    )


async def _status(port: int, extra: list[tuple[bytes, bytes]]) -> int:
    lines = [
        "GET / HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ] + [f"{k.decode()}: {v.decode()}" for k, v in extra]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        with trio.fail_after(WAIT_S):
            while b"\r\n" not in data:
                chunk = await stream.receive_some()
                assert chunk, data
                data += chunk
    return int(data.split(b" ", 2)[1])


async def test_a_real_handshake_offering_the_session_is_served_and_a_foreign_one_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    sessions, offered = signed_in_sessions()
    backend = FakeBackend()
    backend.nursery = nursery
    config = Config(state_dir=tmp_path, port=0)
    port = await nursery.start(
        partial(control.serve_control, config, backend, token=TOKEN, session_ok=sessions.handshake_ok)
    )
    assert await _status(port, headers("http://evil.example", offered)) == 403
    assert await _status(port, headers(DASH_ORIGIN, None)) == 403
    assert await _status(port, headers(DASH_ORIGIN, offered)) == 101
    sid = offered.rsplit(".", 1)[1]
    async with as_the_page(port, sid) as ws:
        # The dashboard's subprotocol is selected (a browser drops a socket otherwise),
        # never the entry with the secret.
        assert ws.subprotocol == "agentd-dashboard"
        await ws.send_message(json.dumps({"id": 1, "op": "ping"}))
        with trio.fail_after(WAIT_S):
            reply = json.loads(await ws.get_message())
    assert reply["ok"] is True and reply["result"]["pong"] is True


async def serve_signed_in(nursery: trio.Nursery, tmp_path: Path, *, watch: bool) -> tuple[Any, str, int]:
    """A control socket that lets a signed-in dashboard session in (``watch``: and closes
    its connections when it ends): the sessions, the session's secret, the port."""
    sessions, offered = signed_in_sessions()
    backend = FakeBackend()
    backend.nursery = nursery
    config = Config(state_dir=tmp_path, port=0)
    more: dict[str, Any] = {"session_watch": sessions.watching} if watch else {}
    port = await nursery.start(
        partial(control.serve_control, config, backend, token=TOKEN, session_ok=sessions.handshake_ok, **more)
    )
    return sessions, offered.rsplit(".", 1)[1], port


async def test_a_non_browser_client_with_the_session_in_a_cookie_and_a_forged_origin_is_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # What another server on 127.0.0.1 would receive from the browser (cookies go to every
    # port of a host) must not open the control socket, even with the Origin forged.
    sessions, sid, port = await serve_signed_in(nursery, tmp_path, watch=False)
    for name in ("agentd_session", f"agentd_session_{DASH_PORT}"):
        forged = [(b"Origin", DASH_ORIGIN.encode()), (b"Cookie", f"{name}={sid}".encode())]
        assert await _status(port, forged) == 403, name


@pytest.mark.parametrize("offered", [["agentd-dashboard"], []], ids=["as the page", "the session entry alone"])
async def test_signing_out_closes_the_sessions_open_sockets_and_refuses_new_ones(
    nursery: trio.Nursery, tmp_path: Path, offered: list[str]
) -> None:
    # A socket let in by the session alone (no browser's subprotocol: a non-browser holder
    # of the secret) was not watched, and stayed open past the sign-out.
    sessions, sid, port = await serve_signed_in(nursery, tmp_path, watch=True)
    async with as_the_page(port, sid, offered) as ws:
        await ws.send_message(json.dumps({"id": 1, "op": "ping"}))
        with trio.fail_after(WAIT_S):
            assert json.loads(await ws.get_message())["ok"] is True
        assert sessions.end(sid)
        with trio.fail_after(WAIT_S), pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason is not None and closed.value.reason.code == 1008
        # trio-websocket's client leaves its TCP stream open after a close the server began.
        await ws._stream.aclose()
    assert await _status(port, headers(DASH_ORIGIN, f"agentd-dashboard, agentd-session.{sid}")) == 403
