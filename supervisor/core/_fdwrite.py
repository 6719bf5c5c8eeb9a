"""One line into a runner's input, whole, bounded: ``write_whole``.

A fact the daemon journals before it writes it to a runner (an approval's answer into
its channel, a steer into its stdin) must then be written or said unsent, whatever else
comes: the caller shields the write, so it is bounded here, and it says how many bytes
went in (a line cut short is not the line; one cut only before its last newline is whole
JSON, which its reader takes at the next newline or EOF). Writers that share a channel
share a lock, held only to write: a wait for room while none of the line is in is made
without it, so one writer stuck behind a reader that does not read holds no other.
"""

from __future__ import annotations

import contextlib
import os

import trio

__all__ = ["write_whole"]


async def write_whole(
    fd: int,
    data: bytes,
    *,
    timeout_s: float,
    late: str,
    lock: trio.Lock | None = None,
    give_up: tuple[trio.Event, str] | None = None,
) -> tuple[int, str | None]:
    """Write ``data`` into the non-blocking ``fd``, waiting for room ``timeout_s`` at most
    (its reader reads at once); how many bytes went in, and why not all (None: all; ``late``
    when the time ran out; else the write's error, in words for a reader gone).

    ``lock``: the channel's writers' (no other line between a line's parts): taken to
    write, and let go while the channel has no room and none of ``data`` is in yet.
    ``give_up``: (an event, why): while none of ``data`` is in, the wait for room ends when
    the event is set, and nothing is written (0, why); once part of it is in, it is not."""
    done = 0
    with trio.move_on_after(timeout_s):
        while True:
            async with lock if lock is not None else contextlib.nullcontext():
                while done < len(data):
                    try:
                        done += os.write(fd, data[done:])
                    except BlockingIOError:
                        if lock is not None and done == 0:
                            break  # no room, nothing of it in: wait without the lock
                        if done == 0 and give_up is not None and await _room_or(fd, give_up[0]):
                            return 0, give_up[1]
                        await trio.lowlevel.wait_writable(fd)
                    except BrokenPipeError:
                        return done, "the runner closed its end (its run is ending)"
                    except OSError as exc:
                        return done, str(exc)
                else:
                    return done, None
            if give_up is not None and await _room_or(fd, give_up[0]):
                return 0, give_up[1]
            await trio.lowlevel.wait_writable(fd)
    return done, late


async def _room_or(fd: int, event: trio.Event) -> bool:
    """Wait until ``fd`` has room or ``event`` is set; True if the event came (first)."""
    if event.is_set():
        return True
    gave_up = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal gave_up
            await event.wait()
            gave_up = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        await trio.lowlevel.wait_writable(fd)
        nursery.cancel_scope.cancel()
    return gave_up
