"""A run and the other processes' ``/proc``: command lines, environments, status.

A run shares the host's PID namespace, so the host's ``/proc`` listed every process and
showed its command line to anyone: another program's password in its argv, the
dashboard's one-time login link given to a browser (``agentd dashboard --open``). A root
daemon's runner now mounts a procfs of its own over ``/proc`` with ``hidepid=invisible``
before it enters its user namespace (``subagent._isolate.private_proc``): only the
processes the run may ptrace-read are there. Its processes are uid 0 on the host, as the
daemon, the host's root processes and every other run of that daemon are; what hides
those is Landlock, which refuses ptrace access to any process outside the run's domain.

The daemon runs in-process (``tests/e2e/test_sandbox.py``'s fixture, cold and forked
from a zygote's spare); a host process holds a secret in its argv, another run waits at a
gate, and a run's command tries to see both, and the daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagent.sandbox import PROC_HIDDEN
from tests import conftest
from tests.e2e.sandbox_daemon import lines, sandboxed_daemon
from tests.e2e.test_sandbox import SCENARIO_S, Daemon, command, finish_gated, gated_run, outputs, scripted
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture
from tests.supervisor.test_zygote_spare import spare_ready

SECRET = "hunter2-agentd-argv-secret-5e1c"

# In the run: the host's process (argv[1]), the other run's runner (argv[2]) and the daemon
# (argv[3]): listed in /proc? command line readable? Then what the run's own tools need.
PROBE = r"""
set -u
for who in host:$1 other:$2 daemon:$3; do
  name=${who%%:*}; pid=${who#*:}
  if ls /proc | grep -qx "$pid"; then echo "${name}_listed=1"; else echo "${name}_listed=0"; fi
  if tr '\0' ' ' < /proc/$pid/cmdline; then echo; echo "${name}_cmdline=0"; else echo "${name}_cmdline=denied"; fi
  if cat /proc/$pid/status > /dev/null; then echo "${name}_status=0"; else echo "${name}_status=denied"; fi
done
echo "pids_listed=$(ls /proc | grep -c '^[0-9]*$')"
sh -c 'sleep 30 & echo "child_listed=$(ls /proc | grep -cx $!)"; kill $!'
grep -q '^btime ' /proc/stat && echo stat_ok=1
grep -q '^MemTotal:' /proc/meminfo && echo meminfo_ok=1
grep -q "^Pid:	$$\$" /proc/$$/status && grep -q '^Name:	grep$' /proc/self/status && echo self_ok=1
"""


@pytest.fixture(params=["off", "auto"])
async def daemon(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    """``tests/e2e/test_sandbox.py``'s daemon, its runners cold (``zygote = "off"``) and
    forked from a zygote's spare: both halves of the sandbox made at once, and ahead."""
    async with sandboxed_daemon(tmp_path, monkeypatch, request.param) as d:
        yield d


async def test_a_run_does_not_see_the_host_the_daemon_or_another_run(daemon: Daemon) -> None:
    conftest.require(os.geteuid() == 0, "root: a procfs of the run's own needs a root daemon")
    host = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", SECRET], stdin=subprocess.PIPE)
    try:
        with trio.fail_after(SCENARIO_S):
            other_id, other_dir = await gated_run(daemon)
            other_pid = int((await daemon.m.status(other_id))["pid"])
            if daemon.config.zygote != "off":
                await spare_ready(daemon.m, other_than=other_pid)
            script = PROBE.replace("'", "'\\''")
            r = await daemon.m.spawn(
                scripted([command(f"sh -c '{script}' probe {host.pid} {other_pid} {os.getpid()}")])
            )
            st = await daemon.m.wait_terminal(r["run_id"])
            await finish_gated(daemon, other_id, other_dir)
            zygote = (await daemon.m.summary())["zygote"]
    finally:
        assert host.stdin is not None
        host.stdin.close()
        host.wait(timeout=10)
    (out,) = outputs(st)
    assert SECRET not in out, out
    seen = lines(out)
    for name in ("host", "other", "daemon"):
        assert seen.get(f"{name}_listed") == "0", out
        assert seen.get(f"{name}_cmdline") == "denied", out
        assert seen.get(f"{name}_status") == "denied", out
    # What the run's tools need is there: their own processes, /proc/self, /proc/stat...
    assert seen.get("child_listed") == "1", out
    assert 0 < int(seen.get("pids_listed", "0")) < 20, out  # its own few, not the host's
    assert seen.get("stat_ok") == seen.get("meminfo_ok") == seen.get("self_ok") == "1", out
    if daemon.config.zygote != "off":  # both runs were forked from spares: the sandbox's half made ahead
        assert zygote["spares"]["used"] == 2 and zygote["cold_fallbacks"] == 0, zygote
    assert st["sandbox"]["proc"] == PROC_HIDDEN
    assert "problems" not in st["sandbox"], st["sandbox"]
