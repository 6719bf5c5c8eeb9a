"""Pre-spawning MCP servers: the environment matches what the SDK alone would give."""

from __future__ import annotations

import pytest

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
