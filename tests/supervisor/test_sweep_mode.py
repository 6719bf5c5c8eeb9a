"""Without cgroups (``AGENTD_CGROUPS=off``) the sweep still ends what escaped a run.

Seed 002's fault-injection table, the two cases that once outlived their run and the
daemon in subreaper+sweep mode: a descendant in a session of its own with an emptied
environment (``env -i setsid sleep 300 &`` from a command), and such a descendant that
also holds the runner's stdout open. Real daemon, real runner (scripted model) or the
stand-in runner; afterwards nothing the run started is left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.osedge import LINUX
from tests.supervisor.real_daemon import Client, real_daemon

WAIT_S = 30.0


def descendants(pid: int, helpers: frozenset[int] = frozenset()) -> list[int]:
    """Live (not zombie) descendants of ``pid``; ``helpers`` (the daemon's runner zygote,
    which lives as long as the daemon) are left out, not what they started."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = LINUX.stat(int(name))
            if p is not None and not p.dead:
                children.setdefault(p.ppid, []).append(p.pid)
    out: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        if child not in helpers:
            out.append(child)
        todo.extend(children.get(child, ()))
    return out


async def none_left(daemon_pid: int, helpers: frozenset[int] = frozenset()) -> None:
    """Wait (bounded) until the daemon has no live descendant but its helpers: its clean-up
    runs after the run's end is reported."""
    with trio.fail_after(10):
        while left := descendants(daemon_pid, helpers):
            await trio.sleep(0.05)
    assert left == []


def setsid_command_spec() -> dict[str, Any]:
    # The command waits (on a file) until its orphan has left the session and the
    # environment, so the orphan has escaped for sure before anything sweeps.
    command = (
        "env -i setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' >/dev/null 2>&1 & "
        "while [ ! -s escaped.pid ]; do :; done; echo started"
    )
    return {
        "task": "start something that escapes",
        "model": {
            "provider": "scripted",
            "script": {"turns": [{"text": "go", "tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}], "final": "done"},
        },
    }  # fmt: skip


async def run_to_end(c: Client, spec: dict[str, Any]) -> dict[str, Any]:
    run_id = (await c.ok("spawn", spec=spec))["run_id"]
    end = await c.wait_end(run_id, WAIT_S)
    return {"end": end, **(await c.ok("status", run_id=run_id))}


@pytest.mark.parametrize("containment", ["subreaper+sweep"])
async def test_a_setsid_descendant_with_an_empty_environment_is_ended(tmp_path: Path, containment: str) -> None:
    env = {"AGENTD_CGROUPS": "off", "AGENTD_RUNNER_COMMAND": ""}  # the real runner
    with trio.fail_after(60):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            st = await run_to_end(c, setsid_command_spec())
            assert st["state"] == "completed", st
            assert st["containment"] == containment
            zygote = (await c.ok("status"))["summary"]["zygote"].get("pid")
            await none_left(d.pid, frozenset([zygote] if zygote else []))
            assert d.alive()
            with trio.fail_after(5):  # the daemon logs what it killed right after the kill
                while "'cmdline': 'sleep 300'" not in d.log_text():
                    await trio.sleep(0.05)


async def test_a_descendant_holding_the_runners_stdout_is_ended_with_its_run(tmp_path: Path) -> None:
    env = {"AGENTD_CGROUPS": "off"}
    with trio.fail_after(60):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            # Another live run: an orphan no sweep can place waits for the daemon to be
            # idle; this one holds the runner's pipe, so it is the run's, and ends with it.
            other = (await c.ok("spawn", spec={"task": json.dumps({"snapshots": 1})}))["run_id"]
            await c.wait_kind(other, "step_snapshot")
            st = await run_to_end(c, {"task": json.dumps({"wait": False, "hold_stdout_scrubbed": True})})
            assert st["state"] == "completed", st
            assert st["containment"] == "subreaper+sweep"
            events = (await c.ok("events", run_id=st["id"]))["events"]
            (holder,) = [int(e["data"]["message"].split()[1]) for e in events if e["kind"] == "log"]
            path_b = st["receipt"]["path_b"]
            ended = {k["pid"] for k in path_b["killed"]} | {  # by pid, or by the group it leads
                int(sig["id"]) for sig in path_b["signals"] if sig["signal"] == "SIGKILL" and sig["result"] == "sent"
            }
            assert holder in ended, path_b
            assert LINUX.stat(holder) is None or LINUX.stat(holder).dead  # type: ignore[union-attr]
            assert not st["receipt"]["path_b"].get("pipes_held_open")
            other_pid = (await c.ok("status", run_id=other))["pid"]
            assert descendants(d.pid) == [other_pid]  # only the other run's runner is left
            assert (await c.ok("cancel", run_id=other))["was_active"] is True
            assert (await c.wait_end(other, WAIT_S))["state"] == "cancelled"
            await none_left(d.pid)
