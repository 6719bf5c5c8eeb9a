"""Bounded draining of a child's pipe: a descendant holding it open cannot hang a run."""

from __future__ import annotations

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
    """Read ``stream`` into ``sink`` until EOF, or until ``after_exit_s`` after ``process`` exits.

    A descendant that inherited the pipe can hold it open long after the runner is gone;
    this bounds how long that can keep a run from ending. Closes the stream when cut.
    An exception from ``sink`` propagates as itself (not in an ExceptionGroup).

    Returns:
        True if EOF was reached, False if reading was cut off after the bound.
    """
    eof = False
    failure: Exception | None = None
    read_scope = trio.CancelScope()

    async def cut() -> None:
        await process.wait()
        await trio.sleep(after_exit_s)
        read_scope.cancel(reason=f"pipe still open {after_exit_s} s after the process exited")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut)
        with read_scope:
            try:
                while chunk := await stream.receive_some():
                    await sink(bytes(chunk))
                eof = True
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                eof = True
            except Exception as exc:  # the sink's own error: re-raised below, not in a group
                failure = exc
        nursery.cancel_scope.cancel(reason="draining is over")
    if failure is not None:
        raise failure
    if not eof:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    return eof
