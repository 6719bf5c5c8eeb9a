"""Reaping what a subreaper adopts: which zombie child is provably not the daemon's own,
which live one no tree claims, and the events that wake the reaper.

Helpers of ``supervisor.trees.containment`` (its ``Containment`` owns the state: trees,
leaders, what was seen adopted). Trio (and any Popen in the daemon) waits for its own
children by pid; a ``waitpid(-1)`` would take their exit codes, so only a zombie child
that provably was not forked by the daemon is ever reaped here.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Container, Mapping

import trio

from subagent.osedge import Proc, ProcessTable, Watch, parse_var
from supervisor.trees._handles import HOST_VAR, MARKER_VAR

__all__ = ["mark_host", "scrubbed_orphan", "reap_adopted_zombies", "in_settled_tree", "Wakeup", "open_sigchld"]


def mark_host(table: ProcessTable) -> str:
    """Put this process's identity in its environment, for whatever it forks from now on."""
    me = table.read(os.getpid())
    identity = f"{os.getpid()}:{me.start_ticks if me is not None else 0}"
    os.environ[HOST_VAR] = identity
    return identity


def scrubbed_orphan(table: ProcessTable, p: Proc, identity: str) -> bool:
    """Has this child of ours an environment that is neither a tree's nor ours?

    Not one whose environment cannot be read. (Callers leave out one that started less
    than ``SETTLED_S`` ago: for an instant around exec an environment reads empty.)
    """
    env = table.kernel.environ(p.pid)
    if env is None:
        return False
    return parse_var(env, MARKER_VAR) is None and parse_var(env, HOST_VAR) != identity


def reap_adopted_zombies(
    table: ProcessTable,
    *,
    seen: Mapping[int, int] | None = None,
    exclude: Container[int] = (),
    subtree: str | None = None,
    settled: Container[str] = (),
    procs: Mapping[int, Proc] | None = None,
) -> list[int]:
    """Reap zombie children of this process that provably were not forked by it.

    Provably adopted: ``seen`` (pid -> start ticks, recorded while it ran as a tree
    member), or born in another session, or in the cgroup subtree ``subtree``
    ("/a/b/"), in the cgroup of a ``settled`` tree (one whose leader is known: while a
    tree is being spawned, a zombie in its cgroup may be the leader Trio has not been told
    about yet), or in the cgroup of a tree since removed (``in_removed_tree``). ``exclude``
    holds pids never to touch (Trio's unreaped tree leaders).
    """
    if procs is None:
        procs = table.scan()
    me, _pgid, my_sid = table.kernel.own_ids()
    reaped: list[int] = []
    for p in procs.values():
        if p.ppid != me or not p.dead or p.pid in exclude:
            continue
        if not (
            (seen is not None and seen.get(p.pid) == p.start_ticks)
            or p.sid not in (my_sid, p.pid)
            or in_settled_tree(table, p.pid, subtree, settled)
            or in_removed_tree(table, p.pid, subtree)
        ):
            continue
        if table.kernel.reap(p.pid):
            reaped.append(p.pid)
    return reaped


def in_removed_tree(table: ProcessTable, pid: int, subtree: str | None) -> bool:
    """Did ``pid`` die in a tree cgroup (below ``subtree``) that has since been removed?

    A tree's cgroup is removed once the tree is over, its leader reaped (an unreaped one
    is in ``exclude``): a zombie left there is an adopted escaper, never a child Trio
    waits for. (A setsid escaper the runner killed before the stop's scan saw it leads its
    own session and was never seen alive: no other rule tells it from Trio's children, and
    it stayed a zombie of the daemon for good.)
    """
    if subtree is None:
        return False
    path = table.kernel.cgroup(pid) or ""
    return path.startswith(subtree) and path.endswith(" (deleted)")


def in_settled_tree(table: ProcessTable, pid: int, subtree: str | None, settled: Container[str]) -> bool:
    """Is ``pid`` in the cgroup (below ``subtree``) of a tree in ``settled``?"""
    if subtree is None:
        return False
    path = table.kernel.cgroup(pid) or ""
    if not path.startswith(subtree):
        return False
    return path[len(subtree) :].split("/", 1)[0] in settled


# ----------------------------------------------------------------------------- Containment


class Wakeup:
    """Wakes the reaper: set by its event sources, waited for with a timeout."""

    def __init__(self) -> None:
        self._event = trio.Event()

    async def wait(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            await self._event.wait()
        self._event = trio.Event()

    async def on_signals(self, signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            self._event.set()

    async def on_readable(self, watch: Watch) -> None:
        while True:
            await trio.lowlevel.wait_readable(watch.fd)
            watch.drain()
            self._event.set()


def open_sigchld(stack: contextlib.ExitStack) -> AsyncIterator[int] | None:
    """A Trio receiver of SIGCHLD (a child of ours exited, adopted ones included), or None
    outside the main thread. Its handler restarts interrupted syscalls (SA_RESTART): the
    daemon's other threads (the journal's sqlite) never see EINTR from a child's exit."""
    if not hasattr(signal, "SIGCHLD"):
        return None
    # Trio puts back the handler it found when the receiver closes. Were that SIG_DFL, a
    # SIGCHLD caught just before (CPython's C handler ran, its Python handler not yet) would
    # find no Python handler: CPython reports "Signal 17 ignored due to race condition" as an
    # unraisable error. A no-op Python handler, the one Trio finds and puts back, closes that
    # window. (SIG_IGN is left alone: it means "reap my children for me".)
    try:
        if signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL:
            signal.signal(signal.SIGCHLD, _ignore_sigchld)
        # Pushed first, so it runs once Trio has put its handler back (last in, first out).
        stack.callback(_restart_after_sigchld)
        receiver: AsyncIterator[int] = stack.enter_context(trio.open_signal_receiver(signal.SIGCHLD))
    except (RuntimeError, ValueError):  # not the main thread
        return None
    signal.siginterrupt(signal.SIGCHLD, False)
    return receiver


def _ignore_sigchld(signum: int, frame: object) -> None:
    """SIGCHLD's Python handler between daemons: nothing to do (see ``open_sigchld``)."""


def _restart_after_sigchld() -> None:
    # Putting a handler back resets SA_RESTART; keep the other threads free of EINTR.
    if callable(signal.getsignal(signal.SIGCHLD)):
        signal.siginterrupt(signal.SIGCHLD, False)
