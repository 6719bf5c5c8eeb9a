"""The handles and records of process control: trees, stop receipts. No I/O but /proc reads.

``Tree`` is a tree this daemon spawned (Trio's ``Process`` inside); ``AdoptedTree`` one
found again after a restart. Both name their runner by pid *and* start time, because pids
are recycled. ``StopReceipt`` is what path B did and saw, JSON-ready via ``to_dict()``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, final

import trio

from supervisor.containment import cgroup_pids, read_marker, read_proc

if TYPE_CHECKING:
    from supervisor.zygote import ForkedProcess

__all__ = ["Tree", "AdoptedTree", "AnyTree", "Found", "SignalSent", "StopReceipt"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _TreeBase:
    tree_id: str
    pid: int  # the runner, leader of its session and group
    pgid: int  # == pid, recorded at spawn; never asked of the kernel later
    start_time: float  # psutil create_time of the leader: identity across a daemon restart
    cgroup: Path | None
    containment: str  # "cgroup", "subreaper+sweep" or "group"
    # Known process groups (the runner's, and those its PROCESS_GROUP events name), each
    # with the start ticks of its leader when we learned of it (None: leader already gone).
    groups: dict[int, int | None] = field(default_factory=dict)
    # The runner's start time in clock ticks (/proc/<pid>/stat), None when not proven.
    leader_ticks: int | None = None
    # Inode numbers of the runner's stdio pipes (empty for a re-adopted tree): an orphan
    # that holds one open is the tree's, whatever it did to its session and environment.
    pipes: frozenset[int] = frozenset()
    # Known groups whose tool a stop interrupts (a command with stop policy "interrupt"):
    # path A SIGTERMs them at cancel time, even while the runner lives. Never a group whose
    # tool the policy lets finish, never an MCP server (the runner cancels its calls).
    interruptible: set[int] = field(default_factory=set)

    def set_interruptible(self, pgid: int, interruptible: bool) -> None:
        """Mark a known group as one path A may SIGTERM at cancel time (or not any more)."""
        if interruptible and pgid in self.groups and pgid != self.pgid:
            self.interruptible.add(pgid)
        else:
            self.interruptible.discard(pgid)

    def add_group(self, pgid: int) -> bool:
        """Remember another process group of this tree (an MCP server, a command).

        The runner reports these, so a report is checked, not trusted: the group's leader
        must be running now and descend from the runner, or carry this tree's marker, or
        sit in its cgroup. (Ancestry comes first: for an instant after exec a process's
        environment reads empty.) A group we could not check is not added; its members
        are still found by the sweep.
        Returns whether the group is known now.
        """
        if pgid in self.groups:
            return True
        if pgid <= 1 or pgid in (os.getpgrp(), os.getsid(0)):
            return False
        leader = read_proc(pgid)
        if leader is None or leader.dead or leader.pgid != pgid:
            return False
        ours = (
            self._descends_from_runner(leader.ppid)
            or read_marker(pgid) == self.tree_id
            or (self.cgroup is not None and pgid in cgroup_pids(self.cgroup))
        )
        if not ours:
            logger.warning("tree %s: group %d is not the tree's; not adding it", self.tree_id, pgid)
            return False
        self.groups[pgid] = leader.start_ticks
        return True

    def _descends_from_runner(self, pid: int) -> bool:
        for _ in range(64):  # a parent chain, bounded in case of a loop during reparenting
            if pid <= 1:
                return False
            p = read_proc(pid)
            if p is None:
                return False
            if pid == self.pid:
                return self.leader_ticks is not None and p.start_ticks == self.leader_ticks
            pid = p.ppid
        return False

    @property
    def leader_reaped(self) -> bool:
        return False


@final
@dataclass(eq=False)
class Tree(_TreeBase):
    """A tree this daemon spawned; ``process`` is the handle on the runner (its pipes too):
    Trio's for a cold start, a ``ForkedProcess`` (the same surface) for a zygote's fork."""

    process: trio.Process | ForkedProcess = field(kw_only=True)

    @property
    def leader_reaped(self) -> bool:
        """Trio has waited for the runner. Reads /proc, not Trio: callable from any thread."""
        p = read_proc(self.pid)
        return p is None or p.start_ticks != self.leader_ticks


@final
@dataclass(eq=False)
class AdoptedTree(_TreeBase):
    """A tree found again after a daemon restart: no pipes, no exit status."""


AnyTree: TypeAlias = Tree | AdoptedTree


@dataclass(frozen=True, slots=True)
class Found:
    """What ``find_tree`` saw: the tree (usable with every stop routine) and its state."""

    tree: AdoptedTree
    leader_alive: bool  # the recorded pid still runs and is provably the same process
    members: list[int]  # live members, the leader included when alive


@dataclass(frozen=True, slots=True)
class SignalSent:
    signal: str  # "SIGTERM", "SIGKILL", "cgroup.kill", "taskkill", "taskkill /F"
    target: str  # "group", "pid", "cgroup", "tree"
    id: str  # pgid, pid or cgroup path
    at_s: float  # seconds after the routine started
    result: str  # "sent", "gone" (ESRCH/ENOENT), "eperm" (maybe alive), "refused", an error
    what: str = ""  # the process's command line, for pid targets


@dataclass(slots=True)
class StopReceipt:
    """What path B did and saw. ``to_dict()`` is JSON-ready.

    Times: ``started_at`` and ``tree_dead_at`` are on the Trio clock (``trio.current_time``);
    ``at_s``, ``waited_s`` and ``tree_dead_after_s`` are seconds after ``started_at``.
    """

    tree_id: str
    pid: int
    pgid: int
    containment: str
    cgroup: str | None
    grace_s: float  # the grace asked for
    started_at: float
    waited_s: float = 0.0  # SIGTERM to SIGKILL (or to the runner's exit): the effective grace
    escalated: bool = False  # the runner outlived the grace and was SIGKILLed
    leader: str = "unknown"  # "exited" in the grace, "killed", "gone" before we started
    signals: list[SignalSent] = field(default_factory=list)
    killed: list[dict[str, Any]] = field(default_factory=list)  # members SIGKILLed by pid
    tree_dead_at: float | None = None
    tree_dead_after_s: float | None = None
    survivors: list[dict[str, Any]] = field(default_factory=list)  # pid + cmdline
    reaped: list[int] = field(default_factory=list)  # adopted zombies reaped here
    timed_out: bool = False  # the routine's own deadline ended it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
