"""Pre-spawning MCP servers: the environment matches what the SDK alone would give."""

from __future__ import annotations

import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from subagent.spec import McpServerSpec
from subagent.tools.commands import SUBTREE_VAR
from subagent.tools.mcp_spawn import SDK_INHERITED_ENV_VARS, server_env


def test_inherited_env_vars_match_the_sdk() -> None:
    from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS

    assert tuple(DEFAULT_INHERITED_ENV_VARS) == SDK_INHERITED_ENV_VARS


def test_server_env_is_sdk_default_plus_agentd_tmpdir_and_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTD_TREE", "tree-1")
    monkeypatch.setenv("TMPDIR", "/run/x/tmp")
    monkeypatch.setenv("SECRET_TOKEN", "do-not-pass")
    monkeypatch.setenv("PATH", "/usr/bin")
    spec = McpServerSpec(command="x", env={"API_URL": "http://y", "AGENTD_TREE": "spoofed", "TMPDIR": "/own"})
    env = server_env(spec, "m1")
    assert env["PATH"] == "/usr/bin"
    assert env["AGENTD_TREE"] == "tree-1"  # containment markers cannot be overridden
    assert env["TMPDIR"] == "/own"  # a spec (the browser preset) may choose its own TMPDIR
    assert env["API_URL"] == "http://y"
    assert env[SUBTREE_VAR] == "m1"
    assert "SECRET_TOKEN" not in env


def test_the_tool_env_allowlist_covers_what_the_sdk_would_pass() -> None:
    from subagent.sandbox import TOOL_ENV_NAMES

    assert set(SDK_INHERITED_ENV_VARS) <= set(TOOL_ENV_NAMES)


async def test_a_server_whose_leader_was_out_of_sight_at_its_start_is_still_ended_by_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a command's (test_commands): its start ticks unread at the spawn (a hidepid /proc
    # before its execve made it dumpable), a server that drops its environment (the marker)
    # is found by its group alone, which its close must still end.
    from subagent.tools import mcp_spawn

    real = mcp_spawn.leader_ticks
    reads: list[int | None] = []

    def first_out_of_sight(pid: int) -> int | None:
        ticks = None if not reads else real(pid)
        reads.append(ticks)
        return ticks

    monkeypatch.setattr(mcp_spawn, "leader_ticks", first_out_of_sight)
    flag = tmp_path / "started"
    spec = McpServerSpec(command="/bin/sh", args=["-c", f"touch {flag}; exec env -i sleep 30"])
    groups: list[tuple[int, bool]] = []
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            p = await mcp_spawn.prespawn(
                "s", spec, stack, run_dir=tmp_path, on_group=lambda g, a: groups.append((g, a))
            )
            assert p.process is not None and p.error is None
            while not flag.exists():
                await trio.sleep(0.01)
    assert reads[0] is None and reads[1] is not None, reads
    assert groups == [(p.process.pid, True), (p.process.pid, False)]
    assert p.process.returncode == -signal.SIGTERM  # its group's SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(p.process.pid, 0)
