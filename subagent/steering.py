"""Steering: extra user input for a running run, on stdin after the spec.

Each later stdin line ``{"steer": "text"}`` is queued (``steering`` event, state
``queued``) and applied at the next step boundary as a user message (state ``applied``).
Invariants (DESIGN "Steering"): the queue is separate from cancel: queued input is never a
reason to keep going after a stop; input never applied when the run ends is reported
(state ``unapplied``, and the result's ``unapplied_steering``), never silently dropped.
A bad line is a ``log`` warning and is otherwise ignored; EOF just ends the reader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import trio

__all__ = ["SteeringQueue", "read_steering", "MAX_STEER_LINE_BYTES"]

# A longer stdin line is not steering (bytes).
MAX_STEER_LINE_BYTES: Final = 256 * 1024


@dataclass
class SteeringQueue:
    emit: Callable[..., None]  # emit(state=..., text=..., step=...)
    pending: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)

    def push(self, text: str, step: int) -> None:
        self.pending.append(text)
        self.emit(state="queued", text=text, step=step)

    def take(self, step: int) -> list[str]:
        """Everything queued, now applied at ``step``."""
        taken, self.pending = self.pending, []
        for text in taken:
            self.applied.append(text)
            self.emit(state="applied", text=text, step=step)
        return taken

    def unapplied(self, step: int) -> list[str]:
        """The run ends: what was never applied is reported, once."""
        left, self.pending = self.pending, []
        for text in left:
            self.emit(state="unapplied", text=text, step=step)
        return left


def parse_steer_line(line: bytes) -> str | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    steer = obj.get("steer") if isinstance(obj, dict) else None
    return steer if isinstance(steer, str) and steer.strip() else None


async def read_steering(
    leftover: bytes, queue: SteeringQueue, current_step: Callable[[], int], warn: Callable[[str], None], *, fd: int = 0
) -> None:
    """Read steering lines from stdin (after the spec) until EOF. Runs as a task."""
    buf = bytearray(leftover)
    try:
        stream: Any = trio.lowlevel.FdStream(os.dup(fd))
    except OSError:
        return  # no stdin at all: nothing to steer with
    async with stream:
        while True:
            while b"\n" in buf:
                line, _, rest = bytes(buf).partition(b"\n")
                buf = bytearray(rest)
                if line.strip():
                    text = parse_steer_line(line)
                    if text is None:
                        warn(f'ignored a stdin line that is not {{"steer": text}}: {line[:200]!r}')
                    else:
                        queue.push(text, current_step())
            if len(buf) > MAX_STEER_LINE_BYTES:
                warn("ignored an over-long stdin line")
                buf.clear()
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                if bytes(buf).strip():
                    buf += b"\n"
                    continue
                return
            buf += data
