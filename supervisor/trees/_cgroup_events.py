"""Waits on stopping trees' ``cgroup.events``: one inotify descriptor per Trio run.

A stopping cgroup tree is dead when its ``cgroup.events`` says ``populated 0`` (kernfs
notifies that as a modification). Path B waits for it through ``CgroupEvents``: one
``WatchSet`` (one inotify descriptor) for every tree stopping in this Trio run, read by
one system task that wakes the waiters whose watch had an event. A descriptor per stop
cost a close each, and closing an inotify descriptor waits for an RCU grace period
(5-40 ms of the Trio thread): a thousand runs stopping at once spent seconds there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import trio

from subagent.osedge import IN_MODIFY, WatchSet

__all__ = ["CgroupEvents", "Waiter"]

logger = logging.getLogger(__name__)

_CURRENT: Final[trio.lowlevel.RunVar[CgroupEvents | None]] = trio.lowlevel.RunVar("agentd_cgroup_events")


class Waiter:
    """One path's watch: ``await changed(timeout)``; ``close()`` when done (idempotent)."""

    def __init__(self, owner: CgroupEvents, wd: int) -> None:
        self._owner = owner
        self.wd = wd
        self._changed = False
        self._event = trio.Event()
        self._closed = False

    def notify(self) -> None:
        self._changed = True
        self._event.set()

    async def changed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) for an event since the last call: True if one came."""
        if not self._changed:
            with trio.move_on_after(max(0.0, timeout)):
                await self._event.wait()
        got, self._changed = self._changed, False
        if got:
            self._event = trio.Event()
        return got

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner.release(self)


class CgroupEvents:
    """The Trio run's one inotify descriptor for cgroup.events files (``current()``)."""

    def __init__(self, watches: WatchSet) -> None:
        self._watches = watches
        self._by_wd: dict[int, set[Waiter]] = {}

    @classmethod
    def current(cls) -> CgroupEvents | None:
        """This Trio run's, made (and its reader started) on first use; None without inotify."""
        try:
            return _CURRENT.get()
        except LookupError:
            pass
        watches = WatchSet.open()
        found = cls(watches) if watches is not None else None
        _CURRENT.set(found)
        if found is not None:
            trio.lowlevel.spawn_system_task(found._read_events, name="cgroup.events watch")
        return found

    def watch(self, path: Path) -> Waiter | None:
        """A waiter on ``path`` (a ``cgroup.events``); None if it cannot be watched."""
        wd = self._watches.add(path, IN_MODIFY)
        if wd is None:
            return None
        waiter = Waiter(self, wd)
        self._by_wd.setdefault(wd, set()).add(waiter)
        return waiter

    def release(self, waiter: Waiter) -> None:
        left = self._by_wd.get(waiter.wd)
        if left is None:
            return
        left.discard(waiter)
        if not left:  # the same file watched twice has one watch: the last one removes it
            del self._by_wd[waiter.wd]
            self._watches.remove(waiter.wd)

    async def _read_events(self) -> None:
        fd = self._watches.fd
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                wds = self._watches.read()
                targets = list(self._by_wd) if wds is None else wds
                for wd in targets:
                    for waiter in list(self._by_wd.get(wd, ())):
                        waiter.notify()
        finally:
            trio.lowlevel.notify_closing(fd)
            self._watches.close()
