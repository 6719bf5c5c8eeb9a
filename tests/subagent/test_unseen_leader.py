"""A command whose processes the runner cannot see is ended by its escalation all the same.

A sandboxed runner reads a ``hidepid=invisible`` /proc of its own: a process it may not
ptrace-read is not listed there. A command's shell is such a process for a moment (its
first ``execve`` from the non-dumpable runner: the runner learns that the exec succeeded
before the kernel makes the new image dumpable; under load that moment lasted past the
run's end), and a command that makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: ssh-agent,
gpg-agent) is one for good. The escalation found no member of its set in the table and
took it for ended: no signal, ``dead``, and the command ran on until the runner's last
resort SIGKILLed its group 2 s later ("outlived its escalation"). Its group, which exists
(``killpg(pgid, 0)``), is a live member the table does not show.

Real runners (the scripted model, real commands), and one in-process, its /proc reads
played as a loaded runner saw them.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.events import EventKind, ExitCode, ToolCallState
from subagent.osedge._kernel import LinuxKernel, Proc
from subagent.tools.background import BackgroundCommands
from tests.subagent.harness import spec, start_runner

# Makes itself non-dumpable (invisible in the runner's /proc), then says so by a file.
UNDUMPABLE = (
    f'exec {sys.executable} -c "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); '
    "open('undumpable', 'w').close(); time.sleep(60)\""
)
WAIT_FOR_IT = "until [ -e undumpable ]; do sleep 0.01; done"


async def test_a_background_command_the_runner_cannot_see_is_ended_by_its_escalation(tmp_path: Path) -> None:
    script = {
        "turns": [
            {"tool_calls": [{"name": "run_command", "arguments": {"command": UNDUMPABLE, "background": True}}]},
            {"tool_calls": [{"name": "run_command", "arguments": {"command": WAIT_FOR_IT, "timeout_s": 20}}]},
        ],
        "final": "done",
    }
    async with start_runner(spec(script=script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    started, waited = result["tool_calls"]
    assert waited["state"] == ToolCallState.SUCCEEDED and waited["output"].startswith("[exit code 0]"), waited
    # Its SIGTERM ended it (a Python dies of it), not the last resort's SIGKILL.
    assert started["reason"].startswith(
        "background_ended_with_run: its background command bg1 was still running when the run ended; "
        "it was ended with the run (killed by SIGTERM)"
    ), started
    logs = [e.data["message"] for e in r.of(EventKind.LOG)]
    assert not [m for m in logs if "outlived its escalation" in m], logs


async def test_a_background_command_whose_shell_showed_late_is_ended_by_its_escalation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # In-process, the table's reads of the command's leader played as a loaded sandboxed
    # runner saw them (1 run in 4 at load ~6): out of sight for its first two looks (its
    # spawn's, and one as the run ended), then in sight mid-exec, no environment yet. Its
    # start ticks were never learned, so its group was no target once its leader showed,
    # and its marker was unread: the escalation found nothing, signalled nothing, and the
    # last resort SIGKILLed it 2 s later ("outlived its escalation (state S)").
    leaders: set[int] = set()  # the command's shell: its pid, from its spawn on
    looks: dict[int, int] = {}
    real_open, real_stat, real_environ = trio.lowlevel.open_process, LinuxKernel.stat, LinuxKernel.environ

    async def open_process(*args: Any, **kwargs: Any) -> trio.Process:
        proc = await real_open(*args, **kwargs)
        leaders.add(proc.pid)
        return proc

    def stat(self: LinuxKernel, pid: int) -> Proc | None:
        if pid in leaders:
            looks[pid] = looks.get(pid, 0) + 1
            if looks[pid] <= 2:
                return None
        return real_stat(self, pid)

    def environ(self: LinuxKernel, pid: int) -> bytes | None:
        return b"" if pid in leaders else real_environ(self, pid)

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    monkeypatch.setattr(LinuxKernel, "stat", stat)
    monkeypatch.setattr(LinuxKernel, "environ", environ)
    async with trio.open_nursery() as n:
        jobs = BackgroundCommands(tmp_path, lambda *_: None, 1000)
        await n.start(jobs.run)
        with trio.fail_after(10):
            started = await jobs.start(f'exec {sys.executable} -c "import time; time.sleep(60)"')
            assert started is not None and "id bg1" in started, started
            await jobs.aclose()
        n.cancel_scope.cancel()
    assert len(leaders) == 1 and max(looks.values()) > 2, looks
    (end,) = jobs.ends()
    assert (end.exit_code, end.killed) == (-signal.SIGTERM, False), end
    assert not [r.getMessage() for r in caplog.records if "outlived its escalation" in r.getMessage()]
