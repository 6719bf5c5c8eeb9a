"""Acceptance: the daemon is SIGKILLed with runs live, then restarted.

Real daemon processes on one state dir, a real SQLite file, real runner trees and a real
websocket. Terminal runs stay as they were; a live run whose runner is still there (same
pid and start time) is re-adopted and can still be cancelled; a live run whose runner
died meanwhile is marked lost with its last partial result; nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import trio
from trio_websocket import open_websocket_url

CHILDREN = Path(__file__).parent.parent / "children"
FAKE = f"{sys.executable} {CHILDREN / 'fake_runner.py'}"


class Client:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.n = 0

    async def call(self, op: str, **args: Any) -> Any:
        self.n += 1
        await self.ws.send_message(json.dumps({"id": self.n, "op": op, **args}))
        while True:
            msg = json.loads(await self.ws.get_message())
            if msg.get("id") == self.n:
                assert msg["ok"], msg
                return msg["result"]

    async def wait_for(self, run_id: str, *, kind: str | None = None, count: int = 1) -> str | None:
        """Subscribe from the start; return at the count-th ``kind`` event, or at the end."""
        await self.call("subscribe", run_id=run_id, after_seq=0)
        seen = 0
        while True:
            msg = json.loads(await self.ws.get_message())
            if msg.get("op") == "event" and msg["run_id"] == run_id and msg["kind"] == kind:
                seen += 1
                if seen >= count:
                    await self.call("unsubscribe", sub=msg["sub"])
                    return None
            if msg.get("op") == "end" and msg["run_id"] == run_id:
                return msg["state"]


@asynccontextmanager
async def daemon(state_dir: Path, env: dict[str, str] | None = None) -> AsyncIterator[tuple[trio.Process, Client]]:
    """A daemon process on ``state_dir``; its runner is the fake one unless ``env`` is given."""
    env = dict(os.environ, AGENTD_RUNNER_COMMAND=FAKE, AGENTD_GRACE_S="1") if env is None else env
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(CHILDREN / "daemon_main.py"), str(state_dir)],
        stdout=-1,
        env=env,
        start_new_session=True,
    )
    try:
        buf = b""
        assert proc.stdout is not None
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some()
            assert chunk, "daemon exited before it served"
            buf += chunk
        info = json.loads(buf.split(b"\n")[0])
        headers = [(b"authorization", f"Bearer {info['token']}".encode())]
        async with open_websocket_url(info["url"], extra_headers=headers) as ws:
            yield proc, Client(ws)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_restart_keeps_terminal_runs_readopts_live_ones_and_loses_the_gone(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with trio.fail_after(40):
        async with daemon(state) as (d1, c):
            done = (await c.call("spawn", spec={"task": json.dumps({"wait": False})}))["run_id"]
            assert await c.wait_for(done) == "completed"
            before = await c.call("status", run_id=done)
            alive = (await c.call("spawn", spec={"task": json.dumps({"snapshots": 2})}))["run_id"]
            await c.wait_for(alive, kind="step_snapshot", count=2)
            gone = (await c.call("spawn", spec={"task": json.dumps({"snapshots": 1})}))["run_id"]
            await c.wait_for(gone, kind="step_snapshot")
            alive_pid = (await c.call("status", run_id=alive))["pid"]
            gone_pid = (await c.call("status", run_id=gone))["pid"]
            await c.ws.aclose()
            d1.kill()  # SIGKILL: no cleanup at all
            await d1.wait()
        assert psutil.pid_exists(alive_pid)
        os.kill(gone_pid, signal.SIGKILL)  # its runner dies while no daemon watches

        async with daemon(state) as (d2, c):
            after = await c.call("status", run_id=done)
            assert after["state"] == "completed"
            assert after["result"] == before["result"] and after["ended_at"] == before["ended_at"]

            lost = await c.call("status", run_id=gone)
            assert lost["state"] == "lost"
            assert lost["partial"] is True
            assert lost["result"]["progress"] == "step 1 done. "

            adopted = await c.call("status", run_id=alive)
            assert adopted["state"] == "running" and adopted["live"] is True
            reply = await c.call("cancel", run_id=alive)
            assert reply["was_active"] is True
            assert await c.wait_for(alive) == "cancelled"
            final = await c.call("status", run_id=alive)
            assert final["partial"] is True
            assert final["result"]["progress"] == "step 1 done. step 2 done. "
            await c.ws.aclose()
            d2.send_signal(signal.SIGTERM)
            await d2.wait()
            assert d2.returncode == 0
    assert not psutil.pid_exists(alive_pid) or psutil.Process(alive_pid).status() == psutil.STATUS_ZOMBIE
