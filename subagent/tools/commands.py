"""The built-in ``run_command`` tool: one foreground shell command in its own process group.

Invariants: the command runs as ``/bin/sh -c`` in a new session (pgid == pid, reported
alive=True before any output is read and alive=False only once the whole group is gone);
captured output is bounded (the head is kept, the rest counted and dropped); when the
shell exits, whatever it left in its group, or in its call's cgroup
(``subagent.callgroups``: where it has one, even an escaper that emptied its environment),
or that escaped the group but carries this command's marker variable, is ended: nothing a
command starts outlives its call. A stop (when the call's policy is ``interrupt``), a
timeout or an explicit interrupt (a repeated SIGINT to the runner) ends the group at once
(SIGTERM, SIGKILL after a short grace) and returns the output captured so far and how the
command ended; a stop after its shell exited by itself ends what it left with the stop's
grace, and the command counts as done before the stop. The child gets the tool
environment (``subagent.sandbox.tool_env``: an allowlist, never the model key), and runs
in the runner's working directory (the run dir, or the spec's ``sandbox.workdir``).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import trio

from subagent import callgroups
from subagent.callgroups import TREE_VAR as TREE_VAR
from subagent.callgroups import own_tree_cgroup as own_tree_cgroup
from subagent.osedge import ProcessTable, Targets, TrioRuntime, escalate
from subagent.sandbox import tool_env
from subagent.tools._gate import open_gate, open_gated

__all__ = [
    "CommandOutcome",
    "run_command",
    "end_group_and_escapers",
    "RUN_COMMAND_TOOL",
    "SUBTREE_VAR",
    "format_outcome",
    "killed_by_signal",
    "kill_unreaped_group",
    "leader_ticks",
    "own_leader_ticks",
    "STOP_SETTLE_S",
]

logger = logging.getLogger(__name__)

# How long a shell let go at its gate may take to exit before it is killed (seconds).
GATE_EXIT_S: Final = 1.0
# After the shell exits, how long a descendant holding the pipe may keep writing (seconds).
DRAIN_AFTER_EXIT_S: Final = 0.5
# After the group is gone, how long the last buffered output may take to drain (seconds).
FINAL_DRAIN_S: Final = 0.2
# Bounds closing our end of the command's stdout pipe (seconds).
PIPE_CLOSE_TIMEOUT_S: Final = 0.1
# Between SIGTERM and SIGKILL for a command's group on timeout or interrupt (seconds); after
# a stop, spec.DEFAULT_COMMAND_STOP_GRACE_S unless ``stop_policy.command_grace_s`` says otherwise.
COMMAND_KILL_GRACE_S: Final = 2.0
# A command killed by a signal while the run's stop is not (yet) set may have been killed
# by the daemon's path A, which signals the runner and the command's group together: the
# runner's own SIGTERM is then in flight. How long we wait for it before calling the
# command's death its own (seconds; only ever waited for a command killed by a signal).
STOP_SETTLE_S: Final = 0.2
# Exit statuses of a shell whose child died of SIGTERM/SIGKILL (128 + signal number).
SHELL_SIGNAL_EXITS: Final = frozenset({128 + 15, 128 + 9})
READ_CHUNK_BYTES: Final = 65536
# A command that goes on after the run's stop (its policy lets it finish) reports its output
# at the stop and this often after (seconds): if the grace runs out, that much is kept.
OUTPUT_REPORT_S: Final = 1.0
# Marks every process a command starts, so escapers can be found after the group kill.
SUBTREE_VAR: Final = "AGENTD_SUBTREE"
# After SIGKILL, how long a group and its escapers may take to be dead before the runner
# gives up on them, loudly (seconds).
GROUP_KILL_REAP_S: Final = 2.0
# ``sighted_ticks``: how long a new shell may stay out of sight, and between looks (seconds).
LEADER_SIGHT_S, LEADER_SIGHT_POLL_S = 1.0, 0.002

_seq = itertools.count(1)

RUN_COMMAND_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "run_command",
        "description": (
            "Run a shell command (/bin/sh -c) in the run's working directory and return its exit "
            "code and combined stdout/stderr (bounded). Foreground only: anything the command "
            "leaves running is stopped when it exits."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command line."},
                "timeout_s": {
                    "type": "number",
                    "description": "Optional timeout in seconds (capped by the run's limit).",
                },
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}


@dataclass(slots=True)
class CommandOutcome:
    pid: int | None
    exit_code: int | None
    output: str
    truncated: bool
    timed_out: bool = False
    interrupted: bool = False  # the interrupt scope was cancelled (an explicit interrupt or the stop)
    spawn_error: str | None = None
    not_started: bool = False  # the stop came first: the command was never spawned
    by_stop: bool = False  # the run's stop interrupted it (its ``stop`` event fired while it ran)
    stop_at: float | None = None  # trio clock: when the stop reached it
    ended_at: float | None = None  # trio clock: when its group was gone
    # Its shell exited by itself before any stop was asked: what came after (its output's
    # drain, the end of what it left running) is no part of the command's outcome.
    finished_before_stop: bool = False
    # Something of it outlived its SIGTERM (the shell died of it, a child ignored it): it
    # was SIGKILLed at the end of the grace. The shell's own exit does not say so.
    killed_after_grace: bool = False

    @property
    def ended_by(self) -> str:
        """How the command ended: ``exit 0``, ``SIGTERM``, ``SIGKILL``, ..."""
        return ended_by(self.exit_code)


def ended_by(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def format_outcome(o: CommandOutcome, *, foreign_signal: bool = False) -> str:
    """The text the model sees. ``foreign_signal``: the run stopped on a signal no stop of
    the daemon's sent (``subagent.stopmark``): a command the stop ended says that."""
    if o.spawn_error is not None:
        return f"error: could not start the command: {o.spawn_error}"
    if o.exit_code is None:
        head = "[no exit code]"
    elif o.exit_code < 0:
        head = f"[killed by {o.ended_by}]"
    else:
        head = f"[exit code {o.exit_code}]"
    if o.timed_out:
        head += " [timed out: the command was stopped]"
    # What it wrote until then follows, if anything: never "below" with nothing there.
    so_far = "output so far below" if o.output else "it had written no output"
    if o.by_stop and foreign_signal:
        head += (
            f" [interrupted as the run stopped on a SIGTERM not sent by agentd's stop: "
            f"the command was stopped; {so_far}]"
        )
    elif o.by_stop:
        head += f" [interrupted by the stop: the command was stopped; {so_far}]"
    elif o.interrupted:
        head += " [interrupted: the command was stopped]"
    if o.killed_after_grace and (o.interrupted or o.timed_out or o.by_stop):  # (by_stop: path A's)
        head += " [what it started did not end on SIGTERM: SIGKILLed at the end of the grace]"
    if o.truncated:
        head += " [output truncated]"
    return f"{head}\n{o.output}"


async def end_group_and_escapers(
    pgid: int,
    leader_ticks: int | None,
    marker: str,
    *,
    grace_s: float,
    what: str,
    cgroup: callgroups.Slot | None = None,
    give: bool = True,
    escalated: list[bool] | None = None,
) -> bool:
    """End a group the runner started, and every escaper that carries its marker or is in
    its call's ``cgroup`` (``subagent.callgroups``: back to the pool once empty).

    One escalation (``subagent.osedge.escalate``): SIGTERM, ``grace_s``, SIGKILL, a bounded
    wait. The group is signalled only while its leader is the one started (``leader_ticks``)
    or gone; escapers (``setsid``, double fork) by pidfd, or all at once by ``cgroup.kill``.
    Shielded: safe under a cancelled scope. Returns whether nothing of it is left.
    ``give``: False for a second escalation of the same set (its cgroup is given back once).
    ``escalated``: told whether SIGKILL came at the end of the grace (appended).
    """
    within = own_tree_cgroup()
    targets = Targets(
        groups={pgid: leader_ticks},
        marker=(SUBTREE_VAR, marker),
        cgroup=cgroup.path if cgroup is not None else None,
        within=within,
        cgroup_kill_fd=cgroup.kill_fd if cgroup is not None else None,
    )
    # Inside the tree's cgroup a read of the set is a few small files: inline, no thread.
    runtime = TrioRuntime(threads=False) if within is not None or cgroup is not None else None
    with trio.CancelScope(shield=True):
        r = await escalate(
            targets, grace_s=grace_s, kill_wait_s=GROUP_KILL_REAP_S, runtime=runtime, label=f"{what} {pgid}", log=logger
        )
    if escalated is not None:
        escalated.append(r.escalated)
    if r.dead and cgroup is not None and give:
        callgroups.give(cgroup)
    return r.dead


async def let_go_unrun(proc: trio.Process, ticks: int | None, marker: str, cgroup: callgroups.Slot | None) -> None:
    """A command whose gate stayed shut: its shell exits at once; reap it, and end (and
    confirm ended) whatever is in its group or cgroup. Shielded, bounded."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(GATE_EXIT_S):
            await proc.wait()
        await end_group_and_escapers(proc.pid, ticks, marker, grace_s=0.0, what="command group", cgroup=cgroup)


class Started(NamedTuple):
    """A command past its gate: its process (its group's leader), the leader's start
    ticks, and its call cgroup (None: found by group and marker only)."""

    proc: trio.Process
    ticks: int | None
    cgroup: callgroups.Slot | None


async def start_gated(command: str, marker: str, stopped: Callable[[], bool], **options: Any) -> Started | None:
    """Spawn ``command`` held at its gate, then let it run unless ``stopped()`` says a stop
    came meanwhile: then its shell exits having run nothing, its group is ended, and the
    answer is None. Every command starts here (foreground and background alike).

    Raises:
        OSError, ValueError: it could not be started (a NUL in it, a lone surrogate).
    """
    proc, cgroup, gate = await open_gated(command, **options)
    ticks = await sighted_ticks(proc)
    go = not stopped()
    open_gate(gate, go)
    if not go:
        await let_go_unrun(proc, ticks, marker, cgroup)
        with trio.CancelScope(shield=True):
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    await pipe.aclose()
        return None
    return Started(proc, ticks, cgroup)


def killed_by_signal(code: int | None) -> bool:
    """Did a command end by SIGTERM or SIGKILL (itself, or the child its shell waited for)?"""
    return code is not None and (code in (-signal.SIGTERM, -signal.SIGKILL) or code in SHELL_SIGNAL_EXITS)


def leader_ticks(pid: int) -> int | None:
    """The start ticks of a child just started (unreaped, so its pid is still its own)."""
    p = ProcessTable().read(pid)
    return p.start_ticks if p is not None else None


async def sighted_ticks(proc: trio.Process) -> int | None:
    """The start ticks of a new shell at its gate, looked for until it shows (bounded; shielded).
    A sandboxed runner's /proc lists it once its exec made it dumpable, after the spawn
    returned (under load, after the run's end); a group whose leader's ticks are unknown is
    no target once it shows (``ProcessTable.live_groups``): its escalation signalled nothing."""
    with trio.CancelScope(shield=True):
        deadline = trio.current_time() + LEADER_SIGHT_S
        while (ticks := leader_ticks(proc.pid)) is None and proc.returncode is None and trio.current_time() < deadline:
            await trio.sleep(LEADER_SIGHT_POLL_S)
    return ticks


def own_leader_ticks(proc: trio.Process, ticks: int | None) -> int | None:
    """``ticks``, or, where they were not read at the start (the leader was out of the
    runner's sight then: a child of a non-dumpable runner is invisible under a
    ``hidepid`` /proc until its ``execve`` makes it dumpable, a moment after its parent
    learned that the exec succeeded), read now while it is unreaped: its pid is its own."""
    if ticks is None and proc.returncode is None:
        return leader_ticks(proc.pid)
    return ticks


async def kill_unreaped_group(proc: trio.Process, what: str) -> None:
    """The last resort when a group's leader outlived its escalation: it is this process's
    child and not reaped, so its pid, and the group it leads, are still its own. SIGKILL
    the group, then wait for the leader (bounded). Shielded."""
    if proc.returncode is not None:
        return
    leader = ProcessTable().read(proc.pid)  # (unreaped: the pid is still its own)
    logger.warning(
        "%s %d outlived its escalation (state %s): SIGKILL to its group",
        what,
        proc.pid,
        leader.state if leader is not None else "unreadable",
    )
    with trio.CancelScope(shield=True):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        with trio.move_on_after(GROUP_KILL_REAP_S):
            await proc.wait()


def _child_env(marker: str) -> dict[str, str]:
    env = tool_env()
    env[SUBTREE_VAR] = marker
    return env


async def run_command(
    command: str,
    *,
    timeout_s: float,
    max_output_bytes: int,
    interrupt: trio.CancelScope,
    on_group: Callable[[int, bool], None],
    stop: trio.Event | None = None,
    interrupt_on_stop: bool = True,
    kill_grace_s: float = COMMAND_KILL_GRACE_S,
    cwd: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    starting: AbstractContextManager[Callable[[], bool] | None] | None = None,
    on_output: Callable[[str, bool], None] | None = None,
) -> CommandOutcome:
    """Run one command to its end (or timeout, or interrupt) and report what happened.

    ``interrupt`` is a fresh cancel scope owned by the caller; cancelling it stops the
    command. ``stop`` is the run's stop: set before the spawn, the command never starts
    (``not_started``); set while it runs and ``interrupt_on_stop``, it stops the command
    like the interrupt, its group then getting ``kill_grace_s`` between SIGTERM and
    SIGKILL. ``on_group(pgid, alive)`` is called when the group appears and when it is
    gone. ``starting`` (``StopControl.starting``): held from the check of ``stop`` to the
    spawn's end; a stop asked meanwhile leaves the command at its gate: it never runs
    (``not_started``).
    ``on_output(text, truncated)``: the output so far, reported from the stop on (at once,
    then every ``OUTPUT_REPORT_S``) while the command runs past it.
    """
    marker = f"{os.getpid()}-cmd-{next(_seq)}"
    env = _child_env(marker)
    if extra_env:
        env.update(extra_env)
    captured = bytearray()
    total = 0
    with starting if starting is not None else nullcontext() as asked:
        if stop is not None and stop.is_set():
            return CommandOutcome(None, None, "", False, not_started=True)

        def stopped() -> bool:
            return (asked is not None and asked()) or (stop is not None and stop.is_set())

        try:
            started = await start_gated(
                command, marker, stopped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL in it, a lone surrogate (not UTF-8)
            return CommandOutcome(None, None, "", False, spawn_error=f"{type(exc).__name__}: {exc}")
        if started is None:  # a stop came while it was spawned: it never ran
            return CommandOutcome(None, None, "", False, not_started=True)
        proc, ticks, cgroup = started
        pgid = proc.pid
        on_group(pgid, True)
    assert proc.stdout is not None
    stdout = proc.stdout
    eof = trio.Event()

    async def reader() -> None:
        nonlocal total
        try:
            while data := await stdout.receive_some(READ_CHUNK_BYTES):
                total += len(data)
                room = max_output_bytes - len(captured)
                if room > 0:
                    captured.extend(data[:room])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        eof.set()

    stop_at: float | None = None
    finished_before_stop = False
    draining: trio.CancelScope | None = None  # its output after its shell exited
    leftovers = False  # what its exited shell left is being ended, with a timeout's grace
    escalations: list[bool] = []  # each ending of its group: did it need SIGKILL

    async def interrupt_at(stop: trio.Event) -> None:
        nonlocal stop_at
        await stop.wait()
        stop_at = trio.current_time()
        interrupt.cancel(reason="the run's stop interrupts the command")
        if draining is not None:  # what its shell left gets the stop's grace, at once
            draining.cancel(reason="the run's stop ends the drain")
        if leftovers:  # (being ended already: the stop's grace, from now, ends it sooner)
            await end_group_and_escapers(
                pgid,
                ticks,
                marker,
                grace_s=kill_grace_s,
                what="command group",
                cgroup=cgroup,
                give=False,
                escalated=escalations,
            )

    async def report_output(stop: trio.Event, report: Callable[[str, bool], None]) -> None:
        await stop.wait()
        sent = -1
        while True:
            if total != sent:
                sent = total
                report(captured.decode("utf-8", errors="replace"), total > len(captured))
            await trio.sleep(OUTPUT_REPORT_S)

    grace = COMMAND_KILL_GRACE_S
    async with trio.open_nursery() as nursery:
        # The reader lives outside the timeout and the interrupt: what the command wrote
        # before it was stopped is still read (bounded), and returned as known output.
        nursery.start_soon(reader)
        if stop is not None and interrupt_on_stop:
            nursery.start_soon(interrupt_at, stop)
        elif stop is not None and on_output is not None:
            nursery.start_soon(report_output, stop, on_output)
        try:
            with trio.move_on_after(timeout_s) as timer:
                with interrupt:
                    await proc.wait()
                    # Seen exiting before any stop was asked (a stop noted but not applied
                    # yet counts as asked: path A may have ended it).
                    finished_before_stop = not killed_by_signal(proc.returncode) and not stopped()
        finally:
            # Whatever happened, nothing of this command survives it (shielded, bounded).
            with trio.CancelScope(shield=True):
                by_path_a = (
                    stop is not None and stop_at is None and interrupt_on_stop and killed_by_signal(proc.returncode)
                )
                if by_path_a:
                    # The daemon's path A killed the shell for the run's stop: its escapers
                    # get the stop's grace too, at once (no drain first), not a timeout's.
                    assert stop is not None
                    with trio.move_on_after(STOP_SETTLE_S):
                        await stop.wait()
                    by_path_a = stop.is_set()
                if stop_at is not None or by_path_a:
                    grace = kill_grace_s
                ticks = own_leader_ticks(proc, ticks)
                if proc.returncode is None or by_path_a or stop_at is not None:
                    # (A stop's: its escapers get the stop's grace at once, no drain first.)
                    await end_group_and_escapers(
                        pgid, ticks, marker, grace_s=grace, what="command group", cgroup=cgroup, escalated=escalations
                    )
                    with trio.move_on_after(grace):
                        await proc.wait()
                    await kill_unreaped_group(proc, "command group")
                else:
                    with trio.move_on_after(DRAIN_AFTER_EXIT_S) as draining:
                        await eof.wait()
                    if stop_at is not None:  # the stop came meanwhile (``interrupt_at``)
                        grace = kill_grace_s
                    leftovers = stop_at is None
                    await end_group_and_escapers(
                        pgid, ticks, marker, grace_s=grace, what="command group", cgroup=cgroup, escalated=escalations
                    )
                ended_at = trio.current_time()
                with trio.move_on_after(FINAL_DRAIN_S):
                    await eof.wait()
                nursery.cancel_scope.cancel(reason="command ended; output drained")
                with trio.move_on_after(PIPE_CLOSE_TIMEOUT_S):
                    await stdout.aclose()
                on_group(pgid, False)
    timed_out = timer.cancelled_caught
    # A shell that exited (not killed by a signal: it finished, or answered the SIGTERM
    # with an exit of its own) was not cut short by the interrupt: the same outcome, a
    # command done as the stop came, was "succeeded" or "interrupted" by whether the loop
    # saw its exit or the stop first.
    ended_by_itself = proc.returncode is not None and not killed_by_signal(proc.returncode)
    return CommandOutcome(
        pid=pgid,
        exit_code=proc.returncode,
        output=captured.decode("utf-8", errors="replace"),
        truncated=total > len(captured),
        timed_out=timed_out,
        interrupted=interrupt.cancelled_caught and not ended_by_itself,
        by_stop=stop_at is not None and interrupt.cancelled_caught and not ended_by_itself,
        stop_at=stop_at,
        ended_at=ended_at,
        finished_before_stop=finished_before_stop,
        killed_after_grace=any(escalations),
    )
