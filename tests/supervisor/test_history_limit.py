"""``history`` requests side by side cannot take the daemon's memory with them.

A history reply holds its session's whole transcript many times over while it is built,
encoded and sent; a connection may have 32 requests in flight, and each held its own. A
real daemon, a session of a few megabytes, and eight ``history`` requests sent at once on
one connection that reads none of the replies until all are sent: the daemon's peak
resident memory (``VmHWM``) grows by about what ``HISTORY_AT_ONCE`` (2) replies take,
not eight.
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
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
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
