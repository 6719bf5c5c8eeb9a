"""``history`` requests side by side cannot take the daemon's memory with them.

A history reply holds its session's whole transcript many times over while it is built,
encoded and sent; a connection may have 32 requests in flight, and each held its own. A
real daemon, a session of a few megabytes, and eight ``history`` requests sent at once on
one connection that reads none of the replies until all are sent: the daemon's peak
resident memory (``VmHWM``) grows by about what ``HISTORY_AT_ONCE`` (2) replies take,
not eight.

And a reply is one page (``history_reply_bytes``): one request of a long session (~24 MB
of history) cost the daemon ~96 MiB; now it, and paging through the whole session, cost
a few pages at most.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio

from supervisor.control.server import HISTORY_AT_ONCE
from tests.supervisor.real_daemon import Client, real_daemon, strict_loads

TURNS = 3
TEXT_CHARS = 500_000  # each turn's task and its answer: a ~3 MB transcript, ~7 MB replies
AT_ONCE = 8
WAIT_S = 60.0


def peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


async def histories(c: Client, n: int) -> list[int]:
    """Send ``n`` history requests at once, then read the ``n`` replies (their sizes)."""
    for i in range(n):
        await c.send_raw(json.dumps({"id": f"h{i}", "op": "history", "session_id": "big"}))
    sizes = []
    with trio.fail_after(WAIT_S):
        for _ in range(n):
            text = await c.ws.get_message()
            reply = strict_loads(text)
            assert reply["ok"] is True, str(reply)[:300]
            assert len(reply["result"]["turns"]) == TURNS
            sizes.append(len(text))
    return sizes


async def test_history_replies_side_by_side_are_built_and_sent_a_few_at_a_time(tmp_path: Path) -> None:
    # Bound far above these replies: each is one page, the whole session.
    env = {"AGENTD_HISTORY_REPLY_BYTES": str(64 * 1024 * 1024)}
    async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
        for _ in range(TURNS):
            behaviour = {"wait": False, "pad": "t" * TEXT_CHARS, "result_fields": {"final_text": "a" * TEXT_CHARS}}
            run_id = (await c.ok("spawn", spec={"task": json.dumps(behaviour)}, session_id="big"))["run_id"]
            assert (await c.wait_end(run_id))["state"] == "completed"
        before = peak_kib(d.pid)
        (size,) = await histories(c, 1)
        assert size > 2 * TURNS * TEXT_CHARS  # each text twice: its turn's and the whole history's
        one = peak_kib(d.pid) - before
        assert one > size // 1024, (one, size)  # one reply costs the daemon at least its size
        sizes = await histories(c, AT_ONCE)
        assert sizes == [size] * AT_ONCE
        many = peak_kib(d.pid) - before
        # Eight at once took about eight times one (~8x); now about two at a time.
        assert many < (HISTORY_AT_ONCE + 1) * one, f"one: {one} KiB, {AT_ONCE} at once: {many} KiB"
        assert (await c.ok("ping"))["pong"] is True


LONG_TURNS = 30
LONG_TEXT_CHARS = 100_000  # ~0.8 MB of reply a turn: ~24 MB for the whole session at once
PAGE_BYTES = 2 * 1024 * 1024


async def test_one_history_request_of_a_long_session_costs_the_daemon_a_page_not_the_session(
    tmp_path: Path,
) -> None:
    """One reply held the whole transcript (and cost the daemon several times it): now one
    request, or paging through the whole session, costs about a page."""
    env = {"AGENTD_HISTORY_REPLY_BYTES": str(PAGE_BYTES)}
    async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
        for i in range(LONG_TURNS):
            behaviour = {
                "wait": False,
                "pad": "t" * LONG_TEXT_CHARS,
                "result_fields": {"final_text": f"{i} " + "a" * LONG_TEXT_CHARS},
            }
            run_id = (await c.ok("spawn", spec={"task": json.dumps(behaviour)}, session_id="long"))["run_id"]
            assert (await c.wait_end(run_id))["state"] == "completed"
        before = peak_kib(d.pid)
        await c.send_raw(json.dumps({"id": "old", "op": "history", "session_id": "long"}))  # as an old client
        with trio.fail_after(WAIT_S):
            text = await c.ws.get_message()
        one = peak_kib(d.pid) - before
        # The whole session at once (~24 MB) took at least that; a page takes a few MiB.
        assert one < 4 * PAGE_BYTES // 1024, f"one request: {one} KiB (a {len(text)} B reply)"
        seen = strict_loads(text)["result"]
        assert len(text) <= PAGE_BYTES + 4096 and seen["more"] is True and seen["complete"] is False, len(text)
        whole = len(text)  # what one reply of it all would be: every page's
        while seen["more"]:
            await c.send_raw(
                json.dumps({"id": "p", "op": "history", "session_id": "long", "before_turn": seen["first_turn"]})
            )
            with trio.fail_after(WAIT_S):
                text = await c.ws.get_message()
            assert len(text) <= PAGE_BYTES + 4096
            whole += len(text)
            seen = strict_loads(text)["result"]
        assert seen["first_turn"] == 1
        every = peak_kib(d.pid) - before
        whole_kib = whole // 1024
        print(f"one: {one} KiB, every page: {every} KiB, the whole session at once: >= {whole_kib} KiB")
        assert every < 4 * PAGE_BYTES // 1024 < whole_kib // 2, (every, whole_kib)
        assert (await c.ok("ping"))["pong"] is True
