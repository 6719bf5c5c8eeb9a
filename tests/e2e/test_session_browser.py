"""Acceptance, real Chromium: a session's browser state outlives a stopped turn, not its close.

The daemon runs in-process on a temp state dir; each turn is a scripted sub-agent driving
@playwright/mcp and Chromium against a site this test serves on 127.0.0.1. Turn 1 signs in
(the site sets a cookie) and is cancelled while its model is thinking; turn 2 of the same
session opens a page that shows the cookie the browser sent. Closing the session removes
the profile; no process of either turn is left (checked by their dirs, the profile path,
and the suite's own leak check).
"""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.core.runs import RunManager
from tests import browser_support as bs
from tests.e2e.test_browser_stop_probes import _SIGNAL_OWN_BROWSER as SIGNAL_OWN_BROWSER

pytestmark = pytest.mark.chromium

GRACE_S = 3.0
SCENARIO_S = 120.0
COOKIE = "agentd_login=alice-42"
# A login many sites make with a session cookie (no Expires/Max-Age: PHPSESSID, JSESSIONID),
# and a persistent one beside it.
SESSION_COOKIE, LASTING_COOKIE = "agentd_sess=s-77", "agentd_pers=p-88"


class _Site(http.server.ThreadingHTTPServer):
    cookies_seen: list[str]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Site

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/set":
            body, extra = "<h1>Signed in</h1>", [("Set-Cookie", f"{COOKIE}; Max-Age=3600; Path=/")]
        elif self.path == "/login":
            body = "<h1>Signed in for this session</h1>"
            extra = [
                ("Set-Cookie", f"{SESSION_COOKIE}; Path=/"),
                ("Set-Cookie", f"{LASTING_COOKIE}; Max-Age=3600; Path=/"),
            ]
        elif self.path == "/show":
            cookie = self.headers.get("Cookie") or "none"
            self.server.cookies_seen.append(cookie)
            body, extra = f"<h1>Cookie: {cookie}</h1>", []
        else:
            self.send_error(404)
            return
        data = f"<!doctype html><html><body>{body}</body></html>".encode()
        self.send_response(200)
        for k, v in [("Content-Type", "text/html"), ("Content-Length", str(len(data))), *extra]:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def site() -> Any:
    server = _Site(("127.0.0.1", 0), _Handler)
    server.cookies_seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    async with bs.browser_daemon(tmp_path, monkeypatch, grace_s=GRACE_S) as m:
        yield m


def spec(turns: list[Any], *, extract: str | None = None, final: str = "done") -> dict[str, Any]:
    script: dict[str, Any] = {"turns": turns, "final": final}
    if extract:
        script["extract"] = extract
    return {
        "task": "use the site",
        "model": {"provider": "scripted", "script": script},
        "builtin_tools": [],
        "browser": True,
        "limits": {"max_steps": 6},
    }


def reading_the_cookie(url: str, *, after: int) -> dict[str, Any]:
    """A turn that opens the page showing the cookie its browser sent, and says it. Its
    history holds the earlier turn's ``after`` assistant messages: its script starts there."""
    return spec(
        [
            *([{}] * after),
            {"tool_calls": [{"name": "browser_navigate", "arguments": {"url": url + "/show"}}]},
            {"tool_calls": [{"name": "browser_snapshot", "arguments": {}}]},
        ],
        extract=r"Cookie: agentd_login=([\w-]+)",
        final="The site still knows me as {{match}}.",
    )


async def wait_event(m: RunManager, run_id: str, kind: str) -> dict[str, Any]:
    async with m.subscribe(run_id) as live:
        for ev in await m.events_after(run_id, 0):
            if ev["kind"] == kind:
                return ev
        async for ev in live:
            if ev["kind"] == kind:
                return ev
    raise AssertionError(f"run {run_id} ended without a {kind!r} event")


async def test_a_stopped_turn_keeps_the_sessions_login_for_the_next_turn_and_closing_removes_it(
    manager: RunManager, site: Any
) -> None:
    url = f"http://127.0.0.1:{site.server_address[1]}"
    sign_in = spec([{"tool_calls": [{"name": "browser_navigate", "arguments": {"url": url + "/set"}}]}, {"hang": True}])
    read_back = reading_the_cookie(url, after=1)  # turn 1 said one thing
    with trio.fail_after(SCENARIO_S):
        first = await manager.spawn(sign_in, session_id="web-1")
        await wait_event(manager, first["run_id"], "step_started")
        async with manager.subscribe(first["run_id"]) as live:
            async for ev in live:  # the sign-in page loaded: the model is thinking again
                if ev["kind"] == "step_started" and ev["data"]["step"] == 2:
                    break
        await manager.cancel(first["run_id"])
        turn1 = await manager.wait_terminal(first["run_id"])
        profile = Path(manager.session_desk.profile_path("web-1"))
        kept = profile.is_dir() and any(profile.iterdir())
        second = await manager.spawn(read_back, session_id="web-1")
        turn2 = await manager.wait_terminal(second["run_id"])
        sessions = (await manager.list_sessions())["sessions"]
        closed = await manager.close_session("web-1")
        frags = [str(profile), *(f"{turn['run_dir']}/" for turn in (turn1, turn2))]
        await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags))
    assert turn1["state"] == "cancelled" and kept
    (nav,) = turn1["tool_calls"]
    assert (nav["name"], nav["state"]) == ("browser_navigate", "succeeded")
    assert turn1["sandbox"]["write"][-1] == str(profile)  # granted by the daemon, explicitly
    assert turn2["state"] == "completed", turn2
    assert turn2["result"]["final_text"] == "The site still knows me as alice-42.", turn2["tool_calls"]
    assert site.cookies_seen == [COOKIE]
    (row,) = sessions
    assert row["profile"]["path"] == str(profile)
    assert closed == {"session_id": "web-1", "was_open": True, "stopped": [], "profile_removed": True}
    assert not profile.exists() and not profile.parent.exists()


@pytest.mark.parametrize("stopped", [False, True])
async def test_a_stop_whose_grace_runs_out_in_a_browser_call_still_keeps_the_login(
    manager: RunManager, site: Any, stopped: bool
) -> None:
    # A call the policy lets finish (evaluate) outlives the grace: the tree was SIGKILLed,
    # Chromium with it, and the cookie it had not written yet was gone for turn 2.
    # ``stopped``: the run's own command SIGSTOPped its whole browser (node, Chromium, its
    # helpers) before the call: resumed at the grace's reserve, it closes and writes all the
    # same (it neither answered nor wrote: the runner was SIGKILLed at the grace, the cookie lost).
    url = f"http://127.0.0.1:{site.server_address[1]}"
    slow = "() => new Promise(r => setTimeout(() => r('late'), 60000))"
    stop_it = {"name": "run_command", "arguments": {"command": f"python3 -c '{SIGNAL_OWN_BROWSER}' SIGSTOP all"}}
    sign_in = spec(
        [
            {"tool_calls": [{"name": "browser_navigate", "arguments": {"url": url + "/set"}}]},
            *([{"tool_calls": [stop_it]}] if stopped else []),
            {"tool_calls": [{"name": "browser_evaluate", "arguments": {"function": slow}}]},
        ]
    )
    if stopped:
        sign_in["builtin_tools"] = ["run_command"]
    read_back = reading_the_cookie(url, after=3 if stopped else 2)  # what turn 1 said
    with trio.fail_after(SCENARIO_S):
        first = await manager.spawn(sign_in, session_id="web-3")
        async with manager.subscribe(first["run_id"]) as live:
            async for ev in live:
                record = ev["data"].get("record") or {}
                if ev["kind"] == "tool_call" and record.get("name") == "browser_evaluate":
                    # Sent (its first "running" record comes before the hand-off: a stop
                    # in between leaves it unsent, and this case untested).
                    if record.get("state") == "running" and record.get("sent_at") is not None:
                        break
        await manager.cancel(first["run_id"])
        turn1 = await manager.wait_terminal(first["run_id"])
        second = await manager.spawn(read_back, session_id="web-3")
        turn2 = await manager.wait_terminal(second["run_id"])
        profile = str(manager.session_desk.profile_path("web-3"))
        await manager.close_session("web-3")
        frags = [profile, *(f"{turn['run_dir']}/" for turn in (turn1, turn2))]
        await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags))
    assert turn1["state"] == "cancelled", turn1
    nav, *own, evaluate = turn1["tool_calls"]
    assert nav["state"] == "succeeded" and evaluate["state"] == "failed", evaluate  # the browser closed under it
    if stopped:
        assert own[0]["state"] == "succeeded" and "signalled SIGSTOP to 0" not in own[0]["output"], own
    # Said as such: ended by the stop (it was said to have finished, allowed to, after it).
    assert evaluate["stop_effect"] == "interrupted", evaluate
    assert evaluate["reason"].startswith("interrupted: its server was closed before the stop's grace ran out")
    assert "interrupted `browser_evaluate`" in turn1["receipt"]["tool_summary"], turn1["receipt"]
    assert turn1["receipt"]["path_b"]["escalated"] is False  # it ended within the grace
    assert turn2["state"] == "completed", turn2
    assert turn2["result"]["final_text"] == "The site still knows me as alice-42.", turn2["tool_calls"]
    assert site.cookies_seen == [COOKIE]


async def test_closing_a_session_as_its_browser_turn_starts_stops_that_turn_at_once(
    manager: RunManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A browser turn takes its session's lock to prepare its profile at its start; a close
    # (or an --interrupt spawn) holds that lock while it waits for the turn to end. The
    # stop must end the preparation, not wait out the grace and then refuse the close.
    desk = manager.session_desk
    prepare = desk.prepare_turn
    entered, go_on = trio.Event(), trio.Event()

    async def held_prepare(*args: Any) -> Any:
        entered.set()  # the turn is starting: its preparation comes next
        await go_on.wait()
        return await prepare(*args)

    monkeypatch.setattr(desk, "prepare_turn", held_prepare)
    with trio.fail_after(SCENARIO_S):
        first = await manager.spawn(spec([{"hang": True}]), session_id="web-2")
        await entered.wait()
        async with trio.open_nursery() as n:
            closing: list[dict[str, Any]] = []
            t0 = trio.current_time()

            async def close() -> None:
                closing.append(await manager.close_session("web-2"))

            n.start_soon(close)
            run = manager._live[first["run_id"]]
            while not run.token.cancelled:  # the close holds the lock and has sent the stop
                await trio.sleep(0.01)
            go_on.set()
        close_s = trio.current_time() - t0
        turn = await manager.wait_terminal(first["run_id"])
    (closed,) = closing
    assert closed["stopped"] == [first["run_id"]] and closed["was_open"] is True
    assert close_s < GRACE_S  # not the grace and a margin, then a refusal
    assert (turn["state"], turn["reason"]) == ("cancelled", "session_closed")
    assert turn["receipt"]["note"] == "cancelled before its runner started: never started"
    assert turn["pid"] is None  # no runner was ever started for it
    assert not Path(desk.profile_path("web-2")).exists()  # nor a profile made after the close


@pytest.mark.parametrize("end", ["completed", "cancelled", "grace", "interrupt"])
async def test_a_login_kept_in_a_session_cookie_outlives_the_turn_that_made_it(
    manager: RunManager, site: Any, end: str
) -> None:
    # Chromium writes session cookies at every shutdown but, by default, drops them at the
    # next start: turn 2 was signed out of any site whose login is a session cookie. Turn 1
    # ends by itself, is cancelled while its model thinks, or is cancelled (or interrupted by
    # turn 2) in a call that outlives the grace (its browser closed before the grace runs out).
    url = f"http://127.0.0.1:{site.server_address[1]}"
    slow = "() => new Promise(r => setTimeout(() => r('late'), 60000))"
    login = {"tool_calls": [{"name": "browser_navigate", "arguments": {"url": url + "/login"}}]}
    then = {
        "completed": [],
        "cancelled": [{"hang": True}],
        "grace": [{"tool_calls": [{"name": "browser_evaluate", "arguments": {"function": slow}}]}],
    }[end if end != "interrupt" else "grace"]
    said = 1 if end == "cancelled" else 2  # turn 1's assistant messages: turn 2's script starts there
    read_back = spec(
        [
            *([{}] * said),
            {"tool_calls": [{"name": "browser_navigate", "arguments": {"url": url + "/show"}}]},
            {"tool_calls": [{"name": "browser_tabs", "arguments": {"action": "list"}}]},
            {"tool_calls": [{"name": "browser_snapshot", "arguments": {}}]},
        ],
        extract=r"agentd_sess=([\w-]+)",
        final="session {{match}}",
    )
    session_id = f"web-sess-{end}"
    with trio.fail_after(SCENARIO_S):
        first = await manager.spawn(spec([login, *then]), session_id=session_id)
        if end != "completed":
            async with manager.subscribe(first["run_id"]) as live:
                async for ev in live:  # the login page loaded; the model thinks, or evaluates
                    record = ev["data"].get("record") or {}
                    if end == "cancelled" and ev["kind"] == "step_started" and ev["data"]["step"] == 2:
                        break
                    if record.get("name") == "browser_evaluate" and record.get("sent_at") is not None:
                        break  # the call was handed to the browser server (not just announced running)
        if end == "interrupt":  # turn 2 stops turn 1 and waits for it to end
            second = await manager.spawn(read_back, session_id=session_id, interrupt=True)
            turn1 = await manager.wait_terminal(first["run_id"])
        else:
            if end != "completed":
                await manager.cancel(first["run_id"])
            turn1 = await manager.wait_terminal(first["run_id"])
            second = await manager.spawn(read_back, session_id=session_id)
        turn2 = await manager.wait_terminal(second["run_id"])
        profile = str(manager.session_desk.profile_path(session_id))
        await manager.close_session(session_id)
        frags = [profile, *(f"{turn['run_dir']}/" for turn in (turn1, turn2))]
        await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags))
    assert turn1["state"] == ("completed" if end == "completed" else "cancelled"), turn1
    assert turn1["tool_calls"][0]["state"] == "succeeded", turn1["tool_calls"]
    if end != "completed":
        assert turn1["receipt"]["path_b"]["escalated"] is False  # ended within the grace, browser closed
    assert turn2["state"] == "completed", turn2
    (seen,) = site.cookies_seen  # what turn 2's browser sent: both cookies
    assert sorted(seen.split("; ")) == sorted([LASTING_COOKIE, SESSION_COOKIE]), seen
    assert turn2["result"]["final_text"] == "session s-77", turn2["tool_calls"]
    # And no tab of turn 1 came back: turn 2's browser has one page, the one it opened.
    (tabs,) = [c for c in turn2["tool_calls"] if c["name"] == "browser_tabs"]
    # The tab lines only: the same answer may also list new console entries (a favicon's
    # 404, logged by Chromium whenever it comes), as "- New console entries: ...".
    listed = [line for line in tabs["output"].splitlines() if re.match(r"- \d+: ", line)]
    assert listed == [f"- 0: (current) []({url}/show)"], tabs["output"]
