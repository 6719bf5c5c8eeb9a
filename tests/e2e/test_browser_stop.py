"""Acceptance: a stop during a long read-only browser call ends the whole tree at once.

Real daemon (in-process, default 10 s grace), real runner, @playwright/mcp and Chromium.
``browser_wait_for`` is annotated ``readOnlyHint: true`` by @playwright/mcp, so a stop
abandons it (notifications/cancelled) instead of letting it run out; the runner then
closes the browser server and the tree is gone well inside a second, not at the grace.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagent.tools import browser
from supervisor.core.runs import RunManager
from tests import browser_support as bs
from tests.supervisor.test_stop_tools import sent, wait_event

pytestmark = pytest.mark.chromium

# The acceptance bound: cancel to the whole tree dead, Chromium included (seconds).
TREE_DEAD_WITHIN_S = 1.0


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    async with bs.browser_daemon(tmp_path, monkeypatch, runner_python=sys.executable) as m:
        yield m


async def test_a_stop_during_a_long_browser_wait_for_ends_the_tree_within_a_second(manager: RunManager) -> None:
    with bs.LocalSite() as site:
        wait = {
            "text": "Waiting for the page to settle.",
            "tool_calls": [{"name": "browser_wait_for", "arguments": {"time": 30}}],
        }
        spec = bs.scripted_browser_spec(site.url + "/", then=[wait])
        with trio.fail_after(120):
            r = await manager.spawn(spec)
            rid = r["run_id"]
            # Its first "running" record comes before its request is handed to the server:
            # a stop in between leaves it unsent (``not_started``, right, but not the case
            # under test). Its record says when it was handed over (``sent_at``).
            await wait_event(manager, rid, sent("browser_wait_for"))
            st0 = await manager.status(rid)
            run_dir, tree_id = Path(st0["run_dir"]), st0["tree_id"]
            t0 = trio.current_time()
            assert (await manager.cancel(rid))["was_active"] is True
            st = await manager.wait_terminal(rid)
            took = trio.current_time() - t0
    calls = {c["name"]: c for c in st["tool_calls"]}
    assert st["state"] == "cancelled" and st["reason"] == "user"
    wait_call = calls["browser_wait_for"]
    assert (wait_call["on_stop"], wait_call["state"], wait_call["stop_effect"]) == ("abandon", "cancelled", "abandoned")
    assert wait_call["sent_at"] is not None
    dead = st["receipt"]["cancel_to_tree_dead_s"]
    assert dead is not None and dead < TREE_DEAD_WITHIN_S, f"cancel to tree dead {dead:.2f} s, to terminal {took:.2f} s"
    assert st["receipt"]["path_b"]["escalated"] is False and st["receipt"]["path_b"]["survivors"] == []
    assert "tangerine-42" in str(st["result"]), "what was read before the stop is kept"
    frags = [str(run_dir) + "/", str(browser.browser_tmpdir(run_dir)) + "/"]
    await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags, env=[f"AGENTD_TREE={tree_id}"]))
