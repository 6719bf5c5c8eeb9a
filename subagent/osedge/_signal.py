"""Signals that reach exactly the process meant: pidfds checked against start times.

A pid is recycled, so a process is signalled through a pidfd opened *after* its start
time was read again and found unchanged: once the pidfd is open, it names that process
for good, whoever takes the pid later. A group is signalled by number (``killpg``): the
caller checks that the group is still the one it learned (``ProcessTable.live_groups``).
Never signalled: group 0 or 1, the caller's own group or session, a cgroup holding the
caller. Every outcome is a ``Delivery`` value, never an exception. A SIGTERM is followed
by a SIGCONT (a stopped process acts on it); ``resume_stopped`` sends the SIGCONT alone, to
a set about to be closed by others' code (an SDK's bounded waits) that a stop would stall.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Final

from subagent.osedge._kernel import Proc, ProcessId
from subagent.osedge._table import ProcessTable, Targets

__all__ = [
    "Delivery",
    "signal_process",
    "signal_group",
    "group_exists",
    "kill_cgroup",
    "signal_unseen",
    "open_pidfd",
    "resume_stopped",
]

logger = logging.getLogger(__name__)

# A SIGTERM is followed by a SIGCONT, as kill(1) and systemd do: a stopped process (SIGSTOP)
# that handles SIGTERM, a runner, would otherwise sit on it until the grace ran out.
_SIGTERM: Final = int(getattr(signal, "SIGTERM", 15))
_SIGCONT: Final = int(getattr(signal, "SIGCONT", 18))


class Delivery(enum.StrEnum):
    """What became of one signal."""

    SENT = "sent"
    GONE = "gone"  # no such process, group or cgroup (ESRCH, ENOENT)
    EPERM = "eperm"  # not ours to signal: maybe alive
    REFUSED = "refused"  # never signalled (0, 1, the caller's own)
    ERROR = "error"  # another failure (logged)


def open_pidfd(table: ProcessTable, ident: ProcessId | Proc) -> int | None:
    """A pidfd on exactly this process, or None if it is gone (or its pid reused).

    Raises:
        OSError: pidfds are not supported here (callers fall back to polling).
    """
    kernel = table.kernel
    try:
        fd = kernel.pidfd_open(ident.pid)
    except ProcessLookupError:
        return None
    if table.same(ident.pid, ident.start_ticks) is None:
        kernel.close(fd)  # the pid names another process now
        return None
    return fd


def signal_process(table: ProcessTable, ident: ProcessId | Proc, sig: int) -> Delivery:
    """Signal exactly the process ``ident`` names, never a later owner of its pid."""
    kernel = table.kernel
    if ident.pid <= 1 or ident.pid == kernel.own_ids()[0]:
        return Delivery.REFUSED
    try:
        fd = open_pidfd(table, ident)
    except OSError:  # no pidfd support: check, then signal by pid (a tiny window remains)
        if table.same(ident.pid, ident.start_ticks) is None:
            return Delivery.GONE
        try:
            kernel.kill(ident.pid, sig)
        except ProcessLookupError:
            return Delivery.GONE
        except PermissionError:
            return Delivery.EPERM
        if sig == _SIGTERM:
            _quietly(kernel.kill, ident.pid, _SIGCONT)
        return Delivery.SENT
    if fd is None:
        return Delivery.GONE
    try:
        kernel.pidfd_send_signal(fd, sig)
        if sig == _SIGTERM:
            _quietly(kernel.pidfd_send_signal, fd, _SIGCONT)
    except ProcessLookupError:
        return Delivery.GONE
    except PermissionError:
        return Delivery.EPERM
    except OSError as exc:
        logger.warning("pid %d: signal %d failed: %s", ident.pid, sig, exc)
        return Delivery.ERROR
    finally:
        kernel.close(fd)
    return Delivery.SENT


def signal_group(table: ProcessTable, pgid: int, sig: int) -> Delivery:
    """``killpg``; refused for 0, 1 and the caller's own group or session."""
    _pid, my_pgid, my_sid = table.kernel.own_ids()
    if pgid <= 1 or pgid in (my_pgid, my_sid):
        return Delivery.REFUSED
    try:
        table.kernel.killpg(pgid, sig)
        if sig == _SIGTERM:
            _quietly(table.kernel.killpg, pgid, _SIGCONT)
    except ProcessLookupError:
        return Delivery.GONE
    except PermissionError:
        return Delivery.EPERM
    except OSError as exc:
        logger.warning("group %d: signal %d failed: %s", pgid, sig, exc)
        return Delivery.ERROR
    return Delivery.SENT


def group_exists(table: ProcessTable, pgid: int) -> bool:
    """``killpg(pgid, 0)``: does any process (a zombie too) have this group? EPERM: yes."""
    try:
        table.kernel.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def kill_cgroup(table: ProcessTable, path: Path, sig: int = 9, *, fd: int | None = None) -> Delivery:
    """SIGKILL every process in a cgroup and below it, forks in flight included.

    ``cgroup.kill`` where the kernel has it (5.14+), through ``fd`` if given (its
    ``cgroup.kill`` opened earlier: a sandboxed runner may not open it by path); else each
    process by pidfd. Refused for a cgroup that holds the caller.
    """
    kernel = table.kernel
    try:
        if kernel.own_ids()[0] in kernel.cgroup_pids(path):
            return Delivery.REFUSED
        if fd is not None:
            os.write(fd, b"1")
        else:
            kernel.cgroup_kill(path)
    except FileNotFoundError:
        if not path.exists():
            return Delivery.GONE
        for pid in kernel.cgroup_pids(path):  # kernel < 5.14
            p = table.read(pid)
            if p is not None:
                signal_process(table, p, sig)
    except OSError as exc:
        logger.warning("cgroup %s: cgroup.kill failed: %s", path, exc)
        return Delivery.ERROR
    return Delivery.SENT


def signal_unseen(table: ProcessTable, path: Path, sig: int) -> dict[int, Delivery]:
    """Signal each process of the cgroup ``path`` that the table cannot read, by pidfd.

    ``cgroup.procs`` lists every process of a cgroup; a ``hidepid=invisible`` /proc (a
    sandboxed runner's) lists none its reader may not ptrace-read (a non-dumpable one:
    ssh-agent, gpg-agent), so no start time proves its pid. The pidfd, opened on the pid
    first, is used only if the pid is still in the cgroup once it is open: the process it
    names either is that one, or it is dead (a pid is reused only once its holder is
    reaped) and the signal finds nothing. Never the caller or pid 1.

    Returns:
        What became of each signal, by pid (none: the table reads every process there).
    """
    kernel = table.kernel
    me = kernel.own_ids()[0]
    out: dict[int, Delivery] = {}
    try:
        listed = kernel.cgroup_pids(path)
    except OSError:
        return out
    for pid in sorted(listed - {0, 1, me}):
        if table.read(pid) is not None:  # in sight: a member, signalled as one
            continue
        try:
            fd = kernel.pidfd_open(pid)
        except ProcessLookupError:
            out[pid] = Delivery.GONE
            continue
        except OSError as exc:  # no pidfds: no proof of identity, no signal
            logger.debug("cgroup %s: pid %d out of sight, no pidfd: %s", path, pid, exc)
            out[pid] = Delivery.ERROR
            continue
        try:
            if pid not in kernel.cgroup_pids(path):
                out[pid] = Delivery.GONE
                continue
            kernel.pidfd_send_signal(fd, sig)
            if sig == _SIGTERM:
                _quietly(kernel.pidfd_send_signal, fd, _SIGCONT)
            out[pid] = Delivery.SENT
        except ProcessLookupError:
            out[pid] = Delivery.GONE
        except PermissionError:
            out[pid] = Delivery.EPERM
        except OSError as exc:
            logger.warning("pid %d: signal %d failed: %s", pid, sig, exc)
            out[pid] = Delivery.ERROR
        finally:
            kernel.close(fd)
    return out


def resume_stopped(targets: Targets, table: ProcessTable | None = None) -> list[int]:
    """SIGCONT every member of ``targets`` that is stopped (state ``T``: SIGSTOP, SIGTSTP),
    each by pidfd; a running one is left alone (a SIGCONT would be harmless to it anyway).

    For a set about to be closed by code that waits on it (the MCP SDK's close of a server:
    stdin closed, 2 s for its exit, SIGTERM, 2 s more, then SIGKILL): a stopped process acts
    on neither, and each wait ran out (a stop took 4 s more). Blocking (a read of the table).

    Returns:
        The pids resumed.
    """
    table = ProcessTable() if table is None else table
    return sorted(
        p.pid
        for p in table.members(targets).values()
        if p.state in ("T", "t") and signal_process(table, p, _SIGCONT) == Delivery.SENT
    )


def _quietly(send: Callable[[int, int], None], target: int, sig: int) -> None:
    """A follow-up signal (SIGCONT): the target may be gone by now; that is no failure."""
    try:
        send(target, sig)
    except OSError:
        pass
