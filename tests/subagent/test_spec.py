"""RunSpec validation: what the daemon calls at spawn time (stdlib only, cheap)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from subagent.spec import Limits, RunSpec, SpecError, parse_spec_text


def test_minimal_spec_gets_the_documented_defaults() -> None:
    s = RunSpec.from_dict({"task": "t"}, env={})
    assert s.model.provider == "scripted"
    assert s.builtin_tools == ("run_command",)
    assert s.mcp_servers == {} and s.browser is False
    assert s.limits == Limits(max_steps=20, deadline_s=None, command_timeout_s=120.0, max_output_bytes=65536)


def test_provider_defaults_to_openai_when_a_key_is_set() -> None:
    assert RunSpec.from_dict({"task": "t"}, env={"OPENAI_API_KEY": "sk"}).model.provider == "openai"


def test_a_model_named_without_a_provider_is_an_openai_one_never_the_scripted_one() -> None:
    m = RunSpec.from_dict({"task": "t", "model": {"name": "gpt-4o-mini"}}, env={}).model
    assert m.provider == "openai" and m.name == "gpt-4o-mini"


def test_full_spec_round_trips() -> None:
    d = {
        "run_id": "r1",
        "session_id": "s1",
        "task": "t",
        "system_prompt": "be brief",
        "model": {"provider": "openai", "name": "gpt", "base_url": "http://x/v1", "request_timeout_s": 5},
        "builtin_tools": [],
        "mcpServers": {"fs": {"command": "npx", "args": ["-y", "server"], "env": {"A": "1"}, "cwd": "/tmp"}},
        "browser": {"headless": True},
        "limits": {"max_steps": 3, "deadline_s": 9.5, "command_timeout_s": 4, "max_output_bytes": 100},
    }
    s = RunSpec.from_dict(d, env={})
    again = RunSpec.from_dict(s.to_dict(), env={})
    assert again == s
    assert s.mcp_servers["fs"].args == ("-y", "server")


def test_claude_desktop_file_shape_is_accepted_unchanged() -> None:
    desktop = {
        "mcpServers": {
            "filesystem": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]},
            "brave-search": {
                "command": "npx",
                "args": ["-y", "@modelcontextprotocol/server-brave-search"],
                "env": {"BRAVE_API_KEY": "k"},
            },
            "My Server.v2": {"command": "/opt/srv"},
        }
    }
    s = RunSpec.from_dict({"task": "t", **desktop}, env={})
    assert s.mcp_servers["filesystem"].command == "npx"
    assert set(s.mcp_servers) == {"filesystem", "brave-search", "My Server.v2"}


@pytest.mark.parametrize(
    "d, field",
    [
        ({}, "task"),
        ({"task": ""}, "task"),
        ({"task": 3}, "task"),
        ({"task": "t", "extra": 1}, "extra"),
        ({"task": "t", "model": {"provider": "anthropic"}}, "model.provider"),
        ({"task": "t", "model": {"temperature": 1}}, "model.temperature"),
        ({"task": "t", "model": {"provider": "openai", "script": {}}}, "model.script"),
        ({"task": "t", "model": {"script": {}, "script_path": "/x"}}, "model.script_path"),
        (
            {"task": "t", "model": {"script": {"turns": [{"tool_calls": [{"name": ""}]}]}}},
            "model.script.turns[0].tool_calls[0].name",
        ),
        ({"task": "t", "model": {"request_timeout_s": 0}}, "model.request_timeout_s"),
        ({"task": "t", "builtin_tools": ["rm_rf"]}, "builtin_tools[0]"),
        ({"task": "t", "builtin_tools": "run_command"}, "builtin_tools"),
        ({"task": "t", "mcpServers": []}, "mcpServers"),
        ({"task": "t", "mcpServers": {"a": {}}}, "mcpServers.a.command"),
        ({"task": "t", "mcpServers": {"a": {"command": "x", "args": "y"}}}, "mcpServers.a.args"),
        ({"task": "t", "mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}, "mcpServers.a.env.K"),
        ({"task": "t", "mcpServers": {"a": {"command": "x", "type": "sse"}}}, "mcpServers.a.type"),
        ({"task": "t", "mcpServers": {"a__b": {"command": "x"}}}, "mcpServers.a__b"),
        ({"task": "t", "mcpServers": {"a/b": {"command": "x"}}}, "mcpServers.a/b"),
        ({"task": "t", "mcpServers": {" ": {"command": "x"}}}, "mcpServers. "),
        ({"task": "t", "mcpServers": {"browser": {"command": "x"}}, "browser": True}, "mcpServers.browser"),
        ({"task": "t", "browser": "yes"}, "browser"),
        ({"task": "t", "limits": {"max_steps": True}}, "limits.max_steps"),
        ({"task": "t", "limits": {"deadline_s": -1}}, "limits.deadline_s"),
        ({"task": "t", "limits": {"deadline_s": float("nan")}}, "limits.deadline_s"),
        ({"task": "t", "limits": {"max_output_bytes": 10}}, "limits.max_output_bytes"),
        ({"task": "t", "limits": {"max_output_bytes": 10**9}}, "limits.max_output_bytes"),
        ({"task": "t", "limits": {"steps": 3}}, "limits.steps"),
        ({"task": "t\x00"}, "task"),
    ],
)
def test_bad_specs_name_the_offending_field(d: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        RunSpec.from_dict(d, env={})
    assert info.value.field == field
    assert str(info.value)


@pytest.mark.parametrize("text", ["", "   \n", "nope", "[1]", '"task"'])
def test_parse_spec_text_rejects_non_objects(text: str) -> None:
    with pytest.raises(SpecError):
        parse_spec_text(text, env={})


def test_spec_module_imports_only_the_stdlib() -> None:
    code = (
        "import sys; import subagent.spec, subagent.events;"
        "bad = [m for m in ('trio', 'openai', 'mcp', 'pydantic', 'anyio') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("name", "at_bound", "over", "said"),
    [
        ("max_steps", 1000, 1001, "<= 1000"),
        ("max_steps", 1000, 2**63 - 1, "<= 1000"),  # what the socket's 64-bit ints still let through
        ("deadline_s", 30 * 24 * 3600, 30 * 24 * 3600 + 1, "<= 2592000"),
        ("deadline_s", 30 * 24 * 3600, 1e308, "<= 2592000"),
        ("command_timeout_s", 30 * 24 * 3600, 1e20, "<= 2592000"),
    ],
)
def test_a_specs_limits_have_an_upper_bound_named_when_refused(
    name: str, at_bound: float, over: float, said: str
) -> None:
    # A spec could ask for max_steps 2**63 - 1 (a run with no bound on its model turns, so
    # none on its calls and events), or deadlines of 1e308 s; the bound is said by name.
    assert RunSpec.from_dict({"task": "t", "limits": {name: at_bound}}, env={}).limits.to_dict()[name] == at_bound
    with pytest.raises(SpecError, match=f"limits.{name}: expected .*{said}, got") as info:
        RunSpec.from_dict({"task": "t", "limits": {name: over}}, env={})
    assert info.value.field == f"limits.{name}"
    defaults = RunSpec.from_dict({"task": "t"}, env={}).limits  # the defaults stay as they were
    assert (defaults.max_steps, defaults.deadline_s, defaults.command_timeout_s) == (20, None, 120.0)
