"""Sessions on the daemon's side: profiles' lifetime, history from the journal, the answer desk.

A real journal file and real directories; the clock of the TTL is passed in (``now``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.approvals import Answer, AnswerChannel
from subagent.history import STOP_NOTES
from supervisor import protocol
from supervisor.config import Config
from supervisor.core import approvals as desk_module
from supervisor.core.approvals import ApprovalDesk, Hooks, RunApprovals, answers_path, make_channel
from supervisor.core.sessions import SessionDesk, SessionNotFound, history_messages, session_key
from supervisor.errors import ControlProtocolError
from supervisor.states import RunState
from supervisor.store.journal import Journal


@pytest.fixture
async def journal(tmp_path: Path) -> Any:
    async with await Journal.open(tmp_path / "j.sqlite3") as j:
        yield j


def desk(tmp_path: Path, journal: Journal, live: set[str] | None = None, **config: Any) -> SessionDesk:
    cfg = Config.load(state_dir=tmp_path / "state", environ={}, **config)
    return SessionDesk(cfg, journal, live_sessions=lambda: set(live or ()))


async def test_profiles_go_after_the_idle_ttl_and_beyond_the_bound_least_recently_used_first(
    tmp_path: Path, journal: Journal
) -> None:
    live = {"busy"}
    d = desk(tmp_path, journal, live, session_profile_ttl_s=100, session_profiles_max=2)
    t0 = time.time()
    for i, sid in enumerate(["old", "busy", "a", "b", "c"]):
        p = d.profile_path(sid)
        p.mkdir(parents=True)
        (p / "Cookies").write_text(sid)
        await journal.set_profile(sid, str(p), used_at=t0 - 1000 + i if sid in ("old", "busy") else t0 + i)
    removed = await d.sweep(now=t0 + 10)
    # "old" idled past the TTL; "busy" too, but a turn of it is live. Four are left, two
    # beyond the bound: the least recently used ones that are not busy go.
    assert removed == ["old", "a", "b"]
    assert not any(d.profile_path(s).exists() for s in ("old", "a", "b"))
    assert {p["session_id"] for p in await journal.profiles()} == {"busy", "c"}
    assert d.profile_path("busy").is_dir() and (d.profile_path("c") / "Cookies").read_text() == "c"


async def test_close_marks_the_session_and_removes_its_profile_and_a_closed_session_takes_no_turn(
    tmp_path: Path, journal: Journal
) -> None:
    d = desk(tmp_path, journal)
    await d.open("s1")
    p = d.profile_path("s1")
    p.mkdir(parents=True)
    await journal.set_profile("s1", str(p), used_at=time.time())
    assert await d.close("s1") == (True, True)
    assert not p.parent.exists()
    assert await d.close("s1") == (False, False)
    with pytest.raises(ControlProtocolError) as info:
        await d.open("s1")
    assert info.value.code == "refused" and "closed" in str(info.value)
    with pytest.raises(SessionNotFound):
        await d.close("never-seen")
    with pytest.raises(SessionNotFound):
        await d.history("never-seen", {})


def test_session_keys_are_safe_names_and_unique() -> None:
    keys = {session_key(s) for s in ["a/b", "a_b", "../..", "x" * 300, "chat 1", "ünï"]}
    assert len(keys) == 6
    for k in keys:
        assert "/" not in k and not k.startswith(".") and len(k) <= 45


async def test_the_history_is_rebuilt_from_the_journal_with_what_each_turn_really_did(
    tmp_path: Path, journal: Journal
) -> None:
    now = time.time()
    await journal.create_run("r1", session_id="s", spec={"task": "one"}, created_at=now, timeout_s=None)
    await journal.append_event("r1", "assistant_text", {"step": 1, "text": "Trying.", "complete": True})
    await journal.upsert_tool_call(
        "r1", {"id": "c1", "name": "run_command", "arguments": "{}", "step": 1, "state": "running"}
    )
    await journal.record_cancel("r1", reason="user", at=now, stop_deadline=now + 10)
    await journal.settle_tool_calls(
        "r1", reason="grace_ran_out: killed", stop_effects=("grace_ran_out", "stopped_before_start")
    )
    await journal.finish("r1", RunState.CANCELLED, reason="user", result=None, partial=True)
    await journal.create_run("r2", session_id="s", spec={"task": "two"}, created_at=now + 1, timeout_s=None)
    turns = await journal.session_turns("s")
    msgs = history_messages(turns, before="r2")
    assert msgs == [
        {"role": "user", "content": "one"},
        {
            "role": "assistant",
            "content": "Trying.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run_command", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "outcome unknown: grace_ran_out: killed"},
        {"role": "system", "content": STOP_NOTES["user"]},
    ]
    shown = await desk(tmp_path, journal).history("s", {"r2": "running"})
    assert [t["state"] for t in shown["turns"]] == ["cancelled", "running"] and shown["live_run"] == "r2"
    assert shown["messages"] == msgs and shown["turns"][1]["messages"] == [{"role": "user", "content": "two"}]
    # A turn that ended while the journal was read is in the live map taken before: its
    # journaled end wins, and it is not the session's live turn.
    shown = await desk(tmp_path, journal).history("s", {"r1": "running", "r2": "running"})
    assert [t["state"] for t in shown["turns"]] == ["cancelled", "running"] and shown["live_run"] == "r2"
    assert shown["turns"][0]["messages"][-1] == {"role": "system", "content": STOP_NOTES["user"]}


async def test_a_sessions_turns_are_in_the_order_they_were_made_though_the_clock_went_back(
    tmp_path: Path, journal: Journal
) -> None:
    # The wall clock stepped back between two turns (an NTP correction, a VM resumed): the
    # turns were ordered by their creation time, so the next turn came first, and its
    # history (the turns before it) was empty: turn one was lost to it, and shown after it.
    now = time.time()
    await journal.create_run("r1", session_id="s", spec={"task": "one"}, created_at=now, timeout_s=None)
    for state in (RunState.STARTING, RunState.RUNNING):
        await journal.transition("r1", state)
    await journal.finish("r1", RunState.COMPLETED, reason=None, result={"final_text": "Answer one."}, partial=False)
    await journal.create_run("r2", session_id="s", spec={"task": "two"}, created_at=now - 60, timeout_s=None)
    turns = await journal.session_turns("s")
    assert [t["run_id"] for t in turns] == ["r1", "r2"]
    assert history_messages(turns, before="r2") == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Answer one."},
    ]
    (row,) = (await desk(tmp_path, journal).list(10, {}))["sessions"]
    assert (row["last_run"], row["last_state"]) == ("r2", "queued")


class FakeRun:
    def __init__(self, run_dir: Path) -> None:
        self.run_id = "r-1"
        self.state = RunState.RUNNING
        self.run_dir = run_dir
        self.approvals = RunApprovals()
        self.stopping = False
        self.caught_up: trio.Event | None = None


async def test_an_answer_goes_into_the_runs_fifo_once_and_the_state_follows_the_runner(tmp_path: Path) -> None:
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    make_channel(run_dir)
    reader = os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK)  # the runner's end
    recorded: list[tuple[str, dict[str, Any]]] = []
    states: list[RunState] = []
    run = FakeRun(run_dir)

    async def record(r: Any, kind: str, data: dict[str, Any]) -> None:
        recorded.append((kind, data))

    async def transition(r: Any, new: RunState, *, only_from: Any = None) -> None:
        states.append(new)
        r.state = new

    async def cancel(run_id: str, reason: str) -> None:
        raise AssertionError("no deadline here")

    d = ApprovalDesk(Hooks(record=record, transition=transition, cancel=cancel))
    await d.on_event(
        run,
        "approval_requested",
        {"call_id": "c1", "name": "run_command", "arguments": "{}", "step": 1, "deadline": None},
    )
    with pytest.raises(ControlProtocolError, match="not awaiting approval"):
        await d.answer(run, "c9", approve=True)
    reply = await d.answer(run, "c1", approve=False, reason="no")
    with pytest.raises(ControlProtocolError, match="answered already"):
        await d.answer(run, "c1", approve=True)
    line = os.read(reader, 4096)
    await d.on_event(run, "approval_answered", {"call_id": "c1", "decision": "denied"})
    os.close(reader)
    assert reply == {"run_id": "r-1", "call_id": "c1", "decision": "denied", "state": "awaiting_approval"}
    assert line == b'\n{"call_id": "c1", "decision": "deny", "reason": "no"}\n'
    assert recorded == [("approval_sent", {"call_id": "c1", "decision": "deny", "reason": "no"})]
    assert states == [RunState.AWAITING_APPROVAL, RunState.RUNNING] and run.approvals.pending == {}
    # The runner is gone (nobody holds the FIFO): an answer is a clear refusal.
    await d.on_event(run, "approval_requested", {"call_id": "c2", "name": "x", "deadline": None})
    with pytest.raises(ControlProtocolError, match="not listening"):
        await d.answer(run, "c2", approve=True)


async def test_the_longest_reason_the_protocol_accepts_reaches_the_runner_whole_and_is_journaled_as_sent(
    tmp_path: Path,
) -> None:
    # 1000 emoji are ~4 KB of UTF-8 and 12 KB escaped: the line was cut to fit one
    # PIPE_BUF write, and the runner read 500 of them while the journal said 1000.
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    make_channel(run_dir)
    call_id = "\U0001f600" * protocol.MAX_ID_CHARS  # a re-adopted runner's call may have such an id
    reason = "\U0001f600" * protocol.MAX_DENY_REASON_CHARS
    recorded: list[tuple[str, dict[str, Any]]] = []
    run = FakeRun(run_dir)

    async def record(r: Any, kind: str, data: dict[str, Any]) -> None:
        recorded.append((kind, data))

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=record, transition=nothing, cancel=nothing))
    # The runner's end of the channel, as the runner reads it.
    channel = AnswerChannel(os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(channel.run)
            for cid in (call_id, "c2"):
                await d.on_event(run, "approval_requested", {"call_id": cid, "name": "x", "deadline": None})
            await d.answer(run, call_id, approve=False, reason=reason)
            await d.answer(run, "c2", approve=True)  # the next answer is read as well
            got = await channel.wait(call_id)
            assert await channel.wait("c2") == Answer("approved")
            n.cancel_scope.cancel()
    assert got == Answer("denied", reason)
    assert recorded[0] == ("approval_sent", {"call_id": call_id, "decision": "deny", "reason": reason})


async def test_a_line_left_half_written_in_the_channel_does_not_swallow_the_next_answer(tmp_path: Path) -> None:
    # An answer may be longer than PIPE_BUF: a daemon that died mid-write leaves a fragment.
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    make_channel(run_dir)
    run = FakeRun(run_dir)

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=nothing))
    channel = AnswerChannel(os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK))
    writer = os.open(answers_path(run_dir), os.O_WRONLY | os.O_NONBLOCK)
    os.write(writer, b'\n{"call_id": "c0", "decision": "deny", "reason": "cut he')
    os.close(writer)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(channel.run)
            await d.on_event(run, "approval_requested", {"call_id": "c1", "name": "x", "deadline": None})
            await d.answer(run, "c1", approve=True)
            assert await channel.wait("c1") == Answer("approved")
            n.cancel_scope.cancel()


async def test_an_answer_to_a_readopted_run_waits_for_its_catch_up_and_only_so_long(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A restarted daemon serves before it has read what a re-adopted runner wrote while no
    # daemon ran: an approve of a call asked about meanwhile was refused ("not awaiting
    # approval") until the events file was read, though the call was waiting.
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    make_channel(run_dir)
    run = FakeRun(run_dir)
    run.caught_up = trio.Event()

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=nothing))
    channel = AnswerChannel(os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK))
    replies: list[dict[str, Any]] = []

    async def approve() -> None:
        replies.append(await d.answer(run, "c1", approve=True))

    async with trio.open_nursery() as n:
        await n.start(channel.run)
        n.start_soon(approve)
        await trio.testing.wait_all_tasks_blocked()
        assert replies == []  # it waits for the catch-up, which then finds the call
        await d.on_event(run, "approval_requested", {"call_id": "c1", "name": "x", "deadline": None})
        run.caught_up.set()
        assert await channel.wait("c1") == Answer("approved")
        n.cancel_scope.cancel()
    assert [r["decision"] for r in replies] == ["approved"]
    # A catch-up that takes longer than the bound: a refusal that says so, at the bound.
    run.caught_up = trio.Event()
    start = trio.current_time()
    with pytest.raises(ControlProtocolError, match="still being read .* try again"):
        await d.answer(run, "c2", approve=True)
    assert trio.current_time() - start == pytest.approx(desk_module.CATCH_UP_WAIT_S)


@pytest.mark.parametrize(
    ("decision", "stopping"),
    [("rejected", False), ("rejected", True), ("approved", True), ("denied", True)],
)
async def test_a_rejection_or_an_answer_once_the_stop_is_under_way_never_moves_the_run_back_to_running(
    tmp_path: Path, decision: str, stopping: bool
) -> None:
    # A stop ends the wait (the daemon's cancel, or the runner's own backstop that a
    # restarted daemon reads late): the run is ending, and 'running' would be a lie (it
    # showed as running between 'call rejected' and 'cancelled').
    moves: list[tuple[RunState, tuple[RunState, ...]]] = []
    run = FakeRun(tmp_path)

    async def transition(r: Any, new: RunState, *, only_from: Any = None) -> None:
        moves.append((new, tuple(only_from or ())))
        if only_from is None or r.state in only_from:
            r.state = new

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=transition, cancel=nothing))
    await d.on_event(run, "approval_requested", {"call_id": "c1", "name": "x", "deadline": None})
    assert run.state == RunState.AWAITING_APPROVAL
    run.stopping = stopping
    await d.on_event(run, "approval_answered", {"call_id": "c1", "decision": decision, "reason": "user"})
    assert run.state == RunState.AWAITING_APPROVAL and run.approvals.pending == {}
    assert moves == [(RunState.AWAITING_APPROVAL, (RunState.RUNNING,))]


async def test_an_answer_moves_the_run_to_running_only_from_awaiting_approval(tmp_path: Path) -> None:
    # Checked under the run's state lock (RunBook.transition's only_from), not before it.
    moves: list[tuple[RunState, tuple[RunState, ...]]] = []
    run = FakeRun(tmp_path)

    async def transition(r: Any, new: RunState, *, only_from: Any = None) -> None:
        moves.append((new, tuple(only_from or ())))
        r.state = new

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=transition, cancel=nothing))
    await d.on_event(run, "approval_requested", {"call_id": "c1", "name": "x", "deadline": None})
    await d.on_event(run, "approval_answered", {"call_id": "c1", "decision": "approved"})
    assert moves == [
        (RunState.AWAITING_APPROVAL, (RunState.RUNNING,)),
        (RunState.RUNNING, (RunState.AWAITING_APPROVAL,)),
    ]


async def test_the_earliest_deadline_cancels_the_run_with_reason_approval_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    cancels: list[tuple[str, str]] = []
    run = FakeRun(Path("/nonexistent"))

    async def cancel(run_id: str, reason: str) -> None:
        cancels.append((run_id, reason))

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=cancel))
    run.approvals.restore(
        [
            {
                "id": "c1",
                "name": "x",
                "state": "not_started",
                "approval": "pending",
                "approval_deadline": time.time() + 30,
            },
            {"id": "c0", "name": "x", "state": "rejected", "approval": "denied"},  # answered: not pending
        ]
    )
    assert [p["call_id"] for p in run.approvals.view()] == ["c1"]
    start = trio.current_time()
    with trio.fail_after(60):
        await d.watch(run)
    assert cancels == [("r-1", "approval_timeout")]
    assert 29 <= trio.current_time() - start <= 31


async def test_a_readopted_runs_approval_deadline_waits_for_its_catch_up_which_may_show_the_call_answered(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A restarted daemon restores a call awaiting approval from the journal; what the runner
    # wrote while no daemon read it (its `approval_answered`: the call was approved, and
    # runs) is in its events file, read by the catch-up. A deadline past by then cancelled
    # the run (`approval_timeout`) before the catch-up read that the call was answered.
    cancels: list[tuple[float, str]] = []
    start = trio.current_time()

    async def cancel(run_id: str, reason: str) -> None:
        cancels.append((trio.current_time() - start, reason))

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=cancel))

    def readopted(call_id: str) -> FakeRun:
        run = FakeRun(Path("/nonexistent"))
        run.caught_up = trio.Event()
        past = time.time() - 1  # its deadline passed while no daemon ran
        run.approvals.restore(
            [{"id": call_id, "name": "x", "state": "not_started", "approval": "pending", "approval_deadline": past}]
        )
        return run

    answered, unanswered = readopted("c1"), readopted("c2")
    with trio.fail_after(100):
        async with trio.open_nursery() as n:
            n.start_soon(d.watch, answered)
            n.start_soon(d.watch, unanswered)
            await trio.sleep(1)  # the catch-up reads the events file
            await d.on_event(answered, "approval_answered", {"call_id": "c1", "decision": "approved"})
            answered.caught_up.set()
            unanswered.caught_up.set()
            await trio.sleep(3 * desk_module.CATCH_UP_WAIT_S)
            n.cancel_scope.cancel()
    # The answered call does not time its run out; the one nobody answered does, once known.
    assert len(cancels) == 1 and cancels[0][1] == "approval_timeout", cancels
    assert 1 <= cancels[0][0] <= 2


async def test_a_call_answered_just_before_its_deadline_does_not_time_the_run_out(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # An answer sent is a person's decision: the deadline is for a call nobody answered.
    # (The runner's own backstop still ends a runner that never acts on the answer.)
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    make_channel(run_dir)
    reader = os.open(answers_path(run_dir), os.O_RDWR | os.O_NONBLOCK)  # the runner's end
    cancels: list[tuple[float, str]] = []
    run = FakeRun(run_dir)
    start = trio.current_time()

    async def cancel(run_id: str, reason: str) -> None:
        cancels.append((trio.current_time() - start, reason))

    async def nothing(*a: Any, **kw: Any) -> None:
        pass

    d = ApprovalDesk(Hooks(record=nothing, transition=nothing, cancel=cancel))
    now = time.time()
    for call_id, deadline in (("c1", now + 30), ("c2", now + 60)):
        await d.on_event(run, "approval_requested", {"call_id": call_id, "name": "x", "deadline": deadline})
    with trio.fail_after(100):
        async with trio.open_nursery() as n:
            n.start_soon(d.watch, run)
            await trio.sleep(29.99)
            await d.answer(run, "c1", approve=True)  # the runner has not acted on it yet
    os.close(reader)
    # c2, which nobody answered, still times the run out at its own deadline.
    assert len(cancels) == 1 and cancels[0][1] == "approval_timeout"
    assert 59 <= cancels[0][0] <= 61
