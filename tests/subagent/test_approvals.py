"""The runner's side of approvals: which calls wait, the answer channel, the wait itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from subagent.approvals import (
    BACKSTOP_S,
    MAX_APPROVAL_ARGUMENTS_CHARS,
    Answer,
    AnswerChannel,
    ApprovalGate,
    open_channel,
)
from subagent.events import EventKind
from subagent.spec import ApprovalSpec, RunSpec, SpecError
from subagent.stop import StopControl
from tests.subagent.harness import spec, start_runner


def gate(spec: ApprovalSpec, fd: int | None = None) -> ApprovalGate:
    where = {
        "write_file": ("fs", "write_file"),
        "fs__write_file": ("fs", "write_file"),
        "read_file": ("fs", "read_file"),
        "pay": ("bank", "pay"),
    }
    return ApprovalGate(spec, AnswerChannel(fd), resolve=where.get)


@pytest.mark.parametrize(
    ("spec", "name", "args", "needed"),
    [
        (ApprovalSpec(), "run_command", {"command": "rm -rf /"}, False),
        (ApprovalSpec(tools=("run_command",)), "run_command", {"command": "ls"}, True),
        (ApprovalSpec(commands=("rm *", "git push*")), "run_command", {"command": "  rm -rf data "}, True),
        (ApprovalSpec(commands=("rm *", "git push*")), "run_command", {"command": "git push origin main"}, True),
        (ApprovalSpec(commands=("rm *",)), "run_command", {"command": "ls; rm x"}, False),  # whole command
        (ApprovalSpec(tools=("write_file",)), "fs__write_file", {}, True),  # the tool's own name
        (ApprovalSpec(tools=("fs/write_file",)), "write_file", {}, True),
        (ApprovalSpec(tools=("fs/write_file",)), "read_file", {}, False),
        (ApprovalSpec(servers=("bank",)), "pay", {}, True),
        (ApprovalSpec(servers=("bank",)), "read_file", {}, False),
    ],
)
def test_which_calls_need_approval(spec: ApprovalSpec, name: str, args: dict[str, str], needed: bool) -> None:
    assert gate(spec).needs_approval(name, args) is needed


def test_the_spec_checks_its_approval_rules() -> None:
    spec = RunSpec.from_dict({"task": "t", "approval": {"commands": ["rm *"], "timeout_s": 1}}, {})
    assert spec.approval == ApprovalSpec(commands=("rm *",), timeout_s=1.0)
    assert RunSpec.from_dict(spec.to_dict(), {}) == spec
    for bad, where in [
        ({"servers": ["nope"]}, "approval.servers[0]"),
        ({"timeout_s": 0}, "approval.timeout_s"),
        ({"tools": "run_command"}, "approval.tools"),
        ({"when": 1}, "approval"),
    ]:
        with pytest.raises(SpecError) as info:
            RunSpec.from_dict({"task": "t", "approval": bad}, {})
        assert info.value.field.startswith(where)


async def test_answers_come_through_the_fifo_and_only_the_first_answer_counts(tmp_path: Path) -> None:
    fifo = tmp_path / "run.answers"
    os.mkfifo(fifo, 0o600)
    fd = open_channel({"AGENTD_ANSWERS": str(fifo)})
    assert fd is not None
    warnings: list[str] = []
    channel = AnswerChannel(fd, warn=warnings.append)
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            await n.start(channel.run)

            def write(data: bytes) -> None:  # as the daemon does: open, one write, close
                w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.write(w, data)
                os.close(w)

            write(b'garbage\n{"call_id": "a", "decision": "deny", "reason": " no "}\n')
            write(b'{"call_id": "a", "decision": "approve"}\n{"call_id": "b", "decision": "approve"}\n')
            assert await channel.wait("a") == Answer("denied", "no")
            assert await channel.wait("b") == Answer("approved", None)
            n.cancel_scope.cancel()
    assert len(warnings) == 1 and "garbage" in warnings[0]


async def test_a_stop_ends_the_wait_and_the_call_is_rejected() -> None:
    stop = StopControl()
    g = gate(ApprovalSpec(tools=("run_command",)))
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(lambda: _stop_soon(stop))
            answer = await g.wait("c1", stop)
    assert answer == Answer("rejected", "signal")
    assert await g.wait("c2", stop) == Answer("rejected", "signal")  # a stop already set


@pytest.mark.parametrize(
    ("marker", "why"),
    [
        ("user", "user"),  # the daemon's stop: its reason, from the marker
        ("approval_timeout", "approval_timeout"),
        ("", "signalled"),  # a marker with no reason: a SIGTERM no stop of the daemon's sent
        (None, "signal"),  # no marker (a runner started by hand): any signal is a stop
    ],
)
async def test_a_signal_stop_rejects_the_call_with_the_daemons_reason(
    tmp_path: Path, marker: str | None, why: str
) -> None:
    from subagent.run import _signal_sender
    from subagent.stopmark import make_marker, open_marker, write_marker

    run_dir = tmp_path / "run"
    fd = None
    if marker is not None:
        make_marker(run_dir)
        if marker:
            assert write_marker(run_dir, marker)
        fd = open_marker(run_dir)
        assert fd is not None
    try:
        stop = StopControl(resolve=lambda reason: _signal_sender(reason, fd, stop))
        g = gate(ApprovalSpec(tools=("run_command",)))
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(lambda: _stop_soon(stop))
                answer = await g.wait("c1", stop)
    finally:
        if fd is not None:
            os.close(fd)
    assert answer == Answer("rejected", why)
    assert stop.reason == ("signalled" if why == "signalled" else "signal")  # the applied reason is unchanged


async def test_an_answer_and_a_stop_that_come_together_reject_the_call() -> None:
    # Approve and Stop at once: both waits woke, and the answer (its task first) won: the
    # call started after the stop (a background command ran). Trio wakes the two in either
    # order, at random: 20 rounds.
    got: list[Answer] = []
    for _ in range(20):
        stop = StopControl()
        g = gate(ApprovalSpec(tools=("run_command",)))
        with trio.fail_after(5):
            async with trio.open_nursery() as n:

                async def wait(g: ApprovalGate = g, stop: StopControl = stop) -> None:
                    got.append(await g.wait("c1", stop))

                n.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                g.channel._take(b'{"call_id": "c1", "decision": "approve"}')  # no checkpoint between
                stop.request("user")
    assert got == [Answer("rejected", "user")] * 20


async def _stop_soon(stop: StopControl) -> None:
    await trio.lowlevel.checkpoint()
    stop.request("signal")


async def test_with_no_answer_the_runner_stops_itself_after_the_timeout_and_its_backstop(
    autojump_clock: trio.abc.Clock,
) -> None:
    stop = StopControl()
    g = gate(ApprovalSpec(tools=("run_command",), timeout_s=2.0))
    start = trio.current_time()
    answer = await g.wait("c1", stop)
    assert answer == Answer("rejected", "approval_timeout")
    assert trio.current_time() - start == pytest.approx(2.0 + BACKSTOP_S)


@pytest.mark.parametrize(("blank", "count"), [(" ", MAX_APPROVAL_ARGUMENTS_CHARS), ("\u00a0", 200_000)])
async def test_a_call_whose_arguments_are_too_long_to_show_whole_is_never_asked_about_nor_run(
    tmp_path: Path, blank: str, count: int
) -> None:
    # Blanks hide where the command goes on: with 200,000 no-break spaces (6 bytes each in
    # an event line) its approval_requested event was cut to fit a line, and the person
    # was asked about 'echo fine ...[cut]'. Just over the bound, it could be cut
    # (characters that take 12 bytes each in a line).
    command = "echo fine" + blank * count + f"; touch {tmp_path / 'ran'}"
    # As a model sends it: raw JSON, its characters as they are (the script would escape them).
    raw = json.dumps({"command": command}, ensure_ascii=False)
    script = {"turns": [{"tool_calls": [{"name": "run_command", "id": "long", "arguments": raw}]}]}
    s = spec(script={**script, "chunk_size": 65536}, approval={"tools": ["run_command"], "timeout_s": 1})
    s["sandbox"] = {"write": [str(tmp_path)]}
    async with start_runner(s, tmp_path) as r:
        code, result = await r.finish()
    assert r.of(EventKind.APPROVAL_REQUESTED) == []
    (rec,) = r.tool_records(result)
    assert rec["state"] == "failed" and rec["reason"].startswith("invalid_arguments: ")
    assert "too long to be shown whole" in rec["reason"]
    assert not (tmp_path / "ran").exists()
    assert result["status"] == "completed" and code == 0
