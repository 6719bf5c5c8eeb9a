"""Acceptance: a Stop pressed while no daemon runs is recorded and applied by the next one.

Real daemon processes (``tests/children/daemon_main.py``) on one state dir, the real
runner with the scripted model busy in a long command, a real SQLite file, a real
websocket and the real CLI (a subprocess). The first daemon is SIGKILLed; its runner goes
on; ``agentd cancel`` finds no daemon, records the stop (exit 10) and the next daemon
applies it before the run goes on. A note that is not one never takes a daemon down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.cli import ExitCode
from supervisor.control._pendingstops import DIR
from tests.supervisor.real_daemon import real_daemon
from tests.supervisor.test_containment import exited
from tests.supervisor.test_restart import Client
from tests.supervisor.test_restart_spawn import ENV as SPARE_ENV
from tests.supervisor.test_restart_spawn import spare_ready, spawn_and_kill
from tests.supervisor.test_restart_stop import command_spec, kill9, wait_gone
from tests.supervisor.test_restart_stop import daemon as restart_stop_daemon

ROOT = Path(__file__).resolve().parent.parent.parent


def daemon(state_dir: Path, log: Path) -> AbstractAsyncContextManager[tuple[trio.Process, Client]]:
    """A real daemon with the real runner (``test_restart_stop.daemon``), its log in ``log``."""
    return restart_stop_daemon(state_dir, grace_s=5, log=log)


async def agentd(state: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The real CLI, as a person runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return await trio.run_process(
        [sys.executable, "-m", "supervisor", "--state-dir", str(state), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )


def command_pid(status: dict[str, Any]) -> int:
    (group,) = [g for g in status["groups"] if g["kind"] == "command" and g["alive"]]
    return int(group["pgid"])  # the command's shell leads its own group


async def test_a_stop_pressed_while_no_daemon_runs_is_applied_by_the_next_daemon_before_the_run_goes_on(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"
    with trio.fail_after(90):
        async with daemon(state, log) as (d1, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await c.wait_for(rid, kind="process_group")  # the command runs
            before = await c.call("status", run_id=rid)
            runner, command = before["pid"], command_pid(before)
            await kill9(d1, c)
        assert psutil.pid_exists(runner) and psutil.pid_exists(command)  # the run goes on

        pressed = await agentd(state, "cancel", rid)
        stderr = pressed.stderr.decode()
        assert pressed.returncode == ExitCode.STOP_PENDING, (pressed.returncode, stderr)
        assert "not delivered now" in stderr and "applies it when it starts" in stderr, stderr
        assert pressed.stdout.decode().strip() == f"{rid}: stop recorded, not delivered (no daemon)"
        as_json = await agentd(state, "--json", "cancel", "--no-wait", rid)
        assert as_json.returncode == ExitCode.STOP_PENDING, as_json.stderr
        reply = json.loads(as_json.stdout)
        assert (reply["run_id"], reply["delivered"], reply["pending"], reply["reason"]) == (rid, False, True, "user")
        notes = sorted((state / DIR).iterdir())
        assert len(notes) == 2 and str(notes[0]) in stderr and str(notes[1]) == reply["pending_stop"]
        assert oct((state / DIR).stat().st_mode & 0o777) == oct(0o700)
        assert all(n.stat().st_mode & 0o777 == 0o600 for n in notes)
        assert psutil.pid_exists(command)  # recorded, not applied: no process was signalled

        async with daemon(state, log) as (d2, c):
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
        await wait_gone(runner, 10)
        await wait_gone(command, 10)
    assert (final["state"], final["reason"], final["cancel_reason"]) == ("cancelled", "user", "user"), final
    carried = final["receipt"]["stop_carried"]
    assert carried["by"] == "pending-stop" and carried["note"] == notes[0].name, carried
    assert carried["pressed_at"] <= final["cancel_requested_at"]
    (call,) = final["tool_calls"]
    assert (call["state"], call["stop_effect"]) == ("cancelled", "interrupted"), call
    assert list((state / DIR).iterdir()) == []  # applied, removed
    text = log.read_text(errors="replace")
    assert f"run {rid}: a stop (user) pressed while no daemon ran" in text, text[-3000:]


async def test_a_note_that_is_not_one_is_set_aside_and_the_daemon_and_its_other_runs_go_on(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"
    with trio.fail_after(90):
        async with daemon(state, log) as (d1, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300"), session_id="s1"))["run_id"]
            await c.wait_for(rid, kind="process_group")
            before = await c.call("status", run_id=rid)
            runner, command = before["pid"], command_pid(before)
            await kill9(d1, c)
        notes = state / DIR
        notes.mkdir(mode=0o700, exist_ok=True)  # (the first daemon made it)
        (notes / "1-1.stop").write_bytes(b"\x00{not json")
        (notes / "2-1.stop").write_text(json.dumps({"run_id": rid, "reason": "user", "at": "x" * 9000}))
        (notes / "3-1.stop").symlink_to("/dev/zero")
        (notes / "4-1.stop").write_text(json.dumps({"run_id": rid, "session_id": "s1", "reason": "u", "at": 1.0}))
        # Valid, but naming nothing live: an unknown run, and a session's turn before this one.
        unknown = {"run_id": "r-nobody", "reason": "user", "at": time.time(), "cli_pid": 1}
        (notes / "5-1.stop").write_text(json.dumps(unknown))
        earlier = {"session_id": "s1", "reason": "user", "at": before["created_at"] - 60}
        (notes / "6-1.stop").write_text(json.dumps(earlier))

        async with daemon(state, log) as (d2, c):
            st = await c.call("status", run_id=rid)
            assert st["state"] == "running" and st["cancel_reason"] is None, st  # not stopped
            assert psutil.pid_exists(command)
            assert sorted(p.name for p in notes.iterdir()) == [
                "1-1.stop.bad",
                "2-1.stop.bad",
                "3-1.stop.bad",
                "4-1.stop.bad",
            ]
            reply = await c.call("cancel", run_id=rid)  # the test's own end of it
            assert reply["was_active"] is True
            assert await c.wait_for(rid) == "cancelled"
        await wait_gone(runner, 10)
        await wait_gone(command, 10)
    text = log.read_text(errors="replace")
    for name in ("1-1.stop", "2-1.stop", "3-1.stop", "4-1.stop"):
        assert f"{name} is not one" in text, text[-3000:]
    assert "pending stop for run r-nobody, pressed while no daemon ran: ignored" in text
    assert "pending stop for session s1, pressed while no daemon ran: ignored" in text
    assert "Traceback" not in text


async def test_a_daemon_that_runs_but_cannot_be_reached_is_handed_the_stop_as_a_note(tmp_path: Path) -> None:
    # Its token file truncated (as a person or a tool may): the CLI cannot reach it. A note
    # written then ("no daemon", exit 10) waited for that daemon's next start while the
    # run went on; then the CLI refused (exit 3, "not delivered, nor recorded") and the run
    # still went on. Now the CLI sees the daemon's lock and hands it the stop as a note,
    # which the running daemon's watch applies: the run ends, the CLI says the note was taken.
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"
    with trio.fail_after(90):
        async with daemon(state, log) as (d, c):
            rid = (await c.call("spawn", spec=command_spec("sleep 300")))["run_id"]
            await c.wait_for(rid, kind="process_group")
            token = (state / "token").read_bytes()
            (state / "token").write_bytes(b"")
            pressed = await agentd(state, "cancel", rid)
            stderr = pressed.stderr.decode()
            assert pressed.returncode == ExitCode.STOP_PENDING, (pressed.returncode, stderr)
            assert f"a daemon (pid {d.pid}) holds the state dir and cannot be reached" in stderr, stderr
            assert "which it took (applied and removed)" in stderr, stderr
            assert list((state / DIR).iterdir()) == []  # taken
            assert await c.wait_for(rid) == "cancelled"
            st = await c.call("status", run_id=rid)
            assert st["cancel_reason"] == "user", st
            assert st["receipt"]["stop_carried"]["by"] == "pending-stop", st["receipt"]
            (state / "token").write_bytes(token)
            pressed = await agentd(state, "cancel", rid)
            assert pressed.returncode == ExitCode.RUN_CANCELLED, pressed.stderr
        assert list((state / DIR).iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")
async def test_a_note_for_a_run_still_starting_at_the_kill_ends_it_cancelled_not_lost(tmp_path: Path) -> None:
    # Its start journaled, its runner (the zygote's spare) never let go: the spare exits at
    # the hang-up, having done nothing. A queued run with a note ended `cancelled`; this
    # one ended `lost` and its note was logged "ignored, it has ended (lost)": the stop a
    # person pressed left no trace on the run.
    state, marker = tmp_path / "state", tmp_path / "ran"
    with trio.fail_after(120):
        async with real_daemon(state, env={**SPARE_ENV, "AGENTD_TEST_HOLD_AT": "spare_go"}) as d1:
            async with d1.connect() as c:
                spare = await spare_ready(c)
                rid = await spawn_and_kill(c, d1, f"touch {marker}")
        pressed = await agentd(state, "cancel", "--no-wait", rid)
        assert pressed.returncode == ExitCode.STOP_PENDING, pressed.stderr
        (note,) = (state / DIR).iterdir()
        await exited(spare, timeout_s=10)
        async with real_daemon(state, env=SPARE_ENV) as d2, d2.connect() as c:
            st = await c.ok("status", run_id=rid)
            events = (await c.ok("events", run_id=rid, after_seq=0))["events"]
            assert (await c.ok("status"))["live_runs"] == []
            log = d2.log_text()
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", "user", "user"), st
    carried = st["receipt"]["stop_carried"]
    assert (carried["by"], carried["note"]) == ("pending-stop", note.name), carried
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert states == ["queued", "starting", "cancelled"], states
    assert not marker.exists()  # its command never ran
    assert not (state / DIR).exists() or list((state / DIR).iterdir()) == []
    assert "ignored" not in log, log[-3000:]
