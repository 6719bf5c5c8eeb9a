"""A journal another process holds locked degrades the daemon, and costs no request more
than a short wait: a real daemon, real runners, a real ``sqlite3`` client holding
``BEGIN EXCLUSIVE`` on its journal file.

The daemon's one journal worker runs every read and write in order. While the lock was
held, each of the backlog's retries (every ``RETRY_S``) waited the whole busy timeout
(5 s) for it, and every request queued behind them: the ``status`` of a run the lock had
nothing to do with took 5 s, each time, for as long as the lock was held.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_fault_isolation import WAIT_S, journal_state, running_pair, stop_and_check, until

# A request's answer while the journal is locked, at most (seconds): it was 5 s.
ANSWER_S = 1.0
# What the lock is held over: requests spread over several of the backlog's retries.
REQUESTS = 8
PACE_S = 0.5

LOCKER = (
    "import sqlite3, sys\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN EXCLUSIVE')\n"
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
    "c.execute('COMMIT')\n"
)


async def test_a_journal_locked_by_another_process_delays_no_request_for_long_and_loses_no_fact(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with real_daemon(state) as d, d.connect() as c:
        a, b = await running_pair(c)
        with subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(state / "agentd.sqlite3")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as locker:
            assert locker.stdout is not None and locker.stdout.readline() == "locked\n"
            # B's stop: its intent cannot be written, the daemon is degraded, B still ends.
            reply = await c.ok("cancel", run_id=b)
            assert reply["was_active"] is True and "not durable yet" in reply["warning"], reply
            assert (await c.wait_end(b, WAIT_S))["state"] == "cancelled"
            journal = await journal_state(c)
            assert journal["writable"] is False and "locked" in journal["error"], journal
            slowest = 0.0
            for _ in range(REQUESTS):
                t0 = trio.current_time()
                assert (await c.ok("status", run_id=a))["state"] == "running"
                slowest = max(slowest, trio.current_time() - t0)
                await trio.sleep(PACE_S)  # (pacing over the retries, not a wait for anything)
            assert slowest < ANSWER_S, f"a status took {slowest:.2f} s while the journal was locked"
            assert locker.stdin is not None
            locker.stdin.write("\n")
            locker.stdin.flush()
            assert locker.wait(WAIT_S) == 0
        await until(lambda: _writable(c))
        st = await c.ok("status", run_id=b)
        assert st["state"] == "cancelled" and "journal" not in st, st
        await stop_and_check(c, a)
        assert d.alive()
    async with real_daemon(state) as d, d.connect() as c:  # B's end was written: durable
        assert (await c.ok("status", run_id=b))["state"] == "cancelled"
        assert (await c.ok("status", run_id=a))["state"] == "cancelled"


async def _writable(c: Client) -> bool:
    return bool((await journal_state(c))["writable"])
