"""A daemon killed while degraded: the next one says which runs' last facts were lost
(``supervisor.store._unwritten``). A real daemon on a real SQLite file on a small tmpfs
(root only), a real websocket client."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.store._unwritten import SIZE, UnwrittenNote
from tests.supervisor.real_daemon import Daemon, real_daemon
from tests.supervisor.test_fault_isolation import fill, journal_state, running_pair, small_tmpfs, stop_and_check

__all__ = ["small_tmpfs"]  # a fixture, used by name


async def degrade_then_kill(d: Daemon, filler: Path) -> tuple[str, str]:
    """Two live runs; the journal's disk full; one cancelled (its end waits in memory);
    the daemon killed -9."""
    async with d.connect() as c:
        a, b = await running_pair(c)
        fill(filler)
        reply = await c.ok("cancel", run_id=a)
        assert "not durable yet" in reply["warning"], reply
        assert (await c.wait_end(a))["state"] == "cancelled"
        assert (await journal_state(c))["pending_writes"] > 0
    d.proc.kill()
    await d.proc.wait()
    return a, b


async def test_a_daemon_killed_while_degraded_is_followed_by_one_that_says_which_runs_lost_facts(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    # What waited in its memory is lost with it; the next daemon said nothing of it (the
    # run's last events were silently missing) and found the run the client was told
    # ended `cancelled` gone without a result: `lost`.
    state = small_tmpfs / "state"
    env = {"AGENTD_RUNS_DIR": str(tmp_path / "runs")}
    filler = small_tmpfs / "filler"
    async with real_daemon(state, env=env) as d:
        old_pid = d.pid
        a, b = await degrade_then_kill(d, filler)
    filler.unlink()
    async with real_daemon(state, env=env) as d, d.connect() as c:
        gap = (await journal_state(c))["unwritten_before_restart"]
        assert gap is not None and gap["runs"] == [a] and gap["pid"] == old_pid, gap
        events = (await c.ok("events", run_id=a))["events"]
        [said] = [e for e in events if e["kind"] == "journal_gap"]
        assert "may be missing" in said["data"]["message"] and said["data"]["daemon_pid"] == old_pid
        assert "journal_gap" not in [e["kind"] for e in (await c.ok("events", run_id=b))["events"]]
        # Its end, which the client heard (cancelled), is the one written: not `lost`.
        st = await c.ok("status", run_id=a)
        assert (st["state"], st["reason"]) == ("cancelled", "user"), st
        assert [e["kind"] for e in events][-2:] == ["journal_gap", "state"]
        assert events[-1]["data"] == {"state": "cancelled", "partial": True, "reason": "user"}
        assert f"the previous daemon (pid {old_pid}) ended while the journal could not be written" in d.log_text()
        await stop_and_check(c, b)
    async with real_daemon(state, env=env) as d, d.connect() as c:  # said once
        assert (await journal_state(c))["unwritten_before_restart"] is None


def test_a_torn_note_says_something_waited_and_a_long_one_is_cut(tmp_path: Path) -> None:
    note = UnwrittenNote(tmp_path / "note")
    assert note.read() is None
    note.reset()
    assert note.read() is None and (tmp_path / "note").stat().st_size == SIZE
    runs = [f"r-{i:016x}" for i in range(10_000)]
    ends = {r: {"state": "cancelled", "reason": "user", "ended_at": 3.0} for r in runs}
    note.save({"pid": 1, "since": 2.0, "runs": runs, "ends": ends})
    got = note.read()
    assert got is not None and got["runs"] == runs[: len(got["runs"])] and got["more"] == 10_000 - len(got["runs"])
    assert got["ends"] == {r: ends[r] for r in got["runs"]}
    assert (tmp_path / "note").stat().st_size == SIZE
    note.save(None)
    assert note.read() is None
    (tmp_path / "note").write_bytes(json.dumps({"pid": 1, "runs": ["r"]}).encode()[:9] + b"\0")
    assert note.read() == {"runs": [], "unreadable": True}
    note.close()
