"""``subagent.osedge.resume_stopped`` on real processes: it SIGCONTs the stopped members of
its targets and nothing else (a stopped process outside them stays stopped).

What uses it: the runner, right before the MCP SDK closes a server the run's own command
may have stopped (``subagent.tools.mcp_spawn.resume_stopped_server``; the acceptance test
is ``tests/supervisor/test_stop_stopped_server.py``), and the browser preset.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import trio

from subagent.osedge import LINUX, Targets, resume_stopped

SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"


async def _start() -> trio.Process:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    with trio.fail_after(10):
        assert (await proc.stdout.receive_some(100)).startswith(b"ready")
    return proc


def _state(pid: int) -> str:
    p = LINUX.stat(pid)
    assert p is not None
    return p.state


async def _until(pid: int, stopped: bool) -> None:
    with trio.fail_after(5):
        while (_state(pid) == "T") != stopped:
            await trio.sleep(0.005)


async def test_only_the_stopped_members_of_the_targets_are_resumed() -> None:
    ours, other, running = await _start(), await _start(), await _start()
    try:
        for proc in (ours, other):
            proc.send_signal(signal.SIGSTOP)  # our children, not reaped: their pids are theirs
            await _until(proc.pid, stopped=True)
        ticks = {p.pid: LINUX.stat(p.pid).start_ticks for p in (ours, running)}  # type: ignore[union-attr]
        resumed = resume_stopped(Targets(groups={ours.pid: ticks[ours.pid], running.pid: ticks[running.pid]}))
        assert resumed == [ours.pid]  # not the one that was running, never the one outside
        await _until(ours.pid, stopped=False)
        assert _state(other.pid) == "T"
        # A group named with other start ticks than its leader's is not the one learned: left alone.
        wrong = LINUX.stat(other.pid).start_ticks + 1  # type: ignore[union-attr]
        assert resume_stopped(Targets(groups={other.pid: wrong})) == []
        assert _state(other.pid) == "T"
    finally:
        with trio.CancelScope(shield=True), trio.fail_after(10):
            for proc in (ours, other, running):
                proc.kill()
                await proc.wait()
