"""Bounded draining of a child's pipe: a descendant holding it open cannot hang a run."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

import trio

__all__ = ["DRAIN_AFTER_EXIT_S", "drain_bounded"]

# After the runner exits, how long its pipes are still read: a descendant may hold them.
DRAIN_AFTER_EXIT_S: Final = 2.0


class _Exits(Protocol):
    async def wait(self) -> object: ...


async def drain_bounded(
    stream: trio.abc.ReceiveStream,
    sink: Callable[[bytes], Awaitable[object]],
    *,
    process: _Exits,
    after_exit_s: float = DRAIN_AFTER_EXIT_S,
) -> bool:
    """Read ``stream`` into ``sink`` until EOF, or until it stays silent ``after_exit_s``
    after ``process`` exited.

    A descendant that inherited the pipe can hold it open long after the runner is gone;
    this bounds how long that can keep a run from ending. Only a *silent* pipe is cut:
    data still arriving, and a ``sink`` still busy with what was read (journaling it on a
    loaded machine), are never cut short, so no event the runner wrote is dropped.
    Closes the stream when cut. An exception from ``sink`` propagates as itself.

    Returns:
        True if EOF was reached, False if reading was cut off after the bound.
    """
    exited = False
    reading: trio.CancelScope | None = None

    async def watch_exit() -> None:
        nonlocal exited
        await process.wait()
        exited = True
        if reading is not None:
            reading.deadline = trio.current_time() + after_exit_s

    eof = False
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_exit)
        while True:
            scope = trio.CancelScope(deadline=trio.current_time() + after_exit_s if exited else math.inf)
            reading = scope
            with scope:
                try:
                    chunk = await stream.receive_some()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    chunk = b""
            reading = None
            if scope.cancelled_caught:
                break  # silent for after_exit_s since the exit: cut
            if not chunk:
                eof = True
                break
            try:
                await sink(bytes(chunk))
            except Exception as exc:  # the sink's own error: re-raised below, not in a group
                failure = exc
                break
        nursery.cancel_scope.cancel(reason="draining is over")
    if failure is not None:
        raise failure
    if not eof:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    return eof
