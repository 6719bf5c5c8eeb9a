"""An approval's answer is journaled before it goes into the run's channel, never after.

The desk (``supervisor.core.approvals``) with a real FIFO as the run's channel, the
runner's own reader of it (``subagent.approvals.AnswerChannel``) where it matters, and a
real journal for the account a restarted daemon reads. A daemon killed between the two
steps, end to end: ``tests/e2e/test_approvals.py``.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from subagent.approvals import Answer, AnswerChannel
from supervisor.core.approvals import SEND_TIMEOUT_S, ApprovalDesk, Hooks, answers_path, make_channel
from supervisor.errors import ControlProtocolError, JournalUnavailable
from supervisor.store.journal import Journal
from tests.supervisor.test_sessions import FakeRun

Recorded = list[tuple[str, dict[str, Any]]]


async def nothing(*a: Any, **kw: Any) -> None:
    pass


def channel(tmp_path: Path) -> tuple[FakeRun, int]:
    """A run with its channel, and the runner's end of it (read-write, non-blocking)."""
    run_dir = tmp_path / "t-1"
    run_dir.mkdir(parents=True)
    make_channel(run_dir)
    return FakeRun(run_dir), os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK)


def unread(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def recording_desk() -> tuple[ApprovalDesk, Recorded]:
    """A desk whose journal is a list: what it recorded, in order."""
    recorded: Recorded = []

    async def record(r: Any, kind: str, data: dict[str, Any]) -> None:
        recorded.append((kind, data))

    return ApprovalDesk(Hooks(record=record, transition=nothing, cancel=nothing)), recorded


async def asked(d: ApprovalDesk, run: FakeRun, call_id: str = "c1") -> None:
    await d.on_event(run, "approval_requested", {"call_id": call_id, "name": "x", "deadline": None})


async def test_the_answer_is_journaled_before_anything_of_it_is_in_the_channel(tmp_path: Path) -> None:
    # Written first and journaled after: a daemon killed between the two left nothing that
    # said an answer had gone out, and its successor took a second, different one.
    run, reader = channel(tmp_path)
    seen_at_record: list[bytes] = []

    async def record(r: Any, kind: str, data: dict[str, Any]) -> None:
        seen_at_record.append(unread(reader))

    d = ApprovalDesk(Hooks(record=record, transition=nothing, cancel=nothing))
    await asked(d, run)
    await d.answer(run, "c1", approve=True)
    line = unread(reader)
    os.close(reader)
    assert seen_at_record == [b""]
    assert line == b'\n{"call_id": "c1", "decision": "approve"}\n'


async def test_an_answer_the_journal_cannot_hold_is_not_sent_and_the_call_still_waits(tmp_path: Path) -> None:
    run, reader = channel(tmp_path)
    recorded: Recorded = []
    down = [True]

    async def record(r: Any, kind: str, data: dict[str, Any]) -> None:
        if down[0]:
            raise JournalUnavailable("disk full")
        recorded.append((kind, data))

    d = ApprovalDesk(Hooks(record=record, transition=nothing, cancel=nothing))
    await asked(d, run)
    with pytest.raises(ControlProtocolError, match="cannot be journaled .*disk full.*not sent"):
        await d.answer(run, "c1", approve=True)
    assert unread(reader) == b""
    assert run.approvals.pending["c1"].sent is None
    down[0] = False
    await d.answer(run, "c1", approve=False)  # the journal is back: the call is answered
    assert unread(reader) == b'\n{"call_id": "c1", "decision": "deny"}\n'
    os.close(reader)
    assert recorded == [("approval_sent", {"call_id": "c1", "decision": "deny", "reason": None})]


async def test_an_answer_that_went_into_the_channel_in_part_is_journaled_unsent_and_the_runner_drops_the_part(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A runner that does not read (frozen, stuck) with its channel nearly full: the line
    # goes in in part, the send gives up. The runner never takes a cut line (the next
    # line's leading newline ends it, and it is not JSON), so the call waits again, and
    # the journal says so: a restarted daemon must not count it answered.
    run, reader = channel(tmp_path)
    d, recorded = recording_desk()
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4 * 4096)  # four page slots
    for _ in range(3):
        os.write(reader, b"x" * 4095 + b"\n")  # junk lines the runner drops, one slot each
    await asked(d, run)
    before = trio.current_time()
    with pytest.raises(ControlProtocolError, match="has not read its answers.*not sent"):
        await d.answer(run, "c1", approve=False, reason="n" * 5000)  # one slot's worth goes in
    assert trio.current_time() - before == pytest.approx(SEND_TIMEOUT_S)
    assert [k for k, _ in recorded] == ["approval_sent", "approval_unsent"]
    assert recorded[1][1]["call_id"] == "c1" and run.approvals.pending["c1"].sent is None
    runner = AnswerChannel(reader)
    async with trio.open_nursery() as n:
        await n.start(runner.run)
        await trio.testing.wait_all_tasks_blocked()  # the runner has read all there was
        await d.answer(run, "c1", approve=True)  # answered again: this one it takes
        assert await runner.wait("c1") == Answer("approved")
        n.cancel_scope.cancel()


async def test_a_request_cancelled_while_its_answer_waits_for_room_still_ends_written_or_journaled_unsent(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # The answer is journaled and its channel is full (a runner not reading); the request
    # is cancelled meanwhile (its client went away). Left there, the journal said sent
    # while nothing went in, and the call was held answered with no answer on its way.
    run, reader = channel(tmp_path)
    errors: list[str] = []
    d, recorded = recording_desk()
    try:
        while True:
            os.write(reader, b"x" * 4096)
    except BlockingIOError:
        pass
    await asked(d, run)
    with trio.move_on_after(1.0):
        try:
            await d.answer(run, "c1", approve=True)
        except ControlProtocolError as exc:
            errors.append(str(exc))
    os.close(reader)
    assert [k for k, _ in recorded] == ["approval_sent", "approval_unsent"]
    assert run.approvals.pending["c1"].sent is None
    assert len(errors) == 1 and "not sent" in errors[0]


async def test_an_answer_a_dead_daemon_journaled_is_sent_again_once_the_run_has_caught_up(tmp_path: Path) -> None:
    # Journaled, then the daemon died before (or after) writing it: the next daemon holds
    # the call answered and writes the journaled answer again once it has read the
    # runner's events file, unless that file says the runner acted on it.
    run, reader = channel(tmp_path)
    other, other_reader = channel(tmp_path / "o")
    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=nothing))
    records = [{"id": "c1", "name": "x", "approval": "pending", "state": "not_started"}]
    sent = {"c1": {"decision": "deny", "reason": "not now"}}
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            for r in (run, other):
                r.caught_up = trio.Event()
                r.approvals.restore(records, sent=sent)
                n.start_soon(d.watch, r)
            await trio.testing.wait_all_tasks_blocked()
            assert unread(reader) == b"" and unread(other_reader) == b""  # not before the catch-up
            await d.on_event(other, "approval_answered", {"call_id": "c1", "decision": "denied"})  # read meanwhile
            for r in (run, other):
                assert r.caught_up is not None
                r.caught_up.set()
            await trio.lowlevel.wait_readable(reader)
            await trio.testing.wait_all_tasks_blocked()
            n.cancel_scope.cancel()
    assert unread(reader) == b'\n{"call_id": "c1", "decision": "deny", "reason": "not now"}\n'
    assert unread(other_reader) == b""  # its runner acted on the answer: nothing again
    assert run.approvals.pending["c1"].sent == "deny"  # and a second answer is refused
    os.close(reader)
    os.close(other_reader)


async def test_the_journal_names_the_answer_sent_and_not_one_journaled_unsent(tmp_path: Path) -> None:
    async with await Journal.open(tmp_path / "j.sqlite3") as j:
        await j.create_run("r1", session_id=None, spec={"task": "t"}, created_at=1.0, timeout_s=None)
        for kind, data in [
            ("approval_sent", {"call_id": "a", "decision": "approve", "reason": None}),
            ("approval_sent", {"call_id": "b", "decision": "approve", "reason": None}),
            ("approval_unsent", {"call_id": "b", "why": "the runner has not read its answers for 10 s"}),
            ("approval_sent", {"call_id": "b", "decision": "deny", "reason": "no"}),
            ("approval_sent", {"call_id": "c", "decision": "deny", "reason": "x"}),
            ("approval_unsent", {"call_id": "c", "why": "gone"}),
            ("approval_sent", {"call_id": "a", "decision": "deny", "reason": "late"}),  # the first one counts
        ]:
            await j.append_event("r1", kind, data)
        assert await j.approvals_sent("r1") == {
            "a": {"decision": "approve", "reason": None},
            "b": {"decision": "deny", "reason": "no"},
        }


async def test_answers_sent_again_into_a_full_channel_hold_no_other_answer_nor_a_deadline(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A restarted daemon sends again two journaled answers to a runner that does not read
    # (frozen, stuck) and whose channel is full. The re-send held the run's answer lock
    # for SEND_TIMEOUT_S per answer, and the deadline watch waited for it: a person's
    # answer to a third call waited 20 s for the lock before its own 10 s, and the third
    # call's deadline (1 s) was acted on 20 s late.
    run, reader = channel(tmp_path)
    cancels: list[tuple[str, float]] = []

    async def cancel(run_id: str, reason: str) -> None:
        cancels.append((reason, trio.current_time()))

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=cancel))
    records = [{"id": c, "name": "x", "approval": "pending", "state": "not_started"} for c in ("c1", "c2")]
    run.approvals.restore(records, sent={c: {"decision": "approve", "reason": None} for c in ("c1", "c2")})
    try:
        while True:
            os.write(reader, b"x" * 4096)
    except BlockingIOError:
        pass
    start = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(d.watch, run)
        await trio.testing.wait_all_tasks_blocked()
        due = trio.current_time() + 12.0  # its deadline, 2 s after the answer below gives up
        await d.on_event(run, "approval_requested", {"call_id": "c3", "name": "x", "deadline": time.time() + 12.0})
        with pytest.raises(ControlProtocolError, match="has not read its answers"):
            await d.answer(run, "c3", approve=True)
        answered_after = trio.current_time() - start
        with trio.fail_after(60):
            while not cancels:
                await trio.sleep(0.1)
        n.cancel_scope.cancel()
    os.close(reader)
    assert answered_after == pytest.approx(SEND_TIMEOUT_S)  # its own wait only
    assert cancels == [("approval_timeout", pytest.approx(due, abs=0.2))]


async def test_an_answer_after_the_calls_deadline_is_refused_even_before_the_deadline_stops_the_run(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Only the deadline's watcher acted on it: an approve in the instant between the
    # deadline and the watcher's cancel went into the channel, and the call could start
    # after its deadline. (No watcher here: the desk alone.)
    run, reader = channel(tmp_path)
    d, recorded = recording_desk()
    request = {"call_id": "c1", "name": "x", "deadline": time.time() + 5.0}
    await d.on_event(run, "approval_requested", request)
    await trio.sleep(6.0)
    with pytest.raises(ControlProtocolError, match="its approval deadline has passed"):
        await d.answer(run, "c1", approve=True)
    assert unread(reader) == b"" and recorded == []
    os.close(reader)
