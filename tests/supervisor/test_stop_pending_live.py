"""Acceptance: a pending-stop note written after the daemon found its runs again is applied now.

``agentd cancel`` that finds no daemon writes a note and tries once more; a daemon that
started between its two tries, read ``pending-stops/`` before the note was there and did
not answer the retry in time applied that note only at its next start, while the run
went on. Real daemon process, the real runner with the scripted model busy in a long
command, real SQLite, real websocket; the notes are written after the daemon's start by
the CLI's own function (``_pendingstops.write``) or by hand, as a person might.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.control import _pendingstops
from supervisor.control._pendingstops import DIR
from supervisor.core import _pendingwatch
from supervisor.core._pendingwatch import PendingWatch
from supervisor.core._run import Run
from supervisor.core.token import CancelToken
from tests.supervisor.test_restart_stop import command_spec, wait_gone
from tests.supervisor.test_stop_no_daemon import command_pid, daemon


async def gone(path: Path, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while path.exists():
            await trio.sleep(0.02)


async def test_a_note_written_while_the_daemon_runs_stops_the_run_as_a_users_cancel(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"
    with trio.fail_after(90):
        async with daemon(state, log) as (d, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            other = (await c.call("spawn", spec=command_spec("sleep 301"), session_id="s1"))["run_id"]
            await c.wait_for(rid, kind="process_group")
            await c.wait_for(other, kind="process_group")
            before, other_before = await c.call("status", run_id=rid), await c.call("status", run_id=other)
            runner, command = before["pid"], command_pid(before)
            # Written after this daemon read the notes at its start (none were there): a note
            # that is not one, one for a run that does not exist, then the stop of rid.
            (state / DIR).mkdir(mode=0o700, exist_ok=True)  # (as the CLI's write makes it)
            (state / DIR / "1-1.stop").write_bytes(b"\x00{not json")
            unknown = _pendingstops.write(state, reason="user", run_id="r-nobody")
            note = _pendingstops.write(state, reason="user", run_id=rid)
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
            await wait_gone(command, 10)
            await gone(note, 10)
            await gone(unknown, 10)
            assert sorted(p.name for p in (state / DIR).iterdir()) == ["1-1.stop.bad"]
            # The daemon and its other run go on; a session note stops that session's turn.
            assert (await c.call("status", run_id=other))["state"] == "running"
            assert psutil.pid_exists(command_pid(other_before))
            session_note = _pendingstops.write(state, reason="user", session_id="s1")
            assert await c.wait_for(other) == "cancelled"
            other_final = await c.call("status", run_id=other)
            await gone(session_note, 10)
            assert d.returncode is None
        await wait_gone(runner, 10)
        await wait_gone(other_before["pid"], 10)
        await wait_gone(command_pid(other_before), 10)
    assert (final["state"], final["reason"], final["cancel_reason"]) == ("cancelled", "user", "user"), final
    carried = final["receipt"]["stop_carried"]
    assert (carried["by"], carried["note"], carried["applied"]) == ("pending-stop", note.name, "while-running")
    assert carried["pressed_at"] <= final["cancel_requested_at"]
    (call,) = final["tool_calls"]
    assert (call["state"], call["stop_effect"]) == ("cancelled", "interrupted"), call
    assert (other_final["state"], other_final["reason"]) == ("cancelled", "user"), other_final
    other_carried = other_final["receipt"]["stop_carried"]
    assert (other_carried["note"], other_carried["session_id"]) == (session_note.name, "s1"), other_carried
    text = log.read_text(errors="replace")
    assert f"run {rid}: a stop (user) recorded in pending stop {note.name}" in text, text[-3000:]
    assert "1-1.stop is not one" in text, text[-3000:]
    assert "pending stop for run r-nobody, recorded while this daemon ran: ignored, no such run is live" in text
    assert "Traceback" not in text, text[-3000:]


async def test_a_note_naming_no_live_run_is_logged_and_removed_not_kept_for_the_next_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"
    with trio.fail_after(90):
        async with daemon(state, log) as (d, c):
            first = (await c.call("spawn", spec=command_spec("true"), session_id="s1"))["run_id"]
            assert await c.wait_for(first) == "completed"
            # A note for a run that ended, one for a session with no live turn.
            ended = _pendingstops.write(state, reason="user", run_id=first)
            session = _pendingstops.write(state, reason="user", session_id="s1")
            await gone(ended, 10)
            await gone(session, 10)
            assert (await c.call("status", run_id=first))["state"] == "completed"
            assert d.returncode is None
    text = log.read_text(errors="replace")
    assert f"pending stop for run {first}, recorded while this daemon ran: ignored, it has ended (completed)" in text
    assert "pending stop for session s1, recorded while this daemon ran: ignored, no such run is live" in text
    assert "Traceback" not in text, text[-3000:]


class Cancels:
    """The live ``cancel`` op as the watch calls it: each call recorded, the token taken."""

    def __init__(self, live: dict[str, Run], fail: set[str] | None = None) -> None:
        self.live = live
        self.fail = fail or set()
        self.calls: list[tuple[str, str]] = []
        self.send, self.receive = trio.open_memory_channel[tuple[str, str]](100)

    async def __call__(self, run_id: str, reason: str) -> dict[str, Any]:
        self.calls.append((run_id, reason))
        self.send.send_nowait((run_id, reason))
        if reason in self.fail:
            raise RuntimeError(f"the cancel failed ({reason})")
        self.live[run_id].token.cancel(reason)
        return {"run_id": run_id, "was_active": True}


def live_run(run_id: str, session_id: str | None = None) -> Run:
    return Run(run_id=run_id, session_id=session_id, spec={}, timeout_s=None, token=CancelToken(run_id))


async def no_row(run_id: str) -> None:
    return None


async def test_a_note_recovery_read_or_the_watch_took_is_never_applied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = {"r1": live_run("r1")}
    cancels = Cancels(live)
    # A note recovery read and kept (its run failed to recover): it waits for the next start.
    kept = _pendingstops.write(tmp_path, reason="kept", run_id="r1")
    # Notes that cannot be removed stay on disk, read again at every event in the directory.
    monkeypatch.setattr(_pendingstops, "remove", lambda note: None)
    watch = PendingWatch(tmp_path, live=live, cancel=cancels, get_run=no_row)
    watch.skip([kept.name])
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(watch.run)
            first = _pendingstops.write(tmp_path, reason="first", run_id="r1")
            assert await cancels.receive.receive() == ("r1", "first")
            (tmp_path / DIR / "x").write_bytes(b"")  # (an event: the directory read again)
            second = _pendingstops.write(tmp_path, reason="second", run_id="r1")
            assert await cancels.receive.receive() == ("r1", "second")
            n.cancel_scope.cancel()
    assert watch.inotify
    # Read at every event, each note applied once, oldest first; the kept one never here.
    assert cancels.calls == [("r1", "first"), ("r1", "second")]
    assert kept.exists() and first.exists() and second.exists()
    carried = live["r1"].stop_carried
    assert carried is not None and carried["note"] == first.name  # the stop's, not the later note's
    assert live["r1"].token.reason == "first"  # the oldest note's reason, as the first of two cancels


async def test_a_failure_of_the_watch_or_of_one_note_harms_that_note_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (Real time, not the autojump clock: the watch reads the directory in a thread.)
    monkeypatch.setattr(_pendingwatch, "RETRY_S", 0.05)
    live = {"r1": live_run("r1"), "r2": live_run("r2")}
    cancels = Cancels(live, fail={"boom"})
    real_read_all = _pendingstops.read_all
    reads = 0

    def read_all_failing_once(state_dir: Path) -> list[_pendingstops.PendingStop]:
        nonlocal reads
        reads += 1
        if reads == 2:
            raise OSError("the watch's read failed")
        return real_read_all(state_dir)

    monkeypatch.setattr(_pendingstops, "read_all", read_all_failing_once)
    watch = PendingWatch(tmp_path, live=live, cancel=cancels, get_run=no_row)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(watch.run)
            # Its cancel raises: logged, the note kept for the next start, the watch goes on.
            bad = _pendingstops.write(tmp_path, reason="boom", run_id="r1")
            # (The second read raised: the watch is opened again RETRY_S later and reads it.)
            assert await cancels.receive.receive() == ("r1", "boom")
            good = _pendingstops.write(tmp_path, reason="user", run_id="r2")
            assert await cancels.receive.receive() == ("r2", "user")
            n.cancel_scope.cancel()
    assert reads >= 3 and bad.exists() and not good.exists()
    assert live["r2"].token.reason == "user" and not live["r1"].token.cancelled
