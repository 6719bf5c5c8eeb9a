"""A command's cgroup: what it starts ends with its call, not only with the run.

An escaper that leaves the command's group (``setsid``), is re-parented (the shell's
``&``) and empties its environment (``env -i``) carries neither the group nor the marker
the runner looks for. In its call's own cgroup (``subagent.callgroups``) it is found all
the same, and ended when the call ends, while the run goes on. Real daemon with cgroups,
real runner and sandbox, scripted model: the run's next command reports what it sees.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from subagent.osedge import LINUX
from tests import conftest
from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_sweep_mode import none_left

WAIT_S = 30.0
ENV = {"AGENTD_RUNNER_COMMAND": ""}  # the real runner

ESCAPE = (
    "env -i setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' >/dev/null 2>&1 & "
    "while [ ! -s escaped.pid ]; do :; done; echo started $(cat escaped.pid)"
)
# What the next command sees of it: its state letter, or "gone" (a zombie is "Z").
LOOK = "s=$(cut -d' ' -f3 /proc/$(cat escaped.pid)/stat 2>/dev/null); echo state=${s:-gone}"


# Where the command runs, and what it may write in cgroupfs: nothing (a write to a
# cgroup.procs of its own would let it move in any process of the host, and kill it).
def attempts(victim: int) -> str:
    return (
        "cg=$(awk -F: '$1==0{print $3}' /proc/self/cgroup); echo cgroup=$cg; "
        "d=$(awk '$9==\"cgroup2\"{print $5; exit}' /proc/self/mountinfo)$cg; "
        "tree=$(dirname $(dirname $d)); "
        f"(echo {victim} > $d/cgroup.procs) 2>/dev/null && echo MOVED-VICTIM; "
        "(echo 0 > $d/cgroup.procs) 2>/dev/null && echo REJOINED; "
        "(echo 1 > $tree/cgroup.max.descendants) 2>/dev/null && echo WROTE-TREE; "
        "(echo 0 > $tree/cgroup.procs) 2>/dev/null && echo JOINED-TREE; "
        "(echo 0 > $(dirname $tree)/cgroup.procs) 2>/dev/null && echo LEFT-TREE; "
        "mkdir $tree/mine 2>/dev/null && echo MADE-IN-TREE; "
        "mkdir $d/mine 2>/dev/null && echo MADE-IN-CALL; "
        "(echo 1 > $d/cgroup.freeze) 2>/dev/null && echo FROZE; "
        "echo tried"
    )


# The same for a background command, whose end the runner sees on its own time: waited
# for (5 s at most) by the command that looks.
BG_ESCAPE = (
    "env -i setsid sh -c 'echo $$ > bg.pid; exec sleep 300' >/dev/null 2>&1 & "
    "while [ ! -s bg.pid ]; do :; done; echo up"
)
BG_LOOK = (
    "i=0; while [ $i -lt 100 ]; do s=$(cut -d' ' -f3 /proc/$(cat bg.pid)/stat 2>/dev/null); "
    '[ -z "$s" ] || [ "$s" = Z ] && break; i=$((i+1)); sleep 0.05; done; echo state=${s:-gone}'
)


# A process that hops to a new pid as fast as it can forks (the parent exits at once),
# ignoring SIGTERM, in a session of its own: one SIGKILL per pid it is seen at does not
# catch it; cgroup.kill does. Then what the run's next command sees in the other calls'
# cgroups (it runs in its own): nothing.
HOP = (
    f"{sys.executable} -c 'import os,signal,time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); os.setsid(); end = time.time() + 8\n"
    "while time.time() < end:\n"
    "    os.fork() and os._exit(0)\n"
    'os.execvp("sleep", ["sleep", "300"])\' >/dev/null 2>&1 & echo hopping'
)
OTHERS = (
    "mine=$(awk -F: '$1==0{print $3}' /proc/self/cgroup); "
    "root=$(awk '$9==\"cgroup2\"{print $5; exit}' /proc/self/mountinfo); "
    'for d in $root$(dirname $mine)/*/; do [ "$d" = "$root$mine/" ] || cat $d/cgroup.procs; done | wc -l'
)


def script(*commands: str | dict[str, Any]) -> dict[str, Any]:
    calls = [c if isinstance(c, dict) else {"command": c} for c in commands]
    turns = [
        {"text": f"step {i}", "tool_calls": [{"name": "run_command", "arguments": a}]} for i, a in enumerate(calls)
    ]
    return {"task": "escape", "model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}}}  # fmt: skip


async def run_to_end(c: Client, spec: dict[str, Any]) -> dict[str, Any]:
    run_id = (await c.ok("spawn", spec=spec))["run_id"]
    end = await c.wait_end(run_id, WAIT_S)
    st: dict[str, Any] = await c.ok("status", run_id=run_id)
    assert end["state"] == "completed", st
    return st


def require_cgroups(st: dict[str, Any]) -> None:
    conftest.require(st["containment"] == "cgroup", "a writable cgroup2 mount (cgroup containment)")


async def outputs_of(tmp_path: Path, *commands: str | dict[str, Any]) -> list[str]:
    """The outputs of a run of these commands, on a daemon with cgroup containment; then
    nothing of the run is left."""
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
            st = await run_to_end(c, script(*commands))
            require_cgroups(st)
            await none_left(d.pid, _zygote(await c.ok("status")))
    return [t["output"] for t in st["tool_calls"]]


async def test_an_escaper_with_an_empty_environment_ends_with_its_call(tmp_path: Path) -> None:
    first, second = await outputs_of(tmp_path, ESCAPE, LOOK)
    assert "started" in first, first
    # The call ended it, before the run's next step (a zombie is dead, not reaped yet).
    assert second.strip().splitlines()[-1] in ("state=gone", "state=Z"), second
    p = LINUX.stat(int(first.split("started ")[1].split()[0]))
    assert p is None or p.dead


async def test_a_background_commands_escaper_ends_when_it_does(tmp_path: Path) -> None:
    first, second = await outputs_of(tmp_path, {"command": BG_ESCAPE, "background": True}, BG_LOOK)
    assert first.startswith("started in the background"), first
    assert second.strip().splitlines()[-1] in ("state=gone", "state=Z"), second


async def test_a_process_that_keeps_forking_ends_with_its_call(tmp_path: Path) -> None:
    first, second = await outputs_of(tmp_path, HOP, OTHERS)
    assert "hopping" in first, first
    assert second.strip().splitlines()[-1] == "0", second  # nothing left in any other call's cgroup


async def test_a_sandboxed_command_writes_nothing_in_cgroupfs(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "300"])  # a process of the host, not of the run
    try:
        with trio.fail_after(90):
            async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
                before = LINUX.cgroup(victim.pid)
                st = await run_to_end(c, script(attempts(victim.pid)))
                require_cgroups(st)
                conftest.require(st["sandbox"]["mode"] == "landlock", "landlock")
                out = st["tool_calls"][0]["output"]
                assert "tried" in out, out
                cgroup = next(line for line in out.splitlines() if line.startswith("cgroup="))
                assert f"/{st['tree_id']}/calls/" in cgroup, out  # the command ran in its call's cgroup
                for refused in ("MOVED-VICTIM", "REJOINED", "WROTE-TREE", "JOINED-TREE", "LEFT-TREE", "MADE-IN"):
                    assert refused not in out, out
                assert "FROZE" not in out, out
                assert victim.poll() is None and LINUX.cgroup(victim.pid) == before
                await none_left(d.pid, _zygote(await c.ok("status")))
    finally:
        victim.kill()
        victim.wait()


def _zygote(summary: dict[str, Any]) -> frozenset[int]:
    pid = summary["summary"]["zygote"].get("pid")
    return frozenset([pid] if pid else [])
