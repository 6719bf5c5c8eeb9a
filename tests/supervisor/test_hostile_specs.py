"""A spec with hostile values is refused at spawn, naming its field, and harms no other run.

A real daemon and real runners. An MCP server's environment variable whose name the
kernel's environment cannot hold (``A=B``, empty, a NUL) passed the spec's checks: the
run started, its runner's ``Popen`` raised ``ValueError`` and the run failed ``internal``
("a runner bug"), after the daemon had spent a runner on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.supervisor.real_daemon import real_daemon


@pytest.mark.parametrize("name", ["A=B", "", "A\x00B"], ids=["equals sign", "empty", "NUL"])
async def test_an_mcp_servers_env_name_no_environment_holds_is_a_bad_spec_at_spawn(tmp_path: Path, name: str) -> None:
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        bystander = (await c.ok("spawn", spec={"task": json.dumps({"wait": True})}))["run_id"]
        await c.wait_kind(bystander, "step_snapshot")
        server = {"command": sys.executable, "args": ["-c", "pass"], "env": {name: "x"}}
        reply = await c.call("spawn", spec={"task": "t", "mcpServers": {"s": server}})
        assert reply["ok"] is False, reply
        assert reply["error"]["code"] == "bad_spec", reply
        assert "mcpServers.s.env" in reply["error"]["message"], reply
        assert [r["id"] for r in (await c.ok("list", limit=10))["runs"]] == [bystander]  # no run was made
        assert (await c.ok("status", run_id=bystander))["state"] == "running"
        await c.ok("cancel", run_id=bystander)
        assert (await c.wait_end(bystander))["state"] == "cancelled"
        assert d.alive()
