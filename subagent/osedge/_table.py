"""The one process-table reader, and what a target set resolves to in it.

``ProcessTable`` owns what is worth keeping between reads: the last whole-table read
(concurrent stops share one walk of ``/proc`` per round) and each process's marker, read
once per process (pid and start time), not once per sweep. That state lives in the owner
(the daemon's containment, one escalation), never in a module.

``Targets`` names a set of processes the ways a supervisor knows them: process groups
(each with its leader's start ticks when learned), exact processes, a marker variable in
the environment, a cgroup, paths in a command line, pipes the set's leader reads and
writes. ``members`` resolves it against one read of the table. The caller (its pid, its
group and session) and pid 1 are never members, however they match.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from subagent.osedge._kernel import LINUX, Kernel, Proc

__all__ = ["Targets", "ProcessTable", "parse_var"]


def parse_var(env: bytes, var: str) -> str | None:
    """The value of ``var`` in a NUL-separated environment block, if set."""
    needle = var.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(needle):
            return item[len(needle) :].decode(errors="replace")
    return None


@dataclass(frozen=True)
class Targets:
    """A set of processes to find, signal and wait for.

    Attributes:
        groups: process groups, each with its leader's start ticks when it was learned
            (None: the leader was already gone). A group is a member source only while
            it is provably the set's (see ``ProcessTable.live_groups``).
        pids: exact processes (pid -> start ticks). A process now at one of these pids
            with other start ticks is never a member, however else it matches.
        marker: (VAR, value): processes whose environment holds ``VAR=value``.
        cgroup: a cgroup; when it exists it is the set's whole universe (a process cannot
            leave a cgroup on its own), read from ``cgroup.procs``, no table walk.
        cmdline: processes whose command line contains one of these strings.
        pipes: inode numbers of the leader's stdio pipes: an unmarked orphan adopted by
            the caller (or a descendant of one) that holds one is a member.
        follow: close over members: their descendants, and every process in the group
            or session of a member (Chromium's helpers show no environment and outlive
            their browser in its session).
        within: a cgroup known to hold every member (a runner's own tree cgroup holds
            whatever its commands start, however they escape): the set is looked for
            among its processes (``cgroup.procs``) instead of the whole table. Unlike
            ``cgroup``, its processes are not members by that alone, and it is never
            killed. Ignored once it is gone.
        cgroup_kill_fd: ``cgroup``'s ``cgroup.kill``, opened for writing by the caller
            while it still could (a sandboxed runner may not open it by its path).
    """

    groups: Mapping[int, int | None] = field(default_factory=dict)
    pids: Mapping[int, int] = field(default_factory=dict)
    marker: tuple[str, str] | None = None
    cgroup: Path | None = None
    cmdline: tuple[str, ...] = ()
    pipes: frozenset[int] = frozenset()
    follow: bool = False
    within: Path | None = None
    cgroup_kill_fd: int | None = None

    @classmethod
    def group(cls, pgid: int, leader_ticks: int | None = None) -> Targets:
        return cls(groups={pgid: leader_ticks})

    @property
    def empty(self) -> bool:
        return not (self.groups or self.pids or self.marker or self.cgroup or self.cmdline)


class ProcessTable:
    """Reads of the process table through a ``Kernel``, and the cache they share.

    Thread-safe: the daemon reads it from worker threads while the Trio thread adds
    trees. Nothing here sends a signal.
    """

    def __init__(self, kernel: Kernel = LINUX) -> None:
        self.kernel = kernel
        self._scan_lock = threading.Lock()
        self._last_scan: tuple[float, dict[int, Proc]] | None = None
        self._markers: dict[tuple[int, int, str], str | None] = {}

    # ------------------------------------------------------------------ reads

    def read(self, pid: int) -> Proc | None:
        """The table entry of ``pid``, or None if there is no such process."""
        return self.kernel.stat(pid)

    def same(self, pid: int, start_ticks: int | None) -> Proc | None:
        """``pid``'s entry if it is still the process that had ``start_ticks`` (alive or
        a zombie); None if it is gone, its pid reused, or its identity unproven."""
        if start_ticks is None:
            return None
        p = self.kernel.stat(pid)
        return p if p is not None and p.start_ticks == start_ticks else None

    def running(self, pid: int, start_ticks: int | None) -> bool:
        """Is the process that had ``start_ticks`` at ``pid`` still running (not a zombie)?"""
        p = self.same(pid, start_ticks)
        return p is not None and not p.dead

    def scan(self, *, shared: bool = True) -> dict[int, Proc]:
        """Read the whole process table (~20-60 us a process). Do not mutate the result.

        Args:
            shared: a caller that asks while another thread is reading the table waits
                for, and shares, that read if it started after the call; many trees
                stopping at once cost one walk per round. False: read now, alone.

        Raises:
            OSError: ``/proc`` cannot be listed (out of file descriptors).
        """
        asked = time.monotonic()
        with self._scan_lock:
            last = self._last_scan
            if shared and last is not None and last[0] >= asked:
                return last[1]
            started = time.monotonic()
            procs: dict[int, Proc] = {}
            for pid in self.kernel.pids():
                p = self.kernel.stat(pid)
                if p is not None:
                    procs[p.pid] = p
            self._last_scan = (started, procs)
            stale = [k for k in self._markers if (q := procs.get(k[0])) is None or q.start_ticks != k[1]]
            for key in stale:
                self._markers.pop(key, None)
            return procs

    def read_many(self, pids: Iterable[int]) -> dict[int, Proc]:
        out: dict[int, Proc] = {}
        for pid in pids:
            p = self.kernel.stat(pid)
            if p is not None:
                out[pid] = p
        return out

    def children(self) -> dict[int, Proc] | None:
        """The caller's own children (adopted orphans included), or None when the kernel
        cannot list them (then scan the table)."""
        pids = self.kernel.children()
        return None if pids is None else self.read_many(pids)

    def env_var(self, pid: int, var: str) -> str | None:
        """``var`` in the environment of ``pid`` now (not remembered)."""
        return parse_var(self.kernel.environ(pid) or b"", var)

    def marker_of(self, p: Proc, var: str) -> str | None:
        """``var`` in ``p``'s environment, remembered per process (pid and start time).

        Not remembered: an empty read (a process caught mid-exec shows none), and "not
        set" for the caller's own children (between fork and exec a child still shows
        its parent's environment).
        """
        key = (p.pid, p.start_ticks, var)
        try:
            return self._markers[key]
        except KeyError:
            pass
        env = self.kernel.environ(p.pid) or b""
        value = parse_var(env, var)
        if env and (value is not None or p.ppid != self.kernel.own_ids()[0]):
            self._markers[key] = value
        return value

    def cmdline_text(self, pid: int, limit: int = 200) -> str:
        """The command line of ``pid`` as one line of text (for logs and receipts)."""
        return self.kernel.cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()[:limit]

    def wall_start(self, p: Proc) -> float:
        """When ``p`` started, on the wall clock (what psutil calls ``create_time``)."""
        return self.kernel.boot_time() + p.start_ticks / self.kernel.clock_ticks

    def age_s(self, p: Proc) -> float:
        """How long ago ``p`` started, in seconds."""
        return self.kernel.uptime_s() - p.start_ticks / self.kernel.clock_ticks

    # ------------------------------------------------------------------ target sets

    def live_groups(self, groups: Mapping[int, int | None]) -> list[int]:
        """The groups that may still exist and are provably still the set's.

        A group is signalled only while its leader is the process learned about (same
        start ticks), or while no process has its number (a leaderless group's number
        stays reserved while members remain). A number now held by a non-leader names no
        group; one whose leader was gone when learned is never trusted to a new leader.
        """
        out: list[int] = []
        for pgid, ticks in list(groups.items()):  # another thread may be adding
            if pgid <= 1:
                continue
            leader = self.kernel.stat(pgid)
            if leader is None:
                out.append(pgid)
            elif leader.pgid != pgid:
                continue
            elif ticks is not None and leader.start_ticks == ticks:
                out.append(pgid)
        return out

    def cgroup_bound(self, t: Targets) -> bool:
        """Is the set its cgroup (it has one, and the cgroup exists)?"""
        return t.cgroup is not None and self.kernel.cgroup_populated(t.cgroup) is not None

    def universe(self, t: Targets) -> dict[int, Proc]:
        """What ``members`` looks at: the cgroup's processes when the set has a cgroup
        that exists (or else lies ``within`` one), else the whole table."""
        for bound in (t.cgroup, t.within):
            if bound is not None and self.kernel.cgroup_populated(bound) is not None:
                return self.read_many(self.kernel.cgroup_pids(bound))
        return self.scan()

    def members(self, t: Targets, procs: Mapping[int, Proc] | None = None) -> dict[int, Proc]:
        """Every process of the set in ``procs`` (default ``universe(t)``), zombies included.

        Raises:
            OSError: the table could not be read (out of file descriptors).
        """
        if procs is None:
            procs = self.universe(t)
        me, my_pgid, my_sid = self.kernel.own_ids()
        ours = {0, 1, my_pgid, my_sid}  # never the caller's session or group
        never = {me, 1}
        wanted = set(self.live_groups(t.groups)) - ours
        members: set[int] = set()
        if t.cgroup is not None:
            members.update(pid for pid in self.kernel.cgroup_pids(t.cgroup) if pid in procs)
        members.update(pid for pid, ticks in t.pids.items() if (p := procs.get(pid)) and p.start_ticks == ticks)
        needles = [c.encode() for c in t.cmdline if c]
        for p in procs.values():
            if p.pid in members or p.pid in never:
                continue
            if p.pgid in wanted or p.sid in wanted:
                members.add(p.pid)
            elif t.marker is not None and not p.dead and self.marker_of(p, t.marker[0]) == t.marker[1]:
                members.add(p.pid)
            elif needles and not p.dead and any(n in self.kernel.cmdline(p.pid) for n in needles):
                members.add(p.pid)
        if t.follow or t.pipes:
            by_parent: dict[int, list[int]] = {}
            for p in procs.values():
                by_parent.setdefault(p.ppid, []).append(p.pid)
            if t.pipes:
                members.update(self._pipe_holders(t, procs, by_parent, members))
            if t.follow:
                self._close_over(procs, by_parent, members, wanted | ours, never)
        # A process at a known pid that is not the known process is never a member.
        for pid, ticks in t.pids.items():
            if pid in members and procs[pid].start_ticks != ticks:
                members.discard(pid)
        return {pid: procs[pid] for pid in members}

    def _close_over(
        self,
        procs: Mapping[int, Proc],
        by_parent: Mapping[int, list[int]],
        members: set[int],
        seen_groups: set[int],
        never: Container[int],
    ) -> None:
        # Children that scrubbed the marker and left the group, and the groups and
        # sessions of members (remembered by number once seen).
        by_group: dict[int, list[int]] = {}
        for p in procs.values():
            by_group.setdefault(p.pgid, []).append(p.pid)
            if p.sid != p.pgid:
                by_group.setdefault(p.sid, []).append(p.pid)
        todo = list(members)
        while todo:
            p = procs[todo.pop()]
            related = list(by_parent.get(p.pid, ()))
            for g in (p.pgid, p.sid):
                if g not in seen_groups:
                    seen_groups.add(g)
                    related.extend(by_group.get(g, ()))
            for pid in related:
                if pid not in members and pid not in never:
                    members.add(pid)
                    todo.append(pid)

    def _pipe_holders(
        self,
        t: Targets,
        procs: Mapping[int, Proc],
        by_parent: Mapping[int, list[int]],
        members: Container[int],
    ) -> set[int]:
        """Unmarked orphans adopted by the caller (and their descendants) holding a pipe.

        Only those are looked at: any other descendant of a set is found by ancestry or
        its marker, and reading every fd of every process would cost far more.
        """
        me = self.kernel.own_ids()[0]
        var = t.marker[0] if t.marker is not None else None
        todo = [
            pid
            for pid in by_parent.get(me, ())
            if pid not in members and not procs[pid].dead and (var is None or self.marker_of(procs[pid], var) is None)
        ]
        found: set[int] = set()
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            if pid not in members:
                held = self.kernel.pipe_inodes(pid)
                if held and not held.isdisjoint(t.pipes):
                    found.add(pid)
            todo.extend(by_parent.get(pid, ()))
        return found
