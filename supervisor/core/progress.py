"""Splitting a runner's stderr into event lines. Pure: bytes in, values out.

A line longer than ``MAX_EVENT_LINE_BYTES`` is not an event: it is cut, reported once as
a ``BadLine`` and the rest of it up to the next newline is dropped. Garbage never raises.
"""

from __future__ import annotations

from subagent.events import MAX_EVENT_LINE_BYTES, BadLine, Event, decode_event_line

__all__ = ["LineSplitter"]

# How much of a bad line is kept for the record.
BAD_LINE_KEEP_CHARS = 2000


class LineSplitter:
    def __init__(self, max_line: int = MAX_EVENT_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_line
        self._skipping = False  # inside an overlong line, dropping until its newline

    def feed(self, data: bytes) -> list[Event | BadLine]:
        out: list[Event | BadLine] = []
        self._buf += data
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max:
                    if not self._skipping:
                        out.append(_overlong(bytes(self._buf[:BAD_LINE_KEEP_CHARS]), self._max))
                        self._skipping = True
                    self._buf.clear()
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if self._skipping:
                self._skipping = False
                continue
            if len(line) > self._max:
                out.append(_overlong(line[:BAD_LINE_KEEP_CHARS], self._max))
                continue
            if not line.strip():
                continue
            item = decode_event_line(line)
            if isinstance(item, BadLine) and len(item.text) > BAD_LINE_KEEP_CHARS:
                item = BadLine(text=item.text[:BAD_LINE_KEEP_CHARS], problem=item.problem)
            out.append(item)

    def close(self) -> list[Event | BadLine]:
        """The stream ended: whatever is left without a newline is one last line."""
        if self._skipping or not self._buf.strip():
            self._buf.clear()
            return []
        rest = bytes(self._buf)
        self._buf.clear()
        return self.feed(rest + b"\n")


def _overlong(head: bytes, limit: int) -> BadLine:
    return BadLine(
        text=head.decode("utf-8", errors="replace"),
        problem=f"line longer than {limit} bytes",
    )
