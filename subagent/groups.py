"""Ending the process groups the runner created, for sure and in bounded time.

One escalation routine for every group (commands, MCP servers): SIGTERM the group, poll
until no live member is left or the grace ends, SIGKILL, wait a bounded time, then give
up loudly. The pgid is the pid recorded at spawn (``start_new_session``), never
``getpgid`` later. A group counts as gone when ``killpg(pgid, 0)`` says ESRCH or when
every member left is a zombie (orphans may wait for PID 1 to reap them). EPERM counts as
"maybe alive". ``sweep_marked`` ends escapers (``setsid``, double fork) that still carry
the marker variable the runner put in their environment. Linux ``/proc`` is used where
present; elsewhere the probe falls back to ``killpg`` alone.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Final

import trio

__all__ = ["group_alive", "terminate_group", "sweep_marked", "GROUP_TERM_GRACE_S", "GROUP_KILL_REAP_S"]

logger = logging.getLogger(__name__)

# How long a group gets between SIGTERM and SIGKILL (seconds).
GROUP_TERM_GRACE_S: Final = 2.0
# How long we wait after SIGKILL for the group to disappear before giving up (seconds).
GROUP_KILL_REAP_S: Final = 2.0
# Probe interval while waiting for a group to die (seconds).
GROUP_POLL_S: Final = 0.01

_PROC = "/proc"


def _members(pgid: int) -> list[tuple[int, str]] | None:
    """(pid, state) of the processes in the group, or None when /proc is unavailable."""
    if not os.path.isdir(_PROC):
        return None
    out: list[tuple[int, str]] = []
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"{_PROC}/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        # comm may contain spaces and parens: the fields start after the last ')'.
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and rest[2] == str(pgid):
            out.append((int(name), rest[0]))
    return out


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie member of the group is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    members = _members(pgid)
    if members is None:
        return True
    return any(state != "Z" for _, state in members)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.warning("no permission to signal some of process group %d", pgid)
    return True


async def _wait_gone(pgid: int, timeout_s: float) -> bool:
    with trio.move_on_after(timeout_s):
        while group_alive(pgid):
            await trio.sleep(GROUP_POLL_S)
        return True
    return False


async def terminate_group(
    pgid: int,
    *,
    grace_s: float = GROUP_TERM_GRACE_S,
    reap_s: float = GROUP_KILL_REAP_S,
    what: str = "process group",
) -> bool:
    """End a whole process group: SIGTERM, grace, SIGKILL, bounded reap.

    Safe to call on a group that is already gone, and under a cancelled scope (every wait
    is shielded and bounded). Returns whether the group is gone.
    """
    with trio.CancelScope(shield=True):
        if not group_alive(pgid):
            return True
        _signal_group(pgid, signal.SIGTERM)
        if await _wait_gone(pgid, grace_s):
            return True
        logger.warning("%s %d still running %.1f s after SIGTERM; sending SIGKILL", what, pgid, grace_s)
        _signal_group(pgid, signal.SIGKILL)
        if await _wait_gone(pgid, reap_s):
            return True
        logger.warning("%s %d is still alive after SIGKILL; abandoning it", what, pgid)
        return False


def _marked_pids(var: str, value: str) -> list[int]:
    if not os.path.isdir(_PROC):
        return []
    needle = f"{var}={value}".encode() + b"\0"
    me = os.getpid()
    found = []
    for name in os.listdir(_PROC):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"{_PROC}/{name}/environ", "rb") as f:
                env = f.read() + b"\0"
            with open(f"{_PROC}/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        if needle in env and stat[stat.rfind(")") + 2 :].split()[:1] != ["Z"]:
            found.append(int(name))
    return found


async def sweep_marked(var: str, value: str, *, grace_s: float = GROUP_TERM_GRACE_S) -> list[int]:
    """SIGTERM then SIGKILL every live process whose environment holds ``var=value``.

    Returns the pids that were still alive at the end (normally none).
    """
    with trio.CancelScope(shield=True):
        pids = _marked_pids(var, value)
        if not pids:
            return []
        logger.warning("ending %d escaped process(es) marked %s=%s: %s", len(pids), var, value, pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        with trio.move_on_after(grace_s):
            while _marked_pids(var, value):
                await trio.sleep(GROUP_POLL_S * 5)
            return []
        for pid in _marked_pids(var, value):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        with trio.move_on_after(GROUP_KILL_REAP_S):
            while left := _marked_pids(var, value):
                await trio.sleep(GROUP_POLL_S * 5)
            return []
        return left
