"""What a stop does to each @playwright/mcp tool, as the installed server declares them.

The README lists which browser tools a stop abandons, tells to stop, or lets finish. This
asks the real server (node, no Chromium: listing tools does not start a browser) for its
tools and their MCP annotations and checks the list still holds, so an upgrade of
@playwright/mcp that changes a tool's hints cannot silently change what a stop does.
"""

from __future__ import annotations

import pathlib

import pytest
import trio

from subagent.spec import StopPolicySpec
from subagent.stop_policy import mcp_policy
from subagent.tools.browser import browser_server_config
from tests import browser_support as bs

pytestmark = pytest.mark.chromium

# As the README's "What a stop does" says.
ABANDONED = {
    "browser_wait_for", "browser_snapshot", "browser_take_screenshot", "browser_find",
    "browser_console_messages", "browser_network_requests", "browser_network_request",
}
TOLD_TO_STOP = {"browser_navigate", "browser_navigate_back"}
LET_FINISH = {
    "browser_click", "browser_type", "browser_fill_form", "browser_press_key", "browser_select_option",
    "browser_drag", "browser_drop", "browser_hover", "browser_file_upload", "browser_handle_dialog",
    "browser_evaluate", "browser_run_code_unsafe", "browser_tabs", "browser_resize",
    "browser_emulate_media", "browser_close",
}


async def list_tools(run_dir: pathlib.Path) -> list[object]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    entry = browser_server_config(run_dir, True)
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=entry["env"], cwd=entry.get("cwd"))
    with open(run_dir / "server.stderr.log", "wb") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return list((await session.list_tools()).tools)


async def test_the_readme_says_what_a_stop_does_to_each_playwright_tool(tmp_path: pathlib.Path) -> None:
    bs.require_browser()
    with trio.fail_after(60):
        tools = await list_tools(tmp_path)
    spec = StopPolicySpec()
    policy = {t.name: mcp_policy(spec, "browser", t.name, t.annotations, preset=True) for t in tools}  # type: ignore[attr-defined]
    by_policy: dict[str, set[str]] = {}
    for name, p in policy.items():
        by_policy.setdefault(str(p), set()).add(name)
    assert by_policy.get("abandon", set()) == ABANDONED
    assert by_policy.get("cancel", set()) == TOLD_TO_STOP
    assert by_policy.get("finish", set()) == LET_FINISH
    # The preset's two overrides are over tools the server itself calls destructive.
    hints = {t.name: t.annotations for t in tools}  # type: ignore[attr-defined]
    assert all(hints[n].destructive_hint is True and not hints[n].read_only_hint for n in TOLD_TO_STOP)
    # A user's override still wins over the preset's.
    user = StopPolicySpec(mcp={"browser/browser_navigate": "finish", "browser": "abandon"})
    assert str(mcp_policy(user, "browser", "browser_navigate", hints["browser_navigate"], preset=True)) == "finish"
    assert str(mcp_policy(user, "browser", "browser_click", hints["browser_click"], preset=True)) == "abandon"
