"""A process of a command that the runner cannot see is ended with its call, by its escalation.

A sandboxed runner reads a ``hidepid=invisible`` /proc of its own: a process it may not
ptrace-read (one that made itself non-dumpable, as ssh-agent and gpg-agent do) is not
listed there. Its call's cgroup lists it (``cgroup.procs``) and says it is ``populated``,
but the set read from the table was empty: its escalation took it for ended, signalled
nothing and gave its cgroup back to the pool, and it ran on until the run's end (the
daemon's sweep: "outlived the runner"). Real daemon with cgroups, real runner and sandbox,
scripted model. The test holds the hidden process by a pidfd, opened once its pid (which it
writes in the run's directory) is shown to be in the run's own call cgroup.
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path
from typing import Any

import trio

from subagent.events import TERMINAL_TOOL_STATES, ToolCallState
from subagent.tools.commands import CommandOutcome, format_outcome
from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_call_cgroups import ENV, _zygote, require_cgroups, script
from tests.supervisor.test_sweep_mode import none_left

WAIT_S = 60.0


def hidden(*, leave_group: bool, ignore_term: bool) -> str:
    """A command that starts a non-dumpable process (not its group's leader), which writes
    its pid to ``hidden.pid``; it goes on once the test holds that process (``held``). On SIGTERM it writes ``hidden.termed``
    (then exits, or, ``ignore_term``, sleeps on)."""
    on_term = "None" if ignore_term else "os._exit(0)"
    return (
        f"{sys.executable} -c 'import ctypes, os, signal, time\n"
        "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"  # PR_SET_DUMPABLE 0
        + ("os.setsid()\n" if leave_group else "")
        + f'signal.signal(signal.SIGTERM, lambda *_: (open("hidden.termed", "w").close(), {on_term}))\n'
        'open("hidden.tmp", "w").write(str(os.getpid())); os.rename("hidden.tmp", "hidden.pid")\n'
        "time.sleep(300)' >/dev/null 2>&1 & until [ -e held ]; do sleep 0.01; done; echo up"
    )


async def first_call_ended(c: Client, run_id: str) -> dict[str, Any]:
    """The first tool call's record once it ended (its command's escalation is over; it is
    announced ``not_started`` before it runs)."""
    msg = await c.wait_for(
        run_id,
        lambda m: (
            m.get("kind") == "tool_call"
            and m["data"]["record"]["id"] == "call_1_1"
            and m["data"]["record"]["state"] in TERMINAL_TOOL_STATES - {ToolCallState.NOT_STARTED}
        ),
        WAIT_S,
    )
    assert msg["op"] == "event", msg
    record: dict[str, Any] = msg["data"]["record"]
    return record


async def hold_hidden(run_dir: Path, tree_id: str) -> int:
    """A pidfd on the process whose pid the command wrote, once it is shown to be in the
    run's own call cgroup (read again once the pidfd is open: it names that process)."""
    with trio.fail_after(WAIT_S):
        while not (run_dir / "hidden.pid").exists():
            await trio.sleep(0.02)
    pid = int((run_dir / "hidden.pid").read_text())

    def in_run() -> bool:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return False
        return any(line.startswith("0::") and f"/{tree_id}/calls/" in line for line in lines) and (
            f"AGENTD_TREE={tree_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        )

    assert in_run(), pid
    fd = os.pidfd_open(pid)
    if not in_run():
        os.close(fd)
        raise AssertionError(f"pid {pid} left the run before its pidfd was open")
    (run_dir / "held").touch()
    return fd


async def spawn_hidden(c: Client, spec: dict[str, Any]) -> tuple[str, Path, int]:
    """Spawn ``spec``, whose first command leaves a hidden process: (the run, its run dir,
    a pidfd on that process, shown to be the run's: ``hold_hidden``)."""
    run_id: str = (await c.ok("spawn", spec=spec))["run_id"]
    await c.wait_kind(run_id, "process_group", WAIT_S)
    st = await c.ok("status", run_id=run_id)
    require_cgroups(st)
    run_dir = Path(st["run_dir"])
    return run_id, run_dir, await hold_hidden(run_dir, st["tree_id"])


def dead(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


async def test_a_hidden_process_a_command_leaves_in_its_group_ends_with_its_call(tmp_path: Path) -> None:
    # Its shell exits 0 at once; what it left runs on in its group, out of the runner's sight.
    hold = "until [ -e release ]; do sleep 0.02; done; echo released"
    spec = script(hidden(leave_group=False, ignore_term=False), {"command": hold, "timeout_s": 30})
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
            run_id, run_dir, pidfd = await spawn_hidden(c, spec)
            try:
                first = await first_call_ended(c, run_id)
                # The run goes on (its next command waits): only the call's escalation
                # could have ended it, by the SIGTERM to its (leaderless) group.
                assert first["state"] == "succeeded", first
                assert dead(pidfd), "the hidden process outlived its call"
                assert (run_dir / "hidden.termed").exists()
                (run_dir / "release").touch()
                end = await c.wait_end(run_id, WAIT_S)
            finally:
                os.close(pidfd)
            st = await c.ok("status", run_id=run_id)
            assert end["state"] == "completed", st
            first, second = (t["output"] for t in st["tool_calls"])
            assert first.startswith("[exit code 0]\nup") and second.endswith("released\n"), st
            await none_left(d.pid, _zygote(await c.ok("status")))
        assert "outlived the runner" not in d.log_text()


async def test_a_hidden_process_that_left_its_group_and_ignores_sigterm_ends_with_the_stop(
    tmp_path: Path,
) -> None:
    # Out of its command's group (setsid), out of sight, SIGTERM ignored; its shell waits on.
    spec = {
        **script(hidden(leave_group=True, ignore_term=True) + "; exec sleep 300"),
        "stop_policy": {"command_grace_s": 0.5},
    }
    # The daemon's own grace outlasts the command's: its sweep of the tree comes after.
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env={**ENV, "AGENTD_GRACE_S": "10"}) as d, d.connect() as c:
            run_id, run_dir, pidfd = await spawn_hidden(c, spec)
            try:
                await c.ok("cancel", run_id=run_id)
                first = await first_call_ended(c, run_id)
                # Ended by the command's escalation, before its record (and the run's end):
                # SIGTERM by pidfd, then cgroup.kill at the end of the grace.
                assert dead(pidfd), "the hidden process outlived its command's escalation"
                assert (run_dir / "hidden.termed").exists()
                assert first["state"] == "cancelled", first
                end = await c.wait_end(run_id, WAIT_S)
            finally:
                os.close(pidfd)
            assert end["state"] == "cancelled", end
            (output,) = (t["output"] for t in (await c.ok("status", run_id=run_id))["tool_calls"])
            assert "[interrupted by the stop" in output, output
            assert "SIGKILLed at the end of the grace" in output, output
            await none_left(d.pid, _zygote(await c.ok("status")))
        assert "outlived the runner" not in d.log_text()


def test_a_command_the_daemons_sigterm_ended_says_what_it_started_was_sigkilled() -> None:
    # The daemon's path A SIGTERMs a command's group as it signals the runner: its shell may
    # die of it before the runner's stop interrupts it (``by_stop`` set afterwards, not
    # ``interrupted``). Its escalation's SIGKILL at the end of the grace went unsaid then
    # (1 run in 2 of the test above).
    out = CommandOutcome(1234, -15, "", False, by_stop=True, killed_after_grace=True)
    assert format_outcome(out) == (
        "[killed by SIGTERM] [interrupted by the stop: the command was stopped; it had written no output] "
        "[what it started did not end on SIGTERM: SIGKILLed at the end of the grace]\n"
    )
