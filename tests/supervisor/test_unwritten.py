"""A daemon killed while degraded: the next one says which runs' last facts were lost
(``supervisor.store._unwritten``). A real daemon on a real SQLite file on a small tmpfs
(root only), a real websocket client."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.config import Config
from supervisor.daemon import serve
from supervisor.errors import JournalUnavailable
from supervisor.store._unwritten import NAME as NOTE_NAME
from supervisor.store._unwritten import SIZE, UnwrittenNote, encode
from supervisor.store.journal import Journal
from tests.supervisor.real_daemon import Daemon, real_daemon
from tests.supervisor.test_fault_isolation import fill, journal_state, running_pair, small_tmpfs, stop_and_check
from tests.supervisor.test_restart_stop import command_spec, daemon, kill9

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


def test_a_note_cut_to_its_size_keeps_acknowledged_stops_first_and_counts_what_it_cut(tmp_path: Path) -> None:
    note = UnwrittenNote(tmp_path / "note")
    note.reset()
    detail = {"reason": "disk_full", "message": "m" * 300, "held_bytes": 1 << 30}
    for n_stops, n_ends, n_bare in ((40, 500, 5000), (2000, 10, 10)):
        # Named in id order, as the backlog names them: stops and ends spread among the rest.
        kinds = ["stop"] * n_stops + ["end"] * n_ends + ["bare"] * n_bare
        random.Random(n_stops).shuffle(kinds)
        runs = [f"r-{i:016x}" for i in range(len(kinds))]
        stopped = [r for r, kind in zip(runs, kinds, strict=True) if kind == "stop"]
        ended = [r for r, kind in zip(runs, kinds, strict=True) if kind == "end"]
        stops = {r: {"reason": "user", "at": 1.5, "stop_deadline": 11.5, "detail": detail} for r in stopped}
        ends = {r: {"state": "cancelled", "reason": "user", "ended_at": 3.0} for r in ended}
        whole = {"pid": 1, "since": 2.0, "runs": runs, "ends": ends, "stops": stops}
        assert len(json.dumps(whole)) > SIZE  # (a note that needs cutting)
        assert len(encode(whole)) < SIZE  # its NUL fits too
        note.save(whole)
        got = note.read()
        assert got is not None and (tmp_path / "note").stat().st_size == SIZE
        kept = got["runs"]
        assert got["more"] == len(runs) - len(kept) > 0
        # Stops first, then ends, then bare ids, each in the order named.
        order = [*stopped, *ended, *(r for r in runs if r not in stops and r not in ends)]
        assert kept == order[: len(kept)]
        assert got["stops"] == {r: stops[r] for r in kept if r in stops}
        assert got["ends"] == {r: ends[r] for r in kept if r in ends}
        assert got["more_stops"] == n_stops - len(got["stops"])
        if n_stops == 40:  # room for every stop: only ends and bare ids were cut
            assert got["more_stops"] == 0 and set(stopped) <= set(kept)
        else:  # more stops than room: the first ones kept whole, the rest counted
            assert 0 < len(got["stops"]) < n_stops and set(kept) == set(got["stops"])
    # A stop this daemon could not resume (no reason, no wall times) is not handed on.
    note.save({"pid": 1, "since": 2.0, "runs": ["a", "b"], "stops": {"a": {"at": 1.0}, "b": stops[stopped[0]]}})
    got = note.read()
    assert got is not None and got["stops"] == {"b": stops[stopped[0]]}
    note.close()


async def test_a_stop_acknowledged_while_the_journal_is_full_survives_a_daemon_kill(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    # The cancel's reply said "not durable yet" and the daemon was killed -9 while the run
    # was still stopping: the next daemon re-adopted the run with no stop at all (nobody
    # enforced the grace), and it ran on, `running`, until something else stopped it.
    state = small_tmpfs / "state"
    grace = 6.0
    # Its runs dir off the full disk (the run is not what fills it), the disk guard off.
    settings = {"runs_dir": str(tmp_path / "runs"), "disk_min_free_mib": "0", "disk_min_free_percent": "0"}
    # The command may finish (spec policy): the stop lasts its whole grace.
    spec = command_spec("sleep 300", stop_policy={"run_command": "finish"})
    filler = small_tmpfs / "filler"
    with trio.fail_after(90):
        async with daemon(state, grace_s=grace, **settings) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await c.wait_for(rid, kind="process_group")  # the command runs
            fill(filler)
            asked = time.time()
            reply = await c.call("cancel", run_id=rid)
            replied = time.time()
            assert reply["was_active"] is True and "not durable yet" in reply["warning"], reply
            runner = (await c.call("status", run_id=rid))["pid"]
            await kill9(d1, c)
        assert psutil.pid_exists(runner)  # still stopping: its command may finish
        filler.unlink()
        async with daemon(state, grace_s=grace, **settings) as (d2, c):
            with trio.move_on_after(grace + 10):
                await c.wait_for(rid)
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid))["events"]
            # Journaled now: the new daemon's note names nothing.
            assert UnwrittenNote(state / "journal-unwritten").read() is None
    assert (final["state"], final["reason"], final["cancel_reason"]) == ("cancelled", "user", "user"), final
    # The original stop: asked before the kill, its grace counted from then, not renewed.
    assert asked <= final["cancel_requested_at"] <= replied
    assert final["stop_deadline"] == final["cancel_requested_at"] + grace
    # Killed at the end of that grace (its command was let finish until then).
    assert final["stop_deadline"] - 0.5 <= final["ended_at"] <= final["stop_deadline"] + 2.0, final
    assert final["receipt"]["path_b"]["escalated"] is True, final["receipt"]
    carried = final["receipt"]["stop_carried"]
    assert carried["by"] == "journal-unwritten" and carried["daemon_pid"] == d1.pid, carried
    resumed = [e["data"]["resumed_stop"] for e in events if e["kind"] == "daemon" and "resumed_stop" in e["data"]]
    assert resumed and resumed[0]["carried_by"] == "journal-unwritten" and resumed[0]["reason"] == "user"
    assert "journal_gap" in [e["kind"] for e in events]
    assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == psutil.STATUS_ZOMBIE


async def test_a_noted_stop_the_next_daemon_cannot_journal_either_is_noted_again_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The next daemon finds the journal still unwritable for the stop (a fault it cannot
    # write past): the stop goes on from its note and into this daemon's own note (a
    # second kill -9 would not lose it either), and is journaled once the journal takes it.
    config = Config.load(state_dir=tmp_path / "state", environ={})
    config.state_dir.mkdir(parents=True)
    now = time.time()
    async with await Journal.open(config.journal_path) as j:  # a run queued, its stop noted only
        queued = [("state", {"state": "queued"}, now)]
        await j.create_run("r-q", session_id=None, spec={"task": "t"}, created_at=now, timeout_s=None, events=queued)
    stop = {"reason": "user", "at": now, "stop_deadline": now + 10, "detail": None}
    note = UnwrittenNote(config.state_dir / NOTE_NAME)
    note.reset()
    note.save({"pid": 4242, "since": now, "runs": ["r-q"], "ends": {}, "stops": {"r-q": stop}})
    note.close()
    record_cancel = Journal.record_cancel

    async def unwritable(self: Journal, run_id: str, **kw: Any) -> bool:
        raise JournalUnavailable("injected: the stop's intent cannot be written", path=self.path)

    monkeypatch.setattr(Journal, "record_cancel", unwritable)
    stopping = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stopping, task_status=task_status))
            m = info["manager"]
            again = UnwrittenNote(config.state_dir / NOTE_NAME).read()
            assert again is not None and again["runs"] == ["r-q"] and again["pid"] == os.getpid(), again
            assert again["stops"] == {"r-q": stop}, again
            monkeypatch.setattr(Journal, "record_cancel", record_cancel)
            assert await m.backlog.flush() is True
            assert UnwrittenNote(config.state_dir / NOTE_NAME).read() is None  # journaled: cleared
            st = await m.status("r-q")
            stopping.set()
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", "user", "user"), st
    assert (st["cancel_requested_at"], st["stop_deadline"]) == (now, now + 10), st
    assert st["receipt"]["stop_carried"]["by"] == "journal-unwritten", st["receipt"]
    assert st["receipt"]["stop_carried"]["daemon_pid"] == 4242, st["receipt"]


@pytest.mark.parametrize("stopped", [True, False])
async def test_a_noted_end_the_next_daemon_cannot_write_yet_is_still_the_runs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: bool
) -> None:
    # A run completed (its runner's result said so, its tree was ended, its directory and
    # result file removed), its end waiting in memory and named in the note with the stop
    # a client pressed as it ended; the daemon killed -9. The next one could not write
    # that end either at its start: recovery then found the runner gone without a result,
    # resumed the carried stop and recorded the completed run `cancelled` (without the
    # stop: `lost`), which was written once the journal took writes again.
    config = Config.load(state_dir=tmp_path / "state", environ={})
    config.state_dir.mkdir(parents=True)
    now = time.time()
    child = await trio.lowlevel.open_process(["true"])  # a pid of ours, reaped: no runner has it now
    await child.wait()
    async with await Journal.open(config.journal_path) as j:
        running = [("state", {"state": "running"}, now)]
        await j.create_run("r-c", session_id=None, spec={"task": "t"}, created_at=now, timeout_s=None, events=running)
        await j.record_process(
            "r-c", pid=child.pid, pid_start_time=1.0, pgid=child.pid, tree_id="t-gone", run_dir=str(tmp_path / "gone")
        )
    stop = {"reason": "user", "at": now, "stop_deadline": now + 10, "detail": None}
    end = {"state": "completed", "reason": None, "ended_at": now + 1, "groups_ended_at": now + 1}
    note = UnwrittenNote(config.state_dir / NOTE_NAME)
    note.reset()
    stops = {"r-c": stop} if stopped else {}
    note.save({"pid": 4242, "since": now, "runs": ["r-c"], "ends": {"r-c": end}, "stops": stops})
    note.close()
    finish = Journal.finish

    async def unwritable(self: Journal, run_id: str, *args: Any, **kw: Any) -> bool:
        raise JournalUnavailable("injected: a run's end cannot be written", path=self.path)

    monkeypatch.setattr(Journal, "finish", unwritable)
    stopping = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stopping, task_status=task_status))
            m = info["manager"]
            monkeypatch.setattr(Journal, "finish", finish)
            assert await m.backlog.flush() is True
            st = await m.status("r-c")
            events = await m.events_after("r-c", 0)
            stopping.set()
    assert (st["state"], st["reason"], st["ended_at"]) == ("completed", None, now + 1), st
    # The stop that came as it ended: recorded, not its outcome.
    assert st["cancel_reason"] == ("user" if stopped else None), st
    assert events[-1]["kind"] == "state" and events[-1]["data"] == {"state": "completed", "partial": True}, events


async def test_a_run_started_while_the_journal_is_full_gets_its_spec_only_once_its_process_is_recorded(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    # A queued run started while the journal could not be written: its process record
    # waited in memory and its runner got its spec and ran its command. The daemon killed
    # -9, the next one found no process for it ("lost: the daemon restarted before the
    # run's process started") while its runner and its command ran on, which no Stop
    # could reach any more (the conftest found them left behind).
    state = small_tmpfs / "state"
    settings = {
        "runs_dir": str(tmp_path / "runs"),
        "disk_min_free_mib": "0",
        "disk_min_free_percent": "0",
        "max_concurrent": "1",
        "zygote": "off",
    }
    filler = small_tmpfs / "filler"
    with trio.fail_after(90):
        async with daemon(state, grace_s=2.0, **settings) as (d1, c):
            a = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await c.wait_for(a, kind="process_group")
            b = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            assert (await c.call("status", run_id=b))["state"] == "queued"
            fill(filler)
            assert (await c.call("cancel", run_id=a))["was_active"] is True
            assert await c.wait_for(a) == "cancelled"  # b takes its place
            await c.wait_for(b, kind="state", count=2)  # queued, starting
            # Its runner is up, and gets its spec once its process is journaled: not now.
            with trio.move_on_after(3) as waited:
                await c.wait_for(b, kind="process_group")
            assert waited.cancelled_caught, "its command ran while its process was recorded nowhere"
            await kill9(d1, c)
        filler.unlink()
        async with daemon(state, grace_s=2.0, **settings) as (d2, c):
            # Still `queued` in the journal (its start waited in memory): it never ran,
            # and is queued again by the next daemon (``_requeue``), which runs it.
            await c.wait_for(b, kind="process_group")
            st = await c.call("status", run_id=b)
            kinds = [e["kind"] for e in (await c.call("events", run_id=b))["events"]]
            assert (await c.call("cancel", run_id=b))["was_active"] is True
            assert await c.wait_for(b) == "cancelled"
    assert st["state"] == "running" and "requeued" in kinds, (st, kinds)
