"""A model's text while it streams: when the loop sends what has come so far.

Invariants: the text so far goes out (``send``) at most every ``STREAM_SNAPSHOT_EVERY_S``,
the first time that long after the request began, or sooner once
``STREAM_SNAPSHOT_MAX_CHARS`` wait; what is held back goes out when its time comes, by a
task that lives only as long as the request; a stop cancels the request and that task
together (nothing here waits on the stop path); the provider's own exception leaves
``play`` as itself, never wrapped in a nursery's group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from subagent.events import STREAM_SNAPSHOT_EVERY_S, STREAM_SNAPSHOT_MAX_CHARS
from subagent.model.provider import TurnAssembler

__all__ = ["TextStream"]


class TextStream:
    """Shows a step's model text while it streams: the text so far goes out as a snapshot
    (``send``: ``AgentLoop.stream_snapshot``) at most every ``STREAM_SNAPSHOT_EVERY_S``, the first
    that long after the request began (a turn that streams faster sends none: its step's
    own snapshot carries it), or sooner once ``STREAM_SNAPSHOT_MAX_CHARS`` wait. Text held
    back goes out when its time comes, by a task that sleeps until then (a model that
    streams a burst then goes quiet still shows it). A stop cancels that task with the
    request: nothing here waits on the stop path."""

    def __init__(self, sink: TurnAssembler, send: Callable[[str], None]) -> None:
        self._send_text = send
        self._sink = sink
        self._sent_chars = 0
        self._last = 0.0  # trio clock: the request's start, then the last send
        self._held = trio.Event()
        self.sent = False  # some text went out while it streamed
        sink.on_text = self._arrived

    async def play(
        self,
        stream_turn: Callable[[list[dict[str, Any]], list[dict[str, Any]], TurnAssembler], Awaitable[None]],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> None:
        self._last = trio.current_time()
        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flusher)
            try:
                await stream_turn(messages, tools, self._sink)
            except Exception as exc:  # raised as itself, not in the nursery's group
                failed = exc
            finally:
                nursery.cancel_scope.cancel()
                self._sink.on_text = None
        if failed is not None:
            raise failed

    def _arrived(self) -> None:
        waiting = self._sink.text_chars - self._sent_chars
        if waiting >= STREAM_SNAPSHOT_MAX_CHARS or trio.current_time() - self._last >= STREAM_SNAPSHOT_EVERY_S:
            self._send()
        else:
            self._held.set()

    async def _flusher(self) -> None:
        while True:
            await self._held.wait()
            self._held = trio.Event()
            await trio.sleep_until(self._last + STREAM_SNAPSHOT_EVERY_S)
            self._send()

    def _send(self) -> None:
        if self._sink.text_chars <= self._sent_chars:
            return
        self._sent_chars = self._sink.text_chars
        self._last = trio.current_time()
        self.sent = True
        self._send_text(self._sink.text_so_far())
