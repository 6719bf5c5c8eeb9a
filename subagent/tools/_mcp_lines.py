"""An MCP server's stdout, handed to the SDK a whole line at a time.

The SDK's stdio reader joins its pending text with each chunk it reads
(``lines = (buffer + chunk).split("\\n")``), so a line that arrives in many 64 KiB reads
is copied again at each read: quadratic in the line's length. A 16 MiB answer (a page's
text, a screenshot) cost the runner ~9 s of CPU, and a 32 MiB one did not finish. Here
the chunks are gathered until a line ends, and the SDK gets every complete line of what
was read in one chunk: linear.

A line over ``MAX_LINE_BYTES`` is not gathered: it is dropped up to its end and the SDK
gets a short line in its place, which is not JSON-RPC, so the session reports a protocol
error (``subagent.tools.mcp_tools``): the call in flight ends at once with that error.

Invariants: no ``mcp`` import; no waiting beyond the wrapped stream's own; everything
but ``stdout`` is the wrapped process's.
"""

from __future__ import annotations

import signal
from typing import Final

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

__all__ = ["MAX_LINE_BYTES", "WholeLines", "WholeLinesProcess"]

# The longest line (one JSON-RPC message) a server may send; past it the line is dropped.
MAX_LINE_BYTES: Final = 64 * 1024 * 1024


def dropped_line(size: int) -> bytes:
    """What the SDK reads in place of a line over the bound (not JSON: a protocol error)."""
    return f"agentd dropped a message of over {size} bytes from this server (the bound)\n".encode()


class WholeLines(ByteReceiveStream):
    """``inner``'s bytes in chunks that end where a line ends (or at EOF)."""

    def __init__(self, inner: ByteReceiveStream, max_line: int = MAX_LINE_BYTES) -> None:
        self._inner = inner
        self._max_line = max_line
        self._pending = bytearray()  # the start of a line not ended yet
        self._dropping = False  # inside a line over the bound: dropped up to its end

    async def receive(self, max_bytes: int = 65536) -> bytes:
        # ``max_bytes`` bounds each read of the pipe, not what is returned: a line is whole.
        head = b""  # in place of a line over the bound that ended in this chunk
        while True:
            try:
                chunk = await self._inner.receive(max_bytes)
            except anyio.EndOfStream:
                if self._dropping:  # the stream ended inside a line over the bound
                    head += dropped_line(self._max_line)
                    self._dropping = False
                if head or self._pending:
                    out = head + bytes(self._pending)  # then a last line without its newline
                    self._pending.clear()
                    return out
                raise
            if self._dropping:
                first = chunk.find(b"\n")
                if first < 0:
                    continue
                self._dropping = False
                head, chunk = dropped_line(self._max_line), chunk[first + 1 :]
            end = chunk.rfind(b"\n")  # only the new bytes are searched: linear
            if end < 0:
                self._pending += chunk
                if len(self._pending) > self._max_line:
                    self._pending.clear()
                    self._dropping = True
                if head:
                    return head
                continue
            out = bytes(self._pending) + chunk[: end + 1] if self._pending else chunk[: end + 1]
            self._pending[:] = chunk[end + 1 :]
            if len(out) > self._max_line:  # rare: then split once, still linear
                out = b"".join(
                    dropped_line(self._max_line) if len(line) > self._max_line else line + b"\n"
                    for line in out.split(b"\n")[:-1]
                )
            return head + out

    async def aclose(self) -> None:
        await self._inner.aclose()


class WholeLinesProcess(Process):
    """``process`` with its stdout read through ``WholeLines``; everything else is its own."""

    def __init__(self, process: Process, max_line: int | None = None) -> None:
        self._process = process
        assert process.stdout is not None, "an MCP server is spawned with a stdout pipe"
        self._stdout = WholeLines(process.stdout, MAX_LINE_BYTES if max_line is None else max_line)

    async def aclose(self) -> None:
        await self._process.aclose()

    async def wait(self) -> int:
        return await self._process.wait()

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, signal: signal.Signals) -> None:
        self._process.send_signal(signal)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    @property
    def stdin(self) -> ByteSendStream | None:
        return self._process.stdin

    @property
    def stdout(self) -> ByteReceiveStream:
        return self._stdout

    @property
    def stderr(self) -> ByteReceiveStream | None:
        return self._process.stderr
