"""A command's shell held at its gate, in a cgroup of its own: how every command starts.

``open_gated`` spawns ``/bin/sh`` in a new session, moved into a call cgroup of the
runner's pool (``subagent.callgroups``) while it waits at its gate, a line on its stdin;
``open_gate`` lets it run its command, or exit having run nothing (a stop came during the
spawn: ``commands.start_gated`` decides). Spawned without a ``preexec_fn``, so by
``vfork``. Sends no signal.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Final

import trio

from subagent import callgroups

__all__ = ["open_in_call", "open_gated", "open_gate"]

logger = logging.getLogger("subagent.tools.commands")  # its records are the commands'


async def open_in_call(argv: list[str], **options: Any) -> tuple[trio.Process, callgroups.Slot | None]:
    """``trio.lowlevel.open_process`` in a new session, then moved into a cgroup of its own
    when one can be had (``subagent.callgroups``): the process and that cgroup (None:
    found by group and marker alone).

    Only for a process that starts nothing before it is moved: a shell held at its gate
    (``open_gated``), which the runner lets go once the move is done, so that everything
    its command starts is born in the call's cgroup. Spawned without a ``preexec_fn``, so
    by ``vfork`` (``callgroups.move``: why).

    Raises:
        OSError, ValueError: it could not be started (a NUL in it, a lone surrogate; EAGAIN
            at the run's pids limit, the fork's or the thread's that would make it).
    """
    slot = callgroups.take()
    try:
        proc = await _open_process(argv, start_new_session=True, **options)
    except BaseException:
        if slot is not None:
            callgroups.give(slot)
        raise
    if slot is None:
        return proc, None
    try:
        try:
            await trio.to_thread.run_sync(callgroups.move, slot, proc.pid)
        except RuntimeError as exc:  # no thread to be had (the run at its pids limit)
            if "can't start new thread" not in str(exc):
                raise
            callgroups.move(slot, proc.pid)
    except OSError as exc:  # refused: the shell stays in the tree's cgroup, held at its gate
        logger.warning("command not moved into its cgroup %s (%s): it runs without one", slot.path, exc)
        callgroups.give(slot)
        return proc, None
    return proc, slot


async def _open_process(argv: list[str], **options: Any) -> trio.Process:
    """``trio.lowlevel.open_process``, whose fork runs in a worker thread: a thread that
    cannot be started (the run's tasks at its pids limit) is the fork's own ``EAGAIN``
    (the call fails, the run goes on), not a ``RuntimeError`` that failed the whole run
    'internal'."""
    try:
        return await trio.lowlevel.open_process(argv, **options)
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):
            raise
        raise OSError(errno.EAGAIN, f"{os.strerror(errno.EAGAIN)}: no thread to start it ({exc})") from exc


# A command's shell first waits at a gate (a line on its stdin, written by the runner),
# then runs the command with its stdin from /dev/null. A spawn takes tens of ms (a fork and
# an exec, in a thread), and a stop that came meanwhile found the command running: it did
# its work after the stop (27 of 150 stops in a probe). The runner opens the gate only if
# no stop was asked by the time the spawn returned; else the shell exits, having run nothing.
_GATED: Final = 'IFS= read -r _ || exit 125; exec </dev/null; exec /bin/sh -c "$0"'


async def open_gated(command: str, **options: Any) -> tuple[trio.Process, callgroups.Slot | None, int]:
    """``open_in_call`` of ``/bin/sh -c command``, held at its gate: the process, its cgroup,
    and the gate's descriptor for ``open_gate``. Every command goes through it.

    Raises:
        OSError, ValueError: it could not be started (a NUL in it, a lone surrogate).
    """
    read_end, gate = os.pipe2(os.O_CLOEXEC)
    try:
        proc, slot = await open_in_call(["/bin/sh", "-c", _GATED, command], stdin=read_end, **options)
    except BaseException:
        os.close(gate)
        raise
    finally:
        os.close(read_end)
    return proc, slot, gate


def open_gate(gate: int, go: bool) -> None:
    """Let the held command run (``go``), or let its shell exit without running it."""
    try:
        if go:
            os.write(gate, b"\n")
    except OSError:
        pass  # its shell is gone already (killed as it started): nothing of it ran
    finally:
        os.close(gate)
