"""What a stop does to each @playwright/mcp tool, as the installed server declares them.

The README's "What a stop does" says, in two tables, which policy a stop applies to an MCP
tool by its annotations, and which @playwright/mcp tools a stop abandons, tells to stop,
or lets finish. These tests read both tables from README.md and check them against the
code's policy and the real server's tools (node, no Chromium: listing tools does not start
a browser), so neither the README nor an upgrade of @playwright/mcp that changes a tool's
hints can silently change what a stop does.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import trio
from mcp.types import ToolAnnotations

from subagent.spec import StopPolicySpec
from subagent.stop_policy import mcp_policy
from subagent.tools.browser import browser_server_config
from tests import browser_support as bs

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
POLICIES = {"interrupt", "abandon", "cancel", "finish"}


def readme_tables(section: str) -> list[list[list[str]]]:
    """The markdown tables of a README section (``### section``): rows of cells, header first."""
    text = README.read_text()
    start = text.index(f"\n### {section}\n")
    end = text.find("\n#", start + 1)
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text[start : end if end > 0 else None].splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # the separator row
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def table_headed(first_header: str) -> list[list[str]]:
    found = [t for t in readme_tables("What a stop does") if t[0][0] == first_header]
    assert len(found) == 1, f"README: no single table headed {first_header!r} under 'What a stop does'"
    return found[0][1:]


def policy_cell(cell: str) -> str:
    """The policy a row names: the one backticked word of the cell that is a policy."""
    names = [w for w in re.findall(r"`([^`]+)`", cell) if w in POLICIES]
    assert len(names) == 1, f"README: {cell!r} names no single policy"
    return names[0]


def readme_playwright_policies() -> dict[str, set[str]]:
    """policy -> the @playwright/mcp tools the README's table gives it."""
    out: dict[str, set[str]] = {}
    for tools, policy, *_what in table_headed("`@playwright/mcp` tools"):
        names = set(re.findall(r"`([^`]+)`", tools))
        assert names and all(n.startswith("browser_") for n in names), tools
        out.setdefault(policy_cell(policy), set()).update(names)
    return out


def test_the_readmes_table_of_mcp_annotations_is_the_policy_the_runner_applies() -> None:
    rows = [r for r in table_headed("tool") if r[0].startswith("MCP tool")]
    assert len(rows) == 3, rows
    spec = StopPolicySpec()
    for tool, policy, *_ in rows:
        hints = re.findall(r"`(readOnlyHint|destructiveHint|idempotentHint|openWorldHint): (true|false)`", tool)
        cases = [ToolAnnotations(**{snake(name): value == "true"}) for name, value in hints]  # each alone
        if not hints:  # "says nothing, or destructive"
            assert "says nothing" in tool and "destructive" in tool, tool
            cases = [None, ToolAnnotations(), ToolAnnotations(destructive_hint=True)]
        for hints_given in cases:
            assert str(mcp_policy(spec, "srv", "t", hints_given)) == policy_cell(policy), (tool, hints_given)


def snake(hint: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", hint).lower()


async def list_tools(run_dir: pathlib.Path) -> list[object]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from subagent.tools.browser import release_browser_dir

    entry = browser_server_config(run_dir, True)
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=entry["env"], cwd=entry.get("cwd"))
    try:
        with open(run_dir / "server.stderr.log", "wb") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    return list((await session.list_tools()).tools)
    finally:
        release_browser_dir(run_dir)  # its short TMPDIR link in /tmp (a run's end removes it)


@pytest.mark.chromium
async def test_the_readme_says_what_a_stop_does_to_each_playwright_tool(tmp_path: pathlib.Path) -> None:
    bs.require_browser()
    readme = readme_playwright_policies()
    assert set(readme) == {"abandon", "cancel", "finish"}, readme
    with trio.fail_after(60):
        tools = await list_tools(tmp_path)
    spec = StopPolicySpec()
    policy = {t.name: mcp_policy(spec, "browser", t.name, t.annotations, preset=True) for t in tools}  # type: ignore[attr-defined]
    by_policy: dict[str, set[str]] = {}
    for name, p in policy.items():
        by_policy.setdefault(str(p), set()).add(name)
    assert by_policy == readme  # every tool the server lists, each where the README says
    # The preset's overrides are over tools the server itself calls destructive.
    hints = {t.name: t.annotations for t in tools}  # type: ignore[attr-defined]
    assert all(hints[n].destructive_hint is True and not hints[n].read_only_hint for n in readme["cancel"])
    # A user's override still wins over the preset's.
    user = StopPolicySpec(mcp={"browser/browser_navigate": "finish", "browser": "abandon"})
    assert str(mcp_policy(user, "browser", "browser_navigate", hints["browser_navigate"], preset=True)) == "finish"
    assert str(mcp_policy(user, "browser", "browser_click", hints["browser_click"], preset=True)) == "abandon"
