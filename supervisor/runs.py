"""The run manager: every run's life from spawn to its one terminal fact.

Each run is one Trio task in the manager's nursery. The runner child's pipes are pumped
by tasks *outside* the run's cancel scope, so a stop does not deafen us: the runner's
last snapshot and final JSON written during its grace are still read. Cancel goes two
ways on purpose (DESIGN.md): path A at cancel time (``process.soft_stop``: SIGTERM to the
runner's group and to the command groups it reported interruptible), and path B when the
run's scope is cancelled: the scope unwinds into a shielded
``process.terminate_and_kill`` (SIGTERM, grace, SIGKILL the whole tree, reap). A stop is
journaled (reason, time, the wall-clock end of its grace) before it is acknowledged, and
a timeout is a wall-clock deadline, so a restarted daemon resumes both (``recovery``).

Invariants: one cancel token per run, retired exactly once when the terminal fact is
written; the terminal fact is a compare-and-set in the journal, so a cancel racing a
completion yields one outcome, the true one; a run that completed while its stop was in
flight is recorded as completed; a stop is never recorded as failed.

Fault isolation: a run's task never lets an exception out. A failure in its bookkeeping
(a pump, a journal write, the conclusion) ends that run's supervision with its tree
stopped (path B runs in a ``finally``) and an ``internal`` error on its record; other runs
and the daemon go on. Journal writes go through ``_backlog.Backlog``: while the journal
cannot be written, runs keep running and their facts, terminal ones included, wait in
memory (shown by ``status``) until it can.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from subagent.events import BadLine, Event, EventKind, ExitCode, RunStatus, decode_result
from supervisor import process, recovery
from supervisor._backlog import Backlog
from supervisor._stop_receipt import describe_tool_stops
from supervisor.approvals import ApprovalDesk, Hooks, RunApprovals
from supervisor.config import Config
from supervisor.containment import Containment
from supervisor.errors import ControlProtocolError, JournalError, JournalUnavailable, RunNotFound, SpawnError
from supervisor.journal import Journal
from supervisor.pool import WarmPool, new_tree, remove_dir
from supervisor.progress import LineSplitter
from supervisor.protocol import ErrorCode, Secret
from supervisor.sessions import SessionDesk
from supervisor.states import TERMINAL_STATES, RunState, can_transition
from supervisor.token import CancelToken
from supervisor.zygote import Zygote, usable

__all__ = ["RunManager"]

logger = logging.getLogger(__name__)

# Largest final-result document read from a runner's stdout.
MAX_RESULT_BYTES = 16 * 1024 * 1024
# Buffered events per live subscriber; a subscriber that falls further behind is dropped
# (it reconnects and replays from its last sequence number).
SUBSCRIBER_BUFFER = 4096
# Margin on top of the grace for waiting on every run to end at shutdown.
SHUTDOWN_MARGIN_S = 5.0
# Margin on top of the grace for an interrupted (or closed) session's live turn to end
# before the new turn (or the close) goes ahead.
INTERRUPT_MARGIN_S = 5.0


@dataclass(eq=False)
class _Run:
    run_id: str
    session_id: str | None
    spec: dict[str, Any]
    timeout_s: float | None
    token: CancelToken
    state: RunState = RunState.QUEUED
    run_dir: Path | None = None
    tree: process.Tree | None = None
    scope: trio.CancelScope | None = None
    queue_scope: trio.CancelScope | None = None
    partial: dict[str, Any] | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stdout_overflow: bool = False
    cancel_at: float | None = None  # trio clock
    cancel_wall: float | None = None
    stop_deadline: float | None = None  # wall clock: the end of the stop's grace
    deadline: float | None = None  # wall clock: the timeout
    path_a: list[str] = field(default_factory=list)
    subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=set)
    lock: trio.Lock = field(default_factory=trio.Lock)
    done: trio.Event = field(default_factory=trio.Event)
    readopted: bool = False
    tail_offset: int = 0
    stdin: trio.abc.SendStream | None = None
    stdin_lock: trio.Lock = field(default_factory=trio.Lock)
    pipes_held_open: bool = False
    early_stderr: bytes = b""
    # This run's own model API key: for its runner's environment only, never journaled.
    model_key: Secret | None = field(default=None, repr=False)
    last_seq: int = 0  # the number of its last event (given out, maybe not yet journaled)
    stop_receipt: dict[str, Any] | None = None  # path B's, once the tree was stopped
    final: dict[str, Any] | None = None  # its terminal fact while it waits for the journal
    sandbox: dict[str, Any] | None = None  # the runner's report (runner_started)
    approvals: RunApprovals = field(default_factory=RunApprovals)  # calls awaiting a person's OK
    runner_spec: dict[str, Any] | None = None  # what the runner reads: spec + its session's history

    @property
    def stopping(self) -> bool:
        return self.token.cancelled


class RunManager:
    """Implements the control socket's Backend over the journal and the process layer."""

    def __init__(self, config: Config, journal: Journal, containment: Containment) -> None:
        self.config = config
        self.journal = journal
        self.containment = containment
        self._live: dict[str, _Run] = {}
        self._limiter = trio.CapacityLimiter(config.max_concurrent)
        self._nursery: trio.Nursery | None = None
        self._accepting = False
        # Runners are forked by the zygote when it is usable and ready, else started cold.
        self._zygote = Zygote(config, containment) if usable(config, containment) else None
        self._pool = WarmPool(config, containment, self._zygote) if config.pool_size > 0 else None
        self.backlog = Backlog(journal, on_flushed=self._flushed)
        self.approvals = ApprovalDesk(
            Hooks(
                record=self._record,
                transition=lambda run, new: self._transition(run, new),
                cancel=lambda run_id, reason: self.cancel(run_id, reason=reason),
            )
        )
        self.session_desk = SessionDesk(
            config, journal, live_sessions=lambda: {r.session_id for r in self._live.values() if r.session_id}
        )
        # Ended runs whose facts still wait for the journal (degraded mode).
        self._unflushed: dict[str, _Run] = {}

    # ------------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the runs nursery until cancelled. Call ``shutdown()`` first to stop runs."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.backlog.run)
            for run in await self.recover():
                nursery.start_soon(recovery.adopted_lifecycle, self, run, name=f"run {run.run_id} (re-adopted)")
            if self._zygote is not None:
                await nursery.start(self._zygote.run)
            if self._pool is not None:
                await nursery.start(self._pool.run)
            await nursery.start(self.session_desk.run)
            self._accepting = True
            task_status.started()
            await trio.sleep_forever()

    async def recover(self) -> list[_Run]:
        """Re-adopt or lose the runs a previous daemon left live (called by ``run``)."""
        return await recovery.recover_runs(self)

    @property
    def live_count(self) -> int:
        return len(self._live)

    async def flush_journal(self) -> None:
        """At shutdown: write what waits for the journal, or say what is lost."""
        with trio.CancelScope(shield=True):
            if not await self.backlog.flush():
                self.backlog.report_unwritten()

    def _flushed(self, run_id: str) -> None:
        run = self._unflushed.pop(run_id, None)
        if run is not None:
            run.final = None

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Stop accepting runs, cancel every live run (both paths) and wait for them."""
        self._accepting = False
        runs = list(self._live.values())
        await self._cancel_many([r.run_id for r in runs], reason)
        with trio.move_on_after(self.config.grace_s + SHUTDOWN_MARGIN_S):
            for run in runs:
                await run.done.wait()
        left = [r.run_id for r in runs if not r.done.is_set()]
        if left:
            logger.warning("shutdown: runs still not ended after the grace: %s", left)

    # ------------------------------------------------------------------ backend

    async def spawn(
        self,
        spec: dict[str, Any],
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
        model_key: Secret | None = None,
        interrupt: bool = False,
    ) -> dict[str, Any]:
        """Start a run. ``model_key``: its own model API key (see ``_validate_spec``).

        With a session (``session_id``, or the spec's) the run is the session's next turn:
        it gets the history of the turns before it. One turn of a session is live at a
        time: with ``interrupt`` the live one is cancelled (reason ``user``) and waited for
        first; without, the spawn is refused.

        Raises:
            SpawnError: not accepting runs, or a spec the run cannot carry out.
            ControlProtocolError: ``session_busy`` (the session has a live turn),
                ``refused`` (the session was closed, or its live turn would not end).
        """
        if not self._accepting or self._nursery is None:
            raise SpawnError("the daemon is not accepting runs (shutting down)")
        if not isinstance(spec, dict):
            raise SpawnError(f"spec must be a json object, got {type(spec).__name__}")
        run_id = "r-" + uuid.uuid4().hex[:16]
        spec = dict(spec)
        spec["run_id"] = run_id
        if session_id is not None:
            spec["session_id"] = session_id
        else:
            session_id = spec.get("session_id")
        if timeout_s is None:
            timeout_s = self.config.default_timeout_s
        if "session" in spec:
            raise SpawnError(
                "invalid run spec: session: the daemon sets it for a turn of a session (its history, its "
                "browser profile); spawn with a session_id instead"
            )
        provider = _validate_spec(spec, model_key, self.config)
        if provider is not None:
            # The provider chosen here, from this daemon's environment, is the one the run
            # uses and the one status shows: the runner does not choose again.
            spec["model"] = {**(spec.get("model") or {}), "provider": provider}
        if not isinstance(session_id, str):
            return await self._create(run_id, None, spec, timeout_s, model_key)
        async with self.session_desk.lock(session_id):
            await self.session_desk.open(session_id)
            live = [r for r in self._live.values() if r.session_id == session_id]
            if live and not interrupt:
                raise ControlProtocolError(
                    ErrorCode.SESSION_BUSY,
                    f"session {session_id!r} has a live turn, run {live[0].run_id!r} ({live[0].state}): "
                    "wait for it to end, cancel it, or start the new turn with interrupt (agentd spawn --interrupt)",
                )
            await self._end_turns(live, "user", f"a new turn of session {session_id!r}")
            return await self._create(run_id, session_id, spec, timeout_s, model_key)

    async def _end_turns(self, runs: list[_Run], reason: str, why: str) -> None:
        """Cancel live turns through the normal path and wait for their terminal facts.

        Raises:
            ControlProtocolError: ``refused``, one has not ended after the grace and a margin.
        """
        if not runs:
            return
        await self._cancel_many([r.run_id for r in runs], reason)
        with trio.move_on_after(self.config.grace_s + INTERRUPT_MARGIN_S):
            for run in runs:
                await run.done.wait()
        left = [r.run_id for r in runs if not r.done.is_set()]
        if left:
            raise ControlProtocolError(ErrorCode.REFUSED, f"{why}: the live turn {left[0]!r} has not ended yet (stop sent)")

    async def _create(
        self, run_id: str, session_id: str | None, spec: dict[str, Any], timeout_s: float | None, model_key: Secret | None
    ) -> dict[str, Any]:
        if not self._accepting or self._nursery is None:
            raise SpawnError("the daemon is not accepting runs (shutting down)")
        run = _Run(
            run_id=run_id,
            session_id=session_id,
            spec=spec,
            timeout_s=timeout_s,
            token=CancelToken(run_id),
            model_key=model_key,
        )
        try:
            await self.journal.create_run(
                run_id, session_id=session_id, spec=spec, created_at=time.time(), timeout_s=timeout_s
            )
        except JournalUnavailable as exc:
            self.backlog.note_failure(exc, "a new run")
            raise JournalUnavailable(
                f"no new runs while the journal cannot be written ({exc})", path=exc.path
            ) from exc
        self.backlog.note_success()
        self._live[run_id] = run
        await self._record(run, "state", {"state": str(RunState.QUEUED)})
        self._nursery.start_soon(self._lifecycle, run, name=f"run {run_id}")
        return {"run_id": run_id, "state": str(run.state), "session_id": session_id}

    async def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        run = self._live.get(run_id)
        if run is None:
            row = await self.journal.get_run(run_id)
            if row is None:
                raise RunNotFound(run_id)
            return {"run_id": run_id, "was_active": False, "state": row["state"]}
        was_active = run.token.cancel(reason)
        if was_active and run.token.first_cancel:
            run.cancel_at = trio.current_time()
            run.cancel_wall = time.time()
            run.stop_deadline = run.cancel_wall + self.config.grace_s
            # Path A, before any await: fire and forget, whole-group soft stop.
            if run.tree is not None:
                run.path_a = process.soft_stop(run.tree)
            # Path B: unwinding the run's scope ends in terminate_and_kill.
            if run.scope is not None:
                run.scope.cancel()
            if run.queue_scope is not None:
                run.queue_scope.cancel()
            # Durable intent before the acknowledgement: a restarted daemon finishes it.
            why, at, until = run.token.reason or reason, run.cancel_wall, run.stop_deadline
            await self._write(
                run, "stop intent", lambda j: j.record_cancel(run_id, reason=why, at=at, stop_deadline=until), True
            )
            if run.state in (RunState.STARTING, RunState.RUNNING, RunState.AWAITING_APPROVAL):
                await self._transition(run, RunState.CANCELLING, reason=reason)
        out = {"run_id": run_id, "was_active": was_active, "state": str(run.state)}
        if self.backlog.pending(run_id):
            out["warning"] = "the journal cannot be written: the stop goes on, but is not durable yet"
        return out

    async def steer(self, run_id: str, text: str) -> dict[str, Any]:
        """Extra input for a running turn, applied by the runner at its next step boundary.

        Steering is a queue separate from cancel: it is refused once a stop is under way
        (``accepted: false``), and input the runner never applied is reported in its
        result's ``unapplied_steering`` and ``steering`` events.
        """
        run = self._live.get(run_id)
        if run is None:
            row = await self.journal.get_run(run_id)
            if row is None:
                raise RunNotFound(run_id)
            return {"run_id": run_id, "accepted": False, "state": row["state"], "why": "the run has ended"}
        if run.token.cancelled or run.stdin is None:
            why = "a stop is under way" if run.token.cancelled else "the runner is not reading input yet"
            return {"run_id": run_id, "accepted": False, "state": str(run.state), "why": why}
        line = (json.dumps({"steer": text}) + "\n").encode()
        try:
            async with run.stdin_lock:
                await run.stdin.send_all(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return {"run_id": run_id, "accepted": False, "state": str(run.state), "why": "the runner closed its input"}
        await self._record(run, "steer_sent", {"text": text})
        return {"run_id": run_id, "accepted": True, "state": str(run.state)}

    async def approve(self, run_id: str, call_id: str) -> dict[str, Any]:
        """A person's OK for a call awaiting approval: it runs (``supervisor.approvals``)."""
        return await self.approvals.answer(await self._live_run(run_id), call_id, approve=True)

    async def deny(self, run_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """A person's no: the call never runs, the model is told why, the turn goes on."""
        return await self.approvals.answer(await self._live_run(run_id), call_id, approve=False, reason=reason)

    async def _live_run(self, run_id: str) -> _Run:
        run = self._live.get(run_id)
        if run is not None:
            return run
        row = await self.journal.get_run(run_id)
        if row is None:
            raise RunNotFound(run_id)
        raise ControlProtocolError(ErrorCode.REFUSED, f"run {run_id!r} has ended ({row['state']}): nothing awaits approval")

    async def history(self, session_id: str) -> dict[str, Any]:
        """A session's transcript, rebuilt from the journal (``supervisor.sessions``)."""
        live = {r.run_id: str(r.state) for r in self._live.values() if r.session_id == session_id}
        return await self.session_desk.history(session_id, live)

    async def list_sessions(self, *, limit: int = 50) -> dict[str, Any]:
        live = {r.session_id: (r.run_id, str(r.state)) for r in self._live.values() if r.session_id}
        return await self.session_desk.list(limit, live)

    async def close_session(self, session_id: str) -> dict[str, Any]:
        """Close a session: its live turn is stopped (and waited for), its profile removed."""
        async with self.session_desk.lock(session_id):
            live = [r for r in self._live.values() if r.session_id == session_id]
            await self._end_turns(live, "session_closed", f"closing session {session_id!r}")
            was_open, removed = await self.session_desk.close(session_id)
        return {
            "session_id": session_id,
            "was_open": was_open,
            "stopped": [r.run_id for r in live],
            "profile_removed": removed,
        }

    async def summary(self) -> dict[str, Any]:
        """The daemon at a glance, for ``status`` without a run id."""
        counts: dict[str, int] = {}
        for run in self._live.values():
            counts[str(run.state)] = counts.get(str(run.state), 0) + 1
        return {
            "live": len(self._live),
            "by_state": counts,
            "max_concurrent": self.config.max_concurrent,
            "grace_s": self.config.grace_s,
            "containment": self.containment.mode,
            "cgroup_subtree": str(self.containment.root) if self.containment.root is not None else None,
            "sandbox": self.config.sandbox,
            "warm_runners": self._pool.ready if self._pool is not None else 0,
            "zygote": self._zygote.describe() if self._zygote is not None else {"state": "off"},
            "accepting": self._accepting,
            "journal": self.backlog.describe(),
            "containment_problem": self.containment.problem,
        }

    async def cancel_session(self, session_id: str, *, reason: str = "user") -> dict[str, Any]:
        hits = [r.run_id for r in list(self._live.values()) if r.session_id == session_id]
        out = await self._cancel_many(hits, reason)
        return {"session_id": session_id, "was_active": any(o["was_active"] for o in out), "runs": out}

    async def _cancel_many(self, run_ids: list[str], reason: str) -> list[dict[str, Any]]:
        """Cancel side by side: every run's path A goes out before any journal write."""
        out: dict[str, dict[str, Any]] = {}

        async def one(run_id: str) -> None:
            out[run_id] = await self.cancel(run_id, reason=reason)

        async with trio.open_nursery() as n:
            for run_id in run_ids:
                n.start_soon(one, run_id)
        return [out[r] for r in run_ids]

    async def status(self, run_id: str) -> dict[str, Any]:
        row = await self.journal.get_run(run_id)
        if row is None:
            raise RunNotFound(run_id)
        run = self._live.get(run_id)
        row["live"] = run is not None
        row["approvals"] = run.approvals.view() if run is not None else []
        if run is not None:
            row["state"] = str(run.state)
            if run.partial is not None:
                row["partial_snapshot"] = run.partial
        self._overlay_unwritten(row)
        row["sandbox"] = _sandbox_of(run, row)
        return row

    def _overlay_unwritten(self, row: dict[str, Any]) -> None:
        """What the journal does not hold yet (degraded mode) overrides what it holds."""
        run = self._unflushed.get(row["id"])
        if run is not None and run.final is not None:
            row.update(run.final)
            row["last_seq"] = max(row.get("last_seq") or 0, run.last_seq)
        if self.backlog.pending(row["id"]):
            row["journal"] = "pending: some facts of this run wait in memory for the journal"

    async def list_runs(
        self, *, limit: int = 50, state: str | None = None, session_id: str | None = None
    ) -> list[dict[str, Any]]:
        states = [RunState(state)] if state else None
        rows = await self.journal.list_runs(limit=limit, states=states, session_id=session_id)
        for row in rows:
            run = self._live.get(row["id"])
            row["live"] = run is not None
            if run is not None:
                row["state"] = str(run.state)
            self._overlay_unwritten(row)
        return rows

    async def events_after(self, run_id: str, after_seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        page, _more = await self.events_page(run_id, after_seq, limit=limit, max_bytes=None)
        return page

    async def events_page(
        self, run_id: str, after_seq: int, *, limit: int = 1000, max_bytes: int | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Events after ``after_seq`` bounded in number and bytes, and whether more follow.

        Events still waiting for the journal (degraded mode) follow the journal's own.
        """
        if run_id not in self._live and await self.journal.get_run(run_id) is None:
            raise RunNotFound(run_id)
        page, more = await self.journal.events_page(run_id, after_seq, limit=limit, max_bytes=max_bytes)
        if not more and self.backlog.pending(run_id):
            after = page[-1]["seq"] if page else after_seq
            waiting = self.backlog.pending_events(run_id, after)
            room = limit - len(page)
            page = [*page, *waiting[:room]]
            more = len(waiting) > room
        return list(page), more

    async def wait_terminal(self, run_id: str) -> dict[str, Any]:
        """Wait until the run has its terminal fact; return its status."""
        run = self._live.get(run_id)
        if run is not None:
            await run.done.wait()
        return await self.status(run_id)

    @asynccontextmanager
    async def subscribe(self, run_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](SUBSCRIBER_BUFFER)
        run = self._live.get(run_id)
        if run is None:
            if await self.journal.get_run(run_id) is None:
                raise RunNotFound(run_id)
            send.close()  # terminal already: nothing live will come
            async with recv:
                yield recv
            return
        run.subscribers.add(send)
        try:
            async with recv:
                yield recv
        finally:
            run.subscribers.discard(send)
            send.close()

    # ------------------------------------------------------------------ lifecycle

    async def _lifecycle(self, run: _Run) -> None:
        # A task root: nothing gets out of it (see the module docstring).
        try:
            await self._lifecycle_inner(run)
        except Exception:
            logger.exception("run %s: ending its supervision failed", run.run_id)

    async def _lifecycle_inner(self, run: _Run) -> None:
        acquired = False
        try:
            with trio.CancelScope() as run.queue_scope:
                if not run.token.cancelled:
                    await self._limiter.acquire_on_behalf_of(run)
                    acquired = True
            run.queue_scope = None
            if run.token.cancelled:
                await self._finish(
                    run,
                    RunState.CANCELLED,
                    reason=run.token.reason,
                    result=None,
                    partial=False,
                    error=None,
                    receipt={"note": "cancelled while queued: never started", **self._receipt_head(run)},
                )
                return
            await self._execute(run)
        except Exception as exc:
            logger.exception("run %s: supervision failed", run.run_id)
            await self._finish_internal_error(run, exc, self._receipt_head(run))
        finally:
            if acquired:
                self._limiter.release_on_behalf_of(run)
            if not run.done.is_set():  # only on a bug: never leave waiters hanging
                self._let_go(run)

    async def _execute(self, run: _Run) -> None:
        await self._transition(run, RunState.STARTING)
        if run.session_id is not None:
            try:
                run.runner_spec, session_event = await self.session_desk.prepare_turn(run.run_id, run.session_id, run.spec)
            except (OSError, JournalError) as exc:
                logger.warning("run %s: could not prepare its session's turn: %s", run.run_id, exc)
                await self._finish(
                    run,
                    RunState.CANCELLED if run.token.cancelled else RunState.FAILED,
                    reason=run.token.reason or "session_setup",
                    result=None,
                    partial=False,
                    error={"code": "session_setup", "message": f"the session's history or profile: {exc}"},
                    receipt=None,
                )
                return
            await self._record(run, "session", session_event)
        if run.timeout_s is not None and run.deadline is None:
            # Absolute: a daemon restart does not extend it (recovery reads it back).
            run.deadline = time.time() + run.timeout_s
            deadline = run.deadline
            await self._write(run, "deadline", lambda j: j.record_deadline(run.run_id, deadline), True)
        # A warm runner's environment was set before its spec came: a run with its own
        # model key starts cold, with the key in its runner's environment.
        warm = self._pool.take() if self._pool is not None and run.model_key is None else None
        if warm is None:
            extra_env = {"AGENTD_RUN_ID": run.run_id}
            if run.model_key is not None:
                extra_env["OPENAI_API_KEY"] = run.model_key.reveal()
            try:
                warm = await new_tree(
                    self.config, self.containment, warm=False, extra_env=extra_env, zygote=self._zygote
                )
            except (OSError, SpawnError) as exc:
                logger.warning("run %s: could not start the runner: %s", run.run_id, exc)
                await self._finish(
                    run,
                    RunState.CANCELLED if run.token.cancelled else RunState.FAILED,
                    reason=run.token.reason or "spawn_failed",
                    result=None,
                    partial=False,
                    error={"code": "spawn_failed", "message": str(exc)},
                    receipt=None,
                )
                return
        tree, run_dir = warm.tree, warm.run_dir
        run.run_dir = run_dir
        run.early_stderr = warm.early_stderr
        run.tree = tree
        try:
            await self._supervise(run, tree)
        finally:
            # Also after a failure in the run's bookkeeping: the tree was stopped (path B
            # runs in the supervision's finally); what it leaves behind goes too.
            with trio.CancelScope(shield=True):
                await self._clean_up(run, tree, run_dir)

    async def _supervise(self, run: _Run, tree: process.Tree) -> None:
        receipt: dict[str, Any] = {}
        async with trio.open_nursery() as io:
            io.start_soon(self._feed_stdin, run, tree)
            io.start_soon(self.approvals.watch, run)
            if run.deadline is not None:
                io.start_soon(self._timeout, run)
            # The pipes are read outside the run's scope (a stop must not deafen us) and
            # for at most process.DRAIN_AFTER_EXIT_S after the runner exits.
            async with trio.open_nursery() as pumps:
                pumps.start_soon(self._pump_stdout, run, tree)
                pumps.start_soon(self._pump_stderr, run, tree)
                with trio.CancelScope() as run.scope:
                    if run.token.cancelled:  # the stop came while we were spawning
                        run.path_a = process.soft_stop(tree)
                        run.scope.cancel()
                    try:
                        fields: dict[str, Any] = {
                            "pid": tree.pid,
                            "pid_start_time": tree.start_time,
                            "pgid": tree.pgid,
                            "tree_id": tree.tree_id,
                            "cgroup": str(tree.cgroup) if tree.cgroup else None,
                            "containment": tree.containment,
                            "run_dir": str(run.run_dir),
                        }
                        await self._write(run, "process record", lambda j: j.record_process(run.run_id, **fields), True)
                        await tree.process.wait()
                    finally:
                        # Path B (scope cancelled) or the runner ended by itself: either
                        # way the whole tree is ended and confirmed dead, shielded, bounded.
                        with trio.CancelScope(shield=True):
                            stop = await process.terminate_and_kill(
                                tree, grace_s=self.config.grace_s, sigterm_sent=bool(run.path_a)
                            )
                            receipt = run.stop_receipt = stop.to_dict()
            if run.pipes_held_open:
                receipt["pipes_held_open"] = True
            io.cancel_scope.cancel()
        await self._conclude(run, tree.process.returncode, receipt)

    async def _clean_up(self, run: _Run, tree: process.AnyTree, run_dir: Path | None) -> None:
        """Remove what a stopped tree leaves (its dir, its cgroup, untraceable orphans)."""
        try:
            if run_dir is not None:
                await trio.to_thread.run_sync(remove_dir, run_dir)
            self.containment.remove(tree)
            # An orphan that shed every trace of its tree can only be ended when no tree
            # is live to claim it.
            strays = await process.kill_strays(self.containment, only_if_idle=True)
            if strays:
                logger.warning("run %s: killed %d untraceable orphans: %s", run.run_id, len(strays), strays)
        except Exception:
            logger.exception("run %s: cleaning up after its tree failed", run.run_id)

    async def _timeout(self, run: _Run) -> None:
        assert run.deadline is not None
        await trio.sleep(max(0.0, run.deadline - time.time()))
        await self.cancel(run.run_id, reason="timeout")

    async def _conclude(self, run: _Run, code: int | None, receipt: dict[str, Any]) -> None:
        result = decode_result(bytes(run.stdout))
        if isinstance(result, BadLine) and run.run_dir is not None:
            result = recovery.read_result_file(run.run_dir / "result.json")
        full_receipt = {**self._receipt_head(run), "exit_code": code, "path_b": receipt}
        if run.cancel_at is not None and receipt.get("tree_dead_at") is not None:
            full_receipt["cancel_to_tree_dead_s"] = max(0.0, receipt["tree_dead_at"] - run.cancel_at)
        if isinstance(result, dict):
            await self._take_result_records(run, result)
            await self._add_tool_stops(run, full_receipt, result.get("tool_calls"))
            status = result.get("status")
            if status == RunStatus.COMPLETED:
                state = RunState.COMPLETED
            elif status == RunStatus.CANCELLED:
                state = RunState.CANCELLED
            else:
                state = RunState.CANCELLED if run.token.cancelled else RunState.FAILED
            await self._finish(
                run,
                state,
                reason=(run.token.reason if state == RunState.CANCELLED and run.token.cancelled else result.get("reason")),
                result=result,
                partial=False,
                error=result.get("error"),
                receipt=full_receipt,
            )
            return
        # No final JSON: killed before it wrote one, or it crashed. Keep the last snapshot;
        # a tool that was running has an unknown outcome, one only announced never ran.
        await self._settle_unreported(run)
        await self._add_tool_stops(run, full_receipt, None)
        if run.token.cancelled:
            state, reason, error = RunState.CANCELLED, run.token.reason, None
        else:
            state, reason = RunState.FAILED, "runner_died"
            error = {
                "code": _exit_name(code),
                "message": f"runner exited with code {code} without a result ({result.problem})",
            }
        await self._finish(
            run,
            state,
            reason=reason,
            result=run.partial,
            partial=run.partial is not None,
            error=error,
            receipt=full_receipt,
        )

    async def _take_result_records(self, run: _Run, result: dict[str, Any]) -> None:
        for record in result.get("tool_calls") or []:
            if isinstance(record, dict) and isinstance(record.get("id"), str):
                try:
                    await self._write(run, "tool call", lambda j, r=record: j.upsert_tool_call(run.run_id, r), True)
                except ValueError:
                    logger.warning("run %s: bad tool-call record in the result: %r", run.run_id, record)

    async def _settle_unreported(self, run: _Run) -> None:
        """Close the records a runner that left no result never closed."""
        if run.token.cancelled:
            settle = lambda j: j.settle_tool_calls(  # noqa: E731
                run.run_id,
                reason="grace_ran_out: the runner was killed at the end of the stop's grace while this call ran; its outcome is unknown",
                pending_reason="stopped_before_start: the runner was stopped before this call started",
                stop_effects=("grace_ran_out", "stopped_before_start"),
            )
        else:
            settle = lambda j: j.settle_tool_calls(  # noqa: E731
                run.run_id, reason="the runner ended without reporting this call's outcome"
            )
        await self._write(run, "tool calls settled", settle, 0)

    async def _add_tool_stops(self, run: _Run, receipt: dict[str, Any], records: Any) -> None:
        """The receipt says what the stop did to the running tool (and to the calls after it).

        ``records``: the runner's own (its result's), else the journal's (settled).
        """
        if not run.token.cancelled:
            return
        if not isinstance(records, list):
            try:
                records = await self.journal.tool_calls(run.run_id)
            except JournalError as exc:  # degraded: the receipt goes without them
                logger.warning("run %s: tool records unreadable for the receipt: %s", run.run_id, exc)
                return
        tools = describe_tool_stops([r for r in records if isinstance(r, dict)], cancel_wall=run.cancel_wall)
        if tools:
            receipt["tools"] = tools
            receipt["tool_summary"] = "; ".join(t["text"] for t in tools)

    async def _finish_internal_error(self, run: _Run, exc: Exception, receipt: dict[str, Any]) -> None:
        """A bug in supervision still ends the run once: cancelled if a stop was asked."""
        if run.stop_receipt is not None and "path_b" not in receipt:
            receipt = {**receipt, "path_b": run.stop_receipt}
        await self._finish(
            run,
            RunState.CANCELLED if run.token.cancelled else RunState.FAILED,
            reason=run.token.reason or "internal",
            result=run.partial,
            partial=run.partial is not None,
            error={"code": "internal", "message": f"supervision failed: {_leaf_errors(exc)}"},
            receipt=receipt,
        )

    def _receipt_head(self, run: _Run) -> dict[str, Any]:
        return {
            "cancel_reason": run.token.reason,
            "cancel_requested_wall": run.cancel_wall,
            "path_a": run.path_a,
            "containment": run.tree.containment if run.tree else None,
            "sandbox": run.sandbox,
        }

    # ------------------------------------------------------------------ pipes

    async def _feed_stdin(self, run: _Run, tree: process.Tree) -> None:
        """The spec, then steering lines, on the runner's stdin; closed when the run ends."""
        stdin = tree.process.stdin
        if stdin is None:
            return
        try:
            async with run.stdin_lock:
                await stdin.send_all((json.dumps(run.runner_spec or run.spec) + "\n").encode())
            run.stdin = stdin
            await trio.sleep_forever()  # until the run ends and cancels the pumps
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            run.stdin = None
            with trio.CancelScope(shield=True):
                await stdin.aclose()

    async def _pump_stdout(self, run: _Run, tree: process.Tree) -> None:
        if tree.process.stdout is None:
            return

        async def sink(chunk: bytes) -> None:
            if len(run.stdout) + len(chunk) > MAX_RESULT_BYTES:
                run.stdout_overflow = True
            else:
                run.stdout += chunk

        if not await process.drain_bounded(tree.process.stdout, sink, process=tree.process):
            run.pipes_held_open = True

    async def _pump_stderr(self, run: _Run, tree: process.Tree) -> None:
        if tree.process.stderr is None:
            return
        splitter = LineSplitter()

        async def sink(chunk: bytes) -> None:
            for item in splitter.feed(chunk):
                await self._on_item(run, tree, item)

        if run.early_stderr:
            await sink(run.early_stderr)

        if not await process.drain_bounded(tree.process.stderr, sink, process=tree.process):
            run.pipes_held_open = True
        for item in splitter.close():
            await self._on_item(run, tree, item)

    async def _on_item(self, run: _Run, tree: process.Tree, item: Event | BadLine) -> None:
        if isinstance(item, BadLine):
            await self._record(run, "stderr", {"text": item.text, "problem": item.problem})
            return
        data = item.data
        kind = item.kind
        try:
            if kind == EventKind.RUNNER_STARTED:
                if isinstance(data.get("sandbox"), dict):
                    run.sandbox = data["sandbox"]
                if run.state == RunState.STARTING:
                    await self._transition(run, RunState.RUNNING)
            elif kind == EventKind.PROCESS_GROUP:
                pgid = int(data["pgid"])
                on_stop = data.get("on_stop")
                on_stop = str(on_stop) if on_stop is not None else None
                if data.get("alive", True):
                    tree.add_group(pgid)
                    # Path A may SIGTERM this group at cancel time only if a stop interrupts its tool.
                    tree.set_interruptible(pgid, data.get("kind") == "command" and on_stop == "interrupt")
                    gkind, name = str(data.get("kind", "")), str(data.get("name", ""))
                    await self._write(
                        run, "process group", lambda j: j.add_group(run.run_id, pgid, gkind, name, on_stop=on_stop), None
                    )
                else:
                    tree.set_interruptible(pgid, False)
                    await self._write(run, "process group ended", lambda j: j.remove_group(run.run_id, pgid), True)
            elif kind == EventKind.TOOL_CALL:
                record = data.get("record")
                if isinstance(record, dict) and "id" in record:
                    await self._write(run, "tool call", lambda j: j.upsert_tool_call(run.run_id, record), True)
            elif kind == EventKind.STEP_SNAPSHOT:
                # The partial-result cache: a stale writer's _id does not match; a
                # terminal run keeps its result.
                if data.get("_id") == run.run_id and run.state not in TERMINAL_STATES:
                    run.partial = data
                    await self._write(run, "partial result", lambda j: j.set_partial(run.run_id, data), True)
        except (KeyError, TypeError, ValueError) as exc:
            await self._record(run, "stderr", {"text": json.dumps(item.to_dict())[:2000], "problem": f"bad {kind} event: {exc!r}"})
            return
        await self._record(run, str(kind), data, ts=item.ts)
        if kind in (EventKind.APPROVAL_REQUESTED, EventKind.APPROVAL_ANSWERED):
            # After the event: a watcher sees what is asked, then the state it puts the run in.
            await self.approvals.on_event(run, kind, data)

    # ------------------------------------------------------------------ journal + fan-out

    async def _write(self, run: _Run, what: str, direct: Any, predicted: Any) -> Any:
        """One journal write of the run's, or queued while the journal cannot be written."""
        return await self.backlog.write(run.run_id, direct, predicted, what=what)

    async def _record(self, run: _Run, kind: str, data: dict[str, Any], ts: float | None = None) -> int | None:
        ts = time.time() if ts is None else ts
        async with run.lock:
            seq = await self.backlog.append(run.run_id, run.last_seq + 1, kind, data, ts)
            if seq is None:  # the journal is down and this run's backlog is full: dropped
                return None
            run.last_seq = max(run.last_seq, seq)
            msg = {"run_id": run.run_id, "seq": seq, "ts": ts, "kind": kind, "data": data}
            for send in list(run.subscribers):
                try:
                    send.send_nowait(msg)
                except trio.WouldBlock:
                    logger.warning("run %s: dropping a subscriber that fell %d events behind", run.run_id, SUBSCRIBER_BUFFER)
                    run.subscribers.discard(send)
                    send.close()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    run.subscribers.discard(send)
        return seq

    async def _transition(self, run: _Run, new: RunState, *, reason: str | None = None) -> bool:
        if run.state in TERMINAL_STATES:
            return False
        ok = await self._write(
            run,
            f"state {new}",
            lambda j: j.transition(run.run_id, new, reason=reason),
            can_transition(run.state, new),
        )
        if ok:
            run.state = new
            data: dict[str, Any] = {"state": str(new)}
            if reason:
                data["reason"] = reason
            await self._record(run, "state", data)
        return ok

    async def _finish(
        self,
        run: _Run,
        state: RunState,
        *,
        reason: str | None,
        result: dict[str, Any] | None,
        partial: bool,
        error: dict[str, Any] | None,
        receipt: dict[str, Any] | None,
    ) -> None:
        """Write the run's terminal fact and let the run go. Never raises.

        The fact is written once (compare-and-set), or kept in memory while the journal
        cannot be written; if it cannot be stored at all (a bug, data no JSON holds), a
        minimal one is, naming the failure. Whatever happens, the run is let go: its
        token retired, its subscribers' channels closed, its waiters woken.
        """
        with trio.CancelScope(shield=True):
            try:
                ok = await self._write_terminal(run, state, reason, result, partial, error, receipt)
                run.token.retire()
                if ok:
                    run.state = state
                    data: dict[str, Any] = {"state": str(state), "partial": partial}
                    if reason:
                        data["reason"] = reason
                    await self._record(run, "state", data)
                elif not self.backlog.pending(run.run_id):
                    row = await self.journal.get_run(run.run_id)
                    if row is not None:
                        run.state = RunState(row["state"])
            except Exception:
                logger.exception("run %s: writing its end failed", run.run_id)
            finally:
                self._let_go(run)

    async def _write_terminal(
        self,
        run: _Run,
        state: RunState,
        reason: str | None,
        result: dict[str, Any] | None,
        partial: bool,
        error: dict[str, Any] | None,
        receipt: dict[str, Any] | None,
    ) -> bool:
        ended_at = time.time()
        groups_ended_at = _groups_ended_at(receipt)
        predicted = run.state not in TERMINAL_STATES
        fact: dict[str, Any] = {
            "state": str(state),
            "reason": reason,
            "ended_at": ended_at,
            "result": result if result is not None or not partial else run.partial,
            "partial": partial,
            "error": error,
            "receipt": receipt,
        }

        def write(any_live: bool) -> Any:
            return lambda j: j.finish(
                run.run_id, state, reason=reason, result=result, partial=partial, error=error,
                receipt=receipt, ended_at=ended_at, groups_ended_at=groups_ended_at,
                from_any_live_state=any_live,
            )

        try:
            ok = await self.backlog.write(run.run_id, write(False), predicted, what=f"terminal state {state}", replay=write(True))
        except Exception:
            logger.exception("run %s: its terminal fact cannot be stored as it is; storing a minimal one", run.run_id)
            reason = "internal"
            result, receipt = None, None
            error = {"code": "internal", "message": "the run's end could not be recorded in full (see the daemon log)"}
            fact.update(reason=reason, result=run.partial if partial else None, error=error, receipt=None)
            ok = await self.backlog.write(
                run.run_id, write(False), predicted, what=f"terminal state {state} (minimal)", replay=write(True)
            )
        if ok and self.backlog.pending(run.run_id):
            run.final = fact
            self._unflushed[run.run_id] = run
        return bool(ok)

    def _let_go(self, run: _Run) -> None:
        run.token.retire()
        run.stdout = bytearray()  # up to MAX_RESULT_BYTES, decoded already
        for send in list(run.subscribers):
            send.close()
        run.subscribers.clear()
        self._live.pop(run.run_id, None)
        run.done.set()


def _groups_ended_at(receipt: dict[str, Any] | None) -> float | None:
    """The wall time the stop receipt saw the whole tree dead, or None (survivors, unseen)."""
    if not receipt:
        return None
    path_b = receipt.get("path_b", receipt)
    if not isinstance(path_b, dict) or path_b.get("survivors") or path_b.get("tree_dead_at") is None:
        return None
    try:
        return time.time() - max(0.0, trio.current_time() - float(path_b["tree_dead_at"]))
    except (TypeError, ValueError, RuntimeError):
        return time.time()


def _leaf_errors(exc: BaseException) -> str:
    """What actually failed inside an exception group, for the run's record."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_leaf_errors(e) for e in exc.exceptions)
    return repr(exc)


def _sandbox_of(run: _Run | None, row: dict[str, Any]) -> dict[str, Any] | None:
    """A run's sandbox report: live from its runner, else as its receipt or result kept it."""
    if run is not None and run.sandbox is not None:
        return run.sandbox
    for key in ("receipt", "result"):
        doc = row.get(key)
        if isinstance(doc, dict) and isinstance(doc.get("sandbox"), dict):
            return doc["sandbox"]
    return None


def _validate_spec(spec: dict[str, Any], model_key: Secret | None = None, config: Config | None = None) -> str | None:
    """Reject a bad spec at spawn time, with the runner's own validator (stdlib only).

    Returns the model provider the run will use (None if the runner package is absent).
    A model that cannot be used is refused here, never replaced: provider "openai" with
    no API key (neither this daemon's ``OPENAI_API_KEY`` nor the run's own ``model_key``)
    and no base URL of a local server is a SpawnError saying where the key goes. So is a
    sandbox grant that would reach the daemon's state (``config``'s protected paths).
    """
    try:
        from subagent.spec import RunSpec, SpecError
    except ImportError:  # the runner package is not there: the runner will say so
        return None
    env = dict(os.environ)
    if model_key is not None:
        env["OPENAI_API_KEY"] = model_key.reveal()
    try:
        parsed = RunSpec.from_dict(spec, env)
    except SpecError as exc:
        raise SpawnError(f"invalid run spec: {exc}") from exc
    except Exception as exc:  # the validator tripped on a value (unhashable, overflow...): still bad input
        logger.info("spec validation raised %r", exc)
        raise SpawnError(f"invalid run spec: {type(exc).__name__}: {exc}") from exc
    model = parsed.model
    if model.provider == "openai" and not env.get("OPENAI_API_KEY") and not (model.base_url or env.get("OPENAI_BASE_URL")):
        asked = f"model {model.name!r}" if model.name else "provider 'openai'"
        raise SpawnError(
            f"invalid run spec: model: {asked} needs an API key and the daemon has none: set OPENAI_API_KEY "
            "in the daemon's environment (under systemd: /etc/agentd/agentd.env, see systemd/agentd.env.example, "
            "then restart agentd), or give this run its own with `agentd spawn --model-key-env VAR`; "
            "for a local OpenAI-compatible server set model.base_url or OPENAI_BASE_URL instead"
        )
    grants = parsed.sandbox
    if grants.granted:
        from subagent.sandbox import DEFAULT_PROTECT, check_grants
        from supervisor.pool import protected_paths

        protect = [*(protected_paths(config) if config is not None else ()), *DEFAULT_PROTECT]
        workdir = [grants.workdir] if grants.workdir else []
        why = check_grants(grants.read, [*grants.write, *workdir], protect)
        if why is not None:
            raise SpawnError(f"invalid run spec: sandbox: {why}")
        if grants.workdir is not None and not Path(grants.workdir).is_dir():
            raise SpawnError(f"invalid run spec: sandbox.workdir: expected an existing directory, got {grants.workdir!r}")
    if spec.get("browser"):
        # A missing Chromium or node is a clear error now, not a failed run later.
        from subagent.browser import BrowserSetupError, check_browser

        try:
            check_browser(spec["browser"])
        except BrowserSetupError as exc:
            raise SpawnError(f"invalid run spec: browser: {exc}") from exc
    return model.provider


def _exit_name(code: int | None) -> str:
    if code is None:
        return "unknown_exit"
    if code < 0:
        return f"signal_{-code}"
    try:
        return ExitCode(code).name.lower()
    except ValueError:
        return f"exit_{code}"
