"""A long session's ``history`` comes in pages, each bounded in bytes, every turn once.

A real daemon whose bound (``history_reply_bytes``) is small, a session of several turns
that together exceed it: a request as an old client sends it gets the newest turns that
fit and says it was cut (and how to get the rest); paging back (``before_turn``) or on
(``after_turn``) gives every turn exactly once, in order; ``agentd history`` pages by
itself and prints them all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import trio

from tests.supervisor.real_daemon import Client, real_daemon, strict_loads

TURNS = 7
TEXT_CHARS = 20_000  # each turn's task pad and answer: ~160 kB of reply per turn
BOUND = 400_000  # two turns a page (~160 kB each: its own messages, and the history's)
ENV = {"AGENTD_HISTORY_REPLY_BYTES": str(BOUND)}
WAIT_S = 60.0


async def make_session(c: Client, session_id: str, turns: int) -> list[str]:
    run_ids = []
    for i in range(turns):
        behaviour = {
            "wait": False,
            "pad": f"{i}" * TEXT_CHARS,
            "result_fields": {"final_text": f"answer {i} " + "a" * TEXT_CHARS},
        }
        run_id = (await c.ok("spawn", spec={"task": json.dumps(behaviour)}, session_id=session_id))["run_id"]
        assert (await c.wait_end(run_id))["state"] == "completed"
        run_ids.append(run_id)
    return run_ids


async def raw_history(c: Client, **args: Any) -> tuple[dict[str, Any], int]:
    """A ``history`` request as sent (nothing added): its result and its reply's size."""
    await c.send_raw(json.dumps({"id": "h", "op": "history", **args}))
    with trio.fail_after(WAIT_S):
        text = await c.ws.get_message()
    reply = strict_loads(text)
    assert reply["ok"] is True, str(reply)[:300]
    return reply["result"], len(text)


def own_messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for t in turns for m in t["messages"]]


async def test_an_old_style_request_gets_the_newest_turns_that_fit_and_says_it_was_cut(tmp_path: Path) -> None:
    async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
        run_ids = await make_session(c, "long", TURNS)
        page, size = await raw_history(c, session_id="long")
        assert size <= BOUND + 2048, size  # the turns, and a few fields about them
        assert page["complete"] is False and page["more"] is True
        assert page["turn_count"] == TURNS
        n = len(page["turns"])
        assert 1 < n < TURNS
        assert page["first_turn"] == TURNS - n + 1
        assert [t["run_id"] for t in page["turns"]] == run_ids[-n:]
        assert [t["turn"] for t in page["turns"]] == list(range(TURNS - n + 1, TURNS + 1))
        # ``messages``: the history of the page's turns (all ended), not a silent whole.
        assert page["messages"] == own_messages(page["turns"]) and page["messages"]
        assert page["live_run"] is None and page["closed_at"] is None
        # A short session is answered whole, as before.
        short_ids = await make_session(c, "short", 1)
        short, _ = await raw_history(c, session_id="short")
        assert [t["run_id"] for t in short["turns"]] == short_ids
        assert short["complete"] is True and short["more"] is False and short["first_turn"] == 1
        assert short["messages"] == own_messages(short["turns"])


async def test_paging_back_or_on_gives_every_turn_once_in_order(tmp_path: Path) -> None:
    async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
        run_ids = await make_session(c, "long", TURNS)
        # Back from the newest, as the dashboard does.
        pages = [await c.ok("history", session_id="long")]
        while pages[-1]["more"]:
            pages.append(await c.ok("history", session_id="long", before_turn=pages[-1]["first_turn"]))
        assert len(pages) > 2
        back = [t for p in reversed(pages) for t in p["turns"]]
        assert [t["run_id"] for t in back] == run_ids
        assert [t["turn"] for t in back] == list(range(1, TURNS + 1))
        # On from the start, as the CLI does; a smaller bound asked for: a turn a page.
        forward: list[dict[str, Any]] = []
        after = 0
        while True:
            page, size = await raw_history(c, session_id="long", after_turn=after, max_bytes=1)
            assert len(page["turns"]) == 1 and page["first_turn"] == after + 1
            forward.extend(page["turns"])
            after = page["turns"][-1]["turn"]
            if not page["more"]:
                break
        assert forward == back
        # Every page's messages together: the whole history a next turn would get.
        assert [m for p in reversed(pages) for m in p["messages"]] == own_messages(back)
        # Past either end: an empty page, nothing more.
        end = await c.ok("history", session_id="long", after_turn=TURNS)
        assert (end["turns"], end["more"], end["first_turn"]) == ([], False, TURNS + 1)
        start = await c.ok("history", session_id="long", before_turn=1)
        assert (start["turns"], start["more"]) == ([], False)
        both = await c.call("history", session_id="long", before_turn=3, after_turn=1)
        assert both["ok"] is False and both["error"]["code"] == "bad_args", both


async def test_the_cli_prints_a_long_sessions_whole_history_by_paging(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with real_daemon(state, env=ENV) as d, d.connect() as c:
        run_ids = await make_session(c, "long", TURNS)
        cli = [sys.executable, "-m", "supervisor", "--state-dir", str(state), "history", "long"]
        with trio.fail_after(WAIT_S):
            human = await trio.run_process(cli, capture_stdout=True, capture_stderr=True)
            as_json = await trio.run_process([*cli, "--json"], capture_stdout=True, capture_stderr=True)
    lines = human.stdout.decode().splitlines()
    heads = [line.split()[:3] for line in lines if line.startswith("turn ")]
    assert heads == [["turn", str(n), run_id] for n, run_id in enumerate(run_ids, 1)]
    assert sum(f"answer {i} " in human.stdout.decode() for i in range(TURNS)) == TURNS
    whole = json.loads(as_json.stdout)
    assert [t["run_id"] for t in whole["turns"]] == run_ids
    assert whole["messages"] == own_messages(whole["turns"])
    assert whole["complete"] is True and whole["more"] is False and whole["first_turn"] == 1
