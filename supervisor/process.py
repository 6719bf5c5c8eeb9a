"""Process control: spawn a runner's tree, stop it (path A and path B), find it after a restart.

The only module that sends signals (killpg, pidfd_send_signal, ``cgroup.kill``, taskkill).
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
# Path B, in order: SIGTERM the runner's group; wait up to the grace for the runner to
# exit (the runner owns its tools and applies each running tool's stop policy); then SIGKILL what is
# left: the cgroup, every known group, every swept member (leftovers after the runner
# exited on its own are orphans and get no grace of their own); then wait, bounded, until
# no member runs (zombies are dead), and reap the zombies we adopted.

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import psutil  # type: ignore[import-untyped,unused-ignore]
import trio

from supervisor import _windows
from supervisor.containment import (
    HOST_VAR,
    SETTLED_S,
    age_s,
    CGROUP,
    GROUP,
    MARKER_VAR,
    SUBREAPER_SWEEP,
    Containment,
    cgroup_pids,
    Proc,
    reap_adopted_zombies,
    read_proc,
    scan_processes,
    tree_members,
)
from supervisor._drain import DRAIN_AFTER_EXIT_S, drain_bounded
from supervisor._tree import AdoptedTree, AnyTree, Found, SignalSent, StopReceipt, Tree
from supervisor.errors import SpawnError

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
# How often a tree is re-swept while waiting for death (cgroup.kill takes ~70 ms).
POLL_S: Final = 0.02
# Windows: after ``taskkill /F /T``, how long we wait for the runner to exit; the margin
# there also covers running taskkill twice.
WINDOWS_KILL_WAIT_S: Final = 5.0
WINDOWS_TERMINATE_MARGIN_S: Final = 15.0
# find_tree: a recorded psutil create_time matches within this (it is derived from the
# boot time, which the kernel recomputes from the wall clock).
START_TIME_TOLERANCE_S: Final = 1.0

_POSIX: Final = os.name == "posix"
# Linux: identity, sweeps and reaping read /proc. Elsewhere only groups are signalled.
_HAVE_PROC: Final = os.path.exists("/proc/self/stat")

T = TypeVar("T")


# ----------------------------------------------------------------------------- spawn


async def spawn_tree(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    tree_id: str,
    containment: Containment | None,
) -> Tree:
    """Start ``argv`` as the leader of a new tree: new session, pipes, marker, cgroup.

    The child gets stdin/stdout/stderr pipes, ``env`` (None: this process's environment)
    plus ``AGENTD_TREE=<tree_id>``, and joins the tree's cgroup before it runs a single
    instruction of ``argv`` (so before it can fork). There is no checkpoint after the child
    exists: put its cleanup in place before your next ``await``.

    Raises:
        SpawnError: the child could not be started (the cause is chained).
    """
    if not argv:
        raise SpawnError("expected a command to run, got an empty argv")
    if not tree_id or "\0" in tree_id or "/" in tree_id:
        raise SpawnError(f"expected a tree id without '/' or NUL, got {tree_id!r}")
    child_env = dict(os.environ if env is None else env)
    child_env[MARKER_VAR] = tree_id
    child_env.pop(HOST_VAR, None)  # what the daemon forks besides trees carries it; trees not
    cgroup = containment.prepare(tree_id) if containment is not None else None
    try:
        try:
            proc = await _open_leader(argv, child_env, cwd, cgroup)
        except subprocess.SubprocessError:
            # Only the preexec hook raises this: the child could not join its cgroup and
            # never ran argv, so starting it again without one is safe.
            logger.warning("tree %s: could not join cgroup %s; continuing without it", tree_id, cgroup)
            if containment is not None and cgroup is not None:
                _rmdir_quietly(cgroup)
            cgroup = None
            proc = await _open_leader(argv, child_env, cwd, None)
    except BaseException as exc:  # OSError, or a cancel before the child existed
        if cgroup is not None:
            _rmdir_quietly(cgroup)
        if containment is not None:
            containment.discard(tree_id)
        if isinstance(exc, OSError):
            raise SpawnError(f"cannot start {argv[0]!r}: {exc}") from exc
        raise
    # No await from here on: the caller must own the child before the next checkpoint.
    leader = read_proc(proc.pid) if _POSIX else None
    try:
        start_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        start_time = time.time()
    if containment is not None:
        label = containment.label(cgroup)
    else:
        label = CGROUP if cgroup is not None else GROUP
    tree = Tree(
        tree_id=tree_id,
        pid=proc.pid,
        pgid=proc.pid,
        start_time=start_time,
        cgroup=cgroup,
        containment=label,
        process=proc,
        leader_ticks=leader.start_ticks if leader is not None else None,
    )
    tree.groups[tree.pgid] = tree.leader_ticks
    tree.pipes = _pipe_inodes(proc)
    if containment is not None:
        containment.track(tree)
    logger.debug("tree %s: spawned pid %d (%s) containment %s", tree_id, proc.pid, argv[0], label)
    return tree


async def _open_leader(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str | os.PathLike[str] | None,
    cgroup: Path | None,
) -> trio.Process:
    options: dict[str, Any] = {}
    if _POSIX:
        options["start_new_session"] = True
        if cgroup is not None:
            options["preexec_fn"] = _joiner(os.fsencode(cgroup / "cgroup.procs"))
    else:
        options["creationflags"] = getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)
    return await trio.lowlevel.open_process(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        **options,
    )


def _joiner(procs_file: bytes) -> Callable[[], None]:
    # Runs in the forked child before exec: raw syscalls only, nothing that takes a lock.
    def join_cgroup() -> None:
        fd = os.open(procs_file, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # "0": the writing process itself
        finally:
            os.close(fd)

    return join_cgroup


def _pipe_inodes(proc: trio.Process) -> frozenset[int]:
    inodes: set[int] = set()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        fileno = getattr(stream, "fileno", None)
        if fileno is None:
            continue
        try:
            inodes.add(os.fstat(fileno()).st_ino)
        except (OSError, ValueError):
            continue
    return frozenset(inodes)


def _rmdir_quietly(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


# ----------------------------------------------------------------------------- signals


async def _blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run a /proc scan off the Trio thread (a seam: clock-driven tests run it inline)."""
    return await trio.to_thread.run_sync(fn, *args)


def _killpg(pgid: int, sig: signal.Signals) -> str:
    if pgid <= 1 or pgid == os.getpgrp():  # 0 would be our own group, 1 init's
        return "refused"
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "eperm"
    return "sent"


def _kill_proc(p: Proc, sig: signal.Signals) -> str:
    """Signal exactly the process ``p`` describes, never a later owner of its pid."""
    try:
        fd = os.pidfd_open(p.pid)
    except ProcessLookupError:
        return "gone"
    except OSError:  # no pidfd support: check, then signal by pid (a tiny window remains)
        now = read_proc(p.pid)
        if now is None or now.start_ticks != p.start_ticks:
            return "gone"
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "eperm"
        return "sent"
    try:
        now = read_proc(p.pid)
        if now is None or now.start_ticks != p.start_ticks:
            return "gone"
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "eperm"
    finally:
        os.close(fd)
    return "sent"


def _is_tree_cgroup(path: Path) -> bool:
    """A tree's cgroup lies inside some daemon's agentd-* subtree and does not hold us."""
    return path.parent.name.startswith("agentd-") and os.getpid() not in cgroup_pids(path)


def _cgroup_kill(path: Path) -> str:
    """SIGKILL every process in a cgroup and below it, forks in flight included."""
    if not _is_tree_cgroup(path):
        return "refused"
    try:
        fd = os.open(path / "cgroup.kill", os.O_WRONLY)
    except FileNotFoundError:
        if not path.exists():
            return "gone"
        return _cgroup_kill_by_pid(path)  # kernel < 5.14
    except OSError as exc:
        return f"error: {exc.strerror}"
    try:
        os.write(fd, b"1")
    except OSError as exc:
        return f"error: {exc.strerror}"
    finally:
        os.close(fd)
    return "sent"


def _cgroup_kill_by_pid(path: Path) -> str:
    for pid in cgroup_pids(path):
        p = read_proc(pid)
        if p is not None:
            _kill_proc(p, signal.SIGKILL)
    return "sent"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _live_groups(tree: AnyTree) -> list[int]:
    """The tree's groups that may still exist and are provably still the tree's."""
    out: list[int] = []
    for pgid, ticks in list(tree.groups.items()):  # scans run in a worker thread while add_group may run
        if pgid <= 1:
            continue
        leader = read_proc(pgid)
        if leader is None:
            out.append(pgid)  # leaderless: the number stays reserved while members remain
        elif leader.pgid != pgid:
            continue  # the number now names a non-leader: that group cannot exist
        elif ticks is not None and leader.start_ticks == ticks:
            out.append(pgid)
    return out


def _leader_alive(tree: AnyTree) -> bool:
    # /proc, not Trio's returncode (which polls and needs the Trio thread). A spawned
    # runner's pid cannot be reused before Trio reaps it; a re-adopted one must match the
    # start time we proved.
    if not _HAVE_PROC:  # e.g. macOS: ask Trio, or psutil for a re-adopted runner
        if isinstance(tree, Tree):
            return tree.process.returncode is None
        return _started_at(tree.pid, tree.start_time)
    if tree.leader_ticks is None:  # not provably the recorded process
        return False
    p = read_proc(tree.pid)
    return p is not None and not p.dead and p.start_ticks == tree.leader_ticks


def _started_at(pid: int, start_time: float) -> bool:
    """Does ``pid`` run and has it the psutil create_time ``start_time``?"""
    try:
        created: float = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    return abs(created - start_time) <= START_TIME_TOLERANCE_S


def _cgroup_procs(tree: AnyTree) -> dict[int, Proc] | None:
    """A cgroup tree's processes are exactly its cgroup's (a member cannot leave it), so
    its members are read from ``cgroup.procs`` alone: no scan of the whole process table
    and every environment, which is what made 500 stops at once miss their deadlines."""
    if tree.cgroup is None or not tree.cgroup.is_dir():
        return None
    procs: dict[int, Proc] = {}
    for pid in cgroup_pids(tree.cgroup):
        p = read_proc(pid)
        if p is not None:
            procs[pid] = p
    return procs


def _scan_members(tree: AnyTree) -> tuple[dict[int, Proc], dict[int, Proc]]:
    """A read of the tree's processes (its cgroup, else the whole table) and its members."""
    procs = _cgroup_procs(tree)
    if procs is None:
        procs = scan_processes()
    return procs, _members(tree, procs)


def _members(tree: AnyTree, procs: dict[int, Proc] | None = None) -> dict[int, Proc]:
    if procs is None:
        procs = _cgroup_procs(tree)
    members = tree_members(
        tree.tree_id,
        groups=_live_groups(tree),
        cgroup=tree.cgroup,
        procs=procs,
        pipes=tree.pipes,
    )
    if tree.leader_ticks is not None:
        lead = members.get(tree.pid)
        if lead is not None and lead.start_ticks != tree.leader_ticks:
            del members[tree.pid]
    # Remember the groups and sessions members lead (Chromium's browser leads the session
    # its helpers stay in): once the leader is gone they are still found by number.
    for p in members.values():
        if p.pid in (p.pgid, p.sid) and p.pid not in tree.groups:  # a zombie leader too
            tree.groups[p.pid] = p.start_ticks
    return members


# ----------------------------------------------------------------------------- path A


def soft_stop(tree: AnyTree) -> list[str]:
    """Path A: SIGTERM the runner's group now; fire and forget, idempotent, never raises.

    The runner is the cooperative owner of its tools and applies each running tool's stop
    policy. While it lives, its group is signalled, and so are the groups it reported as
    interruptible (``tree.interruptible``: commands a stop interrupts; seed 000 sends
    run_command's groups SIGTERM at cancel time), so a stuck runner does not keep them
    running; a group whose tool may finish, or an MCP server, is never signalled here.
    Once the runner is gone, every known group is. Returns one line per signal, e.g.
    ``"SIGTERM group 4242: sent"`` ("gone": nothing there; "eperm": maybe alive, not ours
    to signal).
    """
    if not _POSIX:
        return [_windows_fire(_windows.soft_kill_command(tree.pid))]
    if _leader_alive(tree):
        # Runner first: its stop flag is set before its command's death can be seen.
        targets = [tree.pgid] + [g for g in _live_groups(tree) if g in tree.interruptible and g != tree.pgid]
    else:
        targets = _live_groups(tree)
    return [f"SIGTERM group {g}: {_killpg(g, signal.SIGTERM)}" for g in targets]


_fired: list[subprocess.Popen[bytes]] = []  # fire-and-forget taskkills, kept until done


def _windows_fire(cmd: list[str]) -> str:
    _fired[:] = [p for p in _fired if p.poll() is None]
    try:
        _fired.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    except OSError as exc:
        return f"{' '.join(cmd)}: {exc}"
    return f"{' '.join(cmd)}: sent"


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
            await _windows_terminate(tree, grace_s, receipt)
    if scope.cancelled_caught:
        receipt.timed_out = True
        if _POSIX:  # late is bad, leaky is worse: one last kill that needs no scan
            if tree.cgroup is not None:
                _cgroup_kill(tree.cgroup)
            for g in _live_groups(tree):
                _killpg(g, signal.SIGKILL)
        if _POSIX and not receipt.survivors:
            try:
                receipt.survivors = [_describe(p) for p in _members(tree).values() if not p.dead]
            except OSError as exc:
                receipt.survivors = [{"pid": None, "cmdline": f"unknown ({exc})", "state": "?"}]
        logger.warning("tree %s: stop routine hit its deadline; survivors %s", tree.tree_id, receipt.survivors)
    return receipt


def _describe(p: Proc) -> dict[str, Any]:
    return {"pid": p.pid, "cmdline": _cmdline(p.pid), "state": p.state}


async def _posix_terminate(tree: AnyTree, grace_s: float, r: StopReceipt, sigterm_sent: bool = False) -> None:
    def at() -> float:
        return trio.current_time() - r.started_at

    def record(sig: str, target: str, ident: object, result: str, what: str = "") -> None:
        r.signals.append(SignalSent(sig, target, str(ident), round(at(), 4), result, what))

    if _leader_alive(tree):
        if sigterm_sent:
            record("SIGTERM", "group", tree.pgid, "sent by path A")
        else:
            record("SIGTERM", "group", tree.pgid, _killpg(tree.pgid, signal.SIGTERM))
        with trio.move_on_after(grace_s):
            await wait_leader(tree)
        r.waited_s = round(at(), 4)
        if _leader_alive(tree):
            r.escalated = True
            r.leader = "killed"
            logger.warning(
                "tree %s: runner pid %d (%s) still running %.1f s after SIGTERM (the grace); sending SIGKILL to the tree",
                tree.tree_id,
                tree.pid,
                _cmdline(tree.pid),
                r.waited_s,
            )
        else:
            r.leader = "exited"
    else:
        r.leader = "gone"

    # Kill phase: every mechanism once, then re-sweep until nothing of the tree runs.
    # Members are noted first, while they still show marker and cgroup, so that their
    # zombies can be told from Trio's children afterwards.
    try:
        seen_before = {p.pid: p.start_ticks for p in (await _blocking(_members, tree)).values()}
    except OSError as exc:  # out of fds: the kills below need none, the sweep retries
        logger.warning("tree %s: cannot read the process table (%s); killing what is known", tree.tree_id, exc)
        seen_before = {}
    if tree.cgroup is not None:
        record("cgroup.kill", "cgroup", tree.cgroup, _cgroup_kill(tree.cgroup))
    for g in _live_groups(tree):
        record("SIGKILL", "group", g, _killpg(g, signal.SIGKILL))
    killed: dict[int, int] = {}  # pid -> start ticks, so a recycled pid is not re-killed
    seen = dict(seen_before)
    seen.update((g, t) for g, t in tree.groups.items() if g != tree.pid and t is not None)
    leftovers_logged = False
    scan_failed = False
    confirmed = False
    procs: dict[int, Proc] | None = None  # the last table read: its zombies are reaped below
    with trio.move_on_after(KILL_WAIT_S):
        while True:
            try:
                procs, members = await _blocking(_scan_members, tree)
            except OSError as exc:  # out of fds, say: look again at the next poll
                if not scan_failed:
                    logger.warning("tree %s: cannot read the process table (%s); retrying", tree.tree_id, exc)
                    scan_failed = True
                await trio.sleep(POLL_S)
                continue
            seen.update((p.pid, p.start_ticks) for p in members.values())
            alive = [p for p in members.values() if not p.dead]
            if not alive:
                if r.tree_dead_at is None:
                    r.tree_dead_at = trio.current_time()
                    r.tree_dead_after_s = round(at(), 4)
                # Confirm with a second sweep: a process caught mid-exec shows an empty
                # environment for an instant, so one sweep could miss it.
                if confirmed:
                    break
                confirmed = True
                await trio.sleep(POLL_S)
                continue
            r.tree_dead_at = r.tree_dead_after_s = None
            confirmed = False
            fresh = [p for p in alive if killed.get(p.pid) != p.start_ticks]
            if fresh and not r.escalated and not leftovers_logged:
                leftovers_logged = True
                logger.warning(
                    "tree %s: %d processes outlived the runner, killing them: %s",
                    tree.tree_id,
                    len(fresh),
                    ", ".join(f"pid {p.pid} ({_cmdline(p.pid)})" for p in fresh[:5]),
                )
            for p in fresh:
                what = _cmdline(p.pid)
                result = _kill_proc(p, signal.SIGKILL)
                record("SIGKILL", "pid", p.pid, result, what)
                killed[p.pid] = p.start_ticks
                if result == "sent":
                    r.killed.append({"pid": p.pid, "cmdline": what, "state": p.state})
            await trio.sleep(POLL_S)
    if r.tree_dead_at is None:
        try:
            r.survivors = [_describe(p) for p in _members(tree).values() if not p.dead]
        except OSError as exc:
            r.survivors = [{"pid": None, "cmdline": f"unknown: the process table could not be read ({exc})", "state": "?"}]
        logger.warning("tree %s: still alive %.1f s after SIGKILL: %s", tree.tree_id, KILL_WAIT_S, r.survivors)

    # Reap: the runner through Trio, adopted zombies by pid (never Trio's children).
    if isinstance(tree, Tree):
        with trio.move_on_after(REAP_WAIT_S):
            await tree.process.wait()
    # Never the runner: Trio reaps its own child (and a re-adopted runner is not ours).
    # Dead members leave their cgroup's list, so a cgroup tree's zombies are looked up by pid.
    def reap() -> list[int]:
        table = procs if tree.cgroup is None else {pid: p for pid in seen if (p := read_proc(pid)) is not None}
        return reap_adopted_zombies(seen=seen, exclude={tree.pid}, procs=table)

    try:
        r.reaped = await _blocking(reap)
    except OSError as exc:  # the reaping service tries again every second
        logger.warning("tree %s: could not reap its zombies now: %s", tree.tree_id, exc)


async def wait_leader(tree: AnyTree) -> None:
    """Return when the runner has exited (a re-adopted one too); bound it with a deadline."""
    if isinstance(tree, Tree):
        await tree.process.wait()
        return
    try:
        fd = os.pidfd_open(tree.pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = -1
    try:
        if fd >= 0 and _leader_alive(tree):
            await trio.lowlevel.wait_readable(fd)  # readable once the process has exited
        while _leader_alive(tree):
            await trio.sleep(POLL_S)
    finally:
        if fd >= 0:
            os.close(fd)


_wait_leader = wait_leader  # the old private name, still used by runs.py


async def _windows_terminate(tree: AnyTree, grace_s: float, r: StopReceipt) -> None:
    def at() -> float:
        return round(trio.current_time() - r.started_at, 4)

    async def run(cmd: list[str], name: str) -> None:
        try:
            done = await trio.run_process(cmd, check=False, capture_stdout=True, capture_stderr=True)
            result = "sent" if done.returncode == 0 else f"exit {done.returncode}"
        except OSError as exc:
            result = f"error: {exc}"
        r.signals.append(SignalSent(name, "tree", str(tree.pid), at(), result))

    if not isinstance(tree, Tree):  # no handle on a re-adopted tree's exit: force it
        await run(_windows.hard_kill_command(tree.pid), "taskkill /F")
        return
    if tree.process.returncode is None:
        await run(_windows.soft_kill_command(tree.pid), "taskkill")
        with trio.move_on_after(grace_s):
            await tree.process.wait()
        r.waited_s = at()
    r.leader = "exited" if tree.process.returncode is not None else "killed"
    r.escalated = tree.process.returncode is None
    if r.escalated:
        logger.warning("tree %s: pid %d ignored taskkill for %.1f s; forcing", tree.tree_id, tree.pid, r.waited_s)
    await run(_windows.hard_kill_command(tree.pid), "taskkill /F")
    with trio.move_on_after(WINDOWS_KILL_WAIT_S):
        await tree.process.wait()
    if tree.process.returncode is not None:
        r.tree_dead_at = trio.current_time()
        r.tree_dead_after_s = at()
    else:
        r.survivors = [{"pid": tree.pid, "cmdline": "", "state": "?"}]


# ----------------------------------------------------------------------------- liveness


def alive_members(tree: AnyTree) -> list[int]:
    """Pids of the tree's members that still run (zombies are dead), sorted."""
    if not _POSIX:
        return [tree.pid] if isinstance(tree, Tree) and tree.process.returncode is None else []
    return sorted(p.pid for p in _members(tree).values() if not p.dead)


async def wait_tree_gone(tree: AnyTree, timeout: float) -> bool:
    """Wait until no member of the tree runs; False if some still did after ``timeout``."""
    with trio.move_on_after(timeout):
        while await _blocking(alive_members, tree):
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
    young: list[Proc] = []
    try:
        strays = await trio.to_thread.run_sync(lambda: containment.strays(young=young))
        if young:
            # Scrubbed-looking session leaders too young to tell from a process in the
            # middle of an exec: look again once they are settled.
            await trio.sleep(max(0.0, SETTLED_S - min(age_s(p) for p in young)))
            if not (only_if_idle and containment.tracked_trees):  # still nobody to claim them
                seen = {p.pid for p in strays}
                strays += [p for p in await trio.to_thread.run_sync(containment.strays) if p.pid not in seen]
    except OSError as exc:  # out of fds: the next run's end, or shutdown, looks again
        logger.warning("cannot look for untraceable orphans now: %s", exc)
        return []
    killed: list[dict[str, Any]] = []
    for p in strays:
        what = _cmdline(p.pid)
        if _kill_proc(p, signal.SIGKILL) == "sent":
            killed.append({"pid": p.pid, "cmdline": what})
    if killed:
        logger.warning("killed %d adopted orphans no tree claimed: %s", len(killed), killed[:5])
        with trio.move_on_after(KILL_WAIT_S):
            while any(_still_running(p) for p in strays):
                await trio.sleep(POLL_S)
        await trio.to_thread.run_sync(containment.reap_adopted)
    return killed


def _still_running(p: Proc) -> bool:
    now = read_proc(p.pid)
    return now is not None and now.start_ticks == p.start_ticks and not now.dead


# ----------------------------------------------------------------------------- restart


def find_tree(
    tree_id: str,
    *,
    pid: int,
    start_time: float | None,
    cgroup: str | os.PathLike[str] | None,
    groups: Sequence[int] = (),
    containment: str | None = None,
) -> Found:
    """Find a tree recorded by an earlier daemon: is its runner the same process, who is left?

    The runner counts as alive only if ``pid`` runs and its psutil create_time is
    ``start_time`` (within ``START_TIME_TOLERANCE_S``). Members are found by cgroup, marker,
    session/group (the runner's group only while it is provably the same) and ancestry.
    Blocking (a /proc scan): call it through ``trio.to_thread.run_sync`` in async code.

    Raises:
        ValueError: ``pid`` is 0 or 1 (never a runner; killpg(0) would hit the daemon), or
            ``tree_id`` is empty.
    """
    if pid <= 1:
        raise ValueError(f"expected the recorded runner pid, got {pid!r}")
    if not tree_id:
        raise ValueError(f"expected the recorded tree id, got {tree_id!r}")
    leader = read_proc(pid)
    alive = False
    if leader is not None and not leader.dead and start_time is not None:
        alive = _started_at(pid, start_time)
    path = Path(cgroup) if cgroup else None
    if path is not None and not path.is_dir():
        path = None
    if path is not None and not _is_tree_cgroup(path):
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
    )
    # The runner's group: signalled only while its leader is provably the recorded runner
    # or gone with the group leaderless (see _live_groups).
    tree.groups[pid] = tree.leader_ticks
    for g in groups:
        tree.add_group(g)
    members = sorted(p.pid for p in _members(tree, scan_processes()).values() if not p.dead)
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
