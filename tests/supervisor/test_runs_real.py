"""The run manager with the real runner (scripted model): steering and stop semantics."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from supervisor.errors import ControlProtocolError
from tests.supervisor.test_stop_tools import command_alive, wait_event


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = Config.load(state_dir=tmp_path / "state", grace_s=5, environ={})
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield info["manager"]
        stop.set()


@pytest.fixture(params=["cold", "spare"])
async def any_runner(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RunManager]:
    """A daemon whose next run's runner is a cold ``python -m subagent.runner`` (a runner
    the zygote forks at the spawn opens its files as a cold one does), or the zygote's
    spare (which opens them before it has a run)."""
    from tests.supervisor.test_zygote_spare import spare_ready

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    how = {"cold": {"zygote": "off"}, "spare": {"zygote_spares": 1}}[request.param]
    config = Config.load(state_dir=tmp_path / "state", grace_s=5, environ={}, **how)
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        m: RunManager = info["manager"]
        if request.param == "spare":
            await spare_ready(m)
        yield m
        stop.set()


def gated_script(turns_after: list[dict[str, Any]]) -> dict[str, Any]:
    """A first turn whose command waits for a file named ``go`` in the run's directory."""
    wait = "while [ ! -f go ]; do sleep 0.02; done; echo gate open"
    return {
        "turns": [
            {"text": "Waiting at the gate.", "tool_calls": [{"name": "run_command", "arguments": {"command": wait}}]}
        ]
        + turns_after,
        "final": "All done.",
    }


def running_tool(e: dict[str, Any]) -> bool:
    return e["kind"] == "tool_call" and e["data"]["record"]["state"] == "running"


async def test_steering_is_applied_at_the_next_step_boundary(manager: RunManager) -> None:
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, running_tool)
        reply = await manager.steer(rid, "also check the disk")
        assert reply["accepted"] is True
        run_dir = Path((await manager.status(rid))["run_dir"])
        (run_dir / "go").touch()
        st = await manager.wait_terminal(rid)
    assert st["state"] == "completed"
    events = await manager.events_after(rid, 0)
    steering = [e["data"]["state"] for e in events if e["kind"] == "steering"]
    assert steering == ["queued", "applied"]
    users = [m for m in st["result"]["messages"] if m.get("role") == "user"]
    assert any("also check the disk" in json.dumps(m) for m in users)


async def test_a_stop_lets_the_running_tool_finish_and_reports_unapplied_steering(manager: RunManager) -> None:
    with trio.fail_after(30):
        script = gated_script(
            [{"text": "never", "tool_calls": [{"name": "run_command", "arguments": {"command": "echo no"}}]}]
        )
        policy = {"run_command": "finish"}  # this command may finish after the stop
        r = await manager.spawn(
            {"task": "t", "model": {"provider": "scripted", "script": script}, "stop_policy": policy}
        )
        rid = r["run_id"]
        # Its command's process is up (a command the stop finds still spawning is ended:
        # its policy applies to a running command), not only its record.
        await wait_event(manager, rid, command_alive)
        assert (await manager.steer(rid, "do more"))["accepted"] is True
        await wait_event(manager, rid, lambda e: e["kind"] == "steering")
        cancel = await manager.cancel(rid)
        assert cancel["was_active"] is True
        assert (await manager.steer(rid, "too late"))["accepted"] is False
        await wait_event(manager, rid, lambda e: e["kind"] == "stop_requested")
        run_dir = Path((await manager.status(rid))["run_dir"])
        (run_dir / "go").touch()  # the running tool finishes after the stop
        st = await manager.wait_terminal(rid)
    assert st["state"] == "cancelled"
    assert st["partial"] is False  # the runner wrote its own result
    calls = st["tool_calls"]
    assert [c["state"] for c in calls] == ["succeeded"]
    assert "gate open" in calls[0]["output"] and calls[0]["stop_effect"] == "finished_after_stop"
    assert st["receipt"]["tool_summary"].startswith(
        "a command the spec lets finish `run_command` allowed to finish; it finished"
    )
    assert st["result"]["unapplied_steering"] == ["do more"]
    assert st["receipt"]["path_b"]["escalated"] is False


@pytest.mark.parametrize("pool_size", [0, 1])
async def test_the_runs_id_reaches_its_commands_cold_or_warm(tmp_path: Path, pool_size: int) -> None:
    config = Config.load(state_dir=tmp_path / "state", grace_s=5, pool_size=pool_size, environ={})
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "echo id=$AGENTD_RUN_ID"}}]}]}
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            if pool_size:
                while m._pool is None or m._pool.ready < 1:
                    await trio.sleep(0.05)
            r = await m.spawn({"task": "t", "model": {"provider": "scripted", "script": script}})
            st = await m.wait_terminal(r["run_id"])
            stop.set()
    assert st["state"] == "completed"
    assert f"id={r['run_id']}" in st["tool_calls"][0]["output"]


async def test_steering_its_runner_never_read_is_reported_unapplied(manager: RunManager) -> None:
    # A steer written to the runner's input as the run ends (here: the runner is frozen,
    # then dies) reached no one: it is reported unapplied, not lost behind `accepted`.
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        pid = (await manager.status(rid))["pid"]
        os.kill(pid, signal.SIGSTOP)  # the runner this test's daemon started
        reply = await manager.steer(rid, "never read")
        os.kill(pid, signal.SIGKILL)
        st = await manager.wait_terminal(rid)
        with pytest.raises(ControlProtocolError, match="too long"):
            await manager.steer(rid, "x" * 300_000)  # refused whole, whatever the run's state
    assert reply["accepted"] is True
    assert (st["state"], st["reason"]) == ("failed", "runner_died")
    events = await manager.events_after(rid, 0)
    steering = [e["data"] for e in events if e["kind"] == "steering"]
    assert steering == [{"state": "unapplied", "text": "never read", "step": None, "unread": True}]


async def test_steering_its_runner_read_but_never_applied_is_reported_unapplied_when_it_leaves_no_result(
    manager: RunManager,
) -> None:
    # The runner read the steer (``queued``) and was killed before it applied it or wrote
    # a result (its grace ran out, the OOM killer, a crash): the text was neither applied
    # nor reported unapplied, though the client was told it was accepted.
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        reply = await manager.steer(rid, "read, never applied")
        await wait_event(manager, rid, lambda e: e["kind"] == "steering" and e["data"]["state"] == "queued")
        pid = (await manager.status(rid))["pid"]
        os.kill(pid, signal.SIGKILL)  # the runner this test's daemon started
        st = await manager.wait_terminal(rid)
    assert reply["accepted"] is True
    assert (st["state"], st["reason"], st["partial"]) == ("failed", "runner_died", True)
    events = await manager.events_after(rid, 0)
    steering = [e["data"] for e in events if e["kind"] == "steering"]
    assert [s["state"] for s in steering] == ["queued", "unapplied"], steering
    assert steering[1]["text"] == "read, never applied"
    assert st["result"]["unapplied_steering"] == ["read, never applied"]


async def _stop_requested(manager: RunManager, rid: str) -> dict[str, Any]:
    events = await manager.events_after(rid, 0)
    stops = [e["data"] for e in events if e["kind"] == "stop_requested"]
    assert len(stops) == 1, stops
    return stops[0]


def _result_file(st: dict[str, Any]) -> dict[str, Any]:
    # What the runner wrote beside its run dir is gone with the run: the daemon kept it.
    result = st["result"]
    assert isinstance(result, dict), st
    return result


async def test_a_runner_signalled_by_its_own_tool_is_not_a_cancelled_run(any_runner: RunManager) -> None:
    # A stop is a cancel, never inferred: a SIGTERM no cancel sent (here the run's own
    # command signals its runner) is recorded for what it was, by the daemon and by the
    # runner's own result and stop_requested event, which the daemon keeps. (A tool that
    # forges the daemon's stop marker first: tests/e2e/test_sandbox.py.)
    script = {
        "turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "kill -TERM $PPID; sleep 30"}}]}]
    }
    manager = any_runner
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": script}})
        st = await manager.wait_terminal(r["run_id"])
        stop = await _stop_requested(manager, r["run_id"])
    assert (st["state"], st["reason"]) == ("failed", "signalled"), st
    assert st["cancel_reason"] is None and st["error"]["code"] == "signalled"
    result = _result_file(st)
    assert (result["status"], result["reason"]) == ("failed", "signalled"), result
    assert result["error"]["code"] == "signalled", result
    assert "stop_reason" not in result, result
    assert "agentd's stop did not send" in result["error"]["message"]
    assert stop["reason"] == "signalled" and "stop_reason" not in stop, stop
    [call] = result["tool_calls"]
    assert "interrupted by the stop" not in (call["reason"] or "") + (call["output"] or ""), call
    assert "not sent by agentd's stop" in call["reason"], call


@pytest.mark.parametrize("reason", ["user", "Rolled back: not now"])
async def test_a_cancelled_runs_runner_says_whose_stop_it_was(manager: RunManager, reason: str) -> None:
    # The daemon's stop: its marker then its SIGTERM; the runner reads the marker and says
    # it was the daemon's stop, with its reason ("user", or a client's own text, which the
    # marker once turned into "stop"), and is cancelled.
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        await manager.cancel(rid, reason=reason)
        st = await manager.wait_terminal(rid)
        stop = await _stop_requested(manager, rid)
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", reason, reason), st
    result = _result_file(st)
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", reason), result
    assert (stop["reason"], stop["stop_reason"], stop["during"]) == ("signal", reason, "tool"), stop
    [call] = result["tool_calls"]
    assert (call["state"], call["stop_effect"]) == ("cancelled", "interrupted"), call
    assert call["reason"].startswith("interrupted: interrupted by the stop (SIGTERM to its process group)"), call


async def test_a_steer_racing_the_runs_end_is_refused_and_never_reported_unapplied(manager: RunManager) -> None:
    # A steer checked the runner's input, then waited for it (another steer was writing)
    # while the run ended: it then wrote to no input at all (an internal error), and its
    # text, refused, was still reported unapplied. Here the test holds the input's lock.
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        run = manager._live[rid]
        pid = (await manager.status(rid))["pid"]
        replies: list[dict[str, Any]] = []

        async def steer() -> None:
            replies.append(await manager.steer(rid, "too late"))

        async with trio.open_nursery() as n:
            async with run.stdin_lock:
                n.start_soon(steer)
                await trio.testing.wait_all_tasks_blocked()
                os.kill(pid, signal.SIGKILL)  # the runner this test's daemon started: the run ends
                while run.stdin is not None:
                    await trio.sleep(0.01)
        st = await manager.wait_terminal(rid)
    assert replies and replies[0]["accepted"] is False, replies
    assert replies[0]["why"] == "the run is ending: its runner's input is closed", replies
    assert st["state"] == "failed"
    events = await manager.events_after(rid, 0)
    assert not [e for e in events if e["kind"] in ("steering", "steer_sent")], events


async def test_a_second_cancel_is_acknowledged_only_once_the_stop_is_durable(
    manager: RunManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two cancels at once: the one that started the stop waited for its durable intent,
    # the other answered at once ("running"), before the journal held the stop: a `kill -9`
    # then lost a stop it had acknowledged.
    from supervisor.store.journal import Journal

    gate = trio.Event()
    real = Journal.record_cancel

    async def held(self: Journal, *args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await real(self, *args, **kwargs)

    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        monkeypatch.setattr(Journal, "record_cancel", held)
        replies: list[dict[str, Any]] = []

        async def cancel() -> None:
            replies.append(await manager.cancel(rid))

        async with trio.open_nursery() as n:
            n.start_soon(cancel)
            await trio.testing.wait_all_tasks_blocked()  # the first waits for its journal write
            n.start_soon(cancel)
            await trio.testing.wait_all_tasks_blocked()
            assert replies == [], replies  # neither is acknowledged before the stop is durable
            gate.set()
        row = await manager.journal.get_run(rid)
        await manager.wait_terminal(rid)
    assert row is not None and row["cancel_reason"] == "user"
    assert [(x["was_active"], x["state"]) for x in replies] == [(True, "cancelling")] * 2, replies


async def test_a_runs_event_times_never_go_back(manager: RunManager) -> None:
    # The runner stamps its own events; the daemon's `running`, recorded as the runner's
    # first event arrived, was stamped after it and came first: times went back, in every
    # run. (A steer's `steer_sent` and a runner event can still cross: none here.)
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "echo hi"}}]}]}
    with trio.fail_after(30):
        for _ in range(3):
            r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": script}})
            await manager.wait_terminal(r["run_id"])
            events = await manager.events_after(r["run_id"], 0)
            times = [e["ts"] for e in events]
            assert times == sorted(times), [(e["seq"], e["kind"], e["ts"]) for e in events]


async def test_the_runners_stop_at_its_deadline_is_the_daemons_cancel(manager: RunManager) -> None:
    # The runner stopped itself at limits.deadline_s, but the daemon knew nothing of it: a
    # command let finish ran on until the daemon's backstop, then a second whole grace.
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 30"}}]}]}
    spec = {
        "task": "t",
        "model": {"provider": "scripted", "script": script},
        "limits": {"deadline_s": 0.5},
        "stop_policy": {"run_command": "finish"},
    }
    with trio.fail_after(30):
        r = await manager.spawn(spec)
        rid = r["run_id"]
        stopped = await wait_event(manager, rid, lambda e: e["kind"] == "stop_requested")
        assert stopped["data"]["reason"] == "timeout"
        with trio.fail_after(3):  # well before the daemon's own backstop (0.5 + 5 s)
            cancelling = await wait_event(
                manager, rid, lambda e: e["kind"] == "state" and e["data"]["state"] == "cancelling"
            )
        st = await manager.wait_terminal(rid)
    assert cancelling["data"]["reason"] == "timeout"
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", "timeout", "timeout"), st


async def test_the_daemons_deadline_is_the_daemons_stop_in_the_runners_result(manager: RunManager) -> None:
    # The daemon's own timeout (the spawn's timeout_s; no deadline in the runner's spec):
    # its stop is marked before its SIGTERM like a user's cancel, with its own reason.
    with trio.fail_after(30):
        r = await manager.spawn(
            {"task": "t", "model": {"provider": "scripted", "script": gated_script([])}}, timeout_s=1
        )
        st = await manager.wait_terminal(r["run_id"])
        stop = await _stop_requested(manager, r["run_id"])
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", "timeout", "timeout"), st
    result = _result_file(st)
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "timeout"), result
    assert (stop["reason"], stop["stop_reason"]) == ("signal", "timeout"), stop


async def test_a_steer_a_stop_overtakes_while_it_is_journaled_is_refused_not_written(
    manager: RunManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A steer checked that no stop was under way, then journaled itself (an fsynced
    # write, an await); a cancel taken meanwhile was acknowledged, and the steer was then
    # written into the stopped runner's input and answered `accepted: true` (DESIGN:
    # steering is refused once a stop is under way).
    book = manager.book
    real = book.record_durable
    cancels: list[dict[str, Any]] = []

    async def overtaken(run: Any, kind: str, data: dict[str, Any]) -> int:
        seq = await real(run, kind, data)
        if kind == "steer_sent":  # the cancel the daemon takes while the steer's write waited
            cancels.append(await manager.cancel(run.run_id))
        return seq

    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        monkeypatch.setattr(book, "record_durable", overtaken)
        reply = await manager.steer(rid, "after the stop")
        st = await manager.wait_terminal(rid)
    assert cancels and cancels[0]["was_active"] is True, cancels
    assert reply == {"run_id": rid, "accepted": False, "state": "cancelling", "why": "a stop is under way"}, reply
    assert st["state"] == "cancelled"
    events = await manager.events_after(rid, 0)
    steers = [(e["kind"], e["data"]) for e in events if e["kind"] in ("steer_sent", "steer_unsent", "steering")]
    assert steers == [
        ("steer_sent", {"text": "after the stop"}),
        ("steer_unsent", {"text": "after the stop", "why": "a stop is under way"}),
    ], steers
    assert not (st["result"] or {}).get("unapplied_steering"), st["result"]


async def test_a_steer_waiting_for_room_in_the_runners_input_is_refused_at_a_stop(manager: RunManager) -> None:
    # A journaled steer waits for room in its runner's input (up to 10 s); a stop taken
    # meanwhile let it be written once the stopped runner read again, after the stop was
    # acknowledged (or refused only at its 10 s). Now it is refused at the stop, unwritten.
    # Each line ~4,000 bytes: a pipe write that small is whole or nothing (PIPE_BUF), and
    # each takes one of the pipe's 16 slots, so the 17th finds no room at all.
    texts = [f"{i:02d}" + "s" * 3980 for i in range(17)]
    with trio.fail_after(30):
        r = await manager.spawn({"task": "t", "model": {"provider": "scripted", "script": gated_script([])}})
        rid = r["run_id"]
        await wait_event(manager, rid, command_alive)
        pid = (await manager.status(rid))["pid"]
        # The runner this test's daemon started, held by a pidfd (the stop ends it, and its
        # pid could be reused before the SIGCONT below): it reads no input while stopped.
        runner = os.pidfd_open(pid)
        signal.pidfd_send_signal(runner, signal.SIGSTOP)
        try:
            for text in texts[:16]:
                assert (await manager.steer(rid, text))["accepted"] is True
            replies: list[dict[str, Any]] = []

            async def last() -> None:
                replies.append(await manager.steer(rid, texts[16]))

            async with trio.open_nursery() as n:
                n.start_soon(last)
                await wait_event(manager, rid, lambda e: e["kind"] == "steer_sent" and e["data"]["text"] == texts[16])
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                run = manager._live[rid]
                assert run.steers_sent[-1] == texts[16]  # in its write: waiting for room
                cancel = await manager.cancel(rid)
        finally:
            try:
                signal.pidfd_send_signal(runner, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the stop ended it already (its SIGTERM comes with a SIGCONT)
            os.close(runner)
        st = await manager.wait_terminal(rid)
    assert cancel["was_active"] is True
    # (Its state is the run's when it was refused: the stop's `cancelling` is journaled
    # after the stop is taken, so it may still say `running`.)
    assert len(replies) == 1 and replies[0]["state"] in ("running", "cancelling"), replies
    assert {k: v for k, v in replies[0].items() if k != "state"} == {
        "run_id": rid,
        "accepted": False,
        "why": "a stop is under way",
    }
    events = await manager.events_after(rid, 0)
    unsent = [e["data"] for e in events if e["kind"] == "steer_unsent"]
    assert unsent == [{"text": texts[16], "why": "a stop is under way"}], unsent
    assert st["state"] == "cancelled"
