"""Group escalation and the marker sweep, on real processes (OS facts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import psutil
import trio

from subagent import groups
from subagent.groups import group_alive, sweep_marked, terminate_group

IGNORE_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


async def _start(code: str, *, new_session: bool = True, **kw: object) -> trio.Process:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=new_session, **kw  # type: ignore[arg-type]
    )
    assert proc.stdout is not None
    with trio.fail_after(10):
        assert (await proc.stdout.receive_some(100)).startswith(b"ready")
    return proc


async def test_terminate_group_ends_a_cooperative_group_with_sigterm() -> None:
    proc = await _start("import time; print('ready', flush=True); time.sleep(600)")
    assert group_alive(proc.pid)
    with trio.fail_after(5):
        # The leader is our child: reap it as it dies so it does not linger as a zombie.
        async with trio.open_nursery() as n:
            n.start_soon(proc.wait)
            assert await terminate_group(proc.pid, grace_s=3)
    assert proc.returncode == -signal.SIGTERM
    assert not group_alive(proc.pid)


async def test_terminate_group_escalates_to_sigkill_after_the_grace(monkeypatch: object, caplog: object) -> None:
    proc = await _start(IGNORE_TERM)
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        t0 = trio.current_time()
        assert await terminate_group(proc.pid, grace_s=0.3, reap_s=3)
        assert trio.current_time() - t0 >= 0.3
    assert proc.returncode == -signal.SIGKILL


async def test_a_zombie_member_does_not_count_as_alive() -> None:
    # The leader exits but is not reaped yet: the group "exists" for killpg, yet is dead.
    proc = await trio.lowlevel.open_process([sys.executable, "-c", "pass"], start_new_session=True)
    with trio.fail_after(10):
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            await trio.sleep(0.01)
    assert not group_alive(proc.pid)
    await proc.wait()


async def test_terminate_group_on_a_gone_group_returns_at_once() -> None:
    proc = await trio.lowlevel.open_process([sys.executable, "-c", "pass"], start_new_session=True)
    await proc.wait()
    with trio.fail_after(1):
        assert await terminate_group(proc.pid)


async def test_sweep_marked_finds_a_setsid_escaper_by_its_environment() -> None:
    value = uuid.uuid4().hex
    env = dict(os.environ, AGENTD_SWEEP_TEST=value)
    code = "import os, time; os.setsid(); print('ready', flush=True); time.sleep(600)"
    proc = await _start(code, new_session=False, env=env)  # it makes its own session
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        with trio.fail_after(10):
            left = await sweep_marked("AGENTD_SWEEP_TEST", value, grace_s=2)
    assert left == []
    assert proc.returncode == -signal.SIGTERM


async def test_sweep_marked_kills_what_ignores_sigterm(monkeypatch: object) -> None:
    value = uuid.uuid4().hex
    proc = await _start(IGNORE_TERM, env=dict(os.environ, AGENTD_SWEEP_TEST=value))
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        with trio.fail_after(10):
            assert await sweep_marked("AGENTD_SWEEP_TEST", value, grace_s=0.2) == []
    assert proc.returncode == -signal.SIGKILL


def test_group_constants_are_named_with_units() -> None:
    assert groups.GROUP_TERM_GRACE_S > 0 and groups.GROUP_KILL_REAP_S > 0
