"""A real daemon process for fault tests: ``tests/children/daemon_main.py`` and a raw client.

``async with real_daemon(state_dir, env=...) as d`` starts it (stdout: its info line;
stderr: its log, kept in ``d.log``), ``d.connect()`` opens an authenticated websocket,
and the exit stops it with SIGTERM (SIGKILL after a bound). The client sends any frame,
raw strings included, and tells replies from pushed messages.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

CHILDREN = Path(__file__).parent.parent / "children"
ROOT = Path(__file__).parent.parent.parent
FAKE_RUNNER = f"{sys.executable} {CHILDREN / 'fake_runner.py'}"
WAIT_S = 10.0
STOP_S = 15.0


def strict_loads(text: str | bytes) -> Any:
    """json.loads that refuses what JSON does not have (NaN, Infinity)."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not json")

    return json.loads(text, parse_constant=refuse)


class Client:
    """Numbered requests; replies matched by id, pushed messages kept apart."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.n = 0
        self.pushed: list[dict[str, Any]] = []

    async def send_raw(self, frame: str | bytes) -> None:
        await self.ws.send_message(frame)

    async def next_reply(self) -> dict[str, Any]:
        """The next message that is a reply (not an event or end push)."""
        with trio.fail_after(WAIT_S):
            while True:
                msg = strict_loads(await self.ws.get_message())
                assert isinstance(msg, dict), msg
                if msg.get("op") in ("event", "end") and "ok" not in msg:
                    self.pushed.append(msg)
                    continue
                return msg

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.n += 1
        rid = f"c{self.n}"
        await self.ws.send_message(json.dumps({"id": rid, "op": op, **args}))
        with trio.fail_after(WAIT_S):
            while True:
                msg = await self.next_reply()
                if msg.get("id") == rid:
                    return msg

    async def ok(self, op: str, **args: Any) -> Any:
        reply = await self.call(op, **args)
        assert reply["ok"] is True, reply
        return reply["result"]

    async def wait_for(
        self, run_id: str, pred: Callable[[dict[str, Any]], bool], timeout_s: float = WAIT_S
    ) -> dict[str, Any]:
        """Subscribe from the start; return the first pushed message ``pred`` accepts,
        or the subscription's ``end``."""
        sub = (await self.ok("subscribe", run_id=run_id, after_seq=0))["sub"]
        with trio.fail_after(timeout_s):
            while True:
                for msg in self.pushed:
                    if msg.get("sub") == sub and (msg["op"] == "end" or pred(msg)):
                        self.pushed = [m for m in self.pushed if m.get("sub") != sub]
                        if msg["op"] != "end":
                            await self.ok("unsubscribe", sub=sub)
                        return msg
                msg = strict_loads(await self.ws.get_message())
                if msg.get("op") in ("event", "end") and "ok" not in msg:
                    self.pushed.append(msg)

    async def wait_kind(self, run_id: str, kind: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
        return await self.wait_for(run_id, lambda m: m.get("kind") == kind, timeout_s)

    async def wait_end(self, run_id: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The run's ``end`` (its terminal state in ``["state"]``)."""
        return await self.wait_for(run_id, lambda m: False, timeout_s)


class Daemon:
    def __init__(self, proc: trio.Process, info: dict[str, Any], log: Path) -> None:
        self.proc = proc
        self.info = info
        self.url: str = info["url"]
        self.token: str = info["token"]
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", f"Bearer {self.token}".encode())]

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Client]:
        async with open_websocket_url(
            self.url, extra_headers=self.headers(), max_message_size=64 * 1024 * 1024, connect_timeout=WAIT_S
        ) as ws:
            yield Client(ws)

    def alive(self) -> bool:
        return self.proc.returncode is None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@asynccontextmanager
async def real_daemon(
    state_dir: Path,
    *,
    env: dict[str, str] | None = None,
    argv_prefix: Sequence[str] = (),
    preexec_fn: Callable[[], None] | None = None,
) -> AsyncIterator[Daemon]:
    """A daemon on ``state_dir`` with the fake runner (unless ``env`` says otherwise)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir.parent / f"{state_dir.name}.daemon.log"
    full_env = dict(
        os.environ,
        AGENTD_RUNNER_COMMAND=FAKE_RUNNER,
        AGENTD_GRACE_S="1",
        PYTHONPATH=str(ROOT),
    )
    full_env.update(env or {})
    with open(log, "wb") as log_file:
        proc = await trio.lowlevel.open_process(
            [*argv_prefix, sys.executable, str(CHILDREN / "daemon_main.py"), str(state_dir)],
            stdout=-1,
            stderr=log_file,
            env=full_env,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    try:
        buf = b""
        assert proc.stdout is not None
        with trio.fail_after(30):
            while b"\n" not in buf:
                chunk = await proc.stdout.receive_some()
                assert chunk, f"daemon exited before it served: {log.read_text(errors='replace')[-3000:]}"
                buf += chunk
        yield Daemon(proc, json.loads(buf.split(b"\n")[0]), log)
    finally:
        with trio.CancelScope(shield=True):
            await stop_daemon(proc)


async def stop_daemon(proc: trio.Process) -> None:
    if proc.returncode is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        with trio.move_on_after(STOP_S):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.stdout is not None:
        await proc.stdout.aclose()
