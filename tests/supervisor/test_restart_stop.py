"""Acceptance: stops and deadlines survive a daemon SIGKILL; a run that ended meanwhile is what it was.

Real daemon processes (``tests/children/daemon_main.py``) on one state dir, the real
runner with the scripted model, a real SQLite file and a real websocket. The first daemon
is SIGKILLed (no cleanup at all); the second one finds the journal as the first left it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.supervisor.test_restart import CHILDREN, Client


@asynccontextmanager
async def daemon(
    state_dir: Path, *, grace_s: float, log: Path | None = None, **settings: str
) -> AsyncIterator[tuple[trio.Process, Client]]:
    """A real daemon process (``tests/children/daemon_main.py``) with the real runner;
    ``log``: its stderr appended there; ``settings``: more of its settings, by name
    (``disk_min_free_mib="12"``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AGENTD_RUNNER"))}
    env["AGENTD_GRACE_S"] = str(grace_s)
    env.update({f"AGENTD_{k.upper()}": v for k, v in settings.items()})
    with open(log, "ab") if log is not None else contextlib.nullcontext() as log_file:
        proc = await trio.lowlevel.open_process(
            [sys.executable, str(CHILDREN / "daemon_main.py"), str(state_dir)],
            stdout=-1,
            stderr=log_file,
            env=env,
            start_new_session=True,
        )
    try:
        buf = b""
        assert proc.stdout is not None
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some()
            assert chunk, "daemon exited before it served" + (
                f": {log.read_text(errors='replace')[-3000:]}" if log else ""
            )
            buf += chunk
        info = json.loads(buf.split(b"\n")[0])
        headers = [(b"authorization", f"Bearer {info['token']}".encode())]
        async with open_websocket_url(info["url"], extra_headers=headers) as ws:
            yield proc, Client(ws)
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(15):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert proc.stdout is not None
            await proc.stdout.aclose()


def command_spec(command: str, **more: Any) -> dict[str, Any]:
    script = {
        "turns": [{"text": "working", "tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}],
        "final": "done",
    }
    return {"task": "t", "model": {"provider": "scripted", "script": script}, **more}


def reading(turns: list[dict[str, Any]], shared: Path) -> dict[str, Any]:
    """A scripted run of ``turns`` whose sandbox may read ``shared`` (its commands' flags)."""
    return {
        "task": "t",
        "model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}},
        "sandbox": {"read": [str(shared)]},
    }


async def kill9(proc: trio.Process, c: Client) -> None:
    await c.ws.aclose()
    proc.kill()  # SIGKILL: no cleanup at all
    await proc.wait()


async def wait_gone(pid: int, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while True:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return
            except psutil.NoSuchProcess:
                return
            await trio.sleep(0.02)


async def test_an_acknowledged_stop_is_finished_by_the_restarted_daemon_with_its_reason_and_grace(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    grace = 5.0
    # The command may finish (spec policy), so the stop waits on it for the grace.
    spec = command_spec("sleep 300", stop_policy={"run_command": "finish"})
    with trio.fail_after(60):
        async with daemon(state, grace_s=grace) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await c.wait_for(rid, kind="process_group")  # the command runs
            reply = await c.call("cancel", run_id=rid)
            assert reply["was_active"] is True  # acknowledged: journaled before this reply
            st = await c.call("status", run_id=rid)
            runner = st["pid"]
            await kill9(d1, c)
        assert psutil.pid_exists(runner)
        async with daemon(state, grace_s=grace) as (d2, c):
            # No second cancel: the restarted daemon resumes the stop it finds in the journal.
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid))["events"]
    assert final["reason"] == "user"  # the original reason, not the runner's "signal"
    assert final["cancel_reason"] == "user" and final["stop_deadline"] == final["cancel_requested_at"] + grace
    # Within the grace of the original cancel (path B at its deadline), not a fresh one.
    assert final["ended_at"] <= final["stop_deadline"] + 2.0
    assert final["ended_at"] >= final["stop_deadline"] - 0.5  # the command was let finish until then
    resumed = [e["data"] for e in events if e["kind"] == "daemon" and "resumed_stop" in e["data"]]
    assert resumed and resumed[0]["resumed_stop"]["reason"] == "user"
    assert 0 < resumed[0]["resumed_stop"]["grace_left_s"] < grace
    (call,) = final["tool_calls"]
    assert (call["state"], call["stop_effect"]) == ("unknown", "grace_ran_out")
    assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == psutil.STATUS_ZOMBIE


async def test_a_timeout_is_a_wall_clock_deadline_that_a_restart_does_not_extend(tmp_path: Path) -> None:
    state = tmp_path / "state"
    timeout = 4.0
    with trio.fail_after(60):
        async with daemon(state, grace_s=10.0) as (d1, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300"), timeout_s=timeout))["run_id"]
            await c.wait_for(rid, kind="process_group")
            st = await c.call("status", run_id=rid)
            deadline = st["deadline"]
            assert deadline is not None and st["started_at"] <= deadline - timeout <= st["started_at"] + 1.0
            await kill9(d1, c)
        # Down for a while: the run's time goes on (the scenario's own clock, not a sync).
        await trio.sleep(max(0.0, st["started_at"] + timeout / 2 - time.time()))
        async with daemon(state, grace_s=10.0) as (d2, c):
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
    assert final["reason"] == "timeout" and final["deadline"] == deadline
    # It ends at its deadline (the command is interrupted at once), not a timeout later.
    assert deadline <= final["ended_at"] <= deadline + 1.5
    (call,) = final["tool_calls"]
    assert call["state"] == "cancelled" and call["stop_effect"] == "interrupted"


async def wait_call_running(c: Client, run_id: str, call_id: str) -> None:
    """Until the run's command call ``call_id`` is journaled running and its command's
    group alive: the command has passed its gate (a stop before that leaves it unrun)."""
    await c.call("subscribe", run_id=run_id, after_seq=0)
    running = False
    while True:
        msg = json.loads(await c.ws.get_message())
        if msg.get("op") == "event" and msg["run_id"] == run_id and msg["kind"] == "tool_call":
            record = msg["data"]["record"]
            running = running or (record["id"], record["state"]) == (call_id, "running")
        elif running and msg.get("op") == "event" and msg["run_id"] == run_id and msg["kind"] == "process_group":
            if msg["data"]["kind"] == "command" and msg["data"]["alive"] is True:
                await c.call("unsubscribe", sub=msg["sub"])
                return
        assert msg.get("op") != "end", f"run {run_id} ended before {call_id} ran"


@pytest.mark.parametrize("ending", ["completed", "failed", "signalled", "no result"])
async def test_a_run_that_finished_while_the_daemon_was_down_is_what_its_result_says(
    tmp_path: Path, ending: str
) -> None:
    """The runner ends with no daemon watching: by itself (its result says `completed`, or
    `failed` when the model fails), stopped by someone else's SIGTERM (`failed`,
    `signalled`: no stop of a daemon's sent it, so its runner's result says so, not
    `cancelled`), or SIGKILLed (no result: `lost`, with what the journal knew as its
    partial result)."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"  # granted to the run: its sandbox reaches only its own dir
    shared.mkdir()
    flag = shared / "go"
    turns: list[dict[str, Any]] = [
        {"text": "first", "tool_calls": [{"name": "run_command", "arguments": {"command": "echo one"}}]},
        {
            "text": "working",
            "tool_calls": [
                {
                    "name": "run_command",
                    "arguments": {"command": f"while [ ! -e {flag} ]; do sleep 0.02; done; echo finished"},
                }
            ],
        },
    ]
    if ending == "failed":
        turns.append({"text": "", "error": "the model broke"})
    spec = reading(turns, shared)
    with trio.fail_after(60):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_2_1")
            before = await c.call("status", run_id=rid)
            runner = before["pid"]
            await kill9(d1, c)
        if ending in ("completed", "failed"):
            flag.touch()  # the run goes on and ends by itself with no daemon watching
        else:
            os.kill(runner, signal.SIGTERM if ending == "signalled" else signal.SIGKILL)
        await wait_gone(runner, 30)
        async with daemon(state, grace_s=5.0) as (d2, c):
            final = await c.call("status", run_id=rid)
    first, second = final["tool_calls"]
    assert first["state"] == "succeeded" and "one" in first["output"]
    if ending == "no result":
        assert (final["state"], final["partial"]) == ("lost", True), final
        assert final["result"] == before["partial_snapshot"] and final["result"]["progress"].startswith("first")
        assert second["state"] == "unknown", second  # its outcome went with the runner
        assert final["receipt"]["recovery"]["survivors"] == []
        return
    assert final["receipt"]["path_b"]["note"] == "the run ended while the daemon was down"
    assert final["partial"] is False, final
    assert final["result"]["status"] == ("failed" if ending == "signalled" else ending), final
    if ending == "completed":
        assert final["state"] == "completed" and final["result"]["final_text"] == "done"
        assert second["state"] == "succeeded" and "finished" in second["output"]
    elif ending == "failed":
        assert final["state"] == "failed" and "the model broke" in json.dumps(final["error"]), final
        assert second["state"] == "succeeded" and "finished" in second["output"]
    else:
        assert (final["state"], final["reason"], final["cancel_reason"]) == ("failed", "signalled", None), final
        assert final["result"]["reason"] == "signalled" and final["error"]["code"] == "signalled", final
        assert second["state"] == "cancelled" and second["stop_effect"] == "interrupted", second
        assert "not sent by agentd's stop" in second["reason"], second


async def test_a_stop_acknowledged_before_the_runner_started_is_kept_by_the_next_daemon(tmp_path: Path) -> None:
    from supervisor.config import Config
    from supervisor.daemon import serve
    from supervisor.store.journal import Journal

    config = Config.load(state_dir=tmp_path / "state", environ={})
    config.state_dir.mkdir(parents=True)
    now = time.time()
    # What a daemon killed right after acknowledging the cancel of a queued run leaves.
    async with await Journal.open(config.journal_path) as j:
        queued = [("state", {"state": "queued"}, now)]
        await j.create_run(
            "r-queued", session_id=None, spec={"task": "t"}, created_at=now, timeout_s=None, events=queued
        )
        assert await j.record_cancel("r-queued", reason="user", at=now, stop_deadline=now + 10)
        spec = {"task": "t", "model": {"provider": "scripted", "script": {"turns": [], "final": "done"}}}
        await j.create_run("r-never", session_id=None, spec=spec, created_at=now, timeout_s=None, events=queued)
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            cancelled = await info["manager"].status("r-queued")
            # No stop was asked of it: queued again (``_requeue``), it runs (it was `lost`).
            ran = await info["manager"].wait_terminal("r-never")
            events = {r: await info["manager"].events_after(r, 0) for r in ("r-queued", "r-never")}
            stop.set()
    assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "user")
    assert ran["state"] == "completed", ran
    # Each end has its terminal event, as on every other path (`logs`, `watch`, a subscriber).
    states = {r: [(e["seq"], e["data"]) for e in es if e["kind"] == "state"] for r, es in events.items()}
    assert states["r-queued"] == [
        (1, {"state": "queued"}),
        (2, {"state": "cancelled", "partial": False, "reason": "user"}),
    ], states
    assert cancelled["last_seq"] == 2
    assert [e["kind"] for e in events["r-never"]][:3] == ["state", "requeued", "state"], events["r-never"]
    assert [d["state"] for _, d in states["r-never"]] == ["queued", "starting", "running", "completed"], states


async def test_a_run_readopted_twice_has_each_of_its_events_journaled_once(tmp_path: Path) -> None:
    """SIGKILLed twice while one run goes on: each restarted daemon takes from the run's
    events file what its journal lacks, and only that (a second re-adoption journaled the
    file again: every text doubled in the session's history)."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir()
    flags = [shared / "go1", shared / "go2"]

    def gated(text: str, flag: Path) -> dict[str, Any]:
        command = f"while [ ! -e {flag} ]; do sleep 0.02; done; echo {text}"
        return {"text": text, "tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}

    spec = reading([gated("first", flags[0]), gated("second", flags[1])], shared)
    with trio.fail_after(90):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            await kill9(d1, c)
        flags[0].touch()  # on to its second step, with no daemon reading its pipe
        async with daemon(state, grace_s=5.0) as (d2, c):
            await wait_call_running(c, rid, "call_2_1")
            await kill9(d2, c)
        flags[1].touch()  # to its end, with no daemon again
        await wait_gone(runner, 30)
        async with daemon(state, grace_s=5.0) as (d3, c):
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid, after_seq=0))["events"]
    assert final["state"] == "completed", final
    texts = [e["data"]["text"] for e in events if e["kind"] == "assistant_text"]
    assert texts == ["first", "second", "done"], texts
    keys = [(e["kind"], e["ts"], json.dumps(e["data"], sort_keys=True)) for e in events]
    assert len(keys) == len(set(keys)), "an event journaled twice"


async def test_an_acknowledged_stop_whose_runner_died_while_the_daemon_was_down_is_cancelled(tmp_path: Path) -> None:
    """The stop was acknowledged (journaled), then the daemon and the runner died before
    the runner wrote a result: the run is what the live path records then, cancelled with
    its reason and its last snapshot, not `lost` with a cancel reason beside it."""
    state = tmp_path / "state"
    spec = command_spec("sleep 600", stop_policy={"run_command": "finish"})  # the runner waits for it
    with trio.fail_after(60):
        async with daemon(state, grace_s=30.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            assert (await c.call("cancel", run_id=rid))["was_active"] is True
            await kill9(d1, c)
        os.kill(runner, signal.SIGKILL)  # the runner this test's daemon started: no result
        await wait_gone(runner, 30)
        async with daemon(state, grace_s=30.0) as (d2, c):
            final = await c.call("status", run_id=rid)
    assert (final["state"], final["reason"], final["cancel_reason"]) == ("cancelled", "user", "user"), final
    assert final["partial"] is True
    (call,) = final["tool_calls"]
    assert call["state"] == "unknown"  # its outcome went with the runner


async def test_a_start_that_fails_after_finding_the_runs_again_leaves_them_for_the_next(tmp_path: Path) -> None:
    """The second daemon re-adopts the run, then a later step of its start fails: it
    exits, and the run is as it was (its runner alive, its row running), for the third
    daemon to re-adopt; it was ended on the way out, with no terminal fact."""
    state = tmp_path / "state"
    with trio.fail_after(120):
        async with daemon(state, grace_s=2.0) as (proc, c):
            run_id = (await c.call("spawn", spec=command_spec("sleep 600")))["run_id"]
            await c.wait_for(run_id, kind="process_group")
            runner = (await c.call("status", run_id=run_id))["pid"]
            await kill9(proc, c)
        pidfd = os.pidfd_open(runner)  # the runner, pinned: its pid is never reused under us
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AGENTD_RUNNER"))}
            env["AGENTD_TEST_FAIL_AT"] = "after_recovery"
            failing = await trio.run_process(
                [sys.executable, str(CHILDREN / "daemon_main.py"), str(state)],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            log = failing.stderr.decode(errors="replace")
            assert failing.stdout.decode().startswith("failing after recovery"), log[-3000:]
            assert failing.returncode != 0 and "re-adopted" in log, log[-3000:]
            assert psutil.Process(runner).status() != psutil.STATUS_ZOMBIE  # left running
            async with daemon(state, grace_s=2.0) as (_proc, c):
                st = await c.call("status", run_id=run_id)
                assert st["live"] is True and st["state"] == "running" and st["pid"] == runner, st
                await c.call("cancel", run_id=run_id)
                assert await c.wait_for(run_id) == "cancelled"
                st = await c.call("status", run_id=run_id)
            assert st["reason"] == "user", st
        finally:
            os.close(pidfd)


async def test_a_sigterm_during_the_start_stops_the_daemon_cleanly_once_started(tmp_path: Path) -> None:
    """SIGTERM while the restarted daemon finds its runs again: it had its default
    action (a death, the runs neither cancelled nor recorded); now the daemon finishes
    its start, then stops as at any other time: the run is cancelled and says so."""
    state = tmp_path / "state"
    with trio.fail_after(120):
        async with daemon(state, grace_s=2.0) as (proc, c):
            run_id = (await c.call("spawn", spec=command_spec("sleep 600")))["run_id"]
            await c.wait_for(run_id, kind="process_group")
            await kill9(proc, c)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AGENTD_RUNNER"))}
        env["AGENTD_TEST_HOLD_AT"] = "recovery"
        second = await trio.lowlevel.open_process(
            [sys.executable, str(CHILDREN / "daemon_main.py"), str(state)],
            env=env,
            stdout=-1,
            stderr=-1,
            start_new_session=True,
        )
        try:
            assert second.stdout is not None
            buf = b""
            while b"at recovery\n" not in buf:
                chunk = await second.stdout.receive_some()
                assert chunk, "the daemon exited before its recovery"
                buf += chunk
            second.send_signal(signal.SIGTERM)
            assert await second.wait() == 0
        finally:
            if second.returncode is None:
                second.kill()
                await second.wait()
        async with daemon(state, grace_s=2.0) as (_proc, c):
            st = await c.call("status", run_id=run_id)
    assert st["state"] == "cancelled" and st["reason"] == "shutdown", st
    # The runner's own result says whose stop it was: the daemon's, at its shutdown.
    result = st["result"]
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "shutdown"), result


async def test_a_sighup_stops_the_daemon_as_sigterm_does(tmp_path: Path) -> None:
    """A SIGHUP (a terminal closed, `systemctl kill -s HUP`) killed the daemon by its
    default action, without a word: its runs neither cancelled nor recorded, and systemd
    took the death for a clean exit."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with daemon(state, grace_s=2.0) as (proc, c):
            run_id = (await c.call("spawn", spec=command_spec("sleep 600")))["run_id"]
            await c.wait_for(run_id, kind="process_group")
            await c.ws.aclose()
            proc.send_signal(signal.SIGHUP)
            assert await proc.wait() == 0
        async with daemon(state, grace_s=2.0) as (_proc, c):
            st = await c.call("status", run_id=run_id)
    assert st["state"] == "cancelled" and st["reason"] == "shutdown", st
    # The runner's own result says whose stop it was: the daemon's, at its shutdown.
    result = st["result"]
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "shutdown"), result


async def test_a_readopted_run_cancelled_by_the_restarted_daemon_is_that_daemons_stop(tmp_path: Path) -> None:
    """The stop of a run a restarted daemon found again is this daemon's, a process the
    runner never knew: it marks the stop where the runner looks (the marker beside the
    run dir, which the runner opened before its sandbox), then signals. The runner's own
    result and its stop_requested event say it was the daemon's stop, with its reason."""
    state = tmp_path / "state"
    spec = command_spec("sleep 300")
    with trio.fail_after(60):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            await kill9(d1, c)
        async with daemon(state, grace_s=5.0) as (d2, c):
            assert (await c.call("cancel", run_id=rid))["was_active"] is True
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid, after_seq=0))["events"]
    assert (final["state"], final["reason"], final["cancel_reason"]) == ("cancelled", "user", "user"), final
    result = final["result"]
    assert (result["status"], result["reason"], result["stop_reason"]) == ("cancelled", "signal", "user"), result
    stops = [e["data"] for e in events if e["kind"] == "stop_requested"]
    assert [(s["reason"], s.get("stop_reason")) for s in stops] == [("signal", "user")], stops
    (call,) = final["tool_calls"]
    assert (call["state"], call["stop_effect"]) == ("cancelled", "interrupted"), call


async def test_a_reason_a_killed_daemon_left_in_the_marker_is_no_stop_of_the_next(tmp_path: Path) -> None:
    """A daemon SIGKILLed between its marker write and its signal (or before it recorded
    the stop) left a reason in the marker that no stop stands behind. The daemon that
    re-adopts the run, with no stop to resume, empties it: a later SIGTERM nobody's stop
    sent is the run's failure (``signalled``), not a user's cancel."""
    state = tmp_path / "state"
    spec = command_spec("sleep 300")
    with trio.fail_after(60):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            (marker,) = (state / "runs").glob("*.stop")  # this test's only run
            marker.write_text("user\n")  # the dead daemon's write, its signal never sent
            await kill9(d1, c)
        pidfd = os.pidfd_open(runner)  # the runner this test's daemon started, pinned
        try:
            async with daemon(state, grace_s=5.0) as (_d2, c):
                st = await c.call("status", run_id=rid)
                assert st["live"] is True and st["pid"] == runner, st
                assert marker.read_text() == ""
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)  # nobody's stop
                assert await c.wait_for(rid) == "failed"
                final = await c.call("status", run_id=rid)
        finally:
            os.close(pidfd)
    assert (final["state"], final["reason"]) == ("failed", "signalled"), final
    assert final["cancel_reason"] is None, final
    result = final["result"]
    assert (result["status"], result["reason"]) == ("failed", "signalled"), result


async def test_a_steer_sent_before_a_crash_and_never_read_is_reported_at_the_runs_end(tmp_path: Path) -> None:
    """A steer the daemon wrote to the runner's input, which the runner never read: the
    daemon that would have said so at the run's end was SIGKILLed, and what it had sent
    was in its memory only. The next daemon takes it from the journal: the run (its
    runner gone without a result) is lost, and the steer is reported unapplied, unread."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            pidfd = os.pidfd_open(runner)  # the runner this test's daemon started, pinned
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGSTOP)  # it reads nothing more
                assert (await c.call("steer", run_id=rid, text="also check the logs"))["accepted"] is True
                await kill9(d1, c)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # gone without reading it
                await wait_gone(runner, 10)
            finally:
                os.close(pidfd)
        async with daemon(state, grace_s=5.0) as (_d2, c):
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid, after_seq=0))["events"]
    assert final["state"] == "lost", final
    steering = [e["data"] for e in events if e["kind"] == "steering"]
    assert steering == [{"state": "unapplied", "text": "also check the logs", "step": None, "unread": True}], steering


async def test_a_steer_read_before_a_crash_and_never_applied_is_reported_at_the_runs_end(tmp_path: Path) -> None:
    """A steer the runner read (``queued``) while its command ran, then the daemon and the
    runner died before it was applied or the runner wrote a result: the next daemon finds
    the run lost, and the steer, read and never applied, reported unapplied (it was
    neither before: the client was told it was accepted, and that was all)."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await wait_call_running(c, rid, "call_1_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            assert (await c.call("steer", run_id=rid, text="also check the logs"))["accepted"] is True
            assert await c.wait_for(rid, kind="steering") is None  # read: queued
            await kill9(d1, c)
        os.kill(runner, signal.SIGKILL)  # the runner this test's daemon started: no result
        await wait_gone(runner, 30)
        async with daemon(state, grace_s=5.0) as (_d2, c):
            final = await c.call("status", run_id=rid)
            events = (await c.call("events", run_id=rid, after_seq=0))["events"]
    assert (final["state"], final["partial"]) == ("lost", True), final
    steering = [e["data"] for e in events if e["kind"] == "steering"]
    assert [s["state"] for s in steering] == ["queued", "unapplied"], steering
    assert steering[1] == {"state": "unapplied", "text": "also check the logs", "step": None}
    assert final["result"]["unapplied_steering"] == ["also check the logs"]
