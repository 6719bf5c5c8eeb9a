"""ToolBox naming: plain names when unique, ``server__tool`` always (made unique when a cut
or sanitising collides), builtins win, no name offered twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

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


def test_a_plain_name_never_takes_another_servers_qualified_name() -> None:
    # A server that lists a tool literally named "fs__read" must not capture the calls
    # meant for fs's own "read" (whatever the order the servers come in).
    for servers in ({"fs": ["read"], "x": ["fs__read"]}, {"x": ["fs__read"], "fs": ["read"]}):
        b = box(**servers)
        assert b.where("fs__read") == ("fs", "read")
        assert b.where("x__fs__read") == ("x", "fs__read")
        assert b.where("read") == ("fs", "read")
        assert sorted(b.names()) == ["read", "run_command", "x__fs__read"]


def test_names_cut_at_64_characters_into_one_get_distinct_suffixes_and_both_stay_reachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    long_a, long_b = "t" * 70 + "_a", "t" * 70 + "_b"
    with caplog.at_level("WARNING", logger="subagent.tools.toolbox"):
        b = box(one=[long_a, long_b], two=[long_a])
    renamed = [r.getMessage() for r in caplog.records if "is offered as" in r.getMessage()]
    # The cut gave one's two tools one qualified name: the second was renamed, and logged.
    assert len(renamed) == 1 and long_b in renamed[0]
    names = b.names()
    assert len(names) == len(set(names)) == 4
    assert all(len(n) <= 64 for n in names)
    reached = {b.where(n) for n in names if n != "run_command"}
    assert reached == {("one", long_a), ("one", long_b), ("two", long_a)}
    assert [s["function"]["name"] for s in b.schemas()] == names
    # Deterministic: the same tools get the same names.
    assert box(one=[long_a, long_b], two=[long_a]).names() == names


def test_a_verbatim_qualified_name_keeps_it_before_one_that_was_sanitised_into_it() -> None:
    for servers in ({"a.b": ["x"], "a_b": ["x"]}, {"a_b": ["x"], "a.b": ["x"]}):
        b = box(**servers)
        assert b.where("a_b__x") == ("a_b", "x")
        other = [n for n in b.names() if n.startswith("a_b__x_")]
        assert len(other) == 1 and b.where(other[0]) == ("a.b", "x")
