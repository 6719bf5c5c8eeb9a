"""The handles and records of process control: trees, stop receipts. No I/O but /proc reads.

``Tree`` is a tree this daemon spawned (Trio's ``Process`` inside); ``AdoptedTree`` one
found again after a restart. Both name their runner by pid *and* start time, because pids
are recycled, and read the process table through their ``ProcessTable`` (the
containment's: its cache is shared). ``targets()`` is the tree as a target set of the OS
edge (``subagent.osedge``). ``StopReceipt`` is what path B did and saw, JSON-ready via
``to_dict()``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final

import trio

from subagent.osedge import Proc, ProcessTable, Signalled, Targets

if TYPE_CHECKING:
    from supervisor.trees.zygote import ForkedProcess

__all__ = ["MARKER_VAR", "HOST_VAR", "Tree", "AdoptedTree", "AnyTree", "Found", "SignalSent", "StopReceipt"]

logger = logging.getLogger(__name__)

# Every process of a tree inherits ``AGENTD_TREE=<tree id>`` (unless it scrubs it).
MARKER_VAR: Final = "AGENTD_TREE"
# Set in the daemon's own environment by ``Containment.setup``: everything the daemon's
# host forks inherits it, which tells those from adopted orphans; trees never carry it.
HOST_VAR: Final = "AGENTD_FORKED_BY"  # not a Config field name (AGENTD_<field> configures)


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
    # The directory of its per-run pids limit (``pids.max``, ``pids.events``): its v2
    # cgroup or a v1 pids group (``_pidslimit``); None: no limit.
    pids_group: Path | None = None
    # Its per-run memory limit's v1 memory group (``_memlimit``); None: no limit.
    memory_group: Path | None = None
    # Where its process table reads go (and the cache they share): the containment's.
    table: ProcessTable = field(default_factory=ProcessTable, kw_only=True, repr=False)

    def targets(self) -> Targets:
        """The tree as a target set: its cgroup, its marker, its groups (a live view: groups
        learned while it is being stopped count at the next read), descendants, and the
        sessions of members, and orphans that hold its runner's pipes."""
        return Targets(
            groups=self.groups,
            pids={self.pid: self.leader_ticks} if self.leader_ticks is not None else {},
            marker=(MARKER_VAR, self.tree_id),
            cgroup=self.cgroup,
            pipes=self.pipes,
            follow=True,
        )

    def learn_leaders(self, members: Mapping[int, Proc]) -> None:
        """Remember the groups and sessions members lead (Chromium's browser leads the
        session its helpers stay in): once the leader is gone they are still found."""
        for p in list(members.values()):
            if p.pid in (p.pgid, p.sid) and p.pid not in self.groups:  # a zombie leader too
                self.groups[p.pid] = p.start_ticks

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
        _me, my_pgid, my_sid = self.table.kernel.own_ids()
        if pgid <= 1 or pgid in (my_pgid, my_sid):
            return False
        leader = self.table.read(pgid)
        if leader is None or leader.dead or leader.pgid != pgid:
            return False
        ours = (
            self._descends_from_runner(leader.ppid)
            or self.table.env_var(pgid, MARKER_VAR) == self.tree_id
            or (self.cgroup is not None and pgid in self.table.kernel.cgroup_pids(self.cgroup))
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
            p = self.table.read(pid)
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
        return self.table.same(self.pid, self.leader_ticks) is None


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


SignalSent: TypeAlias = Signalled  # one signal of a stop receipt (the OS edge's record)


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
