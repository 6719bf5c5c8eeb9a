"""The control socket: a trio-websocket server that serves ``protocol`` messages.

Access: every handshake presents the daemon's token (``Authorization: Bearer`` or
``?token=``), compared in constant time; a browser ``Origin`` not on
``Config.allowed_origins`` is refused with 403, a missing or wrong token with 401. The
daemon's own dashboard page is let in by its session instead of the token (``session_ok``:
its origin and a signed-in session offered as a ``Sec-WebSocket-Protocol`` entry, see
``supervisor.control.dashboard``); such a handshake is answered with the ``agentd-dashboard``
subprotocol (a browser drops a socket whose server selects none of those it offered).
A refused handshake is closed at once. A malformed, oversized or unknown message gets an
error reply and a handler's bug an ``internal`` one: nothing an authenticated client sends
ends its connection or the daemon (only a frame above the hard cap, which trio-websocket
closes with 1009, and a frame that breaks the websocket protocol, closed with 1007 or 1002
once the requests before it are answered: ``_wsfail``). Every hold a client can take is bounded (``_conn_limits.Limits``):
connections per peer and in all (a connection a run's process made is never admitted,
``_peer_cgroup``; at the limit the oldest one still in its handshake is closed for the
newcomer, ``_conn_limits.Gate``), the handshake, idleness, requests in flight,
subscriptions, bytes buffered per subscriber, replay pages in bytes. A connection that
goes away ends its subscriptions and nothing else: runs are stopped only by an explicit
``cancel``, and a spawn or cancel already in flight completes.

Subscribe = replay from the journal after ``after_seq``, then live, with no gap and no
duplicate: the live channel is opened first and drained into a local buffer, the journal
is replayed, then live events are forwarded if newer than the last one sent; a jump in
``seq`` (a dropped event) is filled from the journal, which holds every event before it
is delivered live.

Size: one connection's protocol (read loop, dispatch of every op, subscriptions with
replay and gap filling, limits); the access checks and limits' bookkeeping are elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, Final, final
from urllib.parse import parse_qs, urlsplit

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, WebSocketServer

from supervisor import protocol
from supervisor.config import Config
from supervisor.control._conn_limits import (
    Gate,
    GatedStream,
    Limits,
    Throttled,
    current_stream,
    fd_connection_cap,
)
from supervisor.control._peer_cgroup import RunPeers
from supervisor.control._statefiles import (
    endpoint_url,
    new_token,
    read_endpoint,
    read_token,
    remove_endpoint,
    write_endpoint,
    write_token,
)
from supervisor.control._wsfail import FailingConnection, handle_connection
from supervisor.errors import AgentdError, ControlProtocolError, ListenError
from supervisor.protocol import BadRequest, ErrorCode
from supervisor.states import LIVE_STATES, TERMINAL_STATES, RunState

__all__ = [
    "serve_control",
    "Subscriptions",
    "Limits",
    "check_access",
    "hard_message_cap",
    "new_token",
    "write_token",
    "read_token",
    "endpoint_url",
    "write_endpoint",
    "read_endpoint",
    "remove_endpoint",
]

logger = logging.getLogger(__name__)

# Bounds the closing handshake when either side closes.
DISCONNECT_TIMEOUT_S: Final = 2.0
# Frames up to this many times Config.max_message_bytes (at least 16 MiB) are read whole,
# so an oversized message gets a ``too_large`` reply; above it trio-websocket closes 1009.
# (Each connection may hold that much while it reads one: 64 MiB a connection made a peer's
# 128 connections worth 8 GiB.)
HARD_CAP_FACTOR: Final = 16
HARD_CAP_MIN_BYTES: Final = 16 * 1024 * 1024
# Live events buffered per subscription (besides Limits.subscriber_bytes).
LIVE_BUFFER: Final = 4096
# Journal page size, in events, when replaying or filling a gap (and Limits.replay_page_bytes).
REPLAY_PAGE: Final = 500
# How much of a refused handshake's reason (which may quote the client's Origin) is logged.
REFUSAL_LOG_CHARS: Final = 200
# How many of the latest live events' encodings are kept for the daemon's subscriptions.
EVENT_TEXTS_CACHED: Final = 512
# A live channel that closes with the run still live is reopened this many times in a
# row without a new event before the subscription ends with the run's current state.
MAX_EMPTY_REOPENS: Final = 3
RECEIVE_BYTES: Final = 64 * 1024
# A message larger than this is decoded and checked in a worker thread (one at a time,
# ``_Server.decoding``): a megabyte of small integers or containers took the event loop
# ~0.1 s (a megabyte of nested brackets ~1 s, before the checks were made linear), and
# four clients sending such messages made another's ``status`` take 6-14 s.
DECODE_IN_THREAD_CHARS: Final = 64 * 1024
# ``history`` replies being built or sent at once, daemon-wide (more wait their turn): one
# holds its session's whole transcript about fourteen times over while it is built, encoded
# and sent (its records, its messages, the reply's text, its frame). A session of 66 MB of
# turns took the daemon to ~950 MB for one, 1.3 GB for two side by side, and a connection
# may have 32 requests in flight: a client could take the daemon to the OOM killer.
HISTORY_AT_ONCE: Final = 2
# The subprotocol the dashboard's page offers (``dashboard._sessions.SUBPROTOCOL``).
DASHBOARD_SUBPROTOCOL: Final = "agentd-dashboard"
# The most a request that waits for a stop adds to the grace (the run manager's and the
# fleet's margins for an interrupted turn to end): published by ``ping`` as ``stop_wait_s``.
STOP_WAIT_MARGIN_S: Final = 10.0


# session_ok(origin, sec_websocket_protocol_header) -> bool: see check_access.
SessionCheck = Callable[[str, str | None], bool]
# session_watch(offered_subprotocols) -> a context holding an event set when the session
# the connection came in with ends (None: it came in with the token).
SessionWatch = Callable[[str | None], AbstractContextManager["trio.Event | None"]]


class _ContainedServer(WebSocketServer):
    """trio-websocket's server, each connection's failure kept to that connection.

    Its connections are ``_wsfail.FailingConnection``s: a frame that breaks the protocol
    (a text frame not UTF-8...) gets the replies owed before it, then a close frame (1007
    or 1002), where trio-websocket dropped the connection and the replies.

    A handshake wsproto cannot parse raises in the library's reader task, before our
    handler runs, and the error ended the whole server, then the daemon and every run
    (a ``Sec-WebSocket-Protocol`` byte outside ASCII was enough, with no token: wsproto
    decodes comma-split headers as ASCII). Such a connection is closed, and said once a
    ``REFUSAL_LOG_INTERVAL_S`` in the log.
    """

    _failed = 0
    _failure_log: Throttled | None = None  # (its own, made at the first failure)

    async def _handle_connection(self, stream: trio.abc.Stream) -> None:
        try:
            if isinstance(stream, GatedStream):
                # Evicted by the gate while still in its handshake (a newer connection
                # needed the slot): the handshake is cancelled, the socket closed.
                if stream.evicted:
                    await trio.aclose_forcefully(stream)
                    return
                with trio.CancelScope() as stream.evict_scope:
                    await handle_connection(self, stream)
                if stream.evicted:
                    await trio.aclose_forcefully(stream)
                return
            await handle_connection(self, stream)
        except Exception as exc:  # (Cancelled, KeyboardInterrupt: not ours to keep)
            await trio.aclose_forcefully(stream)
            self._failed += 1
            if self._failure_log is None:
                self._failure_log = Throttled(logger)
            self._failure_log.warning(
                "control: a connection failed before or during its handshake (%d so far): %s",
                self._failed,
                _one_line(exc),
            )


def _one_line(exc: BaseException) -> str:
    """An exception (the first leaf of a group) as one line, for a log that a client fills."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


def hard_message_cap(config: Config) -> int:
    return max(HARD_CAP_MIN_BYTES, config.max_message_bytes * HARD_CAP_FACTOR)


def check_access(
    headers: list[tuple[bytes, bytes]],
    target: str,
    *,
    token: str | None,
    allowed_origins: tuple[str, ...],
    session_ok: SessionCheck | None = None,
    subprotocols: Sequence[str] = (),
) -> tuple[int, str] | None:
    """Decide a handshake. Returns None to accept, or ``(http_status, reason)`` to refuse.

    ``session_ok(origin, protocols)``, when given, accepts a browser that presents no
    token but a dashboard session (in ``Sec-WebSocket-Protocol``: never a cookie, which a
    browser sends to any port of the host) from the dashboard's own origin.
    ``subprotocols``: those the handshake offers, when the websocket library has taken
    the ``Sec-WebSocket-Protocol`` header out of ``headers`` (wsproto does).
    """
    origin: str | None = None
    auth: str | None = None
    protocols: str | None = ", ".join(subprotocols) or None
    for name, value in headers:
        key = name.decode("latin-1").lower()
        if key == "origin":
            origin = value.decode("latin-1").strip()
        elif key == "authorization":
            auth = value.decode("latin-1").strip()
        elif key == "sec-websocket-protocol":
            # Browsers send one; should there be several, join them (the header is a list).
            text = value.decode("latin-1")
            protocols = text if protocols is None else f"{protocols}, {text}"
    if session_ok is not None and origin is not None and session_ok(origin, protocols):
        return None
    if origin is not None:
        allowed = {o.rstrip("/").lower() for o in allowed_origins}
        if origin.rstrip("/").lower() not in allowed:
            return 403, f"origin {origin!r} is not allowed"
    presented: str | None = None
    if auth is not None:
        scheme, _, credentials = auth.partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            presented = credentials.strip()
    if presented is None:
        try:
            values = parse_qs(urlsplit(target).query).get("token")
        except ValueError:  # e.g. "//[": not a URL urllib can split
            return 400, "bad request target"
        if values:
            presented = values[0]
    if token is None:
        return 401, "the daemon has no token yet"
    if presented is None:
        return 401, "missing token"
    if not hmac.compare_digest(presented.encode(), token.encode()):
        return 401, "wrong token"
    return None


class _TokenSource:
    """The token: fixed, or re-read from the token file whenever the file changes."""

    def __init__(self, path: os.PathLike[str] | str, fixed: str | None) -> None:
        self._path = path
        self._fixed = fixed
        self._key: tuple[int, int, int] | None = None
        self._token: str | None = None

    def get(self) -> str | None:
        if self._fixed is not None:
            return self._fixed
        # A stat per handshake: a local file, microseconds; not worth a thread hop.
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            try:
                self._token = read_token(self._path)
            except (OSError, ValueError):
                return None
            self._key = key
        return self._token


def _peer_name(request: WebSocketRequest, stream: GatedStream | None) -> str:
    if stream is not None:
        return stream.peer
    try:
        remote = request.remote
    except OSError:
        return "?"
    return str(remote) if isinstance(remote, str) else f"{remote.address}:{remote.port}"


class _Gone(Exception):
    """The client went away (or stalled and was dropped) while we were sending."""


async def _close_when(ended: trio.Event, ws: WebSocketConnection, stream: GatedStream | None) -> None:
    await ended.wait()
    # Shielded: the connection's end (which this causes) cancels this task, and the TCP
    # connection must still be closed here, by the server (RFC 6455 7.1.1).
    with trio.CancelScope(shield=True):
        with trio.move_on_after(DISCONNECT_TIMEOUT_S):
            await ws.aclose(code=1008, reason="the dashboard session ended")
        if stream is not None:
            await stream.close_now()


class Subscriptions:
    """The control server's live subscriptions, counted: a stopping daemon lets them
    deliver their runs' last events, and their ``end``, before it closes the connections
    (``drained``). Once every run is terminal, each subscription ends by itself."""

    def __init__(self) -> None:
        self.active = 0
        self.buffered = 0  # bytes of live events buffered in all of them (``_Buffer``)
        self._idle = trio.Event()
        self._idle.set()

    def opened(self) -> None:
        self.active += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def closed(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until no subscription is left; whether none is."""
        with trio.move_on_after(timeout_s):
            await self._idle.wait()
        return self.active == 0


class _Server:
    def __init__(
        self,
        config: Config,
        backend: protocol.Backend,
        tokens: _TokenSource,
        limits: Limits,
        session_ok: SessionCheck | None = None,
        subscriptions: Subscriptions | None = None,
        session_watch: SessionWatch | None = None,
    ) -> None:
        self.config = config
        self.session_watch = session_watch
        self.backend = backend
        self.tokens = tokens
        self.limits = limits
        self.session_ok = session_ok
        self.subscriptions = subscriptions if subscriptions is not None else Subscriptions()
        self.event_texts = _EventTexts()
        self.started_at = time.time()
        self.port = 0
        self.connections = 0
        self.gate: Gate | None = None
        # Large messages are decoded in a thread, one at a time for all connections: the
        # decoder holds the GIL, and the event loop gets it back between two of them.
        self.decoding = trio.CapacityLimiter(1)
        self.histories = trio.CapacityLimiter(HISTORY_AT_ONCE)
        self._refusals_unlogged = 0
        self._refusal_log = Throttled(logger)

    def _log_refusal(self, peer: str, reason: str) -> None:
        """One line a ``REFUSAL_LOG_INTERVAL_S``, its reason cut short, with how many were
        refused meanwhile: a client with no token that kept asking, with a long Origin,
        wrote ~10 MB/s to the log."""
        if not self._refusal_log.due():
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more refused since the last line)" if self._refusals_unlogged else ""
        self._refusals_unlogged = 0
        shown = reason if len(reason) <= REFUSAL_LOG_CHARS else reason[:REFUSAL_LOG_CHARS] + "..."
        logger.warning("control: refused %s: %s%s", peer, shown, more)

    async def handle(self, request: WebSocketRequest) -> None:
        # A task root: whatever happens with one client, the server goes on. (Even a
        # property like `remote` raises OSError once the socket is closed.)
        stream = current_stream.get()
        peer = _peer_name(request, stream)
        try:
            refusal = check_access(
                request.headers,
                request.path,
                token=self.tokens.get(),
                allowed_origins=self.config.allowed_origins,
                session_ok=self.session_ok,
                subprotocols=request.proposed_subprotocols,
            )
            if refusal is None:
                if stream is not None:
                    stream.authenticated()  # no newcomer evicts it now
            else:
                status, reason = refusal
                self._log_refusal(peer, reason)
                headers = [(b"WWW-Authenticate", b"Bearer")] if status == 401 else []
                try:
                    await request.reject(status, extra_headers=headers, body=(reason + "\n").encode())
                finally:
                    # trio-websocket leaves a rejected connection open for as long as the
                    # client keeps it (its reader waits for bytes): close it now.
                    if stream is not None:
                        await stream.close_now()
                return
            # The dashboard's page offers its subprotocol (and its session beside it): a
            # browser drops a socket whose server selects none of the offered ones.
            dash = DASHBOARD_SUBPROTOCOL in request.proposed_subprotocols
            ws = await request.accept(subprotocol=DASHBOARD_SUBPROTOCOL if dash else None)
        except ConnectionClosed:
            return
        except Exception:
            logger.exception("control: handshake with %s failed", peer)
            if stream is not None:
                await stream.close_now()
            return
        self.connections += 1
        logger.debug("control: connection from %s", peer)
        watching: AbstractContextManager[trio.Event | None] = contextlib.nullcontext(None)
        if self.session_watch is not None:  # let in by a session (whatever else it offered): watched
            watching = self.session_watch(", ".join(request.proposed_subprotocols))
        try:
            with watching as ended:
                async with trio.open_nursery() as watch:
                    if ended is not None:
                        # Signed out: the socket closes (requests in flight still complete).
                        watch.start_soon(_close_when, ended, ws, stream)
                    try:
                        await _Connection(self, ws, peer, stream).run()
                    finally:
                        watch.cancel_scope.cancel()
            if isinstance(ws, FailingConnection) and ws.failure is not None:
                logger.info(
                    "control: %s sent a frame that breaks the websocket protocol (%s); replied to the "
                    "requests before it, closing with %d",
                    peer,
                    (ws.failure.reason or "")[:REFUSAL_LOG_CHARS],
                    ws.failure.code,
                )
        except Exception:
            logger.exception("control: connection from %s failed", peer)
        finally:
            self.connections -= 1
            logger.debug("control: %s disconnected", peer)

    def daemon_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "pid": os.getpid(),
            "protocol": protocol.PROTOCOL_VERSION,
            "version": _version(),
            "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 3),
            "url": endpoint_url(self.config.host, self.port),
            "state_dir": str(self.config.state_dir),
            "connections": self.connections,
            # How long a request may wait for a stop before it answers (``spawn`` with
            # ``interrupt``, ``session_close``): a client waits that much longer for it.
            "stop_wait_s": self.config.grace_s + STOP_WAIT_MARGIN_S,
        }
        if self.gate is not None:
            info["connection_limits"] = {
                "per_peer": self.gate.per_peer,
                "total": self.gate.total,
                "open": self.gate.count,
                "refused": self.gate.refused,
                # Connections still in their handshake closed for newer ones at the limit.
                "evicted": self.gate.evicted,
                # Connections made by a run's processes, closed at once (both listeners).
                "refused_runs": self.gate.runs.refused if self.gate.runs is not None else None,
            }
        return info


_VERSION: str | None = None


def _version() -> str:
    global _VERSION
    if _VERSION is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _VERSION = version("agentd")
        except PackageNotFoundError:
            _VERSION = "unknown"
    return _VERSION


class _Connection:
    def __init__(self, server: _Server, ws: WebSocketConnection, peer: str, stream: GatedStream | None) -> None:
        self.server = server
        self.peer = peer
        self.backend = server.backend
        self.limits = server.limits
        self.ws = ws
        self.stream = stream
        self.max_bytes = server.config.max_message_bytes
        self.subs: dict[str, trio.CancelScope] = {}
        self.next_sub = 0
        self.in_flight = trio.Semaphore(self.limits.in_flight)
        self.busy = 0  # requests being served
        self.idle_scope = trio.CancelScope()
        # Why a subscription cancelled before it was answered is refused (None: unsubscribed).
        self.refusal: str | None = None

    async def run(self) -> None:
        # Requests run in `requests`, which is NOT cancelled when the client goes: a spawn
        # or cancel in flight completes (its reply just has nowhere to go). Subscriptions
        # run in `subs_nursery`, cancelled on disconnect: they only read.
        async with trio.open_nursery() as requests:
            closer = trio.CancelScope()
            requests.start_soon(self._close_when_cancelled, closer)
            try:
                await self._read_and_follow(requests)
            finally:
                closer.cancel()

    async def _close_when_cancelled(self, own: trio.CancelScope) -> None:
        """Close the TCP stream at once when the connection itself is cancelled (the daemon
        stops), whatever its tasks are doing: its subscriptions' sends are shielded (a frame
        goes out whole), and after a bad frame they still send while nothing reads."""
        with own:
            try:
                await trio.sleep_forever()
            finally:
                if not own.cancel_called and self.stream is not None:
                    await trio.aclose_forcefully(self.stream)

    async def _read_and_follow(self, requests: trio.Nursery) -> None:
        async with trio.open_nursery() as subs_nursery:
            subs_nursery.start_soon(self._idle_watch)
            try:
                await self._read_loop(requests, subs_nursery)
            finally:
                if isinstance(self.ws, FailingConnection) and self.ws.failure is not None:
                    # A frame broke the protocol; the client may still read. Each
                    # subscription ends, one not answered yet with a refusal (its
                    # request came before that frame); then the nursery is done.
                    self.refusal = "the connection is closing: a frame broke the websocket protocol"
                    self.idle_scope.cancel()
                    for scope in self.subs.values():
                        scope.cancel(reason="control connection failed")
                else:
                    subs_nursery.cancel_scope.cancel(reason="control connection closed")

    async def _idle_watch(self) -> None:
        with self.idle_scope:
            await self._close_when_idle()

    async def _close_when_idle(self) -> None:
        """Close the connection once it is idle: nothing received, asked or subscribed."""
        if self.stream is None:
            return
        idle_s = self.limits.idle_s
        while True:
            last = self.stream.last_received
            await trio.sleep_until(last + idle_s)
            if self.subs or self.busy or self.stream.last_received != last:
                if self.stream.last_received == last:
                    await trio.sleep(idle_s)  # busy: look again after another full period
                continue
            logger.info("control: %s idle for %.0f s; closing it", self.peer, idle_s)
            with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                await self.ws.aclose(1001, "idle")
            await self.stream.close_now()
            return

    async def _read_loop(self, requests: trio.Nursery, subs_nursery: trio.Nursery) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            if len(message) > DECODE_IN_THREAD_CHARS:
                # Awaited here: this connection's messages are still taken in order (the
                # other connections are served meanwhile).
                req = await trio.to_thread.run_sync(
                    functools.partial(protocol.decode_request, message, max_bytes=self.max_bytes),
                    limiter=self.server.decoding,
                )
            else:
                req = protocol.decode_request(message, max_bytes=self.max_bytes)
            del message
            try:
                if isinstance(req, BadRequest):
                    logger.info("control: %s from %s: %s", req.code, self.peer, req.message)
                    await self._send(protocol.encode_error(req.id, req.code, req.message))
                elif isinstance(req, protocol.SubscribeRequest):
                    await self._start_subscription(req, subs_nursery)
                elif isinstance(req, protocol.UnsubscribeRequest):
                    scope = self.subs.pop(req.sub, None)
                    if scope is not None:
                        scope.cancel(reason="unsubscribed")
                    await self._send(protocol.encode_reply(req.id, {"sub": req.sub, "was_active": scope is not None}))
                else:
                    await self.in_flight.acquire()
                    self.busy += 1
                    requests.start_soon(self._serve, req)
            except _Gone:
                return

    async def _send(self, text: str) -> None:
        send_s = self.limits.send_s
        # Shielded: a send cancelled from outside (an unsubscribe, a subscription's end, a
        # bad frame's refusals) may have written part of its frame, and the connection's
        # next message went inside it (the client read garbage, "invalid utf-8", and lost
        # the replies). A send finishes, or fails with the connection, within ``send_s``;
        # an outer cancellation takes effect right after. (``run`` closes the stream at
        # once when the connection itself is cancelled: a stop waits for no slow client.)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(send_s) as scope:
                try:
                    await self.ws.send_message(text)
                except ConnectionClosed:
                    raise _Gone() from None
            if scope.cancelled_caught:
                logger.warning("control: %s read nothing for %.0f s; disconnecting it", self.peer, send_s)
                # A frame may be half written: a close frame now would land inside it (the
                # client reads garbage, "invalid utf-8"). The TCP stream goes, no handshake.
                if self.stream is not None:
                    await self.stream.close_now()
                else:
                    with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                        await self.ws.aclose(1008, "client too slow")
                raise _Gone()
        await trio.lowlevel.checkpoint_if_cancelled()

    async def _serve(self, req: protocol.Request) -> None:
        try:
            if isinstance(req, protocol.HistoryRequest):
                async with self.server.histories:  # built, encoded and sent: see HISTORY_AT_ONCE
                    await self._answer(req)
            else:
                await self._answer(req)
        finally:
            self.busy -= 1
            self.in_flight.release()

    async def _answer(self, req: protocol.Request) -> None:
        try:
            try:
                result = await self._dispatch(req)
            except Exception as exc:
                code, message = protocol.error_code_for(exc)
                if code is ErrorCode.INTERNAL:
                    logger.exception("control: %s request %r failed", req.op, req.id)
                reply = protocol.encode_error(req.id, code, message)
            else:
                try:
                    reply = protocol.encode_reply(req.id, result)
                except Exception:  # not json, or nested too deep: a bug, but one reply's
                    logger.exception("control: %s result is not json", req.op)
                    reply = protocol.encode_error(
                        req.id, ErrorCode.INTERNAL, "internal error in the daemon (see its log)"
                    )
            await self._send(reply)
        except _Gone:
            pass

    async def _cancel_many(self, run_ids: list[str], reason: str) -> list[dict[str, Any]]:
        """Each run's cancel result, or ``{"run_id", "error"}``; in the order asked."""
        cancel_many = getattr(self.backend, "cancel_many", None)
        if cancel_many is not None:
            return list(await cancel_many(run_ids, reason=reason))
        out: dict[int, dict[str, Any]] = {}

        async def one(i: int, run_id: str) -> None:
            try:
                out[i] = await self.backend.cancel(run_id, reason=reason)
            except AgentdError as exc:
                code, message = protocol.error_code_for(exc)
                out[i] = {"run_id": run_id, "error": {"code": str(code), "message": message}}

        async with trio.open_nursery() as nursery:
            for i, run_id in enumerate(run_ids):
                nursery.start_soon(one, i, run_id)
        return [out[i] for i in range(len(run_ids))]

    async def _dispatch(self, req: protocol.Request) -> Any:
        b = self.backend
        if isinstance(req, protocol.SpawnRequest):
            extra: dict[str, Any] = {}
            if req.model_key is not None:
                extra["model_key"] = req.model_key
            if req.interrupt:
                extra["interrupt"] = True
            if req.key is not None:
                extra["key"] = req.key
            return await b.spawn(req.spec, session_id=req.session_id, timeout_s=req.timeout_s, **extra)
        if isinstance(req, protocol.CancelRequest):
            if req.run_id is not None and req.session_id is None:
                return await b.cancel(req.run_id, reason=req.reason)
            if req.run_ids is not None:
                runs = await self._cancel_many(list(req.run_ids), req.reason)
                return {"was_active": any(r.get("was_active") for r in runs), "runs": runs}
            cancel_session = getattr(b, "cancel_session", None)
            if cancel_session is None:
                raise _unsupported("cancel by session")
            # With its turn named (run_id), that turn only: passed only then, so a backend
            # that cannot guard by turn fails loudly rather than stop the live one.
            turn = {} if req.run_id is None else {"turn": req.run_id}
            return await cancel_session(req.session_id, reason=req.reason, **turn)
        if isinstance(req, protocol.StatusRequest):
            if req.run_id is not None:
                return await b.status(req.run_id)
            return await self._daemon_status()
        if isinstance(req, protocol.ListRequest):
            keyed: dict[str, Any] = {} if req.key is None else {"key": req.key}
            runs = await b.list_runs(limit=req.limit, state=req.state, session_id=req.session_id, **keyed)
            return {"runs": [summary_row(r) for r in runs]}
        if isinstance(req, protocol.EventsRequest):
            events, more = await _page(
                self.backend, req.run_id, req.after_seq, req.limit, self.limits.events_reply_bytes
            )
            return {"run_id": req.run_id, "events": events, "more": more}
        if isinstance(req, protocol.PingRequest):
            return {"pong": True, **self.server.daemon_info()}
        if isinstance(req, protocol.SteerRequest):
            steer = getattr(b, "steer", None)
            if steer is None:
                raise _unsupported("steering")
            return await steer(req.run_id, req.text)
        if isinstance(req, protocol.ApproveRequest):
            return await _optional(b, "approve", "approvals")(req.run_id, req.call_id)
        if isinstance(req, protocol.DenyRequest):
            return await _optional(b, "deny", "approvals")(req.run_id, req.call_id, reason=req.reason)
        if isinstance(req, protocol.HistoryRequest):
            page = {k: v for k in ("before_turn", "after_turn", "max_bytes") if (v := getattr(req, k)) is not None}
            return await _optional(b, "history", "session history")(req.session_id, **page)
        if isinstance(req, protocol.SessionsRequest):
            return await _optional(b, "list_sessions", "sessions")(limit=req.limit)
        if isinstance(req, protocol.SessionCloseRequest):
            return await _optional(b, "close_session", "closing sessions")(req.session_id)
        raise AssertionError(f"unhandled op {req.op!r}")

    async def _daemon_status(self) -> dict[str, Any]:
        live: list[dict[str, Any]] = []
        for state in (s for s in RunState if s in LIVE_STATES):
            live.extend(
                summary_row(r)
                for r in await self.backend.list_runs(
                    limit=protocol.DEFAULT_LIST_LIMIT, state=str(state), session_id=None
                )
            )
        out: dict[str, Any] = {"daemon": self.server.daemon_info(), "live_runs": live}
        summary = getattr(self.backend, "summary", None)
        if summary is not None:
            out["summary"] = await summary()
        return out

    # ------------------------------------------------------------------ subscriptions

    async def _start_subscription(self, req: protocol.SubscribeRequest, nursery: trio.Nursery) -> None:
        limit = self.limits.subscriptions
        if len(self.subs) >= limit:
            await self._send(
                protocol.encode_error(
                    req.id, ErrorCode.REFUSED, f"expected at most {limit} subscriptions per connection"
                )
            )
            return
        self.next_sub += 1
        sub = str(self.next_sub)
        # Registered before the task starts, so an unsubscribe right behind it finds it.
        scope = trio.CancelScope()
        self.subs[sub] = scope
        nursery.start_soon(self._subscription, req, sub, scope, name=f"subscription {sub} {req.run_id}")

    async def _subscription(self, req: protocol.SubscribeRequest, sub: str, scope: trio.CancelScope) -> None:
        self.server.subscriptions.opened()  # counted while its task runs, whatever ends it
        try:
            await self._subscription_inner(req, sub, scope)
        finally:
            self.server.subscriptions.closed()

    async def _subscription_inner(self, req: protocol.SubscribeRequest, sub: str, scope: trio.CancelScope) -> None:
        acked = False
        run_id = req.run_id
        try:
            with scope:
                last = req.after_seq
                empty_reopens = 0
                terminal_seen = False
                state = ""  # the run's state as last read: set before terminal_seen is
                while True:
                    before = last
                    async with self.backend.subscribe(run_id) as live:
                        if not acked:
                            await self._send(
                                protocol.encode_reply(req.id, {"sub": sub, "run_id": run_id, "after_seq": last})
                            )
                            acked = True
                        last = await self._follow(sub, run_id, last, live)
                    # The live channel ended: the run is terminal, or the backend dropped us.
                    last = await self._catch_up(sub, run_id, last)
                    if terminal_seen:
                        # A subscription opened after the terminal state was reported has
                        # closed: the terminal event is journaled and sent (see Backend).
                        await self._send_end(sub, run_id, state, last)
                        return
                    state = str((await self.backend.status(run_id)).get("state"))
                    if state in TERMINAL_STATES:
                        # Reported terminal, but its last event may still be on its way to
                        # the journal (we were between subscriptions): one more round.
                        terminal_seen = True
                        continue
                    empty_reopens = 0 if last > before else empty_reopens + 1
                    if empty_reopens > MAX_EMPTY_REOPENS:
                        await self._send_end(sub, run_id, state, last)
                        return
                    logger.info("control: run %s: live events ended while %s; resubscribing", run_id, state)
            if not acked:  # an unsubscribe overtook it, or a bad frame (``run``): still a reply
                await self._send(
                    protocol.encode_error(
                        req.id, ErrorCode.REFUSED, self.refusal or "unsubscribed before the subscription started"
                    )
                )
            elif self.refusal is not None:
                # A bad frame failed the connection under a running subscription: its client
                # learns it ended, and why, before the close frame (an unsubscribe has its
                # own reply).
                await self._send(_end_with_error(sub, run_id, ErrorCode.REFUSED, self.refusal))
        except _Gone:
            return
        except Exception as exc:
            code, message = protocol.error_code_for(exc)
            if code is ErrorCode.INTERNAL:
                logger.exception("control: subscription %s to run %s failed", sub, run_id)
            try:
                if not acked:
                    await self._send(protocol.encode_error(req.id, code, message))
                else:
                    await self._send(_end_with_error(sub, run_id, code, message))
            except _Gone:
                pass
        finally:
            if self.subs.get(sub) is scope:
                del self.subs[sub]

    async def _send_end(self, sub: str, run_id: str, state: str, last: int) -> None:
        """The subscription's ``end``, with the run's own last event number (``last`` is
        the client's ``after_seq`` when nothing came after it: one past the run's end was
        echoed back as if the run had it)."""
        row = await self.backend.status(run_id)
        seq = row.get("last_seq")
        await self._send(protocol.encode_end(sub, run_id, state, seq if isinstance(seq, int) else last))

    async def _follow(self, sub: str, run_id: str, last: int, live: trio.MemoryReceiveChannel[dict[str, Any]]) -> int:
        # The forwarder's own failures (_Gone, RunNotFound) leave the nursery unwrapped:
        # trio would raise them as an ExceptionGroup, which the callers do not expect.
        failure: Exception | None = None
        buffer = _Buffer(
            LIVE_BUFFER, self.limits.subscriber_bytes, self.server.subscriptions, self.limits.subscribers_total_bytes
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(_drain, live, buffer, sub, run_id, after=last, texts=self.server.event_texts)
                )
                try:
                    last = await self._forward(sub, run_id, last, buffer)
                except Exception as exc:
                    failure = exc
                    nursery.cancel_scope.cancel(reason="subscription ended")
        finally:
            buffer.release()
        if failure is not None:
            raise failure
        return last

    async def _forward(self, sub: str, run_id: str, last: int, buffer: _Buffer) -> int:
        last = await self._catch_up(sub, run_id, last)
        async with buffer.recv:
            async for seq, text in buffer.recv:
                buffer.taken(text)
                if seq <= last:
                    continue
                if seq > last + 1:
                    last = await self._catch_up(sub, run_id, last)
                    if seq <= last:
                        continue
                    logger.warning(
                        "control: run %s: events %d..%d are not in the journal yet", run_id, last + 1, seq - 1
                    )
                await self._send(text)
                last = seq
        return last

    async def _catch_up(self, sub: str, run_id: str, last: int) -> int:
        while True:
            page, more = await _page(self.backend, run_id, last, REPLAY_PAGE, self.limits.replay_page_bytes)
            for event in page:
                if event["seq"] > last:
                    await self._send(_event_text(sub, run_id, event))
                    last = event["seq"]
            if not more:
                return last


async def _page(
    backend: protocol.Backend, run_id: str, after_seq: int, limit: int, max_bytes: int
) -> tuple[list[dict[str, Any]], bool]:
    """A page of the journal bounded in events and bytes, and whether more follow."""
    events_page = getattr(backend, "events_page", None)
    if events_page is not None:
        page, more = await events_page(run_id, after_seq, limit=limit, max_bytes=max_bytes)
        return page, more
    page = await backend.events_after(run_id, after_seq, limit)
    # A short page does not prove the end: such a backend may cut its pages by size too
    # (a fleet front relaying a node's). Only an empty page does.
    return page, bool(page)


class _Buffer:
    """A subscription's live events, encoded, bounded in count and in bytes, its own and
    all subscriptions' together (``pool.buffered`` against ``pool_bytes``)."""

    def __init__(self, count: int, max_bytes: int, pool: Subscriptions, pool_bytes: int) -> None:
        self.send, self.recv = trio.open_memory_channel[tuple[int, str]](count)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.pool = pool
        self.pool_bytes = pool_bytes

    def offer(self, seq: int, text: str) -> bool:
        """Buffer one event; False (dropped) when full in count or bytes. An empty buffer
        always takes one: its client, if it reads, sees the gap and fills it."""
        n = len(text)
        if self.bytes > 0 and (self.bytes + n > self.max_bytes or self.pool.buffered + n > self.pool_bytes):
            return False
        self.send.send_nowait((seq, text))  # WouldBlock when full in count
        self.bytes += n
        self.pool.buffered += n
        return True

    def full(self) -> bool:
        """Whether ``offer`` would drop the next event whatever its size."""
        stats = self.send.statistics()
        return stats.current_buffer_used >= stats.max_buffer_size or (
            self.bytes > 0 and (self.bytes >= self.max_bytes or self.pool.buffered >= self.pool_bytes)
        )

    def taken(self, text: str) -> None:
        self.bytes -= len(text)
        self.pool.buffered -= len(text)

    def release(self) -> None:
        """The subscription ended: what it still held counts no more."""
        self.pool.buffered -= self.bytes
        self.bytes = 0


async def _drain(
    live: trio.MemoryReceiveChannel[dict[str, Any]],
    buffer: _Buffer,
    sub: str,
    run_id: str,
    *,
    after: int = 0,
    texts: _EventTexts | None = None,
) -> None:
    # Never blocks on the client: the backend's channel is always read promptly. What the
    # buffer cannot hold is dropped here and re-read from the journal by the forwarder.
    # Nothing is encoded for an event the forwarder would skip (at or before ``after``, the
    # subscription's start) or that finds the buffer full; an event's encoding is shared by
    # every subscription to its run (``texts``): 64 subscriptions past a run's end, never
    # read, made the daemon encode each of its events 64 times, and its runs ~10x slower.
    dropped = 0
    texts = texts if texts is not None else _EventTexts()
    async with buffer.send:
        async for event in live:
            if event["seq"] <= after:
                continue
            if buffer.full():
                dropped += 1
                continue
            try:
                if not buffer.offer(event["seq"], texts.text(sub, run_id, event)):
                    dropped += 1
            except trio.WouldBlock:
                dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the forwarder is gone; so is this subscription
    if dropped:
        logger.info(
            "control: run %s: %d live events dropped for a slow client (re-read from the journal)", run_id, dropped
        )


def _event_text(sub: str, run_id: str, event: dict[str, Any]) -> str:
    """The pushed message of one event; one whose data cannot be encoded says so."""
    return protocol.event_message(sub, run_id, _event_body(run_id, event))


def _event_body(run_id: str, event: dict[str, Any]) -> str:
    try:
        return protocol.encode_event_body(event)
    except ValueError as exc:
        logger.warning("control: run %s: event %s cannot be sent as json: %s", run_id, event.get("seq"), exc)
        return protocol.encode_event_body({**event, "data": {"error": "this event's data cannot be encoded as json"}})


@final
class _EventTexts:
    """The latest live events' encoded bodies, by (run, seq): shared by the daemon's
    subscriptions, so an event is encoded once however many follow its run."""

    def __init__(self, size: int = EVENT_TEXTS_CACHED) -> None:
        self._size = size
        self._bodies: dict[tuple[str, int], str] = {}

    def text(self, sub: str, run_id: str, event: dict[str, Any]) -> str:
        key = (run_id, event["seq"])
        body = self._bodies.get(key)
        if body is None:
            body = self._bodies[key] = _event_body(run_id, event)
            if len(self._bodies) > self._size:
                del self._bodies[next(iter(self._bodies))]  # the oldest (dicts keep insertion order)
        return protocol.event_message(sub, run_id, body)


def _end_with_error(sub: str, run_id: str, code: str, message: str) -> str:
    return protocol._dumps(
        {"op": "end", "sub": sub, "run_id": run_id, "state": None, "error": {"code": str(code), "message": message}}
    )


def _is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


# A list row quotes this much of a run's task, final text or call arguments (chars).
SUMMARY_TEXT_CHARS: Final = 1000
SUMMARY_ARGS_CHARS: Final = 200


def summary_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A run as ``list`` (and the daemon's ``status``) give it: its record less what only
    ``status RUN`` gives (its spec beyond the task, its result beyond its status and steps,
    its tool calls' outputs, its receipt). A full record carries every tool output and the
    model's messages: a thousand of them made a reply of gigabytes."""

    def short(value: Any, n: int) -> Any:
        return value[:n] + "..." if isinstance(value, str) and len(value) > n else value

    out = {k: v for k, v in row.items() if k not in ("spec", "result", "partial_snapshot", "receipt", "tool_calls")}
    spec = row.get("spec")
    out["spec"] = {"task": short(spec.get("task"), SUMMARY_TEXT_CHARS)} if isinstance(spec, Mapping) else None
    result = row.get("result")
    if isinstance(result, Mapping):
        kept = {k: result[k] for k in ("status", "reason", "steps", "step") if k in result}
        if "final_text" in result:
            kept["final_text"] = short(result["final_text"], SUMMARY_TEXT_CHARS)
        out["result"] = kept
    else:
        out["result"] = None
    snapshot = row.get("partial_snapshot")
    out["partial_snapshot"] = {"step": snapshot.get("step")} if isinstance(snapshot, Mapping) else None
    calls = row.get("tool_calls")
    out["tool_calls"] = [
        {
            **{k: c.get(k) for k in ("id", "name", "state", "step", "stop_effect") if k in c},
            "arguments": short(c.get("arguments"), SUMMARY_ARGS_CHARS),
        }
        for c in (calls if isinstance(calls, list) else [])
        if isinstance(c, Mapping)
    ]
    out["summary"] = True  # the whole record: status RUN
    return out


def _optional(backend: Any, name: str, what: str) -> Any:
    """The backend's optional method ``name``, or an ``unsupported`` error naming ``what``."""
    method = getattr(backend, name, None)
    if method is None:
        raise _unsupported(what)
    return method


def _unsupported(what: str) -> Exception:
    return ControlProtocolError(ErrorCode.UNSUPPORTED, f"this daemon does not support {what}")


async def open_listener(host: str, port: int, field: str = "port") -> trio.SocketListener:
    """One listening socket at ``host:port`` (0: any free port).

    "localhost" may resolve to two addresses; with port 0 they would get different ports
    and only one can be published: the first is kept.

    Raises:
        ListenError: the host or port chosen cannot be bound (``field`` names the setting).
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
    except (OSError, UnicodeError) as exc:
        raise ListenError.of(field, host, port, exc) or exc from None
    for extra in listeners[1:]:
        await extra.aclose()
    return listeners[0]


async def serve_control(
    config: Config,
    backend: protocol.Backend,
    *,
    token: str | None = None,
    session_ok: SessionCheck | None = None,
    session_watch: SessionWatch | None = None,
    limits: Limits | None = None,
    subscriptions: Subscriptions | None = None,
    listener: trio.SocketListener | None = None,
    runs: RunPeers | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control socket on ``config.host:config.port`` until cancelled.

    Args:
        config: host, port (0: ephemeral), allowed origins, message size limit, token path.
        backend: the run manager.
        token: the token clients must present; None: the one in ``config.token_path``,
            re-read when the file changes (a connection before it exists is refused).
        session_ok: accepts a dashboard session instead of the token (``check_access``).
        session_watch: closes such a connection when its session ends (``Sessions.watching``).
        limits: connection limits; default ``Limits()``, its total capped by RLIMIT_NOFILE.
        subscriptions: where the live subscriptions are counted (the daemon's, to let them
            drain at shutdown); default a fresh one.
        listener: bound already (``open_listener``); default: bound here.
        runs: tells the connections a run's processes made, which are closed at once
            (``_peer_cgroup``); None: all are admitted.
        task_status: started with the bound port once connections are accepted.
    """
    limits = limits or Limits()
    listeners = [listener or await open_listener(config.host, config.port)]
    server = _Server(
        config, backend, _TokenSource(config.token_path, token), limits, session_ok, subscriptions, session_watch
    )
    server.port = listeners[0].socket.getsockname()[1]
    gate = Gate(listeners[0], per_peer=limits.per_peer, total=fd_connection_cap(limits.total), runs=runs)
    server.gate = gate
    ws_server = _ContainedServer(
        server.handle,
        # Typed for trio's socket and SSL listeners only; any trio Listener works (its docs:
        # "Other listener types are represented by their repr()").
        [gate],  # type: ignore[list-item]
        max_message_size=hard_message_cap(config),
        receive_buffer_size=RECEIVE_BYTES,
        connect_timeout=limits.handshake_s,
        disconnect_timeout=DISCONNECT_TIMEOUT_S,
    )
    address = listeners[0].socket.getsockname()[0]
    if not _is_loopback(address):
        logger.warning(
            "control: listening on %s, which is not a loopback address: anyone who can reach it "
            "and holds the token controls every run",
            address,
        )
    async with trio.open_nursery() as nursery:
        await nursery.start(ws_server.run)
        logger.info(
            "control: listening on %s (at most %d connections per peer, %d in all)",
            endpoint_url(config.host, server.port),
            gate.per_peer,
            gate.total,
        )
        task_status.started(server.port)
