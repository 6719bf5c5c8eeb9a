"""Which stop policy a tool gets: MCP annotations, the browser preset, the spec's overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from subagent.events import StopPolicy
from subagent.spec import RunSpec, SpecError, StopPolicySpec
from subagent.stop_policy import annotation_policy, command_policy, mcp_policy


@dataclass
class Hints:
    read_only_hint: bool | None = None
    destructive_hint: bool | None = None
    idempotent_hint: bool | None = None


@pytest.mark.parametrize(
    ("hints", "policy"),
    [
        (None, StopPolicy.FINISH),  # says nothing: MCP's default is destructive
        (Hints(), StopPolicy.FINISH),
        (Hints(read_only_hint=True), StopPolicy.ABANDON),
        (Hints(read_only_hint=True, destructive_hint=True), StopPolicy.ABANDON),  # destructive is moot when read-only
        (Hints(destructive_hint=False), StopPolicy.CANCEL),
        (Hints(destructive_hint=True, idempotent_hint=True), StopPolicy.CANCEL),
        (Hints(destructive_hint=True, idempotent_hint=False), StopPolicy.FINISH),
    ],
)
def test_mcp_annotations_decide_by_the_tools_nature(hints: Any, policy: StopPolicy) -> None:
    assert annotation_policy(hints) is policy


def test_the_most_specific_override_wins_then_the_preset_then_the_hints() -> None:
    spec = StopPolicySpec(mcp={"fs": "cancel", "fs/write": "finish"})
    assert mcp_policy(spec, "fs", "write", Hints(read_only_hint=True)) is StopPolicy.FINISH
    assert mcp_policy(spec, "fs", "read", Hints(read_only_hint=True)) is StopPolicy.CANCEL
    assert mcp_policy(spec, "other", "read", Hints(read_only_hint=True)) is StopPolicy.ABANDON
    nav = Hints(destructive_hint=True)
    assert mcp_policy(StopPolicySpec(), "browser", "browser_navigate", nav, preset=True) is StopPolicy.CANCEL
    assert mcp_policy(StopPolicySpec(), "browser", "browser_navigate", nav, preset=False) is StopPolicy.FINISH
    assert command_policy(StopPolicySpec()) is StopPolicy.INTERRUPT
    assert command_policy(StopPolicySpec(run_command="finish")) is StopPolicy.FINISH


def test_a_spec_round_trips_its_stop_policy_and_omits_the_default() -> None:
    d = {
        "task": "t",
        "mcpServers": {"fs": {"command": "node", "args": ["fs.js"]}},
        "browser": True,
        "stop_policy": {
            "run_command": "finish",
            "mcp": {"fs": "abandon", "browser/browser_click": "cancel"},
            "command_grace_s": 2,
            "cancel_wait_s": 0.5,
        },
    }
    spec = RunSpec.from_dict(d, env={})
    assert spec.stop_policy == StopPolicySpec("finish", {"fs": "abandon", "browser/browser_click": "cancel"}, 2.0, 0.5)
    assert RunSpec.from_dict(spec.to_dict(), env={}) == spec
    assert "stop_policy" not in RunSpec.from_dict({"task": "t"}, env={}).to_dict()


@pytest.mark.parametrize(
    ("policy", "field", "says"),
    [
        ({"run_command": "abandon"}, "stop_policy.run_command", "expected one of ['interrupt', 'finish']"),
        ({"mcp": {"nope": "finish"}}, "stop_policy.mcp.nope", "no mcp server named 'nope'"),
        ({"mcp": {"fs/": "finish"}}, "stop_policy.mcp.fs/", "expected 'server' or 'server/tool'"),
        ({"mcp": {"fs": "interrupt"}}, "stop_policy.mcp.fs", "expected one of ['abandon', 'cancel', 'finish']"),
        ({"command_grace_s": 0}, "stop_policy.command_grace_s", "positive"),
        ({"cancel_wait_s": "1"}, "stop_policy.cancel_wait_s", "expected a number"),
        ({"finish_all": True}, "stop_policy.finish_all", "unknown key"),
        ("finish", "stop_policy", "expected an object"),
    ],
)
def test_a_bad_stop_policy_names_its_field(policy: Any, field: str, says: str) -> None:
    d = {"task": "t", "mcpServers": {"fs": {"command": "node"}}, "stop_policy": policy}
    with pytest.raises(SpecError) as info:
        RunSpec.from_dict(d, env={})
    assert info.value.field == field and says in info.value.message
