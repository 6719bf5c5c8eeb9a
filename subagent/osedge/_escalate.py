"""The one escalation routine: SIGTERM, grace, SIGKILL everything left, confirm, give up loudly.

``escalate(targets, grace_s=, kill_wait_s=)`` ends a target set (``Targets``) in bounded
time, and says what it did: every signal (to what, when, with what outcome), whether it
had to escalate, when no member was left, and any survivor. Every cancel in agentd ends
here: a run's whole tree (the daemon's path B), a command's or an MCP server's group and
the escapers that carry its marker, a browser's helpers found by command line.

Order: SIGTERM the ``term`` set (default: the targets): its live groups by ``killpg``,
other members by pidfd; wait up to ``grace_s`` for it to settle (every member dead, or
the caller's ``settled`` awaitable returned: a leader's exit); then, unless the set
already settled whole, SIGKILL: the cgroup (``cgroup.kill``), every live group, and every
member by pidfd, re-resolving the set each round (new helpers may appear while the rest
dies) until two reads in a row find no live member, or ``kill_wait_s`` passes. A zombie
is dead. A group of the set whose leader is the caller's child and has not exited, though
the table shows none of it (a ``hidepid`` /proc lists no process its reader may not
ptrace-read: a non-dumpable one), is alive: signalled by ``killpg`` and waited for like
any member (``unseen``). So is a set bound to its cgroup whose ``cgroup.events`` says
``populated`` while the table shows no live member of it (``in_cgroup_unseen``): such a
process gets its SIGTERM by pidfd (``signal_unseen``), its SIGKILL by ``cgroup.kill``,
and the set is dead once the cgroup is empty. Nothing here shields a cancel: callers run it shielded, and its
own waits are bounded by ``grace_s`` and ``kill_wait_s``.

Waits, threads and the clock go through a ``Runtime`` (``TrioRuntime`` for both sides,
which run on Trio; it imports trio only when made, so this package stays stdlib-only).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from subagent.osedge._kernel import Proc
from subagent.osedge._signal import Delivery, group_exists, kill_cgroup, signal_group, signal_process, signal_unseen
from subagent.osedge._table import ProcessTable, Targets

__all__ = ["Runtime", "TrioRuntime", "Signalled", "Escalation", "escalate", "POLL_S"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Between two reads of a target set while waiting for it to die (seconds): cgroup.kill
# takes ~70 ms, a SIGKILLed process a few ms.
POLL_S: Final = 0.02

SIGTERM: Final = 15
SIGKILL: Final = 9


class Runtime(Protocol):
    """The waits of the routine: a clock, sleeps, blocking reads off the event loop."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def run_sync(self, fn: Callable[[], T]) -> T:
        """Run a blocking read (a table walk) without stalling the event loop."""
        ...

    async def wait_for(self, fn: Callable[[], Awaitable[object]], timeout: float) -> bool:
        """Await ``fn()`` for at most ``timeout`` seconds: True if it returned."""
        ...

    async def wait_readable(self, fd: int, timeout: float) -> bool:
        """Wait until ``fd`` is readable, at most ``timeout`` seconds: True if it is."""
        ...


class TrioRuntime:
    """``Runtime`` on Trio. ``threads=False`` runs blocking reads inline (fake kernels)."""

    def __init__(self, *, threads: bool = True) -> None:
        import trio  # here, not at import: the package stays importable without trio

        self._trio = trio
        self._threads = threads

    def now(self) -> float:
        return float(self._trio.current_time())

    async def sleep(self, seconds: float) -> None:
        await self._trio.sleep(max(0.0, seconds))

    async def run_sync(self, fn: Callable[[], T]) -> T:
        if not self._threads:
            await self._trio.lowlevel.checkpoint()
            return fn()
        try:
            return await self._trio.to_thread.run_sync(fn)
        except RuntimeError as exc:
            if "can't start new thread" not in str(exc):
                raise
            # No thread to be had (a run at its pids limit stopping its own command): the
            # read on the loop, as without threads; a stop never fails for want of one.
            return fn()

    async def wait_for(self, fn: Callable[[], Awaitable[object]], timeout: float) -> bool:
        with self._trio.move_on_after(max(0.0, timeout)):
            await fn()
            return True
        return False

    async def wait_readable(self, fd: int, timeout: float) -> bool:
        with self._trio.move_on_after(max(0.0, timeout)):
            await self._trio.lowlevel.wait_readable(fd)
            return True
        return False


@dataclass(frozen=True, slots=True)
class Signalled:
    """One signal sent (or not) by the routine."""

    signal: str  # "SIGTERM", "SIGKILL", "cgroup.kill"
    target: str  # "group", "pid", "cgroup"
    id: str  # pgid, pid or cgroup path
    at_s: float  # seconds after the routine started
    result: str  # a ``Delivery`` ("sent", "gone", "eperm", "refused", "error"), or a note
    what: str = ""  # the process's command line, for pid targets


@dataclass(slots=True)
class Escalation:
    """What ``escalate`` did and saw. Times are seconds after it started."""

    started_at: float  # on the runtime's clock
    signals: list[Signalled] = field(default_factory=list)
    term_sent: bool = False
    settled: bool = False  # the term set settled in the grace
    escalated: bool = False  # it did not: SIGKILL came at the end of the grace
    waited_s: float = 0.0  # SIGTERM to SIGKILL (or to the settling)
    dead_at: float | None = None  # on the runtime's clock: no member left alive
    dead_after_s: float | None = None
    killed: list[dict[str, Any]] = field(default_factory=list)  # SIGKILLed by pid: pid, cmdline, state
    survivors: list[Proc] = field(default_factory=list)  # alive at the end
    seen: dict[int, int] = field(default_factory=dict)  # every member seen: pid -> start ticks
    last: dict[int, Proc] = field(default_factory=dict)  # the last read of the set's universe
    read_failed: bool = False  # some read of the table failed (out of fds): retried

    @property
    def dead(self) -> bool:
        return self.dead_at is not None and not self.survivors


async def escalate(
    targets: Targets,
    *,
    grace_s: float,
    kill_wait_s: float,
    table: ProcessTable | None = None,
    runtime: Runtime | None = None,
    sigterm: bool = True,
    term: Targets | None = None,
    term_sent: str | None = None,
    settled: Callable[[], Awaitable[object]] | None = None,
    learn: Callable[[Mapping[int, Proc]], None] | None = None,
    wait_change: Callable[[float], Awaitable[object]] | None = None,
    label: str = "process group",
    leader: str = "",
    log: logging.Logger = logger,
    poll_s: float = POLL_S,
    into: Escalation | None = None,
) -> Escalation:
    """End ``targets``: SIGTERM, up to ``grace_s`` to settle, SIGKILL, up to ``kill_wait_s``.

    Never raises for the OS (a failed table read is logged and retried). Run it shielded.

    Args:
        targets: the whole set SIGKILL must leave dead.
        grace_s: how long the term set may take after SIGTERM (0: SIGKILL at once).
        kill_wait_s: after SIGKILL, how long every member may take to be dead.
        table: whose reads and cache to use (default: a table of its own).
        runtime: waits and threads (default: ``TrioRuntime()``).
        sigterm: False: no SIGTERM at all (the term set is known to be gone, or a
            SIGKILL-only sweep).
        term: the set SIGTERM goes to and whose settling ends the grace (default:
            ``targets``).
        term_sent: SIGTERM already went out (a note for the record, e.g. "sent by path
            A"): record it, do not send a second one.
        settled: the grace ends when this returns (e.g. the leader's exit) instead of when
            no member of the term set is alive.
        learn: called with each read of the set's members (the daemon remembers the
            groups and sessions they lead).
        wait_change: waits (bounded by its argument) for a sign that the set changed
            (``cgroup.events``), instead of sleeping ``poll_s`` between reads.
        label, leader: name the set and what the grace waits for, in WARNINGs.
        log: the caller's logger.
        into: the record to fill as it goes (a caller whose own deadline may cut the
            routine short still sees what was done; ``started_at`` is reset).
    """
    table = table if table is not None else ProcessTable()
    rt = runtime if runtime is not None else TrioRuntime(threads=table.kernel.blocking)
    grace_s = max(0.0, grace_s)
    r = into if into is not None else Escalation(started_at=0.0)
    r.started_at = rt.now()
    term_set = term if term is not None else targets

    def at() -> float:
        return round(rt.now() - r.started_at, 4)

    def record(sig: str, target: str, ident: object, result: str, what: str = "") -> None:
        r.signals.append(Signalled(sig, target, str(ident), at(), str(result), what))

    async def read(t: Targets) -> dict[int, Proc] | None:
        def members() -> tuple[dict[int, Proc], dict[int, Proc]]:
            universe = table.universe(t)
            return universe, table.members(t, universe)

        try:
            universe, found = await rt.run_sync(members)
        except OSError as exc:  # out of fds, say: the kills need none; look again
            if not r.read_failed:
                log.warning("%s: cannot read the process table (%s); retrying", label, exc)
                r.read_failed = True
            return None
        if t is targets:
            r.last = universe
            r.seen.update((p.pid, p.start_ticks) for p in found.values())
        if learn is not None:
            learn(found)
        return found

    def unseen(t: Targets, found: Mapping[int, Proc]) -> list[int]:
        # The set's live groups whose leader, a child of the caller that has not exited
        # (``waitid`` peeks: no /proc needed), the table does not list, nor any process of
        # its group. A process the caller may not ptrace-read is absent from a
        # ``hidepid=invisible`` /proc (a runner's): a command that made itself non-dumpable
        # (its zombie too), or a shell in the first instant of its exec from the
        # non-dumpable runner. Only a child's: ``killpg(pgid, 0)`` counts zombies, which a
        # set bound to its cgroup does not list.
        _me, my_pgid, my_sid = table.kernel.own_ids()
        shown = {p.pgid for p in found.values()}
        return [
            g
            for g in table.live_groups(t.groups)
            if g not in shown
            and g not in (my_pgid, my_sid)
            and table.read(g) is None
            and table.kernel.child_exited(g) is False
        ]

    def in_cgroup_unseen(t: Targets) -> bool:
        # The set's cgroup holds a process though the read found no live member: one the
        # table cannot read (``cgroup.procs`` lists it; a ``hidepid`` /proc, a runner's,
        # lists no non-dumpable process: a command's ssh-agent, in or out of its group,
        # its leader gone). ``populated`` counts no zombie (v2: a process leaves the count
        # as it exits, before it is reaped; measured on 6.18). Never a cgroup holding the
        # caller (never a member, never killed: ``kill_cgroup``).
        if t.cgroup is None or table.kernel.cgroup_populated(t.cgroup) is not True:
            return False
        try:
            return table.kernel.own_ids()[0] not in table.kernel.cgroup_pids(t.cgroup)
        except OSError:
            return True

    async def alive(t: Targets) -> list[Proc] | None:
        """The set's live members; None when unknown: the read failed, or a group of the
        set is alive though the table shows none of it (``unseen``), or its cgroup holds
        a process the table shows not (``in_cgroup_unseen``)."""
        # Groups alone: killpg(pgid, 0) answers without a walk of the table when gone.
        if not (t.pids or t.marker or t.cgroup or t.cmdline or t.pipes) and not any(
            group_exists(table, g) for g in t.groups
        ):
            return []
        found = await read(t)
        if found is None:
            return None
        live = [p for p in found.values() if not p.dead]
        return None if not live and (unseen(t, found) or in_cgroup_unseen(t)) else live

    # ---- SIGTERM and the grace
    if sigterm:
        if term_sent is not None:
            for g in term_set.groups:
                record("SIGTERM", "group", g, term_sent)
            r.term_sent = True
        else:
            # With ``settled`` the caller knows its leader runs: no read of the set first.
            live = await alive(term_set) if settled is None else None
            if live == [] and term is None:  # nothing of the set runs: nothing to do
                r.settled = True
                r.dead_at, r.dead_after_s = rt.now(), at()
                return r
            if live is None or live:
                groups = table.live_groups(term_set.groups)
                for g in groups:
                    record("SIGTERM", "group", g, signal_group(table, g, SIGTERM))
                for p in live or ():
                    if p.pgid not in groups:
                        record("SIGTERM", "pid", p.pid, signal_process(table, p, SIGTERM), table.cmdline_text(p.pid))
                if term_set.cgroup is not None:  # those it holds out of the table's sight
                    for pid, result in signal_unseen(table, term_set.cgroup, SIGTERM).items():
                        record("SIGTERM", "pid", pid, result, "(out of the table's sight)")
                r.term_sent = True
        if r.term_sent:
            deadline = r.started_at + grace_s
            if settled is not None:
                r.settled = await rt.wait_for(settled, deadline - rt.now())
            else:
                while True:
                    left = await alive(term_set)
                    if left == []:
                        r.settled = True
                        break
                    if rt.now() >= deadline:
                        break
                    await rt.sleep(min(poll_s, deadline - rt.now()))
            r.waited_s = at()
            r.escalated = not r.settled
            if r.escalated:
                log.warning(
                    "%s still running %.1f s after SIGTERM (the grace); sending SIGKILL",
                    f"{label}: {leader}" if leader else label,
                    r.waited_s,
                )
            if r.settled and term is None and settled is None:
                r.dead_at, r.dead_after_s = rt.now(), at()
                return r  # the whole set ended in the grace

    # ---- SIGKILL until nothing of the set runs
    if targets.cgroup is not None and table.kernel.cgroup_populated(targets.cgroup) is False:
        # A set bound to its cgroup is what the cgroup holds (``universe``), and it holds
        # nothing: a process leaves it only by exiting, so no fork, exec or escape hides
        # from ``populated``. Dead, with no walk of the cgroup and nothing to kill (a tree
        # whose runner ended its own tools: most stops). Its groups get their SIGKILL, as
        # below: a belt for a group that has a member outside the cgroup.
        for g in table.live_groups(targets.groups):
            record("SIGKILL", "group", g, signal_group(table, g, SIGKILL))
        r.dead_at, r.dead_after_s = rt.now(), at()
        return r
    await read(targets)  # note the members while they still show marker and cgroup
    if targets.cgroup is not None:
        record("cgroup.kill", "cgroup", targets.cgroup, kill_cgroup(table, targets.cgroup, fd=targets.cgroup_kill_fd))
    for g in table.live_groups(targets.groups):
        record("SIGKILL", "group", g, signal_group(table, g, SIGKILL))
    killed: dict[int, int] = {}  # pid -> start ticks: a recycled pid is not re-killed
    logged = False
    confirmed = False
    # A process caught mid-exec shows an empty environment for an instant, so a set found
    # by marker, ancestry or command line is read twice empty before it counts as dead;
    # a set bound to its cgroup is read from cgroup.procs, which no exec hides.
    confirm = bool(targets.marker or targets.follow or targets.cmdline) and not table.cgroup_bound(targets)
    kill_deadline = rt.now() + max(0.0, kill_wait_s)
    last_alive: list[Proc] = []
    hidden: list[int] = []  # groups of the set alive out of the table's sight (``unseen``)
    hidden_in_cgroup = False  # its cgroup holds a process out of the table's sight
    while True:
        found = await read(targets)
        if found is not None:
            last_alive = [p for p in found.values() if not p.dead]
            hidden = [] if last_alive else unseen(targets, found)  # (SIGKILLed above, by group)
            hidden_in_cgroup = not last_alive and in_cgroup_unseen(targets)  # (by cgroup.kill)
            if not last_alive and not hidden and not hidden_in_cgroup:
                if r.dead_at is None:
                    r.dead_at, r.dead_after_s = rt.now(), at()
                if confirmed or not confirm:
                    break
                confirmed = True
            else:
                r.dead_at = r.dead_after_s = None
                confirmed = False
                fresh = [p for p in last_alive if killed.get(p.pid) != p.start_ticks]
                if fresh and not r.escalated and not logged:
                    logged = True
                    log.warning(
                        "%s: %d processes outlived %s, killing them: %s",
                        label,
                        len(fresh),
                        leader or "the stop",
                        ", ".join(f"pid {p.pid} ({table.cmdline_text(p.pid)})" for p in fresh[:5]),
                    )
                for p in fresh:
                    what = table.cmdline_text(p.pid)
                    result = signal_process(table, p, SIGKILL)
                    record("SIGKILL", "pid", p.pid, result, what)
                    killed[p.pid] = p.start_ticks
                    if result == Delivery.SENT:
                        r.killed.append({"pid": p.pid, "cmdline": what, "state": p.state})
        remaining = kill_deadline - rt.now()
        if remaining <= 0:
            break
        if wait_change is not None and found is not None and not confirmed:
            await wait_change(min(remaining, 10 * poll_s))  # bounded: a missed event costs a round
        else:
            await rt.sleep(min(poll_s, remaining))
    if r.dead_at is None:
        r.survivors = last_alive
        log.warning(
            "%s: still alive %.1f s after SIGKILL; abandoning: %s",
            label,
            kill_wait_s,
            ", ".join(
                [f"pid {p.pid} ({table.cmdline_text(p.pid)})" for p in last_alive[:5]]
                + [f"group {g} (its processes out of sight)" for g in hidden]
                + ([f"cgroup {targets.cgroup} (populated; its processes out of sight)"] if hidden_in_cgroup else [])
            )
            or "unknown",
        )
    return r
