"""``run_trio``: ``trio.run`` whose closing never sends a signal to a closed socket.

Trio points CPython's signal wake-up fd at a socket of its own while it runs. When the run
ends, Trio closes that socket first and restores the previous wake-up fd after: a signal
with a Python handler that lands in between (a child's SIGCHLD as the daemon, a runner or
a test ends) makes CPython write to the closed descriptor and report an unraisable
``OSError: [Errno 9]`` ("Exception ignored when trying to write to the signal wake-up
fd"). In a process that opens descriptors after the run, the same number may already name
another file. The daemon and the runner handle SIGCHLD, SIGTERM and SIGINT in Python, so
every one of their runs goes through here.

The fix is an instrument: once the run's root task has exited (everything of the caller
has ended, system tasks included), the wake-up fd is set to none, before Trio closes its
socket. A signal after that is still dispatched to its Python handler, only no longer
written anywhere. Nothing is left to wake in that run.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import trio

__all__ = ["run_trio"]

T = TypeVar("T")


def run_trio(
    async_fn: Callable[..., Awaitable[T]],
    *args: Any,
    clock: trio.abc.Clock | None = None,
    instruments: Sequence[trio.abc.Instrument] = (),
    **kwargs: Any,
) -> T:
    """``trio.run(async_fn, *args, ...)`` with the wake-up fd released before Trio closes it."""
    import trio

    return trio.run(async_fn, *args, clock=clock, instruments=[*instruments, _release_instrument()], **kwargs)


def _release_instrument() -> trio.abc.Instrument:
    import trio

    class ReleaseWakeupFd(trio.abc.Instrument):
        def task_exited(self, task: trio.lowlevel.Task) -> None:
            if task is trio.lowlevel.current_root_task() and threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(-1)

    return ReleaseWakeupFd()
