"""The front's connection to one node daemon's control socket: requests and subscriptions.

One websocket per node (trio-websocket), multiplexed: requests by id, subscriptions by
``sub``. When it breaks, every pending request raises ``ConnectionLost`` and every
subscription's channel closes without an ``end``: the owner reconnects (the daemon may
have restarted, with a new port and token) and resubscribes after the last seq it kept.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final
from urllib.parse import urlsplit

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, wrap_client_stream

from supervisor import protocol
from supervisor.control._wsclient import ConnectionLost
from supervisor.errors import ControlProtocolError

__all__ = ["NodeLink", "LinkDown"]

logger = logging.getLogger(__name__)

# Bounds opening a node's socket (TCP and handshake).
CONNECT_TIMEOUT_S: Final = 5.0
# Bounds one request's round trip to a node.
REQUEST_TIMEOUT_S: Final = 30.0
# Events buffered per subscription; a subscriber further behind is cut off and resumes.
SUB_BUFFER: Final = 4096
MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024


class LinkDown(ConnectionLost):
    """The node's socket broke or could not be opened."""


class NodeLink:
    def __init__(self, node_id: str, url: str, token: str) -> None:
        self.node_id = node_id
        self.url = url
        self.token = token
        self._ws: WebSocketConnection | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._subs: dict[str, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._sub_waiters: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.closed = trio.Event()
        self._scope: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the connection and read it until it breaks or ``close()``.

        Raises:
            LinkDown: the connection could not be opened (raised outside the nursery, so
                that it reaches ``nursery.start`` bare, not inside an ExceptionGroup).
        """
        failure: LinkDown | None = None
        # The TCP stream is ours to close: after a close the daemon starts, trio-websocket's
        # client waits for the server's TCP close and then leaves its socket open.
        stream: trio.SocketStream | None = None
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    try:
                        parts = urlsplit(self.url)
                        if parts.scheme != "ws" or parts.hostname is None or parts.port is None:
                            raise OSError(f"not a ws://host:port/ url: {self.url!r}")
                        with trio.fail_after(CONNECT_TIMEOUT_S):
                            stream = await trio.open_tcp_stream(parts.hostname, parts.port)
                            ws = await wrap_client_stream(
                                nursery,
                                stream,
                                parts.netloc,
                                parts.path or "/",
                                extra_headers=[(b"Authorization", f"Bearer {self.token}".encode())],
                                max_message_size=MAX_MESSAGE_BYTES,
                                message_queue_size=64,
                            )
                    except (OSError, HandshakeError, trio.TooSlowError, ConnectionClosed) as exc:
                        failure = LinkDown(f"cannot connect to node {self.node_id[:8]} at {self.url}: {exc!r}")
                        failure.__cause__ = exc
                        nursery.cancel_scope.cancel()
                    else:
                        self._ws = ws
                        task_status.started()
                        try:
                            await self._read(ws)
                        finally:
                            nursery.cancel_scope.cancel()
                            with trio.move_on_after(1, shield=True):
                                await ws.aclose()
                if failure is not None:
                    raise failure
        finally:
            self._fail_all()
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    def close(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def _fail_all(self) -> None:
        self._ws = None
        self.closed.set()
        for event, _slot in self._pending.values():
            event.set()
        self._pending.clear()
        for send in list(self._subs.values()) + list(self._sub_waiters.values()):
            send.close()
        self._subs.clear()
        self._sub_waiters.clear()

    async def _read(self, ws: WebSocketConnection) -> None:
        while True:
            try:
                text = await ws.get_message()
            except ConnectionClosed:
                return
            try:
                msg = protocol.decode_server_message(text)
            except ControlProtocolError:
                logger.warning("node %s sent a message that is not json: %r", self.node_id[:8], text[:200])
                continue
            op = msg.get("op")
            if op in ("event", "end"):
                send = self._subs.get(str(msg.get("sub")))
                if send is None:
                    continue
                try:
                    send.send_nowait(msg)
                except trio.WouldBlock:
                    logger.warning(
                        "node %s: a fleet subscriber fell behind; it resumes from the journal", self.node_id[:8]
                    )
                    send.close()
                    self._subs.pop(str(msg.get("sub")), None)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._subs.pop(str(msg.get("sub")), None)
                if op == "end":
                    self._subs.pop(str(msg.get("sub")), None)
                continue
            rid = msg.get("id")
            waiter = self._sub_waiters.pop(rid, None) if isinstance(rid, int) else None
            if waiter is not None and msg.get("ok") is True:
                self._subs[str(msg["result"]["sub"])] = waiter
            entry = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if entry is not None:
                entry[1].append(msg)
                entry[0].set()

    async def request(self, op: str, **args: Any) -> Any:
        """One request's result; protocol errors raise as the sync client's do."""
        ws = self._ws
        if ws is None:
            raise LinkDown(f"no connection to node {self.node_id[:8]}")
        rid = next(self._ids)
        event = trio.Event()
        slot: list[dict[str, Any]] = []  # the reply, put there by _read
        self._pending[rid] = (event, slot)
        try:
            await ws.send_message(protocol.encode_request(rid, op, **args))
        except ConnectionClosed as exc:
            self._pending.pop(rid, None)
            raise LinkDown(f"lost node {self.node_id[:8]} while sending {op!r}") from exc
        with trio.move_on_after(REQUEST_TIMEOUT_S):
            await event.wait()
        self._pending.pop(rid, None)
        if not slot:
            raise LinkDown(f"no reply to {op!r} from node {self.node_id[:8]}")
        msg = slot[0]
        if msg.get("ok") is True:
            return msg.get("result")
        raise protocol.error_from_reply(msg.get("error"), run_id=args.get("run_id"))

    @asynccontextmanager
    async def subscribe(self, run_id: str, after_seq: int) -> AsyncIterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Pushed ``event``/``end`` messages of one run after ``after_seq``.

        The channel closes after ``end``, or without one when the connection breaks.
        """
        ws = self._ws
        if ws is None:
            raise LinkDown(f"no connection to node {self.node_id[:8]}")
        send, recv = trio.open_memory_channel[dict[str, Any]](SUB_BUFFER)
        rid = next(self._ids)
        self._sub_waiters[rid] = send
        event = trio.Event()
        slot: list[dict[str, Any]] = []  # the reply, put there by _read
        self._pending[rid] = (event, slot)
        try:
            await ws.send_message(protocol.encode_request(rid, "subscribe", run_id=run_id, after_seq=after_seq))
        except ConnectionClosed as exc:
            self._pending.pop(rid, None)
            self._sub_waiters.pop(rid, None)
            raise LinkDown(f"lost node {self.node_id[:8]} while subscribing") from exc
        await event.wait()
        if not slot:
            raise LinkDown(f"lost node {self.node_id[:8]} while subscribing")
        if slot[0].get("ok") is not True:
            raise protocol.error_from_reply(slot[0].get("error"), run_id=run_id)
        sub = str(slot[0]["result"]["sub"])
        try:
            async with recv:
                yield recv
        finally:
            if self._subs.pop(sub, None) is not None and self._ws is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await self._ws.send_message(protocol.encode_request(next(self._ids), "unsubscribe", sub=sub))
                    except ConnectionClosed:
                        pass
