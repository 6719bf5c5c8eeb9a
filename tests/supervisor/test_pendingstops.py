"""Pending-stop notes: what the CLI writes with no daemon, what a starting daemon matches.

The notes are real files in a temp state dir; the matching takes journal rows as values;
a daemon in-process on a real SQLite file for a journal that takes no writes.
The end-to-end case (a daemon SIGKILLed, the CLI, the next daemon) is
``test_stop_no_daemon.py``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner

from supervisor import cli as cli_module
from supervisor.cli import ExitCode, cli
from supervisor.config import JOURNAL_FILE, Config
from supervisor.control import _pendingstops
from supervisor.control import client as client_module
from supervisor.control._pendingstops import DIR, TooManyPendingStops, read_all, write
from supervisor.core._pending import PendingStops
from supervisor.daemon import serve
from supervisor.errors import JournalUnavailable
from supervisor.states import RunState
from supervisor.store._unwritten import NAME, UnwrittenNote
from supervisor.store.journal import Journal


def row(
    run_id: str, *, session: str | None = None, created: float = 100.0, cancel: str | None = None
) -> dict[str, Any]:
    return {"id": run_id, "session_id": session, "created_at": created, "cancel_reason": cancel}


def test_a_note_is_written_whole_private_and_read_back(tmp_path: Path) -> None:
    path = write(tmp_path, reason="user", session_id="s1", turn="r2")
    assert path.parent == tmp_path / DIR and (tmp_path / DIR).stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / DIR).iterdir()] == [path.name]  # no temp file left
    (note,) = read_all(tmp_path)
    assert (note.path, note.session_id, note.turn, note.run_id, note.reason) == (path, "s1", "r2", None, "user")


def test_notes_are_bounded_in_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pendingstops, "MAX_NOTES", 2)
    write(tmp_path, reason="user", run_id="r1")
    write(tmp_path, reason="user", run_id="r2")
    with pytest.raises(TooManyPendingStops):
        write(tmp_path, reason="user", run_id="r3")
    assert len(list((tmp_path / DIR).iterdir())) == 2


def test_a_session_note_stops_only_the_turns_that_existed_when_it_was_pressed(tmp_path: Path) -> None:
    session = write(tmp_path, reason="user", session_id="s1")
    (note,) = read_all(tmp_path)
    pending = PendingStops([note])
    assert pending.stop_for(row("r-later", session="s1", created=note.at + 5)) is None
    assert pending.stop_for(row("r-other", session="s2", created=note.at - 5)) is None
    assert pending.stop_for(row("r-live", session="s1", created=note.at - 5)) == note
    assert pending.applied[note] == ["r-live"] and pending.unmatched() == []
    pending.settle()
    assert not session.exists()


def test_a_turn_note_stops_that_turn_only_and_a_stop_under_way_is_not_stopped_again(tmp_path: Path) -> None:
    write(tmp_path, reason="user", session_id="s1", turn="r1")
    write(tmp_path, reason="user", run_id="r2")
    turn, run = read_all(tmp_path)
    pending = PendingStops([turn, run])
    assert pending.stop_for(row("r0", session="s1", created=0.0)) is None
    assert pending.stop_for(row("r1", session="s1", created=0.0)) == turn
    assert pending.stop_for(row("r2", cancel="timeout")) is None  # journaled already: resumed as it is
    assert pending.applied == {turn: ["r1"], run: ["r2"]}


def test_a_note_whose_run_failed_to_recover_is_kept_for_the_next_start(tmp_path: Path) -> None:
    kept = write(tmp_path, reason="user", run_id="r1")
    gone = write(tmp_path, reason="user", run_id="r-nobody")
    pending = PendingStops(read_all(tmp_path))
    pending.keep_for(row("r1"))
    assert [n.run_id for n in pending.unmatched()] == ["r-nobody"]
    pending.settle()
    assert kept.exists() and not gone.exists()


def test_cancel_with_no_daemon_records_the_stop_and_exits_10(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_FILE).touch()  # a state dir a daemon used
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "--json", "cancel", "--session", "s1"])
    assert res.exit_code == ExitCode.STOP_PENDING, res.output
    out = json.loads(res.stdout)
    assert (out["session_id"], out["turn"], out["delivered"], out["pending"]) == ("s1", None, False, True)
    assert "not delivered now: no agentd daemon is running" in res.stderr
    (note,) = read_all(tmp_path)
    assert (str(note.path), note.session_id) == (out["pending_stop"], "s1")


def test_cancel_where_no_daemon_ever_ran_records_nothing(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "cancel", "r1"])
    assert res.exit_code == ExitCode.NO_DAEMON and res.stderr.startswith("error: no agentd daemon"), res.output
    assert not (tmp_path / DIR).exists()


def test_notes_set_aside_do_not_count_against_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A daemon sets aside a note that is not one (``*.bad``) and never removes it; a CLI
    # killed before its rename leaves a temp file. Neither is a stop waiting: counted,
    # enough of them refused every later stop ("256 stops already wait") though none did.
    monkeypatch.setattr(_pendingstops, "MAX_NOTES", 2)
    (tmp_path / DIR).mkdir(mode=0o700)
    for name in ("1-1.stop.bad", "2-2.stop.bad", ".3-3.stop.tmp"):
        (tmp_path / DIR / name).write_text("{")
    write(tmp_path, reason="user", run_id="r1")
    write(tmp_path, reason="user", run_id="r2")
    with pytest.raises(TooManyPendingStops):
        write(tmp_path, reason="user", run_id="r3")
    assert [n.run_id for n in read_all(tmp_path)] == ["r1", "r2"]


def test_cancel_hands_a_note_to_a_daemon_that_holds_the_state_dir_and_cannot_be_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon holds the state dir (its flock on daemon.lock: this test's, here) but its
    # endpoint file is gone. It is waited for (a starting daemon publishes its address),
    # then handed the stop as a note (a running daemon watches for them); this one never
    # takes it, and the CLI says so: exit 10, the note kept.
    monkeypatch.setattr(client_module, "STOP_DELIVERY_S", 0.3)
    monkeypatch.setattr(cli_module, "NOTE_TAKEN_WAIT_S", 0.3)
    (tmp_path / JOURNAL_FILE).touch()
    fd = os.open(tmp_path / _pendingstops.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _pendingstops.lock_holder(tmp_path) == os.getpid()
        res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "cancel", "r1"])
    finally:
        os.close(fd)
    assert res.exit_code == ExitCode.STOP_PENDING, res.output
    assert f"a daemon (pid {os.getpid()}) holds the state dir and cannot be reached" in res.stderr, res.stderr
    assert "has not published its address" in res.stderr, res.stderr
    assert "which it has not taken within 0.3 s" in res.stderr, res.stderr
    assert [n.run_id for n in read_all(tmp_path)] == ["r1"]
    assert _pendingstops.lock_holder(tmp_path) is None  # released: the next cancel records it
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "cancel", "--no-wait", "r1"])
    assert res.exit_code == ExitCode.STOP_PENDING, res.output


def test_the_lock_file_named_for_the_cli_is_the_daemons() -> None:
    from supervisor.daemon import LOCK_FILE

    assert _pendingstops.LOCK_FILE == LOCK_FILE


def test_a_reason_agentd_gives_its_own_stops_is_refused_as_the_daemon_refuses_it(tmp_path: Path) -> None:
    # Live, `cancel --reason timeout` is bad_args; with no daemon it was recorded, and the
    # next daemon stopped the run with reason "timeout": its record said agentd timed it out.
    (tmp_path / JOURNAL_FILE).touch()
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "cancel", "--reason", "timeout", "r1"])
    assert res.exit_code == ExitCode.USAGE and "one agentd gives its own stops" in res.stderr, res.output
    assert not (tmp_path / DIR).exists() or not list((tmp_path / DIR).iterdir())
    # A note that claims one all the same (written by hand, or by another CLI) is no note.
    (tmp_path / DIR).mkdir(mode=0o700, exist_ok=True)
    (tmp_path / DIR / "1-1.stop").write_text(json.dumps({"run_id": "r1", "reason": "disk_full", "at": 1.0}))
    assert read_all(tmp_path) == []
    assert [p.name for p in (tmp_path / DIR).iterdir()] == ["1-1.stop.bad"]


def test_a_note_that_cannot_be_read_now_is_kept_not_set_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EIO or EMFILE at the daemon's start said nothing about the note: setting it aside
    # (`*.bad`, never applied) lost a stop a person pressed.
    path = write(tmp_path, reason="user", run_id="r1")
    real_open = os.open

    def failing_open(p: Any, *args: Any, **kwargs: Any) -> int:
        if str(p) == str(path):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(_pendingstops.os, "open", failing_open)
    assert read_all(tmp_path) == []
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / DIR).iterdir()] == [path.name]
    (note,) = read_all(tmp_path)  # the next start reads it
    assert note.run_id == "r1"


async def test_a_pending_stop_the_journal_cannot_take_is_carried_and_still_named_as_pressed_with_no_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A queued run's note read at a start whose journal took no writes: its stop went into
    # the journal-unwritten note (the pending note removed), and the next daemon's receipt
    # said "acknowledged while the journal could not be written ... the daemon that took
    # it was killed", by "journal-unwritten": no daemon acknowledged it, a CLI recorded it.
    config = Config.load(state_dir=tmp_path / "state", environ={})
    config.state_dir.mkdir(parents=True)
    now = time.time()
    async with await Journal.open(config.journal_path) as j:
        queued = [("state", {"state": "queued"}, now)]
        await j.create_run("r-q", session_id=None, spec={"task": "t"}, created_at=now, timeout_s=None, events=queued)
    note = write(config.state_dir, reason="user", run_id="r-q")

    async def unwritable(self: Journal, run_id: str, *args: Any, **kw: Any) -> bool:
        raise JournalUnavailable("injected: the journal takes no writes", path=self.path)

    with pytest.MonkeyPatch.context() as down:
        for name in ("record_cancel", "finish"):
            down.setattr(Journal, name, unwritable)
        stopping = trio.Event()
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(lambda task_status: serve(config, stop=stopping, task_status=task_status))
                noted = UnwrittenNote(config.state_dir / NAME).read()
                stopping.set()
    assert noted is not None and noted["stops"]["r-q"]["reason"] == "user", noted
    assert not note.exists()  # its stop is in the journal-unwritten note now
    stopping = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stopping, task_status=task_status))
            st = await info["manager"].status("r-q")
            stopping.set()
    assert (st["state"], st["cancel_reason"]) == ("cancelled", "user"), st
    carried = st["receipt"]["stop_carried"]
    assert carried["by"] == "pending-stop", carried
    assert (carried.get("then"), carried["note"]) == ("journal-unwritten", note.name), carried
    assert "pressed while no daemon ran" in carried["message"], carried


def test_set_aside_notes_are_pruned_to_the_newest_few_by_the_daemons_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Set aside by earlier starts (never pruned before: a stream of bad notes filled the
    # directory for good), then one more now; a good note waits beside them.
    d = tmp_path / DIR
    d.mkdir(mode=0o700)
    old = [f"{i:02d}-1.stop.bad" for i in range(20)]
    for name in old:
        (d / name).write_bytes(b"{")
    (d / "99-1.stop").write_bytes(b"{not json")
    good = write(tmp_path, reason="user", run_id="r1")
    with caplog.at_level("WARNING"):
        (note,) = read_all(tmp_path)
    assert note.path == good
    kept = sorted(p.name for p in d.iterdir() if p.name.endswith(".bad"))
    assert len(kept) == 16, kept
    assert "99-1.stop.bad" in kept  # set aside just now: the newest, kept
    assert kept == sorted([*old[5:], "99-1.stop.bad"])  # the 5 oldest removed
    assert "removed 5 set-aside pending stops" in caplog.text and "00-1.stop.bad" in caplog.text
    assert read_all(tmp_path) == [note] and len(list(d.glob("*.bad"))) == 16  # (nothing more)


async def test_cancel_with_no_daemon_reads_the_journal_an_unknown_or_ended_run_records_nothing(tmp_path: Path) -> None:
    # A typo'd run id with no daemon was "stop recorded" (exit 10), and the next daemon
    # logged and dropped the note; a run that had ended the same. The journal (read-only)
    # says so at once now; a live run's stop is still recorded.
    now = time.time()
    async with await Journal.open(tmp_path / JOURNAL_FILE) as j:
        for run_id in ("r-live", "r-done"):
            queued = [("state", {"state": "queued"}, now)]
            await j.create_run(
                run_id, session_id=None, spec={"task": "t"}, created_at=now, timeout_s=None, events=queued
            )
        done = await j.finish(
            "r-done",
            RunState.COMPLETED,
            reason=None,
            result={"status": "completed"},
            partial=False,
            from_any_live_state=True,
        )
        assert done

    def cancel(run_id: str) -> Any:
        return CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "cancel", run_id])

    res = cancel("r-typo")
    assert res.exit_code == ExitCode.NOT_FOUND, res.output
    assert "has no run 'r-typo': nothing to stop, nothing recorded" in res.stderr, res.stderr
    res = cancel("r-done")
    assert res.exit_code == ExitCode.OK, res.output
    assert "r-done: was not active (state: completed" in res.stdout, res.stdout
    assert read_all(tmp_path) == []
    res = cancel("r-live")
    assert res.exit_code == ExitCode.STOP_PENDING, res.output
    assert [n.run_id for n in read_all(tmp_path)] == ["r-live"]
