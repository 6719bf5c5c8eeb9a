"""Acceptance: a stop is not slowed by an MCP server the run itself stopped (SIGSTOP).

Seen: a run's own ``run_command`` SIGSTOPped one of its MCP servers (or the server under a
wrapper that waits for it), then the model thought, then a Stop: the tree took ~4 s more
to die (~2 s for the wrapped one), with nothing running. The SDK's close of a stdio server
closes its stdin and waits 2 s for its exit, SIGTERMs its group and waits 2 s more, then
SIGKILLs it: a stopped process acts on neither. Now the runner SIGCONTs what of the
server's tree is stopped right before that close (``subagent.tools.mcp_spawn``).

Real processes: the daemon in-process, the real runner with the scripted model, the
official SDK's server (``tests/children/mcp_tree_server.py``). The command finds the
server by the run's own markers (its tree and the server's subtree), never by name.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import trio

from supervisor.core.runs import RunManager
from tests.supervisor.test_stop_tools import scripted, start_daemon, tree_members, wait_event

TREE_SERVER = str(Path(__file__).resolve().parent.parent / "children" / "mcp_tree_server.py")
# What the tree must be dead within, from the cancel (it was ~4.2 s for a stopped server).
TREE_DEAD_WITHIN_S = 2.0

# SIGSTOP the run's own MCP server "tree" (argv[1] "leader": the process the runner spawned;
# "served": the Python server under it). Only processes with the run's tree marker and the
# server's subtree marker, which this command inherits the first of and not the second.
_STOP_OWN_SERVER = r"""
import os, signal, sys
def env(p):
    try:
        raw = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)
def stat(p):
    try:
        s = open(f"/proc/{p}/stat").read()
        f = s[s.rindex(")") + 2:].split()
        return int(f[1]), int(f[2])  # ppid, pgid
    except OSError:
        return (0, 0)
tree = os.environ["AGENTD_TREE"]
ours = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
        if env(p).get("AGENTD_TREE") == tree and env(p).get("AGENTD_SUBTREE", "").endswith("-mcp-tree")]
leader = [p for p in ours if stat(p)[1] == p]
hit = leader if sys.argv[1] == "leader" else [p for p in ours if stat(p)[0] in leader and "mcp_tree_server" in open(f"/proc/{p}/cmdline").read()]
for p in hit:
    os.kill(p, signal.SIGSTOP)
print(f"stopped {hit} of {sorted(ours)}")
"""


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    async with start_daemon(tmp_path, monkeypatch) as m:  # the default grace (10 s)
        yield m


@pytest.mark.parametrize("which", ["leader", "served"])
async def test_a_stop_after_the_run_stopped_its_own_mcp_server_ends_the_tree_at_once(
    manager: RunManager, which: str
) -> None:
    if which == "leader":
        server = {"command": sys.executable, "args": [TREE_SERVER]}
    else:  # under a shell that waits for it (as npx does for its node): the stopped one is not the leader
        server = {"command": "/bin/sh", "args": ["-c", f'"{sys.executable}" "{TREE_SERVER}"; exit $?']}
    own = {"name": "run_command", "arguments": {"command": f"python3 -c '{_STOP_OWN_SERVER}' {which}"}}
    spec = scripted([own], mcpServers={"tree": server}, builtin_tools=["run_command"])
    spec["model"]["script"]["turns"].append({"hang": True})  # the model thinks: nothing runs
    with trio.fail_after(60):
        rid = (await manager.spawn(spec))["run_id"]
        group = await wait_event(manager, rid, lambda e: e["kind"] == "process_group" and e["data"]["name"] == "tree")
        done = await wait_event(
            manager,
            rid,
            lambda e: e["kind"] == "tool_call" and e["data"]["record"]["state"] in ("succeeded", "failed"),
        )
        record = done["data"]["record"]
        assert record["state"] == "succeeded" and "\nstopped [" in record["output"], record
        leader = psutil.Process(group["data"]["pgid"])
        stopped = leader if which == "leader" else leader.children()[0]
        assert stopped.status() == psutil.STATUS_STOPPED, (which, stopped, record["output"])
        assert str(stopped.pid) in record["output"], record["output"]
        tree_id = (await manager.status(rid))["tree_id"]
        await manager.cancel(rid)
        st = await manager.wait_terminal(rid)
    assert st["state"] == "cancelled", st
    receipt = st["receipt"]
    print("STOPPED-SERVER", which, receipt["cancel_to_tree_dead_s"], receipt["path_b"]["escalated"])
    assert receipt["path_b"]["survivors"] == [] and receipt["path_b"]["escalated"] is False, receipt
    # Not the SDK's two close timeouts waited out on a server that cannot act (~4 s).
    dead = receipt["cancel_to_tree_dead_s"]
    assert dead is not None and dead < TREE_DEAD_WITHIN_S, receipt
    assert tree_members(tree_id) == [] and not stopped.is_running()
