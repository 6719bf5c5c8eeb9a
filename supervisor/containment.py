"""Containment: where each tree lives, how to find all of it, who reaps what it leaves.

Labels, best first: "cgroup" (a leaf ``<own cgroup>/agentd-<instance>/<tree_id>``, ended by
``cgroup.kill``), "subreaper+sweep" (orphans re-parent to the daemon; members are swept
from /proc by marker, session/group and ancestry), "group" (groups + marker sweep only).
API: ``Containment.setup(config)``, ``.prepare(tree_id)``, ``.track(tree)``, ``.remove(tree)``,
``.reap_adopted()``, ``.run()`` (periodic reaping), ``.strays()``, ``.close()``; and /proc
readers. Sends no signal: ``process.py`` sends them all, ``cgroup.kill`` included.
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
# clock ticks (field 22 of /proc/<pid>/stat), and callers compare it before they act.
#
# Whose subtree is it: see ``supervisor._cgroupfs`` (a flock on the subtree's directory,
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
# to its session and environment (``tree_members(pipes=)``).

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import trio

from supervisor import _cgroupfs
from supervisor._cgroupfs import cgroup_pids as cgroup_pids
from supervisor._cgroupfs import read_cgroup as read_cgroup

if TYPE_CHECKING:
    from supervisor._tree import AnyTree, Tree
    from supervisor.config import Config

__all__ = [
    "MARKER_VAR",
    "CGROUP",
    "SUBREAPER_SWEEP",
    "GROUP",
    "Containment",
    "Proc",
    "scan_processes",
    "read_proc",
    "parse_stat",
    "read_marker",
    "marker_of",
    "cgroup_pids",
    "tree_members",
    "reap_adopted_zombies",
]

logger = logging.getLogger(__name__)

MARKER_VAR: Final = "AGENTD_TREE"
# Set in this process's own environment by Containment.setup: every process it forks
# inherits it, which tells them from adopted orphans (see the module comment).
HOST_VAR: Final = "AGENTD_FORKED_BY"  # not a Config field name (AGENTD_<field> configures)
CGROUP: Final = "cgroup"
SUBREAPER_SWEEP: Final = "subreaper+sweep"
GROUP: Final = "group"

# How often Containment.run reaps adopted zombies (a zombie is dead but holds its pid).
REAP_INTERVAL_S: Final = 1.0
# With no zombie child waiting, the reaper reads the whole process table only every this
# many passes (to note live adopted children while they still show their marker).
FULL_SCAN_EVERY: Final = 10

# A /proc scan that fails for want of file descriptors (or memory) is logged at most once
# per this many seconds, and retried at the next pass.
SCAN_FAILURE_LOG_INTERVAL_S: Final = 30.0

# A session-leading child of ours this young is never taken for a scrubbed orphan (its
# environment may read empty for an instant around exec); a later look decides.
SETTLED_S: Final = 1.0
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

_PR_SET_CHILD_SUBREAPER: Final = 36
_PROC: Final = Path("/proc")

# The last process table read, shared by concurrent sweeps (see scan_processes),
# and each process's marker by (pid, start ticks): environments are read once.
_scan_lock = threading.Lock()
_last_scan: tuple[float, dict[int, Proc]] | None = None
_markers: dict[tuple[int, int], str | None] = {}

# The subreaper flag is per process; several Containments in one process (tests) share it.
_subreaper_lock = threading.Lock()
_subreaper_users = 0


# ----------------------------------------------------------------------------- /proc


@dataclass(frozen=True, slots=True)
class Proc:
    """One line of the process table, as read from ``/proc/<pid>/stat``."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # "R", "S", "T" (stopped), "Z" (zombie), ...
    start_ticks: int  # start time since boot in clock ticks: with pid, the identity

    @property
    def dead(self) -> bool:
        """A zombie is dead: it runs no code and holds no resources but its pid."""
        return self.state in ("Z", "X", "x")


def read_proc(pid: int) -> Proc | None:
    """Return the process table entry of ``pid``, or None if there is no such process."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_stat(pid, raw)


def parse_stat(pid: int, raw: bytes) -> Proc | None:
    """Parse a ``/proc/<pid>/stat`` line; None if it is not one."""
    # The command name may contain spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return Proc(
            pid=pid,
            state=rest[0].decode(),
            ppid=int(rest[1]),
            pgid=int(rest[2]),
            sid=int(rest[3]),
            start_ticks=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


def scan_processes(*, shared: bool = True) -> dict[int, Proc]:
    """Read the whole process table (~20-60 us a process). Do not mutate the result.

    Args:
        shared: callers that ask while another thread is reading the table wait for, and
            share, the next read that starts after they asked: many trees stopping at once
            cost one walk of /proc per round, not one each. The result never predates the
            call. False: read now, alone.
    """
    global _last_scan
    asked = time.monotonic()
    with _scan_lock:
        if shared and _last_scan is not None and _last_scan[0] >= asked:
            return _last_scan[1]
        started = time.monotonic()
        procs: dict[int, Proc] = {}
        for name in os.listdir(_PROC):
            if name.isdigit():
                p = read_proc(int(name))
                if p is not None:
                    procs[p.pid] = p
        _last_scan = (started, procs)
        for key in [k for k in _markers if procs.get(k[0]) is None or procs[k[0]].start_ticks != k[1]]:
            _markers.pop(key, None)
        return procs


def read_marker(pid: int) -> str | None:
    """The ``AGENTD_TREE`` value in the environment of ``pid``, if readable."""
    return _parse_marker(_read_environ(pid))


def marker_of(p: Proc) -> str | None:
    """``read_marker``, remembered per process (pid and start time).

    An environment is read once per process, not once per sweep. Not remembered: an empty
    read (a process caught mid-exec shows none), and "no marker" for our own children
    (between fork and exec a new runner still shows the daemon's environment).
    """
    key = (p.pid, p.start_ticks)
    try:
        return _markers[key]
    except KeyError:
        pass
    env = _read_environ(p.pid)
    value = _parse_marker(env)
    if env and (value is not None or p.ppid != os.getpid()):
        _markers[key] = value
    return value


def _read_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone, a zombie (no memory left), or not ours to read
        return b""


def _parse_marker(env: bytes, var: str = MARKER_VAR) -> str | None:
    needle = var.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(needle):
            return item[len(needle) :].decode(errors="replace")
    return None


def _host_identity() -> str:
    me = read_proc(os.getpid())
    return f"{os.getpid()}:{me.start_ticks if me is not None else 0}"


def _mark_host() -> str:
    """Put this process's identity in its environment, for whatever it forks from now on."""
    identity = _host_identity()
    os.environ[HOST_VAR] = identity
    return identity


def _scrubbed_orphan(p: Proc, identity: str) -> bool:
    """Has this child of ours an environment that is neither a tree's nor ours?

    Not one whose environment cannot be read. (Callers leave out one that started less
    than ``SETTLED_S`` ago: for an instant around exec an environment reads empty.)
    """
    try:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return _parse_marker(env) is None and _parse_marker(env, HOST_VAR) != identity


def age_s(p: Proc) -> float:
    """How long ago ``p`` started, in seconds."""
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - p.start_ticks / _CLOCK_TICKS


def tree_members(
    tree_id: str,
    *,
    groups: Iterable[int] = (),
    cgroup: Path | None = None,
    procs: dict[int, Proc] | None = None,
    pipes: Container[int] = (),
) -> dict[int, Proc]:
    """Every process that belongs to a tree, zombies included.

    A member is in the tree's cgroup, or carries ``AGENTD_TREE=<tree_id>``, or is in one of
    the tree's groups or sessions (those given, and those of any other member), or descends
    from a member, or (``pipes``: inode numbers of the runner's stdio pipes) is an orphan
    adopted by this process, or a descendant of one, that holds one of those pipes. The
    calling process is never a member, nor is anything in its session.
    """
    if procs is None:
        procs = scan_processes()
    me = os.getpid()
    ours = {0, 1, os.getsid(0), os.getpgrp()}  # never the daemon's session or group
    wanted = set(groups) - ours
    members: set[int] = {pid for pid in cgroup_pids(cgroup) if pid in procs}
    for p in procs.values():
        if p.pid in members or p.pid in (me, 1):
            continue
        if p.pgid in wanted or p.sid in wanted:
            members.add(p.pid)
        elif not p.dead and marker_of(p) == tree_id:
            members.add(p.pid)
    by_parent: dict[int, list[int]] = {}
    by_group: dict[int, list[int]] = {}
    for p in procs.values():
        by_parent.setdefault(p.ppid, []).append(p.pid)
        by_group.setdefault(p.pgid, []).append(p.pid)
        if p.sid != p.pgid:
            by_group.setdefault(p.sid, []).append(p.pid)
    if pipes:
        members.update(_pipe_holders(pipes, procs, by_parent, members))
    # Close over ancestry (children that scrubbed the marker and left the group) and over
    # the groups and sessions of members: Chromium's helpers show no environment at all
    # (setproctitle reuses it) and outlive their parent in the browser's session.
    todo = list(members)
    while todo:
        p = procs[todo.pop()]
        related = list(by_parent.get(p.pid, ()))
        for g in (p.pgid, p.sid):
            if g not in ours and g not in wanted:
                wanted.add(g)
                related.extend(by_group.get(g, ()))
        for pid in related:
            if pid not in members and pid not in (me, 1):
                members.add(pid)
                todo.append(pid)
    return {pid: procs[pid] for pid in members}


def _pipe_holders(
    pipes: Container[int],
    procs: dict[int, Proc],
    by_parent: dict[int, list[int]],
    members: Container[int],
) -> set[int]:
    """Orphans adopted by us that show no marker (and their descendants) and hold one of
    ``pipes`` open.

    Only those are looked at: any other descendant of a tree is found by ancestry or its
    marker (other trees' runners and their orphans show theirs), and reading every fd of
    every process would cost far more than the sweep.
    """
    me = os.getpid()
    todo = [
        pid for pid in by_parent.get(me, ())
        if pid not in members and not procs[pid].dead and marker_of(procs[pid]) is None
    ]
    found: set[int] = set()
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if pid not in members and _holds_pipe(pid, pipes):
            found.add(pid)
        todo.extend(by_parent.get(pid, ()))
    return found


def _holds_pipe(pid: int, pipes: Container[int]) -> bool:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False  # gone, not ours to read, or out of fds (the next sweep looks again)
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:[") and target.endswith("]"):
            try:
                if int(target[6:-1]) in pipes:
                    return True
            except ValueError:
                continue
    return False


def _zombie_child_waiting() -> bool:
    """Is any child of ours a zombie? ``waitid(WNOWAIT)`` peeks without reaping it."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False
    except OSError:
        return True  # cannot tell: scan


def reap_adopted_zombies(
    *,
    seen: Mapping[int, int] | None = None,
    exclude: Container[int] = (),
    subtree: str | None = None,
    settled: Container[str] = (),
    procs: dict[int, Proc] | None = None,
) -> list[int]:
    """Reap zombie children of this process that provably were not forked by it.

    Provably adopted: ``seen`` (pid -> start ticks, recorded while it ran as a tree
    member), or born in another session, or in the cgroup subtree ``subtree``
    ("/a/b/"), in the cgroup of a ``settled`` tree (one whose leader is known: while a
    tree is being spawned, a zombie in its cgroup may be the leader Trio has not been told
    about yet). ``exclude`` holds pids never to touch (Trio's unreaped tree leaders).
    """
    if procs is None:
        procs = scan_processes()
    me = os.getpid()
    my_sid = os.getsid(0)
    reaped: list[int] = []
    for p in procs.values():
        if p.ppid != me or not p.dead or p.pid in exclude:
            continue
        if not (
            (seen is not None and seen.get(p.pid) == p.start_ticks)
            or p.sid not in (my_sid, p.pid)
            or _in_settled_tree(p.pid, subtree, settled)
        ):
            continue
        try:
            got, _status = os.waitpid(p.pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got == p.pid:
            reaped.append(p.pid)
    return reaped


def _in_settled_tree(pid: int, subtree: str | None, settled: Container[str]) -> bool:
    """Is ``pid`` in the cgroup (below ``subtree``) of a tree in ``settled``?"""
    if subtree is None:
        return False
    path = read_cgroup(pid) or ""
    if not path.startswith(subtree):
        return False
    return path[len(subtree) :].split("/", 1)[0] in settled


# ----------------------------------------------------------------------------- subreaper


def _set_subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1 if on else 0), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if rc != 0:
        logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


# ----------------------------------------------------------------------------- Containment


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
    _leaders: dict[int, Tree] = field(default_factory=dict)
    _tree_ids: set[str] = field(default_factory=set)
    _pending: set[str] = field(default_factory=set)  # prepared, leader not tracked yet
    _leftover: set[str] = field(default_factory=set)  # removed, but their cgroup was not empty
    _adopted: dict[int, int] = field(default_factory=dict)  # pid -> start ticks
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False
    _passes: int = 0
    # Why the daemon contains less than it should (its cgroup subtree vanished and could
    # not be made again, say); None while all is well. Shown by ``status``.
    problem: str | None = None
    # The flock on ``root`` that says a live daemon owns it (see the module comment).
    _root_lock: int | None = None
    _host: str = ""  # this process's HOST_VAR value
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
        """
        want = cgroups if cgroups is not None else (config.cgroups if config is not None else "auto")
        instance = instance or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        is_reaper = False
        if subreaper and os.name == "posix" and hasattr(os, "waitpid"):
            global _subreaper_users
            with _subreaper_lock:
                is_reaper = _subreaper_users > 0 or _set_subreaper(True)
                if is_reaper:
                    _subreaper_users += 1
        root, lock = None, None
        if want == "auto":
            made = _cgroupfs.make_subtree(instance)
            if made is not None:
                root, lock = made
        self = cls(root=root, subreaper=is_reaper, _root_lock=lock, _host=_mark_host())
        logger.info(
            "containment: %s (cgroup subtree %s, subreaper %s)",
            self.mode,
            root,
            "on" if is_reaper else "off",
        )
        return self

    def prepare(self, tree_id: str) -> Path | None:
        """Make the cgroup leaf for a new tree; None when this daemon has no cgroups."""
        with self._lock:
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
        logger.warning("containment: cgroup subtree %s vanished (removed by someone else); made it again", root)
        return True

    def label(self, cgroup: Path | None) -> str:
        """The containment label of a tree that got ``cgroup`` (None: it got none)."""
        return CGROUP if cgroup is not None else self.fallback_mode

    def track(self, tree: Tree) -> None:
        """Note a spawned tree: its leader is Trio's child and must never be reaped here."""
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
            if self._leaders.get(tree.pid) is tree and tree.leader_reaped:
                del self._leaders[tree.pid]
            self._tree_ids.discard(tree.tree_id)
        if tree.cgroup is None:
            return True
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
        return ok

    async def run(
        self,
        *,
        interval_s: float = REAP_INTERVAL_S,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Reap adopted zombies every ``interval_s`` until cancelled (a daemon service).

        The first pass is done before ``task_status.started()``.
        """
        await trio.to_thread.run_sync(self._pass)
        task_status.started()
        while True:
            await trio.sleep(interval_s)
            await trio.to_thread.run_sync(self._pass)

    def _pass(self) -> None:
        # A scan that fails (out of fds, say) is logged and retried next pass: a reaper
        # that died with it would leave zombies, a daemon that died with it every run.
        try:
            if self.root is not None:
                self.check_subtree()
            self.reap_adopted()
        except OSError as exc:
            now = time.monotonic()
            if now - self._scan_failed_at >= SCAN_FAILURE_LOG_INTERVAL_S:
                self._scan_failed_at = now
                logger.warning("containment: a /proc scan failed (%s); retrying every %.0f s", exc, REAP_INTERVAL_S)

    def reap_adopted(self) -> list[int]:
        """Reap zombie children that were adopted, never one of Trio's. Returns their pids.

        Also remembers live adopted children that carry one of our markers, so they can
        be reaped once they die and no longer show their environment.
        """
        if not self.subreaper:
            return []
        me = os.getpid()
        subtree = self._subtree_prefix()
        with self._lock:
            for pid, tree in list(self._leaders.items()):
                self._remember_groups(tree)
                if tree.leader_reaped:  # Trio has its exit status; the pid may be reused
                    del self._leaders[pid]
            leaders = set(self._leaders)
            # Not a pending tree's: its marked child, or a zombie in its cgroup, may be the
            # leader Trio has not been told about yet.
            settled = (self._tree_ids - self._pending) | self._leftover
            seen = dict(self._adopted)
        # The whole table costs the idle daemon in proportion to the machine's process
        # count, so it is read only when some child of ours is a zombie (a peek that reaps
        # nothing), and otherwise every FULL_SCAN_EVERY passes, to note live adopted
        # children. Read without the lock: prepare() and track() run on the Trio thread.
        self._passes += 1
        if self._passes % FULL_SCAN_EVERY != 1 and not _zombie_child_waiting():
            return []
        procs = scan_processes()
        for p in procs.values():
            if p.ppid == me and not p.dead and p.pid not in leaders and p.pid not in seen:
                if marker_of(p) in settled:
                    seen[p.pid] = p.start_ticks
        reaped = reap_adopted_zombies(seen=seen, exclude=leaders, subtree=subtree, settled=settled, procs=procs)
        with self._lock:
            for pid, ticks in seen.items():
                self._adopted.setdefault(pid, ticks)
            for pid, ticks in list(self._adopted.items()):
                if pid in reaped or pid not in procs or procs[pid].start_ticks != ticks:
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
        me = os.getpid()
        my_sid = os.getsid(0)
        subtree = self._subtree_prefix()
        with self._lock:
            leaders = set(self._leaders)
            settled = (self._tree_ids - self._pending) | self._leftover
            remembered = dict(self._adopted)
            spawning = bool(self._pending)
        out: list[Proc] = []
        for p in scan_processes().values():
            if p.ppid != me or p.dead or p.pid in leaders:
                continue
            if (
                remembered.get(p.pid) == p.start_ticks
                or p.sid not in (my_sid, p.pid)
                or _in_settled_tree(p.pid, subtree, settled)
            ):
                out.append(p)
            elif p.sid == p.pid and not spawning and _scrubbed_orphan(p, self._host):
                # Leads its own session, is no runner of ours and shows neither a tree's
                # marker nor our environment: an orphan that called setsid() and
                # scrubbed its environment.
                if age_s(p) >= SETTLED_S:
                    out.append(p)
                elif young is not None:
                    young.append(p)
        return out

    def _subtree_prefix(self) -> str | None:
        if self.root is None:
            return None
        mount = _cgroupfs.cgroup2_mount()
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
        if self._root_lock is not None:
            os.close(self._root_lock)
            self._root_lock = None
        if self.subreaper:
            global _subreaper_users
            with _subreaper_lock:
                _subreaper_users -= 1
                if _subreaper_users == 0:
                    _set_subreaper(False)


