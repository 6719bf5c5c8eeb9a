"""ToolBox naming: plain names when unique, ``server__tool`` always, builtins win."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from subagent.spec import Limits
from subagent.tools.toolbox import ToolBox, bound_text


@dataclass
class FakeTool:
    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class FakeServer:
    name: str
    tools: list[FakeTool]
    protocol_errors: list[str] = field(default_factory=list)


def box(**servers: list[str]) -> ToolBox:
    return ToolBox(
        builtins=("run_command",),
        limits=Limits(),
        servers={n: FakeServer(n, [FakeTool(t) for t in tools]) for n, tools in servers.items()},  # type: ignore[misc]
        on_group=lambda *a: None,
    )


def test_unique_tools_keep_their_names_and_collisions_are_qualified() -> None:
    b = box(web=["browser_navigate", "search"], docs=["search", "run_command", "odd.name"])
    assert b.names() == [
        "run_command",
        "browser_navigate",
        "web__search",
        "docs__search",
        "docs__run_command",
        "odd_name",
    ]
    assert b.has("web__browser_navigate") and b.has("browser_navigate")
    assert not b.has("search")
    schema_names = [s["function"]["name"] for s in b.schemas()]
    assert schema_names == b.names()


def test_no_tools_means_no_schemas() -> None:
    b = ToolBox(builtins=(), limits=Limits(), servers={}, on_group=lambda *a: None)
    assert b.schemas() == [] and b.names() == []


def test_bound_text_cuts_on_a_character_boundary() -> None:
    text, cut = bound_text("héllo" * 10, 7)
    assert cut and len(text.encode()) <= 7 and text.startswith("héllo")
    assert bound_text("short", 100) == ("short", False)
