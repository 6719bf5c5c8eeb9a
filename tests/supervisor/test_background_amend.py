"""A background command whose runner was killed before it amended its call's record: the
daemon, which ended the run's tree, amends it (``supervisor.core._background``).

Its runner amends the call that started one at the run's end (``background_ended``, or
``background_ended_with_run:``); a runner SIGKILLed first (the stop's grace ran out, a
process of its own, the OOM killer) left "succeeded: started in the background" for ever,
though the daemon had ended the command with the tree. An in-process daemon (``serve``),
real runners with the scripted model, real commands.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from subagent.events import StopEffect
from subagent.history import HISTORY_BACKGROUND_ENDED_BY_STOP, HISTORY_BACKGROUND_ENDED_WITH_RUN, tool_result_text
from supervisor.core._background import amendments
from tests.supervisor.test_restart import daemon as restarted_daemon
from tests.supervisor.test_stop_tools import cancel_and_time, start_daemon, wait_event

SERVING = {"command": "echo serving; exec sleep 300", "background": True}


def turns(*calls: dict[str, Any], **more: Any) -> dict[str, Any]:
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": c}]} for c in calls]}
    return {"task": "t", "model": {"provider": "scripted", "script": script}, **more}


def foreground_alive(e: dict[str, Any]) -> bool:
    return (
        e["kind"] == "process_group"
        and e["data"]["alive"]
        and e["data"]["kind"] == "command"
        and not e["data"]["name"].startswith("[background] ")
    )


def started_pid(call: dict[str, Any]) -> int:
    assert call["output"].startswith("started in the background: id bg1, pid "), call
    return int(call["output"].split("pid ")[1].split(";")[0])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_runner_killed_at_the_grace_leaves_its_background_call_amended_by_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spec lets commands finish: the foreground one outlives the (short) grace, and
    # the runner is SIGKILLed before its run's end amends the background call.
    spec = turns(SERVING, {"command": "echo two; sleep 300"}, stop_policy={"run_command": "finish"})
    async with start_daemon(tmp_path, monkeypatch, grace_s=1.0) as m:
        with trio.fail_after(30):
            rid = (await m.spawn(spec))["run_id"]
            await wait_event(m, rid, foreground_alive)
            st, _took = await cancel_and_time(m, rid)
    assert st["state"] == "cancelled" and st["receipt"]["path_b"]["escalated"] is True, st["receipt"]
    bg, fg = st["tool_calls"]
    assert (fg["state"], fg["stop_effect"]) == ("unknown", "grace_ran_out")
    assert bg["state"] == "succeeded" and gone(started_pid(bg))
    assert bg["stop_effect"] == StopEffect.BACKGROUND_ENDED and bg["amended_by"] == "daemon", bg
    assert bg["reason"].startswith(
        "background_ended: its background command bg1 (process group "
        f"{started_pid(bg)}) was still running when the run was stopped; the runner was killed at the end "
        "of the stop's grace before it said so; agentd ended it with the run's tree, "
    ), bg
    assert bg["reason"].endswith("s after the stop (agentd's account)"), bg
    assert 0.5 < bg["stop_to_end_s"] < 10, bg  # the grace (1 s), then the tree's SIGKILL
    assert bg["stop_requested_at"] == st["receipt"]["cancel_requested_wall"]
    assert "background command of `run_command` ended by the stop after " in st["receipt"]["tool_summary"]
    assert HISTORY_BACKGROUND_ENDED_BY_STOP in tool_result_text(bg, stop_reason="user")


async def test_a_runner_that_died_without_a_stop_leaves_its_background_call_ended_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own command SIGKILLs it (as the OOM killer would): no stop, no result.
    spec = turns(SERVING, {"command": "kill -9 $PPID; sleep 300"})
    async with start_daemon(tmp_path, monkeypatch) as m:
        with trio.fail_after(30):
            rid = (await m.spawn(spec))["run_id"]
            st = await m.wait_terminal(rid)
    assert (st["state"], st["reason"]) == ("failed", "runner_died") and st["receipt"]["exit_code"] == -signal.SIGKILL
    bg = st["tool_calls"][0]
    assert bg["state"] == "succeeded" and bg["stop_effect"] is None and bg["amended_by"] == "daemon", bg
    assert bg["reason"] == (
        f"background_ended_with_run: its background command bg1 (process group {started_pid(bg)}) was still "
        "running when the runner died (killed by SIGKILL, which agentd did not send); agentd ended it with "
        "the run's tree (agentd's account)"
    ), bg
    assert gone(started_pid(bg))
    assert HISTORY_BACKGROUND_ENDED_WITH_RUN in tool_result_text(bg, stop_reason=None)


def test_a_background_command_that_ended_before_the_stop_or_was_amended_is_left_as_it_was() -> None:
    started = {
        "id": "c1",
        "name": "run_command",
        "state": "succeeded",
        "output": "started in the background: id bg1, pid 7; read it",
    }
    ended_early = {"pgid": 7, "kind": "command", "alive": False, "ended_at": 100.0}
    assert amendments([started], [ended_early], how="h", stop_wall=150.0, tree_dead_wall=160.0) == []
    assert amendments([started], [ended_early], how="h", stop_wall=None, tree_dead_wall=160.0) == []
    by_runner = {**started, "stop_effect": "background_ended", "reason": "background_ended: ..."}
    assert amendments([by_runner], [], how="h", stop_wall=150.0, tree_dead_wall=160.0) == []
    # Ended after the stop, as its runner saw: counted from the stop to then.
    (late,) = amendments(
        [started], [{**ended_early, "ended_at": 150.25}], how="h", stop_wall=150.0, tree_dead_wall=None
    )
    assert late["stop_to_end_s"] == 0.25 and "its runner saw its group end, 0.25 s after the stop" in late["reason"]
    # Survivors: the daemon does not claim it saw it die.
    (unseen,) = amendments([started], [], how="h", stop_wall=150.0, tree_dead_wall=None)
    assert unseen["stop_to_end_s"] is None and "did not see all of it die" in unseen["reason"]


async def test_a_runner_gone_while_no_daemon_ran_leaves_its_background_call_ended_with_the_run(tmp_path: Path) -> None:
    # The daemon is killed -9, then its run's runner (no stop, no result); the next daemon
    # finds the runner gone, sweeps what is left of its tree (the background command) and
    # ends the run `lost`: the call's record says the command ended with it.
    spec = turns(SERVING, {"command": "echo two; sleep 300"})
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with restarted_daemon(state, dict(os.environ)) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            # Its groups: the background command's, then the foreground one's (the turn after).
            await c.wait_for(rid, kind="process_group", count=2)
            st = await c.call("status", run_id=rid)
            assert [t["name"] for t in st["tool_calls"]] == ["run_command", "run_command"], st["tool_calls"]
            runner, bg_pid = st["pid"], started_pid(st["tool_calls"][0])
            # Pinned while its own daemon (this test's child) is its parent: the pidfd is
            # that process, whatever its pid becomes once it is orphaned.
            assert psutil.Process(runner).ppid() == d1.pid
            pin = os.pidfd_open(runner)
            await c.ws.aclose()
            d1.kill()
            await d1.wait()
        try:
            signal.pidfd_send_signal(pin, signal.SIGKILL)  # the run's runner, no daemon watching
        finally:
            os.close(pin)
        async with restarted_daemon(state, dict(os.environ)) as (d2, c):
            st = await c.call("status", run_id=rid)
            await c.ws.aclose()
            d2.send_signal(signal.SIGTERM)
            await d2.wait()
    assert st["state"] == "lost", st
    bg = st["tool_calls"][0]
    assert bg["state"] == "succeeded" and bg["stop_effect"] is None and bg["amended_by"] == "daemon", bg
    assert bg["reason"] == (
        f"background_ended_with_run: its background command bg1 (process group {bg_pid}) was still running when "
        "the daemon, restarted, found its runner gone; agentd ended it with the run's tree (agentd's account)"
    ), bg
    assert gone(bg_pid)
