"""Probes of the stop contract with a real browser: real daemon, runner, @playwright/mcp, Chromium.

Each case stops a browser run at a moment a test can know without sleeping (a local
listener that accepted the browser's connection and never answers; the server's group
reported up; a run's own command that wedged its browser), then checks that nothing of the
run is alive (its tree marker, the sessions of marked processes, command lines naming its
dirs), that its records say what happened, and that the daemon goes on serving runs.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.tools import browser
from supervisor.core.runs import RunManager
from tests import browser_support as bs
from tests.supervisor.test_stop_tools import wait_event

pytestmark = pytest.mark.chromium

SCENARIO_S = 120.0
# A stop of a run whose browser calls are all interruptible ends its tree in well under
# the grace (10 s by default): this bound tells "at once" from "at the grace".
TREE_DEAD_WITHIN_S = 3.0


class Silent(bs.Listener):
    """A listener on 127.0.0.1 that accepts connections and never answers: a page that never
    finishes loading. ``accepted`` is set once a browser connected."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[socket.socket] = []
        self.accepted = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/never"

    def handle(self, conn: socket.socket) -> None:
        self._held.append(conn)
        self.accepted.set()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for c in self._held:
            c.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    with Silent() as s:
        yield s


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    async with bs.browser_daemon(tmp_path, monkeypatch, runner_python=sys.executable) as m:
        yield m


def _nav(url: str) -> dict[str, Any]:
    return {"name": "browser_navigate", "arguments": {"url": url}}


async def _accepted(silent: Silent) -> None:
    assert await trio.to_thread.run_sync(silent.accepted.wait, 60), "the browser never connected"


async def assert_nothing_left(m: RunManager, *run_ids: str, extra: tuple[str, ...] = ()) -> None:
    frags: list[str] = list(extra)
    env: list[str] = []
    for rid in run_ids:
        st = await m.status(rid)
        d = Path(st["run_dir"])
        frags += [str(d) + "/", str(browser.browser_tmpdir(d)) + "/"]
        env.append(f"AGENTD_TREE={st['tree_id']}")
    await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags, env=env))


async def assert_daemon_serves(m: RunManager) -> None:
    """Another run, after the stop, completes: the daemon is healthy."""
    r = await m.spawn({"task": "say hi", "model": {"provider": "scripted"}, "builtin_tools": []})
    st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st


def _calls(st: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    return [(c["name"], c["state"], c.get("stop_effect")) for c in st["tool_calls"]]


async def test_a_double_stop_during_a_navigation_that_never_answers_ends_the_tree_at_once(
    manager: RunManager, silent: Silent
) -> None:
    with bs.LocalSite() as site:
        spec = bs.scripted_browser_spec(site.url + "/", then=[{"tool_calls": [_nav(silent.url)]}])
        with trio.fail_after(SCENARIO_S):
            rid = (await manager.spawn(spec))["run_id"]
            await _accepted(silent)
            answers: list[dict[str, Any]] = []
            async with trio.open_nursery() as n:
                for _ in range(2):
                    n.start_soon(lambda: _append(answers, manager.cancel(rid)))
            st = await manager.wait_terminal(rid)
            third = await manager.cancel(rid)
            await assert_nothing_left(manager, rid)
            await assert_daemon_serves(manager)
    assert (st["state"], st["reason"]) == ("cancelled", "user"), st
    assert third["was_active"] is False
    assert any(a["was_active"] for a in answers), answers
    nav1, snap, nav2 = st["tool_calls"]
    assert (nav1["state"], snap["state"]) == ("succeeded", "succeeded")
    # @playwright/mcp does not answer notifications/cancelled for a navigation: the call is
    # given up after ``stop_policy.cancel_wait_s`` and said so.
    assert nav2["state"] == "cancelled" and nav2["stop_effect"] == "cancel_unanswered", nav2

    dead = st["receipt"]["cancel_to_tree_dead_s"]
    assert dead is not None and dead < TREE_DEAD_WITHIN_S, st["receipt"]
    assert st["receipt"]["path_b"]["survivors"] == []
    assert "tangerine-42" in str(st["result"]) + str(st.get("partial_snapshot"))
    row = await manager.journal.get_run(rid)
    assert row is not None and row["state"] == "cancelled"


async def _append(out: list[dict[str, Any]], aw: Any) -> None:
    out.append(await aw)


async def test_a_stop_during_parallel_browser_calls_starts_none_of_the_rest(
    manager: RunManager, silent: Silent
) -> None:
    with bs.LocalSite() as site:
        batch: dict[str, object] = {
            "tool_calls": [
                _nav(silent.url),
                {"name": "browser_snapshot", "arguments": {}},
                _nav(site.url + "/second"),
            ]
        }
        spec = bs.scripted_browser_spec(site.url + "/", then=[batch])
        with trio.fail_after(SCENARIO_S):
            rid = (await manager.spawn(spec))["run_id"]
            await _accepted(silent)
            await manager.cancel(rid)
            st = await manager.wait_terminal(rid)
            await assert_nothing_left(manager, rid)
        assert site.requests("/second") == 0, "a browser call ran after the stop"
    assert st["state"] == "cancelled", st
    calls = _calls(st)
    assert calls[:2] == [("browser_navigate", "succeeded", None), ("browser_snapshot", "succeeded", None)], calls
    for _name, state, effect in calls[3:]:
        assert state in ("not_started", "cancelled"), calls
        if state == "not_started":
            assert effect == "stopped_before_start", calls
    assert st["receipt"]["cancel_to_tree_dead_s"] < TREE_DEAD_WITHIN_S, st["receipt"]


async def test_a_stop_while_the_browser_server_starts_leaves_nothing(manager: RunManager) -> None:
    with bs.LocalSite() as site:
        spec = bs.scripted_browser_spec(site.url + "/")
        with trio.fail_after(SCENARIO_S):
            rid = (await manager.spawn(spec))["run_id"]
            await wait_event(
                manager,
                rid,
                lambda e: e["kind"] == "process_group" and e["data"]["kind"] == "mcp_server" and e["data"]["alive"],
            )
            await manager.cancel(rid)
            st = await manager.wait_terminal(rid)
            await assert_nothing_left(manager, rid)
            await assert_daemon_serves(manager)
        assert site.requests("/") == 0, "a browser call ran after the stop"
    assert st["state"] == "cancelled", st
    assert all(c["state"] == "not_started" for c in st["tool_calls"]), st["tool_calls"]
    assert st["receipt"]["cancel_to_tree_dead_s"] < TREE_DEAD_WITHIN_S, st["receipt"]


# A run's own command that signals its own browser: the node server whose command line
# names this run's browser config, Chromium (node's child), and every process in
# Chromium's session (its helpers). Only processes of the run's own tree.
_SIGNAL_OWN_BROWSER = r"""
import os, signal, sys
sig, what = getattr(signal, sys.argv[1]), sys.argv[2]
conf = os.environ["AGENTD_RUN_DIR"] + "/browser/playwright-mcp.json"
def cmd(p):
    try:
        return open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
def stat(p):
    try:
        s = open(f"/proc/{p}/stat").read()
        f = s[s.rindex(")") + 2:].split()
        return int(f[1]), int(f[3])  # ppid, session
    except OSError:
        return None
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
anc, p = set(), os.getpid()  # this command and its ancestors, its runner among them
while p > 1 and p not in anc:
    anc.add(p)
    p = (stat(p) or (0, 0))[0]
node = [p for p in pids if conf in cmd(p) and (stat(p) or (0, 0))[0] in anc]  # a child of its runner
main = [p for p in pids if (stat(p) or (0, 0))[0] in node and "chrom" in cmd(p)]
tree = [p for p in pids if (stat(p) or (0, 0))[1] in main]
hit = [p for p in tree if what == "all" or what in cmd(p)]
for p in hit:
    os.kill(p, sig)
print(f"node={node} main={main} signalled {sys.argv[1]} to {len(hit)} of {len(tree)}: {hit}")
"""


@pytest.mark.parametrize("session", [None, "probe-w"])
@pytest.mark.parametrize("fault", ["SIGSTOP all", "SIGKILL --type=renderer"])
async def test_a_stop_after_the_run_wedged_or_crashed_its_own_browser_leaves_nothing(
    manager: RunManager, fault: str, session: str | None
) -> None:
    sig, what = fault.split()
    with bs.LocalSite() as site:
        own = {
            "name": "run_command",
            "arguments": {"command": f"python3 -c '{_SIGNAL_OWN_BROWSER}' {sig} {what}"},
        }
        spec = bs.scripted_browser_spec(site.url + "/", then=[{"tool_calls": [own]}, {"hang": True}])
        spec["builtin_tools"] = ["run_command"]
        with trio.fail_after(SCENARIO_S):
            rid = (await manager.spawn(spec, session_id=session))["run_id"]
            await wait_event(manager, rid, lambda e: e["kind"] == "step_started" and e["data"]["step"] == 4)
            await manager.cancel(rid)
            st = await manager.wait_terminal(rid)
            await assert_nothing_left(manager, rid)
            if session is None:
                await assert_daemon_serves(manager)
            else:  # the session's next turn, same profile, its lock left by a killed browser
                nxt = bs.scripted_browser_spec(site.url + "/")
                nxt["model"]["script"]["turns"] = [{}, {}, {}, *nxt["model"]["script"]["turns"]]  # type: ignore[index]
                second = (await manager.spawn(nxt, session_id=session))["run_id"]
                turn2 = await manager.wait_terminal(second)
                profile = str(manager.session_desk.profile_path(session))
                await manager.close_session(session)
                await assert_nothing_left(manager, second, extra=(profile,))
                assert turn2["state"] == "completed", (turn2["state"], turn2.get("reason"), turn2["tool_calls"])
                assert "tangerine-42" in turn2["result"]["final_text"], turn2["tool_calls"]
    assert st["state"] == "cancelled", st
    cmd = [c for c in st["tool_calls"] if c["name"] == "run_command"][0]
    assert cmd["state"] == "succeeded" and "signalled" in cmd["output"], cmd
    assert "signalled " + sig + " to 0" not in cmd["output"], cmd["output"]
    print(
        "PROBE",
        fault,
        session,
        st["receipt"]["cancel_to_tree_dead_s"],
        st["receipt"]["path_b"]["escalated"],
        st["duration_s"] if "duration_s" in st else "",
    )
    assert st["receipt"]["path_b"]["survivors"] == [], st["receipt"]
    # Not the SDK's and node's close timeouts waited out on a browser that cannot act (5-6 s).
    dead = st["receipt"]["cancel_to_tree_dead_s"]
    assert dead is not None and dead < TREE_DEAD_WITHIN_S, st["receipt"]["path_b"]


@pytest.mark.parametrize("how", ["cancel", "interrupt"])
async def test_a_session_turn_stopped_mid_navigation_leaves_the_next_turn_its_profile_unstopped(
    manager: RunManager, silent: Silent, how: str
) -> None:
    # Turn 1 reads the page, then heads for a page that never loads; it is stopped there
    # (a Stop, or turn 2 spawned with --interrupt) and turn 2 of the same session starts at
    # once with the same profile: it must run to its end, not inherit the stop, a held
    # SingletonLock or a process of turn 1.
    with bs.LocalSite() as site:
        first_spec = bs.scripted_browser_spec(site.url + "/", then=[{"tool_calls": [_nav(silent.url)]}])
        second_spec = bs.scripted_browser_spec(site.url + "/second", then=[])
        script = second_spec["model"]["script"]  # type: ignore[index]
        script["turns"] = [{}, {}, {}, *script["turns"]]  # turn 1 said three things
        script["extract"], script["final"] = r"(Giraffes are \w+)", "It says: {{match}}."
        with trio.fail_after(SCENARIO_S):
            first = (await manager.spawn(first_spec, session_id="probe-1"))["run_id"]
            await _accepted(silent)
            if how == "interrupt":
                second = (await manager.spawn(second_spec, session_id="probe-1", interrupt=True))["run_id"]
                turn1 = await manager.wait_terminal(first)
            else:
                await manager.cancel(first)
                turn1 = await manager.wait_terminal(first)
                second = (await manager.spawn(second_spec, session_id="probe-1"))["run_id"]
            turn2 = await manager.wait_terminal(second)
            profile = str(manager.session_desk.profile_path("probe-1"))
            await manager.close_session("probe-1")
            await assert_nothing_left(manager, first, second, extra=(profile,))
    assert turn1["state"] == "cancelled", turn1
    assert turn1["receipt"]["path_b"]["escalated"] is False, turn1["receipt"]
    assert turn2["state"] == "completed", (turn2["state"], turn2.get("reason"), turn2["tool_calls"])
    assert turn2["result"]["final_text"] == "It says: Giraffes are tall.", turn2["tool_calls"]
    assert all(c["state"] == "succeeded" for c in turn2["tool_calls"]), turn2["tool_calls"]
