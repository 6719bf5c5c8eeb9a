"""Splitting a runner's stderr into event lines, and when a run's partial result is
checkpointed. Pure: bytes in, values out.

A line longer than ``MAX_EVENT_LINE_BYTES`` is not an event: it is cut, reported once as
a ``BadLine`` and the rest of it up to the next newline is dropped. Garbage never raises.

A run's partial result (its ``step_snapshot`` deltas folded) is journaled whole only as a
checkpoint (``checkpoint_due``), once the deltas journaled since the last one are about
as big as it was (and at least ``CHECKPOINT_MIN_BYTES``): the checkpoints' bytes stay
within about those of the deltas, so what a run writes for its partial result grows with
its length, not with its square, and a reader (``supervisor.store``) folds at most about
a checkpoint's worth of deltas after the last one. Its end stores it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from subagent.events import MAX_EVENT_LINE_BYTES, BadLine, Event, decode_event_line

__all__ = ["LineSplitter", "checkpoint_due", "CHECKPOINT_MIN_BYTES"]

# Deltas since the last checkpoint below this many bytes never make a new one.
CHECKPOINT_MIN_BYTES: Final = 64 * 1024
# What one record or one event adds beyond its long strings (an estimate, in bytes).
_RECORD_BYTES: Final = 300
_EVENT_BYTES: Final = 120


def _size(progress: Any, records: Any) -> int:
    """About how many bytes a snapshot (or a delta) of this text and these records takes:
    their long strings and a share for each record (no encoding: cheap per event)."""
    n = len(progress) if isinstance(progress, str) else 0
    for rec in records if isinstance(records, list) else []:
        if isinstance(rec, Mapping):
            n += _RECORD_BYTES
            for key in ("output", "arguments", "error"):
                v = rec.get(key)
                n += len(v) if isinstance(v, str) else 0
    return n


def checkpoint_due(run: Any, delta: Mapping[str, Any], whole: dict[str, Any]) -> dict[str, Any] | None:
    """``whole`` if the run's partial result, just folded from ``delta``, is due to be
    journaled as a checkpoint, else None. Keeps the count on ``run`` (its
    ``partial_since``, ``partial_checkpoint``)."""
    run.partial_since += _EVENT_BYTES + _size(
        delta.get("progress_added", delta.get("progress")), delta.get("tool_calls_changed", delta.get("tool_calls"))
    )
    if run.partial_since < max(CHECKPOINT_MIN_BYTES, run.partial_checkpoint):
        return None
    run.partial_since = 0
    run.partial_checkpoint = _size(whole.get("progress"), whole.get("tool_calls"))
    return whole


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
