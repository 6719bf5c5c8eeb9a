"""Fuzz the control socket of a real daemon: no frame earns ``internal`` or a dropped connection.

Hypothesis writes at least 2,000 frames (random requests with random arguments, specs
with absurd numbers and shapes, ids of every kind, broken JSON, lone surrogate escapes,
deep nesting, binary frames), among them the cases once reported to kill the daemon or a
connection. They go over several authenticated connections at once. Every frame gets one
reply that is strict JSON and not ``internal``, no connection is closed, the daemon stays
up, and a run spawned before the fuzz is still running afterwards and then ends normally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import WebSocketConnection, open_websocket_url

from subagent.osedge import run_trio
from supervisor.protocol import Op
from tests.supervisor.real_daemon import CHILDREN, FAKE_RUNNER, ROOT, strict_loads

CONNECTIONS = 4
EXAMPLES = 500  # of 5 to 8 frames each: at least 2,500 frames
REPLY_S = 10.0


@dataclass
class Target:
    url: str
    token: str

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", f"Bearer {self.token}".encode())]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Target]]:
    env = dict(
        os.environ,
        AGENTD_RUNNER_COMMAND=FAKE_RUNNER,
        AGENTD_GRACE_S="0.5",
        AGENTD_DEFAULT_TIMEOUT_S="2",  # a fuzzed spawn that is valid ends on its own
        PYTHONPATH=str(ROOT),
    )
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(CHILDREN / "daemon_main.py"), str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        yield proc, Target(info["url"], info["token"])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()


# ----------------------------------------------------------------------------- frames

OPS = [str(op) for op in Op]
ARGS = ["run_id", "session_id", "reason", "text", "spec", "timeout_s", "limit", "after_seq", "state", "sub"]
leaves = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: 310 digits is as likely a shape as 3
    | st.floats()  # NaN and infinities included
    | st.text(max_size=12)
    | st.sampled_from(["r-0000000000000000", "", "   ", "queued", "running", "1"])
)
values = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=12,
)
numbers = st.integers() | st.floats() | st.sampled_from([10**300, 2**63, -(2**63) - 1, 1e300, 1e-300])
specs = st.fixed_dictionaries(
    {"task": st.text(max_size=10) | values},
    optional={
        "limits": st.dictionaries(st.sampled_from(["max_steps", "deadline_s", "command_timeout_s", "max_output_bytes"]), numbers | values, max_size=3),
        "builtin_tools": values | st.lists(values, max_size=3),
        "model": values | st.fixed_dictionaries({"provider": st.just("scripted"), "script": st.fixed_dictionaries({"turns": st.lists(st.fixed_dictionaries({"text": st.text(max_size=5), "delay_s": numbers}), max_size=2)})}),
        "session_id": values,
    },
)  # fmt: skip
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS) | values},
    optional={"id": values, **{name: values for name in ARGS}},
) | st.builds(
    lambda rid, spec, t: {"id": rid, "op": "spawn", "spec": spec, "timeout_s": t}, values, specs, numbers | values
)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@st.composite
def frames(draw: st.DrawFn) -> str | bytes:
    text = json.dumps(draw(requests))  # NaN/Infinity tokens too: the server must refuse them
    how = draw(st.sampled_from(["as is", "as is", "as is", "surrogate", "truncated", "binary", "deep id", "garbage"]))
    if how == "surrogate":
        at = draw(st.integers(0, len(text)))
        quote = text.find('"', at)
        if quote >= 0:
            text = (
                text[: quote + 1] + draw(st.sampled_from(["\\ud800", "\\udfff", "\\udbff\\u0041"])) + text[quote + 1 :]
            )
    elif how == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif how == "binary":
        return text.encode()
    elif how == "deep id":
        text = '{"id": ' + _deep(draw(st.integers(60, 3000))) + ', "op": "ping"}'
    elif how == "garbage":
        return draw(st.binary(max_size=40) | st.text(max_size=40))
    return text


def reported(live_run: str) -> list[str]:
    """The frames of the issue, each once reported to kill the daemon or a connection."""
    return [
        '{"id":"s","op":"cancel","run_id":"%s","reason":"\\ud800"}' % live_run,
        '{"id":"s","op":"status","run_id":"\\ud800"}',
        '{"id":"s","op":"steer","run_id":"%s","text":"\\udfff"}' % live_run,
        '{"id":"t","op":"spawn","spec":{"task":"x"},"timeout_s":%s}' % ("9" * 310),
        '{"id":%s,"op":"ping"}' % _deep(975),
        '{"id":"l","op":"spawn","spec":{"task":"x","limits":{"max_steps":1%s}}}' % ("0" * 300),
        '{"id":"d","op":"spawn","spec":{"task":"x","model":{"provider":"scripted","script":{"turns":[{"text":"t","delay_s":1%s}]}}}}'
        % ("0" * 300),
        '{"id":"b","op":"spawn","spec":{"task":"x","builtin_tools":[{}]}}',
        '{"id":1e999,"op":"ping"}',
    ]


# ----------------------------------------------------------------------------- driving


class Driver:
    """``CONNECTIONS`` websockets held open for the whole fuzz by a Trio loop in a thread.

    Hypothesis drives synchronously; each example's frames go out over every connection
    at once through ``send`` (``trio.from_thread``). A frame gets exactly one reply.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self.frames = 0
        self.codes: dict[str, int] = {}
        self.closed: list[Any] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="fuzz driver")

    def __enter__(self) -> Driver:
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the fuzz driver did not connect")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)
        if self._error is not None:
            raise self._error

    def send(self, batch: list[str | bytes]) -> None:
        trio.from_thread.run(self._send_batch, batch, trio_token=self._token)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the test thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with AsyncExitStack() as stack:
            self.conns = [
                await stack.enter_async_context(
                    open_websocket_url(self.target.url, extra_headers=self.target.headers(), connect_timeout=REPLY_S)
                )
                for _ in range(CONNECTIONS)
            ]
            self._ready.set()
            await self._stop.wait()
            self.closed = [ws.closed for ws in self.conns]

    async def _send_batch(self, batch: list[str | bytes]) -> None:
        async with trio.open_nursery() as nursery:
            for i, ws in enumerate(self.conns):
                nursery.start_soon(self._send_some, ws, batch[i::CONNECTIONS])

    async def _send_some(self, ws: WebSocketConnection, frames: list[str | bytes]) -> None:
        for frame in frames:
            await ws.send_message(frame)
            with trio.fail_after(REPLY_S):
                while True:  # skip pushed events of subscriptions the fuzz opened
                    msg = strict_loads(await ws.get_message())
                    assert isinstance(msg, dict), msg
                    if msg.get("op") in ("event", "end") and "ok" not in msg:
                        continue
                    break
            assert msg.get("ok") in (True, False), (frame, msg)
            if msg["ok"] is False:
                code = msg["error"]["code"]
                assert code != "internal", (frame, msg)
                self.codes[code] = self.codes.get(code, 0) + 1
            self.frames += 1


async def call(target: Target, op: str, **args: Any) -> dict[str, Any]:
    async with open_websocket_url(target.url, extra_headers=target.headers()) as ws:
        await ws.send_message(json.dumps({"id": 1, "op": op, **args}))
        with trio.fail_after(REPLY_S):
            while True:
                msg = strict_loads(await ws.get_message())
                if msg.get("id") == 1:
                    assert msg["ok"], msg
                    return msg["result"]


async def first_snapshot(target: Target, run_id: str) -> None:
    async with open_websocket_url(target.url, extra_headers=target.headers()) as ws:
        await ws.send_message(json.dumps({"id": 1, "op": "subscribe", "run_id": run_id}))
        with trio.fail_after(REPLY_S):
            while (msg := strict_loads(await ws.get_message())).get("kind") != "step_snapshot":
                assert msg.get("op") != "end", msg


def test_two_thousand_hostile_frames_get_replies_and_harm_nothing(
    daemon: tuple[subprocess.Popen[bytes], Target],
) -> None:
    proc, target = daemon
    live = run_trio(lambda: call(target, "spawn", spec={"task": json.dumps({"snapshots": 1})}, timeout_s=600))
    run_id = live["run_id"]
    run_trio(first_snapshot, target, run_id)
    before = run_trio(lambda: call(target, "status", run_id=run_id))
    assert before["state"] == "running" and before["pid"]

    with Driver(target) as driver:
        driver.send(reported(run_id))

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )  # fmt: skip
        @given(batch=st.lists(frames(), min_size=CONNECTIONS + 1, max_size=2 * CONNECTIONS))
        def fuzz(batch: list[str | bytes]) -> None:
            driver.send(batch)
            assert proc.poll() is None, "the daemon died"

        fuzz()
    assert driver.frames >= 2000, driver.frames
    assert driver.closed == [None] * CONNECTIONS  # none dropped by the server
    assert proc.poll() is None
    assert driver.codes.get("bad_args", 0) > 0 and driver.codes.get("bad_json", 0) > 0, driver.codes

    async def after() -> None:
        now = await call(target, "status", run_id=run_id)
        assert now["state"] == "running" and now["pid"] == before["pid"]
        assert (await call(target, "cancel", run_id=run_id))["was_active"] is True
        async with open_websocket_url(target.url, extra_headers=target.headers()) as ws:
            await ws.send_message(json.dumps({"id": 1, "op": "subscribe", "run_id": run_id}))
            with trio.fail_after(REPLY_S):
                while True:
                    msg = strict_loads(await ws.get_message())
                    if msg.get("op") == "end":
                        assert msg["state"] == "cancelled", msg
                        return

    run_trio(after)
