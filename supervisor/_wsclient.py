"""The client half of RFC 6455 that the control protocol needs, over a plain socket.

Stdlib only (the CLI must not pay for trio or a websocket library): the opening
handshake with its Sec-WebSocket-Accept check, masked text frames out, text/binary
frames in (fragmented or not), ping answered with pong, close answered and reported.
Every failure of the connection is ``ConnectionLost``; a refused handshake is
``Unauthorized``. Blocking, with per-call timeouts.
"""

from __future__ import annotations

import binascii
import os
import socket
import struct
from typing import Final
from urllib.parse import urlsplit

from supervisor.errors import ControlProtocolError
from supervisor.protocol import ErrorCode

__all__ = ["WebSocket", "ConnectionLost", "Unauthorized", "encode_frame", "MAX_FRAME_BYTES"]

# A server frame larger than this is refused (the daemon never sends one).
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class ConnectionLost(ControlProtocolError):
    """The connection to the daemon broke (or timed out) before the reply came."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONNECTION_LOST, message)


class Unauthorized(ControlProtocolError):
    """The daemon refused the handshake: wrong token, or an origin it does not allow."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHORIZED, message)
        self.status = status


def _mask(data: bytes, key: bytes) -> bytes:
    n = len(data)
    if n == 0:
        return b""
    # XOR as one big integer: fast for a 10 MB message, where a byte loop is not.
    k = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(k, "little")).to_bytes(n, "little")


def encode_frame(opcode: int, payload: bytes, *, mask_key: bytes | None = None) -> bytes:
    """One final, masked client frame (RFC 6455 §5.2)."""
    key = os.urandom(4) if mask_key is None else mask_key
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + key + _mask(payload, key)


def _sha1(data: bytes) -> bytes:
    try:
        # CPython's builtin SHA-1: hashlib would load OpenSSL (~2 ms of every CLI call).
        from _sha1 import sha1
    except ImportError:  # pragma: no cover - a build without it
        from hashlib import sha1
    return sha1(data).digest()


class WebSocket:
    def __init__(self, sock: socket.socket, buffered: bytes) -> None:
        self._sock = sock
        self._buf = bytearray(buffered)
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
        # A str host goes through the idna codec in getaddrinfo (imports unicodedata,
        # ~1.5 ms per CLI call); an ASCII host is the same name as bytes.
        sock = socket.create_connection((host.encode() if host.isascii() else host, parts.port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = binascii.b2a_base64(os.urandom(16), newline=False).decode()
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = f"[{host}]" if ":" in host else host
            lines = [
                f"GET {target} HTTP/1.1",
                f"Host: {host}:{parts.port}",
                "Upgrade: websocket",
                "Connection: Upgrade",
                f"Sec-WebSocket-Key: {key}",
                "Sec-WebSocket-Version: 13",
                *(f"{k}: {v}" for k, v in headers.items()),
            ]
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionLost(f"the daemon at {url} closed the connection during the handshake")
                data += chunk
                if len(data) > 65536:
                    raise ConnectionLost(f"expected an http upgrade reply from {url}, got {data[:80]!r}")
            head, _, rest = data.partition(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            try:
                status = int(status_line.split(" ", 2)[1])
            except (IndexError, ValueError):
                raise ConnectionLost(f"expected an http status line from {url}, got {status_line!r}") from None
            reply_headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                reply_headers[name.strip().lower()] = value.strip()
            if status in (401, 403):
                # The reason may follow the headers in a later segment: read what was announced.
                length = reply_headers.get("content-length", "0")
                want = min(int(length), 4096) if length.isdigit() else 0
                while len(rest) < want:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    rest += chunk
                body = rest.decode("utf-8", "replace").strip()
                raise Unauthorized(status, f"the daemon refused the connection (http {status}: {body or 'no reason'})")
            if status != 101:
                raise ConnectionLost(f"expected http 101 from {url}, got {status_line!r}")
            accept = binascii.b2a_base64(_sha1(key.encode() + _GUID), newline=False).decode()
            if reply_headers.get("sec-websocket-accept") != accept:
                raise ConnectionLost(f"the server at {url} answered with a bad Sec-WebSocket-Accept")
            return cls(sock, rest)
        except BaseException:
            sock.close()
            raise

    def send_text(self, text: str) -> None:
        self._send(0x1, text.encode("utf-8"))

    def _send(self, opcode: int, payload: bytes) -> None:
        try:
            self._sock.sendall(encode_frame(opcode, payload))
        except OSError as exc:
            self.close()
            raise ConnectionLost(f"lost the connection to the daemon while sending: {exc}") from exc

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            try:
                chunk = self._sock.recv(max(65536, n - len(self._buf)))
            except TimeoutError as exc:
                raise ConnectionLost("timed out waiting for the daemon") from exc
            except OSError as exc:
                self.close()
                raise ConnectionLost(f"lost the connection to the daemon: {exc}") from exc
            if not chunk:
                self.close()
                raise ConnectionLost("the daemon closed the connection")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def recv_text(self, timeout_s: float | None) -> str:
        """The next complete message (text, or binary decoded as UTF-8).

        Raises:
            ConnectionLost: closed, broken, or nothing within ``timeout_s``.
        """
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        self._sock.settimeout(timeout_s)
        parts: list[bytes] = []
        size = 0
        while True:
            b0, b1 = self._read(2)
            fin, opcode = b0 & 0x80, b0 & 0x0F
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._read(8))
            mask_key = self._read(4) if b1 & 0x80 else None
            if n > MAX_FRAME_BYTES or size + n > MAX_FRAME_BYTES:
                self.close()
                raise ConnectionLost(f"expected a frame of at most {MAX_FRAME_BYTES} bytes, got {n}")
            payload = self._read(n)
            if mask_key is not None:
                payload = _mask(payload, mask_key)
            if opcode == 0x8:  # close: answer it, then report
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                reason = payload[2:].decode("utf-8", "replace")
                try:
                    self._sock.sendall(encode_frame(0x8, payload[:2]))
                except OSError:
                    pass
                self.close()
                raise ConnectionLost(f"the daemon closed the connection ({code}{': ' + reason if reason else ''})")
            if opcode == 0x9:
                self._send(0xA, payload)
                continue
            if opcode == 0xA:
                continue
            if opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                size += n
                if fin:
                    return b"".join(parts).decode("utf-8", "replace")
                continue
            self.close()
            raise ConnectionLost(f"unexpected websocket opcode {opcode:#x} from the daemon")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._sock.settimeout(0.2)
            self._sock.sendall(encode_frame(0x8, struct.pack("!H", 1000)))
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
