"""An honest in-memory Backend for control-socket, client and CLI tests.

It keeps the contract of ``supervisor.protocol.Backend`` the way the run manager does:
every event is journaled (visible to ``events_after``) before it is delivered live, seq
numbers start at 1 and increase by one, a subscription channel closes after the run's
terminal event, cancel is idempotent and reports ``was_active``. Tests drive runs with
``emit``/``finish`` (synchronous, so a test in another thread can call them through
``trio.from_thread.run_sync``). ``cancels`` records every cancel the backend saw.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from supervisor.core.sessions import SessionNotFound
from supervisor.errors import ControlProtocolError, RunNotFound, SpawnError
from supervisor.states import LIVE_STATES, TERMINAL_STATES, RunState


@dataclass
class FakeRun:
    run_id: str
    spec: dict[str, Any]
    session_id: str | None
    timeout_s: float | None
    created_at: float
    state: str = "running"
    events: list[dict[str, Any]] = field(default_factory=list)
    subscribers: list[trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    subscribed: trio.Event = field(default_factory=trio.Event)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.run_id,
            "run_id": self.run_id,
            "state": self.state,
            "session_id": self.session_id,
            "task": self.spec.get("task"),
            "created_at": self.created_at,
            "timeout_s": self.timeout_s,
            "result": self.result,
            "last_seq": len(self.events),
            "live": self.state not in TERMINAL_STATES,
        }


class FakeBackend:
    def __init__(self, *, subscriber_buffer: float = math.inf) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.cancels: list[tuple[str, str]] = []
        self.spawns: list[dict[str, Any]] = []
        self.subscriber_buffer = subscriber_buffer
        # Scripts played by runs spawned with spec {"task": ..., "autoplay": name}:
        # a list of (kind, data) then the terminal state; played once a subscriber exists.
        self.autoplay: dict[str, tuple[list[tuple[str, dict[str, Any]]], str]] = {}
        self.nursery: trio.Nursery | None = None
        self._n = 0
        # A journal that cannot be written: cancels say so, as the daemon's do; the
        # daemon's status summary too (set: the error text).
        self.journal_down: str | None = None

    # ---------------------------------------------------------------- driving
    def add_run(self, spec: dict[str, Any] | None = None, *, session_id: str | None = None) -> str:
        self._n += 1
        run_id = f"r-{self._n:04d}"
        self.runs[run_id] = FakeRun(
            run_id, dict(spec or {"task": "t"}), session_id, None, created_at=1_700_000_000.0 + self._n
        )
        self.emit(run_id, "state", {"state": "running"})
        return run_id

    def emit(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> int:
        run = self.runs[run_id]
        assert run.state not in TERMINAL_STATES, f"run {run_id} is terminal"
        event = {"run_id": run_id, "seq": len(run.events) + 1, "ts": time.time(), "kind": kind, "data": data or {}}
        run.events.append(event)  # durable first, then live
        for send in list(run.subscribers):
            try:
                send.send_nowait(event)
            except trio.WouldBlock:  # the run manager drops a subscriber that fell behind
                run.subscribers.remove(send)
                send.close()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # Its connection went (the server saw a dropped client first): as the run
                # manager (``RunBook._send``), forget it. The fake raised here, once in CI.
                run.subscribers.remove(send)
        return event["seq"]

    def finish(self, run_id: str, state: str = "completed", result: dict[str, Any] | None = None) -> None:
        run = self.runs[run_id]
        self.emit(run_id, "state", {"state": state})
        run.state = state
        run.result = result
        for send in run.subscribers:
            send.close()
        run.subscribers.clear()

    def drop_subscribers(self, run_id: str) -> None:
        """What the run manager does to a subscriber that fell behind: close its channel."""
        run = self.runs[run_id]
        for send in run.subscribers:
            send.close()
        run.subscribers.clear()

    async def _play(self, run_id: str, script: list[tuple[str, dict[str, Any]]], final: str) -> None:
        run = self.runs[run_id]
        await run.subscribed.wait()
        for kind, data in script:
            await trio.lowlevel.checkpoint()
            if run.state in TERMINAL_STATES:
                return
            self.emit(run_id, kind, data)
        if run.state not in TERMINAL_STATES:
            self.finish(run_id, final, {"final_text": "done"})

    # ---------------------------------------------------------------- Backend
    async def spawn(self, spec: dict[str, Any], *, session_id: str | None, timeout_s: float | None) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        if not isinstance(spec.get("task"), str) or not spec["task"].strip():
            raise SpawnError("task: expected a non-empty string")
        if "model" in spec and not isinstance(spec["model"], dict):
            raise SpawnError(f"model: expected an object, got {type(spec['model']).__name__}")
        self.spawns.append({"spec": spec, "session_id": session_id, "timeout_s": timeout_s})
        run_id = self.add_run(spec, session_id=session_id)
        self.runs[run_id].timeout_s = timeout_s
        name = spec.get("autoplay")
        if name is not None:
            script, final = self.autoplay[name]
            assert self.nursery is not None, "autoplay needs FakeBackend.nursery"
            self.nursery.start_soon(self._play, run_id, script, final)
        return {"run_id": run_id, "state": self.runs[run_id].state, "session_id": session_id}

    async def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        run = self._get(run_id)
        self.cancels.append((run_id, reason))
        was_active = run.state not in TERMINAL_STATES
        if was_active:
            self.emit(run_id, "state", {"state": "cancelling", "reason": reason})
            self.finish(run_id, "cancelled")
        out = {"run_id": run_id, "was_active": was_active, "state": run.state}
        if self.journal_down is not None:
            out["warning"] = "the journal cannot be written: the stop goes on, but is not durable yet"
        return out

    async def summary(self) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        down = self.journal_down
        return {"journal": {"writable": down is None, "error": down, "pending_writes": 0 if down is None else 3}}

    async def cancel_session(self, session_id: str, *, reason: str = "user", turn: str | None = None) -> dict[str, Any]:
        if not any(r.session_id == session_id for r in self.runs.values()):
            raise SessionNotFound(session_id)
        if turn is not None and self._get(turn).session_id != session_id:
            raise ControlProtocolError("bad_args", f"run {turn!r} is not a turn of session {session_id!r}")
        out = [
            await self.cancel(r.run_id, reason=reason)
            for r in list(self.runs.values())
            if r.session_id == session_id and (r.state in LIVE_STATES if turn is None else r.run_id == turn)
        ]
        live = next(
            (r.run_id for r in self.runs.values() if r.session_id == session_id and r.state in LIVE_STATES), None
        )
        return {
            "session_id": session_id,
            "was_active": any(o["was_active"] for o in out),
            "runs": out,
            "live_run": live,
        }

    async def status(self, run_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return self._get(run_id).as_dict()

    async def list_runs(self, *, limit: int, state: str | None, session_id: str | None) -> list[dict[str, Any]]:
        await trio.lowlevel.checkpoint()
        runs = [
            r.as_dict()
            for r in reversed(self.runs.values())
            if (state is None or r.state == RunState(state)) and (session_id is None or r.session_id == session_id)
        ]
        return runs[:limit]

    async def events_after(self, run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
        await trio.lowlevel.checkpoint()
        return [dict(e) for e in self._get(run_id).events[after_seq : after_seq + limit]]

    @asynccontextmanager
    async def subscribe(self, run_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        run = self._get(run_id)
        send, recv = trio.open_memory_channel[dict[str, Any]](self.subscriber_buffer)
        if run.state in TERMINAL_STATES:
            send.close()
        else:
            run.subscribers.append(send)
        run.subscribed.set()
        try:
            async with recv:
                yield recv
        finally:
            if send in run.subscribers:
                run.subscribers.remove(send)
            send.close()

    def _get(self, run_id: str) -> FakeRun:
        try:
            return self.runs[run_id]
        except KeyError:
            raise RunNotFound(run_id) from None
