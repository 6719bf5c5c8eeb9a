"""Acceptance: a daemon SIGKILLed at the spawn path's boundary, between the commit that
makes a run's start durable (``starting``, its event, its deadline and the spare's process
record, one transaction) and the spare's ``go``.

Real daemon processes (``tests/children/daemon_main.py``, held there by its
``AGENTD_TEST_HOLD_AT`` fault injection, then SIGKILLed) on one state dir, the zygote's real spare runner with the scripted model, a real
SQLite file and a real websocket. The spare was never let go: it exits at the hang-up
having done nothing of the run. The restarted daemon ends that run ``lost``, naming why,
and never starts it (nor any other runner for it): no step, no tool call, no process left.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.core._lifecycle import STARTING_LOST
from tests.supervisor.real_daemon import Client, Daemon, real_daemon
from tests.supervisor.test_containment import exited

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")

# The real runner (the zygote needs it), one spare, no warm pool.
ENV = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_ZYGOTE_SPARES": "1", "AGENTD_POOL_SIZE": "0"}


def spec(command: str) -> dict[str, Any]:
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}], "final": "done"}
    return {"task": "t", "model": {"provider": "scripted", "script": script}}


async def spare_ready(c: Client) -> int:
    """The pid of the spare the zygote keeps ready."""
    with trio.fail_after(60):
        while True:
            pids = (await c.ok("status"))["summary"]["zygote"]["spares"]["pids"]
            if pids:
                return int(pids[0])
            await trio.sleep(0.02)


async def spawn_and_kill(
    c: Client, d: Daemon, command: str, *, at: bytes = b"at spare_go\n", before_kill: Any = None
) -> str:
    """Spawn; once the daemon holds at the spare's ``go`` (the run's start journaled, the
    spare waiting at its gate), SIGKILL it. The run's id (its spawn was acknowledged)."""
    run_id = str((await c.ok("spawn", spec=spec(command)))["run_id"])
    assert d.proc.stdout is not None
    buf = b""
    with trio.fail_after(30):
        while at not in buf:
            chunk = await d.proc.stdout.receive_some()
            assert chunk, f"the daemon exited: {d.log_text()[-3000:]}"
            buf += chunk
    if before_kill is not None:
        await before_kill()
    await c.ws.aclose()
    d.proc.kill()  # SIGKILL: no cleanup at all
    await d.proc.wait()
    return run_id


async def the_run(c: Client, acknowledged: str) -> dict[str, Any]:
    (row,) = (await c.ok("list"))["runs"]
    assert row["id"] == acknowledged  # an acknowledged spawn is never lost
    return dict(await c.ok("status", run_id=acknowledged))


async def assert_never_started(c: Client, st: dict[str, Any], spare: int, marker: Path) -> None:
    assert st["state"] == "lost" and st["reason"] == STARTING_LOST, st
    assert st["pid"] == spare  # the process record named the spare, durably, before `go`
    assert st["tool_calls"] == []
    events = (await c.ok("events", run_id=st["id"], after_seq=0))["events"]
    kinds = [e["kind"] for e in events]
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert "step_started" not in kinds and "tool_call" not in kinds, kinds
    assert states[:2] == ["queued", "starting"] and states[-1] == "lost", states
    assert not marker.exists()  # its command never ran, here or anywhere
    assert (await c.ok("status"))["live_runs"] == []


async def test_a_spare_never_let_go_leaves_its_run_lost_not_started_twice(tmp_path: Path) -> None:
    state, marker = tmp_path / "state", tmp_path / "ran"
    with trio.fail_after(120):
        async with real_daemon(state, env={**ENV, "AGENTD_TEST_HOLD_AT": "spare_go"}) as d1:
            async with d1.connect() as c:
                spare = await spare_ready(c)
                acknowledged = await spawn_and_kill(c, d1, f"touch {marker}")
        await exited(spare, timeout_s=10)  # it exits at the hang-up: its run was never let go
        async with real_daemon(state, env=ENV) as d2, d2.connect() as c:
            st = await the_run(c, acknowledged)
            assert st["live"] is False and st["run_dir"] is not None
            assert not Path(st["run_dir"]).exists()  # its tree's leftovers removed
            await assert_never_started(c, st, spare, marker)


async def test_a_spare_found_alive_at_its_gate_is_readopted_and_its_run_ends_lost(tmp_path: Path) -> None:
    """The restarted daemon finds the spare still alive (held stopped at its gate): it
    re-adopts it as the run's runner; let go of the stop, it exits at the old daemon's
    hang-up without a result, and the run ends ``lost`` all the same."""
    state, marker = tmp_path / "state", tmp_path / "ran"
    with trio.fail_after(120):
        async with real_daemon(state, env={**ENV, "AGENTD_TEST_HOLD_AT": "spare_go_stopped"}) as d1:
            async with d1.connect() as c:
                spare = await spare_ready(c)
                held = os.pidfd_open(spare)  # signalled by pidfd: never a reused pid
                acknowledged = await spawn_and_kill(c, d1, f"touch {marker}")
        try:
            async with real_daemon(state, env=ENV) as d2, d2.connect() as c:
                st = await the_run(c, acknowledged)
                assert st["live"] is True and st["state"] == "starting" and st["pid"] == spare  # re-adopted
                signal.pidfd_send_signal(held, signal.SIGCONT)
                end = await c.wait_end(st["id"])
                assert end["op"] == "end"
                await assert_never_started(c, await c.ok("status", run_id=st["id"]), spare, marker)
        finally:
            try:
                signal.pidfd_send_signal(held, signal.SIGCONT)  # never left stopped, whatever failed
            except ProcessLookupError:
                pass
            os.close(held)


async def test_a_run_whose_start_event_died_with_the_daemon_is_what_its_result_says(tmp_path: Path) -> None:
    """The spare got its ``go`` and ran its run to the end while the daemon held before
    reading any of its events (its ``runner_started`` died in the pipe with the daemon):
    the journal still says ``starting``. The restarted daemon takes its result: completed
    (running first), not a run stuck in ``starting`` or one that "did nothing"."""
    state = tmp_path / "state"
    with trio.fail_after(120):
        async with real_daemon(state, env={**ENV, "AGENTD_TEST_HOLD_AT": "spare_let_go"}) as d1:
            async with d1.connect() as c:
                spare = await spare_ready(c)

                async def run_ended() -> None:
                    await exited(spare, timeout_s=30)  # its result written; its events in the pipe

                acknowledged = await spawn_and_kill(
                    c, d1, "echo it ran", at=b"at spare_let_go\n", before_kill=run_ended
                )
        async with real_daemon(state, env=ENV) as d2, d2.connect() as c:
            st = await the_run(c, acknowledged)
            events = (await c.ok("events", run_id=acknowledged, after_seq=0))["events"]
    assert (st["state"], st["live"]) == ("completed", False), st
    assert st["result"]["final_text"] == "done"
    (call,) = st["tool_calls"]
    assert call["state"] == "succeeded" and "it ran" in call["output"]
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert states == ["queued", "starting", "running", "completed"], states


NEVER_STARTED = "the daemon restarted before the run's process started"  # recovery.py


def runner_of(daemon_pid: int) -> tuple[int, str]:
    """The pid of the runner the daemon ``daemon_pid`` started (its child carrying an
    ``AGENTD_RUN_ID``: this test's one run) and that run id."""
    for child in psutil.Process(daemon_pid).children():
        try:
            with open(f"/proc/{child.pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(b"AGENTD_RUN_ID="):
                return child.pid, var.split(b"=", 1)[1].decode()
    raise AssertionError(f"no child of the daemon {daemon_pid} carries AGENTD_RUN_ID")


async def test_a_runner_gets_its_spec_only_once_its_process_record_is_journaled(tmp_path: Path) -> None:
    """A runner the spawn starts (no spare: the zygote off, no warm pool) is fed its spec
    only once its process record is in the journal. A daemon SIGKILLed while that write
    is under way leaves a runner that never had its spec: it exits at the hang-up, having
    done nothing. (It used to have its spec at once: it ran its command, unsupervised,
    while the next daemon recorded its run `lost` and removed its directory.)"""
    state, marker = tmp_path / "state", tmp_path / "ran"
    cold = {**ENV, "AGENTD_ZYGOTE": "off"}
    with trio.fail_after(120):
        async with real_daemon(state, env={**cold, "AGENTD_TEST_HOLD_AT": "process_record"}) as d1:
            async with d1.connect() as c:
                found: list[tuple[int, str]] = []

                async def find_runner() -> None:
                    # Before the kill: at the hang-up it exits at once, having no spec
                    # (looked for after the kill, it was gone: seen once in CI).
                    found.append(runner_of(d1.proc.pid))

                acknowledged = await spawn_and_kill(
                    c, d1, f"touch {marker}; exec sleep 300", at=b"at process_record\n", before_kill=find_runner
                )
                ((runner, its_run),) = found
                assert its_run == acknowledged
        await exited(runner, timeout_s=20)  # at the hang-up: it never had a run to run
        assert not marker.exists()
        async with real_daemon(state, env=cold) as d2, d2.connect() as c:
            st = await the_run(c, acknowledged)
            assert st["state"] == "lost" and st["reason"] == NEVER_STARTED, st
            assert st["tool_calls"] == [] and not marker.exists()
            assert (await c.ok("status"))["live_runs"] == []
