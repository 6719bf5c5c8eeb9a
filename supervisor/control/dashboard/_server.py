"""The dashboard's HTTP/1.1 server: h11 over trio, on a loopback port of its own.

Serves ``DashboardApp``'s responses and nothing else; the page then talks to the control
socket (a websocket on the daemon's other port) with its session (``_sessions``). Bounded like the
control socket: connections at once (a connection a run's process made is closed before it
counts, ``_peer_cgroup``), request head and body size, a deadline for each
request to arrive and for each response to be taken. A bad or slow client gets an error or
a closed connection; nothing a client sends ends the server or the daemon.

At ``MAX_CONNECTIONS`` a new connection closes the one that has waited longest for its
next request (``_Slots``), not itself: 64 sockets that each sent a request line and then a
header every few seconds (no token needed) kept every slot for ``REQUEST_TIMEOUT_S`` at a
time, and every other client was reset. Now such a flood churns, and a real request (a
few ms) gets through. A connection whose response is being made or sent is never closed
for a newcomer; when all are, the newcomer is closed as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Final

import h11
import trio

from supervisor.config import Config
from supervisor.control._conn_limits import Throttled
from supervisor.control._peer_cgroup import RefusingListener, RunPeers
from supervisor.control.dashboard._app import DashboardApp, Request, Response
from supervisor.control.dashboard._sessions import Sessions
from supervisor.control.server import open_listener

__all__ = ["serve_dashboard", "load_static", "dashboard_url"]

logger = logging.getLogger(__name__)

# Connections served at once (a browser opens about six); a newcomer beyond them closes
# the one waiting longest for a request, or is closed at once when none waits.
MAX_CONNECTIONS: Final = 64
# Largest request head (request line + headers), bytes.
MAX_HEAD_BYTES: Final = 16 * 1024
# Largest request body, bytes: the dashboard takes no uploads (a logout form at most).
MAX_BODY_BYTES: Final = 16 * 1024
# A request must arrive whole within this long of the previous response (or of the
# connection): bounds idle keep-alive connections and slow senders (seconds).
REQUEST_TIMEOUT_S: Final = 30.0
# A response must be taken within this long (seconds).
SEND_TIMEOUT_S: Final = 10.0
# Bounds closing a connection (seconds).
CLOSE_TIMEOUT_S: Final = 2.0
RECEIVE_BYTES: Final = 16 * 1024
SERVER_HEADER: Final = b"agentd-dashboard"


def load_static() -> dict[str, bytes]:
    """Every file the package ships under ``dashboard/static``, by its relative path."""
    out: dict[str, bytes] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.is_file() and not child.name.startswith("."):
                out[prefix + child.name] = child.read_bytes()

    walk(resources.files("supervisor.control.dashboard") / "static", "")
    return out


def dashboard_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


class _Slot:
    """One connection's slot: evictable while it waits for a request (``waiting``)."""

    def __init__(self, slots: _Slots, stream: trio.SocketStream) -> None:
        self._slots = slots
        self.stream = stream
        self.scope = trio.CancelScope()
        self.evicted = False

    def waiting(self) -> None:
        """From now until ``serving``, a newcomer at the limit may close this one."""
        self._slots.waiting.pop(self, None)
        self._slots.waiting[self] = None  # the newest waiter: evicted last

    def serving(self) -> None:
        self._slots.waiting.pop(self, None)

    def evict(self) -> None:
        self.evicted = True
        self._slots.release(self)
        self.scope.cancel(reason="evicted for a newer connection")
        self.stream.socket.close()  # the fd is free now, not when the task gets to it


class _Slots:
    """At most ``capacity`` connections; a newcomer beyond them evicts the connection that
    has waited longest for its next request (none is evicted while being answered)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.open: set[_Slot] = set()
        self.waiting: dict[_Slot, None] = {}  # oldest first
        self.evicted = 0

    def take(self, stream: trio.SocketStream) -> _Slot | None:
        if len(self.open) >= self.capacity:
            oldest = next(iter(self.waiting), None)
            if oldest is None:
                return None
            oldest.evict()
            self.evicted += 1
        slot = _Slot(self, stream)
        self.open.add(slot)
        slot.waiting()
        return slot

    def release(self, slot: _Slot) -> None:
        self.open.discard(slot)
        self.waiting.pop(slot, None)


class _Closed(Exception):
    """The client went away, stalled, or broke HTTP: the connection ends."""


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _Closed() from exc
            conn.receive_data(data)
            continue
        assert not isinstance(event, type)  # h11.PAUSED: only after a message, handled by the caller
        return event


async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> Request | Response | None:
    """The next request; None when the client closed; a Response when it must be refused."""
    event = await _next_event(conn, stream)
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise _Closed()
    # h11 bounds a head still arriving; one that arrived whole in a read is measured here.
    if len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD_BYTES:
        return Response(431, b"request head too large\n")
    headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.headers)
    request = Request(event.method.decode("ascii", "replace"), event.target.decode("latin-1"), headers)
    size = 0
    while True:
        event = await _next_event(conn, stream)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY_BYTES:
                return Response(413, b"request body too large\n")
        elif isinstance(event, h11.EndOfMessage):
            return request
        else:
            raise _Closed()


async def _send(
    conn: h11.Connection, stream: trio.SocketStream, resp: Response, *, head_only: bool, close: bool
) -> None:
    headers = [
        ("Content-Type", resp.content_type),
        ("Content-Length", str(len(resp.body))),
        ("Server", SERVER_HEADER.decode()),
        *resp.headers,
    ]
    if close:
        headers.append(("Connection", "close"))
    try:
        reason = HTTPStatus(resp.status).phrase.encode()
    except ValueError:
        reason = b""
    data = conn.send(h11.Response(status_code=resp.status, headers=headers, reason=reason))
    if not head_only and resp.body:
        data += conn.send(h11.Data(data=resp.body))
    data += conn.send(h11.EndOfMessage())
    with trio.move_on_after(SEND_TIMEOUT_S) as scope:
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _Closed() from exc
    if scope.cancelled_caught:
        raise _Closed()


async def _serve_connection(app: DashboardApp, stream: trio.SocketStream, slot: _Slot | None = None) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    try:
        while True:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                try:
                    if slot is not None:
                        slot.waiting()
                    try:
                        got = await _read_request(conn, stream)
                    finally:
                        if slot is not None:
                            slot.serving()
                except h11.RemoteProtocolError as exc:
                    if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        status = exc.error_status_hint
                        await _send(
                            conn,
                            stream,
                            Response(status, f"bad request: {exc}\n".encode()),
                            head_only=False,
                            close=True,
                        )
                    return
                if got is None:
                    return
                if isinstance(got, Response):
                    await _send(conn, stream, got, head_only=False, close=True)
                    return
                resp = app.handle(got)
                await _send(conn, stream, resp, head_only=got.method == "HEAD", close=False)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # timed out mid-request, or a client that asked to close
            conn.start_next_cycle()
    except _Closed:
        return
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await stream.aclose()


async def listen(config: Config) -> trio.SocketListener:
    """The dashboard's listening socket at ``config.host:config.dashboard_port``.

    Raises:
        ListenError: it cannot be bound there.
    """
    return await open_listener(config.host, config.dashboard_port, "dashboard_port")


async def serve_dashboard(
    config: Config,
    sessions: Sessions,
    *,
    control_port: int,
    listener: trio.SocketListener | None = None,
    static: Mapping[str, bytes] | None = None,
    runs: RunPeers | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on ``config.host:config.dashboard_port`` until cancelled.

    Args:
        config: host and dashboard port (0: ephemeral).
        sessions: who is signed in; bound here to the port actually listened on.
        control_port: the control socket's port, which the page connects to.
        listener: bound already (``listen``); default: bound here.
        static: the page's files (``load_static``); default: loaded here.
        runs: tells the connections a run's processes made, which are closed at once
            (before ``MAX_CONNECTIONS`` counts them); None: all are admitted.
        task_status: started with the bound port once connections are accepted.
    """
    listener = listener or await listen(config)
    port = listener.socket.getsockname()[1]
    bound = listener.socket.getsockname()[0]
    sessions.bind(port, bound)
    if static is None:
        static = await trio.to_thread.run_sync(load_static)
    app = DashboardApp(sessions, static, control_port=control_port)
    slots = _Slots(MAX_CONNECTIONS)
    # Refusals and evictions come in floods (a client in a loop): one line per interval,
    # like the control socket's, not one per connection.
    refused = 0
    refusal_log, eviction_log = Throttled(logger), Throttled(logger)

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal refused
        evicted = slots.evicted
        slot = slots.take(stream)
        if slot is None:
            refused += 1
            refusal_log.warning(
                "dashboard: %d connections already; closing a new one (%d refused so far)",
                MAX_CONNECTIONS,
                refused,
            )
            await stream.aclose()
            return
        if slots.evicted > evicted:
            eviction_log.warning(
                "dashboard: %d connections already; closed the one waiting longest for a "
                "request for a new one (%d closed so far)",
                MAX_CONNECTIONS,
                slots.evicted,
            )
        try:
            with slot.scope:
                await _serve_connection(app, stream, slot)
        except Exception:
            if not slot.evicted:
                logger.exception("dashboard: a connection failed")
        finally:
            slots.release(slot)
            if slot.evicted:
                await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        served: trio.abc.Listener[trio.SocketStream] = listener
        if runs is not None:
            served = RefusingListener(listener, runs, "dashboard")
        await nursery.start(trio.serve_listeners, handler, [served])
        logger.info("dashboard: serving %s", dashboard_url(config.host, port))
        task_status.started(port)
