"""Containment: where each tree lives, how to find all of it, who reaps what it leaves.

Labels, best first: "cgroup" (a leaf ``<own cgroup>/agentd-<instance>/<tree_id>``, ended by
``cgroup.kill``), "subreaper+sweep" (orphans re-parent to the daemon; members are swept
from /proc by marker, session/group and ancestry), "group" (groups + marker sweep only).
API: ``Containment.setup(config)``, ``.prepare(tree_id)``, ``.prepare_pids(tree_id, cgroup)``
(the tree's per-run pids limit: ``_pidslimit``), ``.prepare_memory(tree_id, cgroup)`` (its memory
limit: ``_memlimit``; the daemon's own leaf beside its subtree: ``_placement``), ``.track(tree)``, ``.remove(tree)``,
``.reap_adopted()``, ``.run()`` (periodic reaping), ``.strays()``, ``.close()``. Its
``table`` is the daemon's one process-table reader (``subagent.osedge``); it sends no
signal: ``process.py`` sends them all, through the OS edge.

Size: a third of it is the comment below (what each label guarantees, who reaps what):
the rules of one owner, kept beside the code that keeps them; the cgroup filesystem
(``_cgroupfs``) and the reaping rules (``_reaping``) already live apart.
"""

# What each label guarantees at the final kill.
# - cgroup: every process any member forks is in the tree's cgroup (or one below it), however
#   it escapes (setsid, double fork, an emptied environment); cgroup.kill ends them all,
#   forks in flight included. Only a privileged member moving itself out could escape.
# - subreaper+sweep: a process is found if it kept the marker (inherited unless scrubbed),
#   or shares a group or session with a member (those are remembered once seen, so
#   Chromium's helpers, which show no environment, are found after their browser dies),
#   or descends from a member. Orphans re-parent to the daemon, so their zombies are reaped
#   here. One that scrubbed its environment, left the session and lost its ancestors before
#   any sweep saw it cannot be traced to a tree: ``strays()`` lists it, and
#   ``process.kill_strays`` ends it once no tree is live (and at shutdown).
# - group: the same sweep without re-parenting: such strays go to PID 1 and are not found.
#
# Reaping without stealing. Trio (and any Popen in the daemon) waits for its own children
# by pid; a ``waitpid(-1)`` here would take their exit codes (Popen then reports 0). So we
# only ever ``waitpid(pid, WNOHANG)`` a zombie child that provably was not forked by the
# daemon: its session is neither ours nor its own (a process the daemon forks keeps our
# session or, after setsid, leads its own), or it sits in one of our tree cgroups, or we
# saw it alive as a tree member (marker, or leader of a tree's group). Tree leaders, which
# are Trio's, are never reaped here.
#
# Pids here wrap at 32768, so a pid alone is no identity: a Proc carries its start time in
# clock ticks (field 22 of /proc/<pid>/stat), and callers compare it before they act
# (``subagent.osedge``).
#
# Whose subtree is it: see ``supervisor.trees._cgroupfs`` (a flock on the subtree's directory,
# which holds across PID namespaces). A daemon whose own subtree vanished anyway makes it
# again, or says so in ``problem`` (shown by ``status``).
#
# Session leaders. A subreaper's children are the runners it started (tracked), whatever
# else the process hosting it forks (a test, a benchmark), and the orphans of its trees it
# adopted. An adopted orphan that called setsid() leads its own session, like a runner or a
# host's child started in a new session. What tells them apart is the environment: an
# orphan that kept its environment carries its tree's marker (and is that tree's), and
# everything this process forks inherits ``HOST_VAR=<this process>`` (set by ``setup``).
# So a live untracked session leader among our children with neither is an orphan that
# scrubbed its environment (``env -i setsid ...``), and ``strays()`` lists it; one started
# by the host with an explicit environment that lacks HOST_VAR would be taken for one. A
# descendant that holds a runner's stdout or stderr belongs to that tree whatever it did
# to its session and environment (``Targets(pipes=)`` of the OS edge).

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import trio

from subagent.osedge import IN_DELETE, LINUX, Kernel, Proc, ProcessTable, TrioRuntime, Watch
from supervisor.trees import _cgroupfs, _placement
from supervisor.trees._handles import HOST_VAR, MARKER_VAR, AnyTree, Tree
from supervisor.trees._memlimit import MemoryLimit
from supervisor.trees._pidslimit import PidsLimit
from supervisor.trees._reaping import (
    Wakeup,
    in_settled_tree,
    mark_host,
    open_sigchld,
    reap_adopted_zombies,
    scrubbed_orphan,
)

if TYPE_CHECKING:
    from supervisor.config import Config

__all__ = [
    "MARKER_VAR",
    "HOST_VAR",
    "CGROUP",
    "SUBREAPER_SWEEP",
    "GROUP",
    "Containment",
    "reap_adopted_zombies",
]

logger = logging.getLogger(__name__)

CGROUP: Final = "cgroup"
SUBREAPER_SWEEP: Final = "subreaper+sweep"
GROUP: Final = "group"

# The reaper is event-driven: a pass runs when a child of ours exits (SIGCHLD) or the
# cgroup subtree's parent directory loses an entry (inotify), never on a timer while runs
# are healthy. These bound what a missed event can cost:
# - without any event, a pass (a peek for a zombie child, the subtree check) still runs
#   this often (another receiver of SIGCHLD in this process, a test's, takes them all);
REAP_FALLBACK_S: Final = 30.0
# - the fallback containment ("subreaper+sweep", no cgroups) reads the daemon's own
#   children (not the whole table: a bounded scan) this often, to note adopted orphans
#   while they still show their marker (a dead one shows none);
NOTE_ADOPTED_S: Final = 10.0
# - passes are at least this far apart: a burst of exits (a cancel-all) costs one pass.
REAP_MIN_INTERVAL_S: Final = 0.1

# A /proc scan that fails for want of file descriptors (or memory) is logged at most once
# per this many seconds, and retried at the next pass.
SCAN_FAILURE_LOG_INTERVAL_S: Final = 30.0

# A session-leading child of ours this young is never taken for a scrubbed orphan (its
# environment may read empty for an instant around exec); a later look decides.
SETTLED_S: Final = 1.0

# The subreaper flag belongs to the process, not to a Containment: several Containments
# in one process (tests) share it, and the last one to close drops it.
_subreaper_lock = threading.Lock()
_subreaper_users = 0


@final
@dataclass(eq=False)
class Containment:
    """The daemon's containment, made once by ``Containment.setup``.

    Attributes:
        root: this daemon's cgroup subtree (``.../agentd-<instance>``) or None.
        subreaper: whether this process is a child subreaper.
        mode: the label trees get when their cgroup can be made.
    """

    root: Path | None
    subreaper: bool
    # The daemon's one process-table reader: its cache is shared by every tree's stop.
    table: ProcessTable = field(default_factory=ProcessTable)
    _leaders: dict[int, Tree] = field(default_factory=dict)
    # Removed trees whose runner Trio had not reaped yet: still never reaped here.
    _unreaped: dict[int, AnyTree] = field(default_factory=dict)
    _tree_ids: set[str] = field(default_factory=set)
    _pending: set[str] = field(default_factory=set)  # prepared, leader not tracked yet
    _leftover: set[str] = field(default_factory=set)  # removed, but their cgroup was not empty
    _adopted: dict[int, int] = field(default_factory=dict)  # pid -> start ticks
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False
    # Why the daemon contains less than it should (its cgroup subtree vanished and could
    # not be made again, say); None while all is well. Shown by ``status``.
    problem: str | None = None
    # The flock on ``root`` that says a live daemon owns it (see the module comment).
    _root_lock: int | None = None
    _host: str = ""  # this process's HOST_VAR value
    # Each tree's pids group (``pids.max`` = ``config.run_pids_max``): ``_pidslimit``.
    pids: PidsLimit = field(default_factory=lambda: PidsLimit(0))
    # Each tree's memory cgroup (``config.run_memory_max_mib``): ``_memlimit``.
    memory: MemoryLimit = field(default_factory=lambda: MemoryLimit(0))
    # The daemon's own leaf beside ``root`` (``_placement``), where it moved; None: it
    # stayed in ``root``'s parent.
    leaf: Path | None = None
    _scan_failed_at: float = -float("inf")

    @property
    def mode(self) -> str:
        if self.root is not None:
            return CGROUP
        return self.fallback_mode

    @property
    def fallback_mode(self) -> str:
        return SUBREAPER_SWEEP if self.subreaper else GROUP

    @classmethod
    def setup(
        cls,
        config: Config | None = None,
        *,
        cgroups: str | None = None,
        subreaper: bool = True,
        instance: str | None = None,
        kernel: Kernel = LINUX,
        pids_max: int | None = None,
        memory_max_mib: int | None = None,
    ) -> Containment:
        """Become a child subreaper and make this daemon's cgroup subtree where possible.

        Blocking (cgroupfs writes): call it through ``trio.to_thread.run_sync``.
        Never raises for a missing or read-only cgroup2 mount: the daemon degrades to
        "subreaper+sweep" (or "group") and says so in a log line.

        Args:
            config: ``config.cgroups`` ("auto" or "off") is read from it.
            cgroups: overrides ``config.cgroups``.
            subreaper: False leaves the subreaper flag alone (tests of the "group" mode).
            instance: names the subtree ``agentd-<instance>``; default ``<pid>-<random>``.
            kernel: the kernel every read and signal goes through (tests pass a fake).
            pids_max: overrides ``config.run_pids_max`` (each tree's pids limit; 0: none;
                without a config: none).
            memory_max_mib: overrides ``config.run_memory_max_mib`` (each tree's memory
                limit; 0: none; without a config: none).
        """
        want = cgroups if cgroups is not None else (config.cgroups if config is not None else "auto")
        instance = instance or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        table = ProcessTable(kernel)
        is_reaper = False
        if subreaper and os.name == "posix" and hasattr(os, "waitpid"):
            global _subreaper_users
            with _subreaper_lock:
                is_reaper = _subreaper_users > 0 or kernel.set_child_subreaper(True)
                if is_reaper:
                    _subreaper_users += 1
                else:
                    logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: orphans go to PID 1")
        root, lock = None, None
        if want == "auto":
            made = _cgroupfs.make_subtree(instance, kernel=kernel)
            if made is not None:
                root, lock = made
        limit = pids_max if pids_max is not None else (config.run_pids_max if config is not None else 0)
        mem_mib = (
            memory_max_mib if memory_max_mib is not None else (config.run_memory_max_mib if config is not None else 0)
        )
        # Per-run limits wanted: the daemon leaves its delegated cgroup for a leaf beside
        # its runs' subtree, so the kernel lets domain controllers (memory) be enabled
        # for them (``_placement``); before it forks anything.
        leaf = (
            _placement.move_into_leaf(root.parent, kernel=kernel) if root is not None and (limit or mem_mib) else None
        )
        pids = PidsLimit.setup(limit, v2_root=root, instance=instance, kernel=kernel) if want == "auto" else None
        memory = MemoryLimit.setup(mem_mib, instance=instance, kernel=kernel, v2_root=root) if want == "auto" else None
        self = cls(root=root, subreaper=is_reaper, table=table, _root_lock=lock, _host=mark_host(table), leaf=leaf)
        if pids is not None:
            self.pids = pids
        if memory is not None:
            self.memory = memory
        logger.info(
            "containment: %s (cgroup subtree %s, subreaper %s)",
            self.mode,
            root,
            "on" if is_reaper else "off",
        )
        return self

    def prepare(self, tree_id: str, *, ahead: bool = False) -> Path | None:
        """Make the cgroup leaf for a new tree; None when this daemon has no cgroups.

        ``ahead``: for a zygote's spare (``trees/zygote.py``), whose leader is the zygote's
        child and may wait long for a run: the leaf only, the tree neither pending nor
        tracked until ``track`` (so it holds back neither the sweeps of strays nor the
        idle daemon's ``kill_strays``).
        """
        with self._lock:
            if not ahead:
                self._tree_ids.add(tree_id)
                self._pending.add(tree_id)
        if self.root is None:
            return None
        path = self.root / tree_id
        try:
            try:
                path.mkdir()
            except FileNotFoundError:
                if not self.check_subtree():
                    return None
                path = self.root / tree_id
                path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            logger.warning("tree %s: cannot create cgroup %s (%s); using %s", tree_id, path, exc, self.fallback_mode)
            return None
        return path

    def prepare_pids(self, tree_id: str, cgroup: Path | None) -> tuple[Path | None, Path | None]:
        """The per-run pids limit of a new tree (after ``prepare``, before its runner
        exists): (its ``Tree.pids_group``, the v1 group its runner joins, or None).
        Blocking: a mkdir and a write, or nothing without a limit."""
        return self.pids.prepare(tree_id, cgroup)

    def prepare_memory(self, tree_id: str, cgroup: Path | None) -> tuple[Path | None, Path | None]:
        """The per-run memory limit of a new tree (after ``prepare``, before its runner
        exists): (its ``Tree.memory_group``, the v1 group its runner joins, or None).
        Blocking: a write (v2), a mkdir and writes (v1), or nothing without a limit."""
        return self.memory.prepare(tree_id, cgroup)

    def memory_report(self, tree: AnyTree) -> dict[str, Any] | None:
        """``{"max", "peak", "failcnt", "oom_kills"}`` of a tree's memory group, for its
        receipt once its processes are gone; None without one."""
        return self.memory.report(tree.memory_group)

    def pids_report(self, tree: AnyTree) -> dict[str, Any] | None:
        """``{"max", "peak", "hit"}`` of a tree's pids group (``hit``: forks its limit
        refused), for its receipt once its processes are gone; None without one."""
        return self.pids.report(tree.pids_group)

    def discard(self, tree_id: str) -> None:
        """Forget a prepared tree that never started (its cgroup is the caller's to remove)."""
        with self._lock:
            self._tree_ids.discard(tree_id)
            self._pending.discard(tree_id)

    def check_subtree(self) -> bool:
        """Is this daemon's cgroup subtree still there? If it vanished, make it again.

        Never silent: a subtree made again is logged, one that cannot be is ``problem``
        (and the daemon then contains its trees with the fallback mode). Blocking.
        """
        root = self.root
        if root is None:
            return False
        with self._lock:
            try:
                intact = self._root_lock is not None and os.stat(root).st_ino == os.fstat(self._root_lock).st_ino
            except OSError:
                intact = False
            if intact:
                return True
            if self._root_lock is not None:
                os.close(self._root_lock)
                self._root_lock = None
            made = _cgroupfs.claim_subtree(root.parent, root.name.removeprefix("agentd-"))
            if made is None:
                self.root = None
                self.problem = (
                    f"cgroup subtree {root} vanished and cannot be made again; "
                    f"trees are contained by {self.fallback_mode}"
                )
                logger.error("containment: %s", self.problem)
                return False
            self.root, self._root_lock = made
            # A fresh cgroup has no controllers: the per-run limits' again.
            self.pids.restore(made[0])
            self.memory.restore(made[0])
        logger.warning("containment: cgroup subtree %s vanished (removed by someone else); made it again", root)
        return True

    def label(self, cgroup: Path | None) -> str:
        """The containment label of a tree that got ``cgroup`` (None: it got none)."""
        return CGROUP if cgroup is not None else self.fallback_mode

    def track(self, tree: Tree) -> None:
        """Note a spawned tree: its leader is Trio's child and must never be reaped here."""
        tree.table = self.table
        with self._lock:
            self._leaders[tree.pid] = tree
            self._tree_ids.add(tree.tree_id)
            self._pending.discard(tree.tree_id)

    def remove(self, tree: AnyTree) -> bool:
        """Forget a finished tree and rmdir its cgroup when empty. True if nothing is left.

        A re-adopted tree's cgroup sits in an earlier daemon's subtree: that subtree goes
        too once empty.
        """
        with self._lock:
            self._remember_groups(tree)
            if self._leaders.get(tree.pid) is tree:
                del self._leaders[tree.pid]
                if not tree.leader_reaped:
                    self._unreaped[tree.pid] = tree
            self._tree_ids.discard(tree.tree_id)
        pids_ok = self.pids.remove(tree.pids_group, tree.cgroup)
        pids_ok = self.memory.remove(tree.memory_group, tree.cgroup) and pids_ok
        if tree.cgroup is None:
            return pids_ok
        ok = _cgroupfs.rmdir_tree(tree.cgroup)
        with self._lock:
            if ok:
                self._leftover.discard(tree.tree_id)
            else:
                self._leftover.add(tree.tree_id)
        parent = tree.cgroup.parent
        if ok and parent != self.root and parent.name.startswith("agentd-"):
            try:
                parent.rmdir()
            except OSError:
                pass  # other trees of that daemon are still there
        return ok and pids_ok

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reap adopted zombies as children exit, until cancelled (a daemon service).

        Event-driven (see ``REAP_FALLBACK_S``): a pass runs on SIGCHLD, when the cgroup
        subtree may have vanished, and in the fallback containment every
        ``NOTE_ADOPTED_S`` over the daemon's children. The first pass (a full one) is done
        before ``task_status.started()``.
        """
        runtime = TrioRuntime(threads=self.table.kernel.blocking)
        await runtime.run_sync(lambda: self._pass(True))
        task_status.started()
        wake = Wakeup()
        with contextlib.ExitStack() as stack:
            async with trio.open_nursery() as nursery:
                sigchld = open_sigchld(stack) if self.subreaper else None
                if sigchld is not None:
                    nursery.start_soon(wake.on_signals, sigchld)
                watch = self._subtree_watch()
                if watch is not None:
                    stack.callback(watch.close)
                    nursery.start_soon(wake.on_readable, watch)
                note_every = NOTE_ADOPTED_S if self.subreaper and self.root is None else math.inf
                next_note = trio.current_time() + note_every
                while True:
                    timeout = min(REAP_FALLBACK_S, max(0.0, next_note - trio.current_time()))
                    await wake.wait(timeout)
                    note = trio.current_time() >= next_note
                    if note:
                        next_note = trio.current_time() + note_every
                    await runtime.run_sync(lambda: self._pass(note))  # noqa: B023 (awaited here)
                    await trio.sleep(REAP_MIN_INTERVAL_S)

    def _subtree_watch(self) -> Watch | None:
        # rmdir on cgroupfs notifies the parent directory (IN_DELETE), not the directory.
        if self.root is None:
            return None
        return Watch.open([(self.root.parent, IN_DELETE)])

    def _pass(self, note: bool = False) -> None:
        # A scan that fails (out of fds, say) is logged and retried next pass: a reaper
        # that died with it would leave zombies, a daemon that died with it every run.
        try:
            if self.root is not None:
                self.check_subtree()
            self.reap_adopted(note=note)
        except OSError as exc:
            now = time.monotonic()
            if now - self._scan_failed_at >= SCAN_FAILURE_LOG_INTERVAL_S:
                self._scan_failed_at = now
                logger.warning("containment: a /proc scan failed (%s); retrying at the next pass", exc)

    def reap_adopted(self, *, note: bool = True) -> list[int]:
        """Reap zombie children that were adopted, never one of Trio's. Returns their pids.

        Reads only the daemon's own children (``/proc/self/task/*/children``), and only
        when one of them is a zombie (a peek that reaps nothing) or ``note`` is set: then
        it also remembers live adopted children that carry one of our markers, so they
        can be reaped once they die and no longer show their environment.
        """
        if not self.subreaper:
            return []
        me = self.table.kernel.own_ids()[0]
        subtree = self._subtree_prefix()
        with self._lock:
            for tree in self._leaders.values():
                self._remember_groups(tree)
            for pid, gone in list(self._unreaped.items()):
                if gone.leader_reaped:  # Trio has its exit status; the pid may be reused
                    del self._unreaped[pid]
            leaders = set(self._leaders) | set(self._unreaped)
            # Not a pending tree's: its marked child, or a zombie in its cgroup, may be the
            # leader Trio has not been told about yet.
            settled = (self._tree_ids - self._pending) | self._leftover
            seen = dict(self._adopted)
        # Read without the lock: prepare() and track() run on the Trio thread.
        if not note and not self.table.kernel.zombie_child_waiting():
            return []
        procs = self.table.children()
        if procs is None:  # the kernel cannot list children: the table, then
            procs = self.table.scan()
        if note:
            for p in procs.values():
                if p.ppid == me and not p.dead and p.pid not in leaders and p.pid not in seen:
                    if self.table.marker_of(p, MARKER_VAR) in settled:
                        seen[p.pid] = p.start_ticks
        reaped = reap_adopted_zombies(
            self.table, seen=seen, exclude=leaders, subtree=subtree, settled=settled, procs=procs
        )
        with self._lock:
            for pid, ticks in seen.items():
                self._adopted.setdefault(pid, ticks)
            for pid, ticks in list(self._adopted.items()):
                if pid in reaped or self.table.same(pid, ticks) is None:
                    del self._adopted[pid]
        if reaped:
            logger.debug("reaped adopted zombies %s", reaped)
        return reaped

    def _remember_groups(self, tree: AnyTree) -> None:
        # The leaders of a tree's other groups (MCP servers, commands) lead their own
        # sessions, so once orphaned and dead nothing else tells them from Trio's children.
        for pgid, ticks in list(tree.groups.items()):  # the Trio thread may be adding
            if pgid != tree.pid and ticks is not None:
                self._adopted.setdefault(pgid, ticks)

    @property
    def tracked_trees(self) -> int:
        """Trees prepared or spawned and not yet removed."""
        with self._lock:
            return len(self._tree_ids)

    def strays(self, *, young: list[Proc] | None = None) -> list[Proc]:
        """Live adopted children that no tree's sweep can place (e.g. a double-forked
        daemon that also emptied its environment, or an ``env -i setsid`` command). Only a
        subreaper has any.

        Args:
            young: a session leader that would count as a scrubbed orphan but started
                less than ``SETTLED_S`` ago is appended here, not returned: look again
                once it is older.

        Raises:
            OSError: the process table could not be read (out of file descriptors).
        """
        if not self.subreaper:
            return []
        me, _pgid, my_sid = self.table.kernel.own_ids()
        subtree = self._subtree_prefix()
        with self._lock:
            leaders = set(self._leaders)
            settled = (self._tree_ids - self._pending) | self._leftover
            remembered = dict(self._adopted)
            spawning = bool(self._pending)
        out: list[Proc] = []
        procs = self.table.children()  # a stray is a child of ours: no walk of the table
        if procs is None:
            procs = self.table.scan()
        for p in procs.values():
            if p.ppid != me or p.dead or p.pid in leaders:
                continue
            if (
                remembered.get(p.pid) == p.start_ticks
                or p.sid not in (my_sid, p.pid)
                or in_settled_tree(self.table, p.pid, subtree, settled)
            ):
                out.append(p)
            elif p.sid == p.pid and not spawning and scrubbed_orphan(self.table, p, self._host):
                # Leads its own session, is no runner of ours and shows neither a tree's
                # marker nor our environment: an orphan that called setsid() and
                # scrubbed its environment.
                if self.table.age_s(p) >= SETTLED_S:
                    out.append(p)
                elif young is not None:
                    young.append(p)
        return out

    def _subtree_prefix(self) -> str | None:
        if self.root is None:
            return None
        mount = self.table.kernel.cgroup2_mount()
        if mount is None or not self.root.is_relative_to(mount[0]):
            return None
        return "/" + str(self.root.relative_to(mount[0])).strip("/") + "/"

    def close(self) -> None:
        """Reap what was adopted, remove the (empty) subtree, drop the subreaper flag.

        Idempotent. A tree cgroup that still holds processes is left (and logged).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.reap_adopted()
        except OSError as exc:
            logger.warning("containment: could not reap adopted zombies at close: %s", exc)
        if self.root is not None and not _cgroupfs.rmdir_tree(self.root):
            logger.warning("cgroup subtree %s not removed: processes are still in it", self.root)
        self.pids.close()
        self.memory.close()
        if self._root_lock is not None:
            os.close(self._root_lock)
            self._root_lock = None
        if self.subreaper:
            global _subreaper_users
            with _subreaper_lock:
                _subreaper_users -= 1
                if _subreaper_users == 0:
                    self.table.kernel.set_child_subreaper(False)
