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

Real runners (the scripted model, real commands).
"""

from __future__ import annotations

import sys
from pathlib import Path

from subagent.events import EventKind, ExitCode, ToolCallState
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
