"""Process control: spawn a runner's tree, stop it (path A and path B), find it after a restart.

The daemon's only sender of signals, all through the OS edge (``subagent.osedge``: pidfds,
``killpg``, ``cgroup.kill``), and of ``taskkill`` on Windows.
  await spawn_tree(argv, *, env, cwd, tree_id, containment) -> Tree   new session + cgroup
  soft_stop(tree) -> list[str]                   path A: SIGTERM now, fire and forget
  await terminate_and_kill(tree, *, grace_s) -> StopReceipt  path B: shielded, bounded
  alive_members(tree), await wait_tree_gone(tree, timeout), await wait_leader(tree)
  find_tree(...) -> Found, await kill_orphaned_tree(...), await kill_strays(containment)
  await drain_bounded(stream, sink, *, process) -> bool  (from _drain; pipes after exit)
"""

# Identity. Pids wrap at 32768 on this kind of host, so a pid alone names nobody. A tree's
# leader is Trio's child until Trio reaps it, so its pid (= its pgid) cannot be reused
# before that. Every other process is signalled through a pidfd opened after checking the
# start time it had when it was found. A known group is signalled only while its leader
# is the process we learned about or is gone (a group's number is not reused while the
# group has members).
#
# Path B is the OS edge's one escalation routine over the tree (``escalate``): SIGTERM the
# runner's group; wait up to the grace for the runner to exit (the runner owns its tools
# and applies each running tool's stop policy); then SIGKILL what is left: the cgroup,
# every known group, every swept member (leftovers after the runner exited on its own are
# orphans and get no grace of their own); then wait, bounded, until no member runs
# (zombies are dead), and reap the zombies we adopted.

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import trio

from subagent.osedge import (
    Delivery,
    Escalation,
    Proc,
    ProcessId,
    ProcessTable,
    Targets,
    TrioRuntime,
    escalate,
    kill_cgroup,
    open_pidfd,
    signal_group,
    signal_process,
)
from supervisor.trees import _windows
from supervisor.trees._cgroup_events import CgroupEvents
from supervisor.trees._drain import DRAIN_AFTER_EXIT_S, drain_bounded
from supervisor.trees._handles import AdoptedTree, AnyTree, Found, SignalSent, StopReceipt, Tree
from supervisor.trees._spawn import spawn_tree
from supervisor.trees.containment import CGROUP, SETTLED_S, SUBREAPER_SWEEP, Containment, reap_adopted_zombies

__all__ = [
    "DRAIN_AFTER_EXIT_S",
    "TERMINATE_MARGIN_S",
    "KILL_WAIT_S",
    "Tree",
    "AdoptedTree",
    "AnyTree",
    "Found",
    "StopReceipt",
    "SignalSent",
    "spawn_tree",
    "soft_stop",
    "terminate_and_kill",
    "wait_leader",
    "alive_members",
    "wait_tree_gone",
    "find_tree",
    "kill_orphaned_tree",
    "kill_strays",
    "drain_bounded",
]

logger = logging.getLogger(__name__)

# terminate_and_kill's own deadline is grace_s + this: it bounds the kill, death and reap
# waits below together, so the routine ends even if the kernel misbehaves.
TERMINATE_MARGIN_S: Final = 5.0
# After SIGKILL, how long we wait for every member to be dead before naming survivors.
KILL_WAIT_S: Final = 3.0
# Then how long Trio gets to reap the runner (dead by now, unless stuck in the kernel).
# KILL_WAIT_S + REAP_WAIT_S stays inside TERMINATE_MARGIN_S.
REAP_WAIT_S: Final = 1.0
# How often a tree is re-read while waiting for death, where no event says it changed.
POLL_S: Final = 0.02
# Windows: after ``taskkill /F /T``, how long we wait for the runner to exit; the margin
# there also covers running taskkill twice.
WINDOWS_KILL_WAIT_S: Final = 5.0
WINDOWS_TERMINATE_MARGIN_S: Final = 15.0
# find_tree: a recorded create_time matches within this (it is derived from the boot
# time, which the kernel recomputes from the wall clock).
START_TIME_TOLERANCE_S: Final = 1.0

_POSIX: Final = os.name == "posix"
# Linux: identity, sweeps and reaping read /proc. Elsewhere only groups are signalled.
_HAVE_PROC: Final = os.path.exists("/proc/self/stat")


# ----------------------------------------------------------------------------- reads


def _runtime(tree: AnyTree) -> TrioRuntime:
    """Waits on Trio; table reads off the Trio thread unless the kernel is a fake."""
    return TrioRuntime(threads=tree.table.kernel.blocking)


def _is_tree_cgroup(path: Path, table: ProcessTable | None = None) -> bool:
    """A tree's cgroup lies inside some daemon's agentd-* subtree and does not hold us.

    An empty cgroup (``populated 0``: one read) cannot hold us; only a populated one is
    walked for our pid.
    """
    if not path.parent.name.startswith("agentd-"):
        return False
    table = table if table is not None else ProcessTable()
    kernel = table.kernel
    return kernel.cgroup_populated(path) is False or kernel.own_ids()[0] not in kernel.cgroup_pids(path)


def _cgroup_kill(path: Path, table: ProcessTable | None = None) -> str:
    """``cgroup.kill`` of a tree's cgroup; refused for any other cgroup."""
    table = table if table is not None else ProcessTable()
    if not _is_tree_cgroup(path, table):
        return Delivery.REFUSED
    return kill_cgroup(table, path)


def _leader_alive(tree: AnyTree) -> bool:
    # /proc, not Trio's returncode (which polls and needs the Trio thread). A spawned
    # runner's pid cannot be reused before Trio reaps it; a re-adopted one must match the
    # start time we proved.
    if not _HAVE_PROC:  # e.g. macOS: ask Trio; a re-adopted runner cannot be proved
        return isinstance(tree, Tree) and tree.process.returncode is None
    return tree.table.running(tree.pid, tree.leader_ticks)


def _members(tree: AnyTree) -> dict[int, Proc]:
    """The tree's members now (zombies included); remembers the groups they lead."""
    members = tree.table.members(tree.targets())
    tree.learn_leaders(members)
    return members


def _describe(tree: AnyTree, p: Proc) -> dict[str, Any]:
    return {"pid": p.pid, "cmdline": tree.table.cmdline_text(p.pid), "state": p.state}


# ----------------------------------------------------------------------------- path A


def soft_stop(tree: AnyTree) -> list[str]:
    """Path A: SIGTERM the runner's group now; fire and forget, idempotent, never raises.

    The runner is the cooperative owner of its tools and applies each running tool's stop
    policy. While it lives, its group is signalled, and so are the groups it reported as
    interruptible (``tree.interruptible``: commands a stop interrupts; seed 000 sends
    run_command's groups SIGTERM at cancel time), so a stuck runner does not keep them
    running; a group whose tool may finish, or an MCP server, is never signalled here.
    Once the runner is gone, every known group is. A caller stopping a run writes its stop
    marker first (``supervisor.core._run.mark_stop``): the runner takes a SIGTERM with no
    reason there for someone else's. Returns one line per signal, e.g.
    ``"SIGTERM group 4242: sent"`` ("gone": nothing there; "eperm": maybe alive, not ours
    to signal).
    """
    if not _POSIX:
        return [_windows.fire(_windows.soft_kill_command(tree.pid))]
    table = tree.table
    live = table.live_groups(tree.groups)
    if _leader_alive(tree):
        # Runner first: its stop flag is set before its command's death can be seen.
        targets = [tree.pgid] + [g for g in live if g in tree.interruptible and g != tree.pgid]
    else:
        targets = live
    return [f"SIGTERM group {g}: {signal_group(table, g, signal.SIGTERM)}" for g in targets]


# ----------------------------------------------------------------------------- path B


async def terminate_and_kill(tree: AnyTree, *, grace_s: float, sigterm_sent: bool = False) -> StopReceipt:
    """Path B: SIGTERM, grace, SIGKILL the whole tree, confirm death, reap. Never raises.

    Safe to call under a cancelled scope and more than once: it runs shielded, under its
    own deadline of ``grace_s + TERMINATE_MARGIN_S``, and every wait inside is bounded.
    Logs a WARNING when it escalates, naming the process and how long it ran after SIGTERM
    (a runner may be letting a non-interruptible tool finish: not "ignoring" the stop).

    Args:
        tree: a spawned or re-adopted tree.
        grace_s: how long the runner may take to exit after SIGTERM.
        sigterm_sent: path A already sent the runner's group SIGTERM: do not send a second
            one (two can reach the runner apart; one stop must look like one).

    Returns:
        The receipt: signals sent (to what, when), escalation, effective grace, when the
        tree was dead, and any survivor that could not be ended.
    """
    grace_s = max(0.0, grace_s)
    receipt = StopReceipt(
        tree_id=tree.tree_id,
        pid=tree.pid,
        pgid=tree.pgid,
        containment=tree.containment,
        cgroup=str(tree.cgroup) if tree.cgroup is not None else None,
        grace_s=grace_s,
        started_at=trio.current_time(),
    )
    margin = TERMINATE_MARGIN_S if _POSIX else WINDOWS_TERMINATE_MARGIN_S
    with trio.move_on_after(grace_s + margin, shield=True) as scope:
        if _POSIX:
            await _posix_terminate(tree, grace_s, receipt, sigterm_sent)
        else:
            await _windows.terminate(tree, grace_s, receipt, kill_wait_s=WINDOWS_KILL_WAIT_S)
    if scope.cancelled_caught:
        receipt.timed_out = True
        if _POSIX:  # late is bad, leaky is worse: one last kill that needs no scan
            if tree.cgroup is not None:
                _cgroup_kill(tree.cgroup, tree.table)
            for g in tree.table.live_groups(tree.groups):
                signal_group(tree.table, g, signal.SIGKILL)
        if _POSIX and not receipt.survivors:
            try:
                receipt.survivors = [_describe(tree, p) for p in _members(tree).values() if not p.dead]
            except OSError as exc:
                receipt.survivors = [{"pid": None, "cmdline": f"unknown ({exc})", "state": "?"}]
        logger.warning("tree %s: stop routine hit its deadline; survivors %s", tree.tree_id, receipt.survivors)
    return receipt


async def _posix_terminate(tree: AnyTree, grace_s: float, r: StopReceipt, sigterm_sent: bool = False) -> None:
    table = tree.table
    runtime = _runtime(tree)
    leader_alive = _leader_alive(tree)
    targets = tree.targets()
    if targets.cgroup is not None and not _is_tree_cgroup(targets.cgroup, table):
        targets = dataclasses.replace(targets, cgroup=None)
    # A cgroup tree's death is an event (cgroup.events: populated 0), not a poll. Watched
    # from before any signal, so the change cannot come before the watch; through the
    # run's one inotify descriptor (a descriptor of its own costs a slow close per stop).
    events = CgroupEvents.current() if targets.cgroup is not None else None
    watch = (
        events.watch(targets.cgroup / "cgroup.events") if events is not None and targets.cgroup is not None else None
    )

    async def cgroup_changed(timeout: float) -> None:
        assert watch is not None
        await watch.changed(timeout)

    esc = Escalation(started_at=r.started_at)
    try:
        await escalate(
            targets,
            grace_s=grace_s,
            kill_wait_s=KILL_WAIT_S,
            table=table,
            runtime=runtime,
            sigterm=leader_alive,
            term=Targets(groups={tree.pgid: tree.leader_ticks}),
            term_sent="sent by path A" if sigterm_sent else None,
            settled=lambda: wait_leader(tree),
            learn=tree.learn_leaders,
            label=f"tree {tree.tree_id}",
            leader=f"the runner (pid {tree.pid}, {table.cmdline_text(tree.pid)})" if leader_alive else "the runner",
            log=logger,
            poll_s=POLL_S,
            into=esc,
            wait_change=cgroup_changed if watch is not None else None,
        )
    finally:  # also when the routine's own deadline cut it short: what it did so far
        if watch is not None:
            watch.close()
        r.signals = list(esc.signals)
        r.waited_s = esc.waited_s
        r.escalated = esc.escalated
        r.leader = "gone" if not leader_alive else ("killed" if esc.escalated else "exited")
        r.killed = esc.killed
        r.tree_dead_at, r.tree_dead_after_s = esc.dead_at, esc.dead_after_s
        if esc.dead_at is None and esc.survivors:
            r.survivors = [_describe(tree, p) for p in esc.survivors]
        elif esc.dead_at is None and esc.read_failed:
            r.survivors = [{"pid": None, "cmdline": "unknown: the process table could not be read", "state": "?"}]

    # Reap: the runner through Trio, adopted zombies by pid (never Trio's children).
    if isinstance(tree, Tree):
        with trio.move_on_after(REAP_WAIT_S):
            await tree.process.wait()
    seen = dict(esc.seen)
    seen.update((g, t) for g, t in tree.groups.items() if g != tree.pid and t is not None)

    # Never the runner: Trio reaps its own child (and a re-adopted runner is not ours).
    # Dead members leave their cgroup's list, so a cgroup tree's zombies are looked up by pid.
    def reap() -> list[int]:
        procs = esc.last if tree.cgroup is None else table.read_many(seen)
        return reap_adopted_zombies(table, seen=seen, exclude={tree.pid}, procs=procs)

    try:
        r.reaped = await runtime.run_sync(reap)
    except OSError as exc:  # the reaping service tries again
        logger.warning("tree %s: could not reap its zombies now: %s", tree.tree_id, exc)


async def wait_leader(tree: AnyTree) -> None:
    """Return when the runner has exited (a re-adopted one too); bound it with a deadline."""
    if isinstance(tree, Tree):
        await tree.process.wait()
        return
    try:
        fd = open_pidfd(tree.table, ProcessId(tree.pid, tree.leader_ticks)) if tree.leader_ticks is not None else None
    except OSError:
        fd = -1  # no pidfds here: poll
    if fd is None:
        return  # gone, or never provably the recorded runner
    try:
        if fd >= 0 and _leader_alive(tree):
            await trio.lowlevel.wait_readable(fd)  # readable once the process has exited
        while _leader_alive(tree):
            await trio.sleep(POLL_S)
    finally:
        if fd >= 0:
            tree.table.kernel.close(fd)


# ----------------------------------------------------------------------------- liveness


def alive_members(tree: AnyTree) -> list[int]:
    """Pids of the tree's members that still run (zombies are dead), sorted."""
    if not _POSIX:
        return [tree.pid] if isinstance(tree, Tree) and tree.process.returncode is None else []
    return sorted(p.pid for p in _members(tree).values() if not p.dead)


async def wait_tree_gone(tree: AnyTree, timeout: float) -> bool:
    """Wait until no member of the tree runs; False if some still did after ``timeout``."""
    runtime = _runtime(tree)
    with trio.move_on_after(timeout):
        while await runtime.run_sync(lambda: alive_members(tree)):
            await trio.sleep(POLL_S)
        return True
    return False


async def kill_strays(containment: Containment, *, only_if_idle: bool = True) -> list[dict[str, Any]]:
    """SIGKILL adopted orphans that no tree claims, then reap them; returns what was killed.

    Every process a subreaper adopts descends from something this daemon started, but
    one that left its session, its ancestry and its environment cannot be traced to a
    tree. With ``only_if_idle`` this acts only while no tree is tracked (every run has
    ended); call it with ``only_if_idle=False`` at shutdown after every run is stopped.
    """
    if not _POSIX or (only_if_idle and containment.tracked_trees):
        return []
    table = containment.table
    runtime = TrioRuntime(threads=table.kernel.blocking)
    young: list[Proc] = []
    try:
        strays = await runtime.run_sync(lambda: containment.strays(young=young))
        if young:
            # Scrubbed-looking session leaders too young to tell from a process in the
            # middle of an exec: look again once they are settled.
            await trio.sleep(max(0.0, SETTLED_S - min(table.age_s(p) for p in young)))
            if not (only_if_idle and containment.tracked_trees):  # still nobody to claim them
                seen = {p.pid for p in strays}
                strays += [p for p in await runtime.run_sync(containment.strays) if p.pid not in seen]
    except OSError as exc:  # out of fds: the next run's end, or shutdown, looks again
        logger.warning("cannot look for untraceable orphans now: %s", exc)
        return []
    killed: list[dict[str, Any]] = []
    for p in strays:
        what = table.cmdline_text(p.pid)
        if signal_process(table, p, signal.SIGKILL) == Delivery.SENT:
            killed.append({"pid": p.pid, "cmdline": what})
    if killed:
        logger.warning("killed %d adopted orphans no tree claimed: %s", len(killed), killed[:5])
        with trio.move_on_after(KILL_WAIT_S):
            while any(table.running(p.pid, p.start_ticks) for p in strays):
                await trio.sleep(POLL_S)
        await runtime.run_sync(containment.reap_adopted)
    return killed


# ----------------------------------------------------------------------------- restart


def find_tree(
    tree_id: str,
    *,
    pid: int,
    start_time: float | None,
    cgroup: str | os.PathLike[str] | None,
    groups: Sequence[int] = (),
    containment: str | None = None,
    table: ProcessTable | None = None,
) -> Found:
    """Find a tree recorded by an earlier daemon: is its runner the same process, who is left?

    The runner counts as alive only if ``pid`` runs and started at ``start_time`` (the
    wall clock, within ``START_TIME_TOLERANCE_S``). Members are found by cgroup, marker,
    session/group (the runner's group only while it is provably the same) and ancestry.
    Blocking (a /proc scan): call it through ``trio.to_thread.run_sync`` in async code.

    Args:
        table: whose process-table reads to use (the containment's; default: a new one).

    Raises:
        ValueError: ``pid`` is 0 or 1 (never a runner; killpg(0) would hit the daemon), or
            ``tree_id`` is empty.
    """
    if pid <= 1:
        raise ValueError(f"expected the recorded runner pid, got {pid!r}")
    if not tree_id:
        raise ValueError(f"expected the recorded tree id, got {tree_id!r}")
    table = table if table is not None else ProcessTable()
    leader = table.read(pid)
    alive = (
        leader is not None
        and not leader.dead
        and start_time is not None
        and abs(table.wall_start(leader) - start_time) <= START_TIME_TOLERANCE_S
    )
    path = Path(cgroup) if cgroup else None
    if path is not None and not path.is_dir():
        path = None
    if path is not None and not _is_tree_cgroup(path, table):
        logger.warning("tree %s: recorded cgroup %s is not a tree's; ignoring it", tree_id, path)
        path = None
    label = containment or (CGROUP if path is not None else SUBREAPER_SWEEP)
    tree = AdoptedTree(
        tree_id=tree_id,
        pid=pid,
        pgid=pid,
        start_time=start_time if start_time is not None else 0.0,
        cgroup=path,
        containment=label,
        leader_ticks=leader.start_ticks if alive and leader is not None else None,
        table=table,
    )
    # The runner's group: signalled only while its leader is provably the recorded runner
    # or gone with the group leaderless (see ProcessTable.live_groups).
    tree.groups[pid] = tree.leader_ticks
    for g in groups:
        tree.add_group(g)
    members = sorted(p.pid for p in _members(tree).values() if not p.dead)
    return Found(tree=tree, leader_alive=alive, members=members)


async def kill_orphaned_tree(
    tree_id: str,
    *,
    pid: int,
    start_time: float | None,
    cgroup: str | os.PathLike[str] | None,
    groups: Sequence[int] = (),
    grace_s: float = 0.0,
) -> StopReceipt:
    """Sweep a lost tree (cgroup + marker + provable groups) and end all of it."""
    found = await trio.to_thread.run_sync(
        lambda: find_tree(tree_id, pid=pid, start_time=start_time, cgroup=cgroup, groups=groups)
    )
    return await terminate_and_kill(found.tree, grace_s=grace_s)
