"""The CLI's websocket to the daemon: a blocking socket driven by ``h11`` and ``wsproto``.

The opening handshake is an HTTP/1.1 upgrade spoken with ``h11``; after the 101 the
connection is ``wsproto``'s (frames, masking, fragments, ping/pong, close). Not
``wsproto.WSConnection``: its client handshake encodes the Host header with the ``idna``
codec, whose import (``stringprep``'s tables) costs ~4 ms of every CLI call; the checks it
makes on the 101 (Upgrade, Connection, Sec-WebSocket-Accept) are made here with
wsproto's own helpers instead. (The CLI imports the client, and so this module, only for a
command that talks to the daemon.)

Every failure of the connection is ``ConnectionLost``; a refused handshake is
``Unauthorized``. Blocking, with per-call timeouts.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Final
from urllib.parse import urlsplit

import h11
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, TextMessage
from wsproto.utilities import LocalProtocolError, generate_accept_token, generate_nonce, split_comma_header

from supervisor.errors import ControlProtocolError
from supervisor.protocol import ErrorCode

__all__ = ["WebSocket", "ConnectionLost", "Unauthorized", "MAX_FRAME_BYTES", "MAX_HANDSHAKE_BYTES"]

# A server message larger than this is refused (the daemon never sends one).
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
# The upgrade reply's head, and the body of a refusal that is read for its reason.
MAX_HANDSHAKE_BYTES: Final = 64 * 1024
MAX_REFUSAL_BODY_BYTES: Final = 4096
RECV_BYTES: Final = 65536
# Bounds sending our close frame when we hang up.
CLOSE_SEND_TIMEOUT_S: Final = 0.2


class ConnectionLost(ControlProtocolError):
    """The connection to the daemon broke (or timed out) before the reply came.

    ``sent``: the request had been sent, so the daemon may have acted on it."""

    sent: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONNECTION_LOST, message)


class Unauthorized(ControlProtocolError):
    """The daemon refused the handshake: wrong token, or an origin it does not allow."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHORIZED, message)
        self.status = status


class WebSocket:
    def __init__(self, sock: socket.socket, conn: Connection) -> None:
        self._sock = sock
        self._conn = conn
        # Events are taken one at a time, so each is handled in the state it arrived in (a
        # ping before a close is answered). The handshake's trailing bytes may hold some.
        self._events: Iterator[Event] = conn.events()
        self.closed = False

    @classmethod
    def connect(cls, url: str, headers: dict[str, str], timeout_s: float) -> WebSocket:
        """Open the TCP connection and do the opening handshake.

        Raises:
            OSError: the TCP connection failed (ConnectionRefusedError: nothing listens).
            Unauthorized: the server refused the handshake with 401/403.
            ConnectionLost: anything else went wrong in the handshake.
        """
        parts = urlsplit(url)
        if parts.scheme != "ws" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected a ws://host:port/ url, got {url!r}")
        host = parts.hostname
        # A str host goes through the idna codec in getaddrinfo (see the module
        # docstring); an ASCII host is the same name as bytes.
        address = (host.encode() if host.isascii() else host, parts.port)
        # typeshed types the host as str only; getaddrinfo takes bytes as well (and skips the codec).
        sock = socket.create_connection(address, timeout=timeout_s)  # type: ignore[arg-type]
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            authority = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
            return cls(sock, _handshake(sock, url, authority, target, headers))
        except BaseException:
            sock.close()
            raise

    def send_text(self, text: str) -> None:
        self._send(TextMessage(data=text))

    def _send(self, event: Event) -> None:
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        try:
            self._sock.sendall(self._conn.send(event))
        except LocalProtocolError as exc:  # the daemon already closed its side
            self.close()
            raise ConnectionLost(f"the connection to the daemon is closing: {exc}") from None
        except OSError as exc:
            self.close()
            raise ConnectionLost(f"lost the connection to the daemon while sending: {exc}") from exc

    def _next_event(self) -> Event:
        """The connection's next event, reading the socket as needed."""
        while (event := next(self._events, None)) is None:
            try:
                data = self._sock.recv(RECV_BYTES)
            except TimeoutError as exc:
                raise ConnectionLost("timed out waiting for the daemon") from exc
            except OSError as exc:
                self.close()
                raise ConnectionLost(f"lost the connection to the daemon: {exc}") from exc
            # b"" is EOF: wsproto turns None into a close with code 1006.
            self._conn.receive_data(data or None)
            self._events = self._conn.events()
        return event

    def recv_text(self, timeout_s: float | None) -> str:
        """The next complete message (text, or binary decoded as UTF-8).

        Raises:
            ConnectionLost: closed, broken, or nothing within ``timeout_s``.
        """
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        self._sock.settimeout(timeout_s)
        text: list[str] = []
        binary: list[bytes] = []
        size = 0  # a text message is counted in characters (wsproto decodes it as it comes)
        while True:
            event = self._next_event()
            if isinstance(event, (TextMessage, BytesMessage)):
                size += len(event.data)
                if size > MAX_FRAME_BYTES:
                    self.close()
                    raise ConnectionLost(f"expected a message of at most {MAX_FRAME_BYTES} bytes from the daemon")
                if isinstance(event, TextMessage):
                    text.append(event.data)
                else:
                    binary.append(bytes(event.data))
                if event.message_finished:
                    return "".join(text) if text else b"".join(binary).decode("utf-8", "replace")
            elif isinstance(event, Ping):
                self._send(event.response())
            elif isinstance(event, CloseConnection):
                if self._conn.state is ConnectionState.REMOTE_CLOSING:
                    try:  # answer the close, as RFC 6455 asks; the socket goes anyway
                        self._sock.sendall(self._conn.send(event.response()))
                    except OSError:
                        pass
                self.close()
                if event.code == 1006:  # no close frame: the TCP connection just ended
                    raise ConnectionLost("the daemon closed the connection")
                reason = f": {event.reason}" if event.reason else ""
                raise ConnectionLost(f"the daemon closed the connection ({event.code}{reason})")
            # a Pong: nothing to do

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._conn.state is ConnectionState.OPEN:
                self._sock.settimeout(CLOSE_SEND_TIMEOUT_S)
                self._sock.sendall(self._conn.send(CloseConnection(code=1000)))
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass


def _handshake(sock: socket.socket, url: str, authority: str, target: str, headers: dict[str, str]) -> Connection:
    """The HTTP/1.1 upgrade (RFC 6455 §4.1) on ``sock``; the websocket after the 101."""
    http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HANDSHAKE_BYTES)
    nonce = generate_nonce()
    request = h11.Request(
        method="GET",
        target=target,
        headers=[
            ("Host", authority),
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Key", nonce.decode("ascii")),
            ("Sec-WebSocket-Version", "13"),
            *headers.items(),
        ],
    )
    sock.sendall(http.send(request) or b"")
    refusal: h11.Response | None = None
    body = b""
    while True:
        try:
            event = http.next_event()
        except h11.RemoteProtocolError as exc:
            if refusal is not None:  # a refusal cut short: its status is what matters
                break
            raise ConnectionLost(f"expected an http upgrade reply from {url}: {exc}") from None
        if event is h11.NEED_DATA:
            data = sock.recv(RECV_BYTES)
            if not data and refusal is None:
                raise ConnectionLost(f"the daemon at {url} closed the connection during the handshake")
            http.receive_data(data)
            continue
        if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
            reply = {name: value for name, value in event.headers}  # h11 lowercases names
            if reply.get(b"upgrade", b"").lower() != b"websocket" or "upgrade" not in [
                t.lower() for t in split_comma_header(reply.get(b"connection", b""))
            ]:
                raise ConnectionLost(f"the server at {url} answered 101 without upgrading to a websocket")
            if reply.get(b"sec-websocket-accept") != generate_accept_token(nonce):
                raise ConnectionLost(f"the server at {url} answered with a bad Sec-WebSocket-Accept")
            trailing, _closed = http.trailing_data
            return Connection(ConnectionType.CLIENT, trailing_data=trailing)
        if isinstance(event, h11.Response):
            refusal = event
        elif isinstance(event, h11.Data):
            body = (body + event.data)[:MAX_REFUSAL_BODY_BYTES]
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)) or event is h11.PAUSED:
            break
    status = refusal.status_code if refusal is not None else 0
    if status in (401, 403):
        text = body.decode("utf-8", "replace").strip()
        raise Unauthorized(status, f"the daemon refused the connection (http {status}: {text or 'no reason'})")
    raise ConnectionLost(f"expected http 101 from {url}, got http {status}")
