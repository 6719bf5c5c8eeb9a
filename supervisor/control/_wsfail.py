"""A server connection that fails as RFC 6455 says when the peer's bytes break the protocol.

A frame wsproto cannot parse (a text frame, or a close frame's reason, that is not UTF-8;
an unmasked or reserved frame...) ends its ``events()`` with a ``CloseConnection`` carrying
1007 or 1002, its state still ``OPEN`` (a close frame received sets ``REMOTE_CLOSING``
first). trio-websocket 0.12 takes that for the peer's close: it marks the connection
closed and closes the TCP stream at once, with no close frame. Replies the server still
owed for the requests before that frame were lost (a ``spawn`` started its run, and its
client never learnt the run's id).

``FailingConnection`` instead stops taking the peer's messages (those before the bad
frame are still delivered), reads and drops whatever else the peer sends (unread bytes at
close would make the kernel reset the connection, and the peer could lose what was sent
to it), and keeps sending: the handler's replies go out. When the handler is done, its
close is a close frame with the failure's code and reason, and the TCP stream is closed
without waiting for the peer's (RFC 6455 7.1.7: no more of its data is processed).

trio-websocket's server builds its connections itself, so ``handle_connection`` is its
``WebSocketServer._handle_connection`` (0.12.2) with this class; the test
``test_trio_websocket_is_the_version_failing_connection_was_written_for`` fails if the
library changes.
"""

from __future__ import annotations

import logging

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, WebSocketServer
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection

__all__ = ["FailingConnection", "handle_connection"]

logger = logging.getLogger(__name__)


class FailingConnection(WebSocketConnection):
    """trio-websocket's connection, failed (not dropped) when the peer breaks the protocol."""

    # Why the peer's bytes failed the connection (1002 or 1007, and wsproto's reason).
    failure: CloseReason | None = None

    async def _handle_close_connection_event(self, event: CloseConnection) -> None:
        # Runs in the library's reader task; a close frame received has moved wsproto's
        # state on already, a parse failure has not.
        if self._wsproto.state is not ConnectionState.OPEN or self._close_reason is not None:
            await super()._handle_close_connection_event(event)
            return
        self.failure = CloseReason(event.code, event.reason or None)
        logger.debug(
            "%s: the peer broke the protocol (%d: %s); no more of its data is read", self, event.code, event.reason
        )
        # get_message: the messages received before the bad frame, then ConnectionClosed.
        await self._send_channel.aclose()
        try:
            while await self._stream.receive_some(self._receive_buffer_size):
                pass  # dropped unread
            await self._close_handshake.wait()  # the peer's EOF: still open until closed here
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed here (``_aclose``), or by the network
        # Ends the reader task.
        raise ConnectionClosed(self._close_reason or self.failure)

    async def _aclose(self, code: int, reason: str | None) -> None:
        failure = self.failure
        if failure is None or self._close_reason is not None:
            await super()._aclose(code, reason)
            return
        self._close_reason = failure  # send_message raises ConnectionClosed from now on
        try:
            if self._wsproto.state is ConnectionState.OPEN:
                await self._send(CloseConnection(code=failure.code, reason=failure.reason))
        except ConnectionClosed:
            pass  # the peer is gone
        finally:
            self._close_handshake.set()
            await self._recv_channel.aclose()
            await self._close_stream()


async def handle_connection(server: WebSocketServer, stream: trio.abc.Stream) -> None:
    """``WebSocketServer._handle_connection`` of trio-websocket 0.12.2, its connection a
    ``FailingConnection``."""
    async with trio.open_nursery() as nursery:
        connection = FailingConnection(
            stream,
            WSConnection(ConnectionType.SERVER),
            message_queue_size=server._message_queue_size,
            max_message_size=server._max_message_size,
            receive_buffer_size=server._receive_buffer_size,
        )
        nursery.start_soon(connection._reader_task)
        with trio.move_on_after(server._connect_timeout) as connect_scope:
            request = await connection._get_request()
        if connect_scope.cancelled_caught:
            nursery.cancel_scope.cancel()
            await stream.aclose()
            return
        try:
            await server._handler(request)
        finally:
            with trio.move_on_after(server._disconnect_timeout):
                # aclose() ends the reader task even if it is cancelled.
                await connection.aclose()
