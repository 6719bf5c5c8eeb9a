"""The run manager: the daemon's runs as the control socket sees them (its ``Backend``).

``RunManager`` takes requests (spawn, cancel, steer, approve/deny, status, list, events,
subscribe, sessions) and owns what runs need: the queue (``max_concurrent``), the runner
zygote and warm pool, the sessions, and the nursery every run's task lives in. A run's
facts go through the book (``supervisor.core._book``), its supervision is the one lifecycle
(``supervisor.core._lifecycle``) for a run started here and one re-adopted after a restart
(``supervisor.core.recovery``) alike.

Cancel goes two ways on purpose (DESIGN.md): path A at cancel time (``process.soft_stop``:
SIGTERM to the runner's group and to the command groups it reported interruptible; the
stop's reason is written into the run's stop marker first, ``_run.mark_stop``, so the
runner knows the SIGTERM for the daemon's stop and not someone else's), and
path B when the run's scope is cancelled (the lifecycle unwinds into a shielded
``process.terminate_and_kill``). A stop is journaled (reason, time, the wall-clock end of
its grace) before it is acknowledged, and a timeout is a wall-clock deadline, so a
restarted daemon resumes both.

Invariants: one cancel token per run, retired exactly once when the terminal fact is
written; the terminal fact is a compare-and-set in the journal, so a cancel racing a
completion yields one outcome, the true one; a stop is never recorded as failed. A run's
task never lets an exception out: a failure in one run's bookkeeping ends that run
alone, with its tree stopped.

Size: the control socket's backend, one method per op; a run's supervision, its facts
and recovery are in ``_lifecycle``, ``_book`` and ``recovery``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final, cast

import trio

from subagent.steering import MAX_STEER_LINE_BYTES
from supervisor.config import Config
from supervisor.core._book import SUBSCRIBER_BUFFER, RunBook
from supervisor.core._lifecycle import Lifecycle
from supervisor.core._pendingwatch import PendingWatch
from supervisor.core._run import Run, mark_stop
from supervisor.core._sources import FileSource, PipeSource
from supervisor.core._spec_check import spec_for_runner, validate_spec
from supervisor.core._steers import send_steer
from supervisor.core.approvals import ApprovalDesk, Hooks
from supervisor.core.diskguard import DiskGuard
from supervisor.core.recovery import Recovery
from supervisor.core.sessions import SessionDesk
from supervisor.core.token import CancelToken
from supervisor.errors import ControlProtocolError, JournalError, JournalUnavailable, RunNotFound, SpawnError
from supervisor.protocol import MAX_ID_CHARS, ErrorCode, Secret
from supervisor.states import TERMINAL_STATES, RunState
from supervisor.store.journal import Journal
from supervisor.trees import process
from supervisor.trees._nest import Nest
from supervisor.trees.containment import Containment
from supervisor.trees.pool import Warm, WarmPool, new_tree, sweep_run_root
from supervisor.trees.zygote import Spare, Zygote, usable

__all__ = ["RunManager"]

logger = logging.getLogger(__name__)

# Margin on top of the grace for waiting on every run to end at shutdown.
SHUTDOWN_MARGIN_S: Final = 5.0
# Margin on top of the grace for an interrupted (or closed) session's live turn to end
# before the new turn (or the close) goes ahead.
INTERRUPT_MARGIN_S: Final = 5.0
# How long a ``status`` of a run re-adopted at a restart waits for the daemon to have read
# what its runner did while no daemon watched (its events file); then it answers anyway.
STATUS_CATCH_UP_WAIT_S: Final = 2.0


# The states a stop moves to ``cancelling`` (a queued run leaves its queue; it never started).
_STOPPABLE: Final = frozenset({RunState.STARTING, RunState.RUNNING, RunState.AWAITING_APPROVAL})


# This long after a spec's limits.deadline_s, the daemon stops the run itself: a runner
# that cannot act (stopped, stuck in a call) missed its own deadline. (A runner that keeps
# it stops itself then, and the daemon takes that stop as its own: ``Lifecycle.on_event``.)
DEADLINE_BACKSTOP_MARGIN_S: Final = 5.0


def _with_deadline_backstop(timeout_s: float | None, spec: dict[str, Any]) -> float | None:
    """The run's timeout, no later than its spec's ``limits.deadline_s`` (the runner's own
    deadline) plus a margin: the deadline holds even for a runner that can no longer keep
    it (its own clock stopped with it)."""
    limits = spec.get("limits")
    deadline = limits.get("deadline_s") if isinstance(limits, dict) else None
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or not math.isfinite(deadline):
        return timeout_s
    backstop = float(deadline) + DEADLINE_BACKSTOP_MARGIN_S
    return backstop if timeout_s is None else min(timeout_s, backstop)


def _no_input_why(run: Run) -> str:
    """Why a run takes no steering now (a stop, its end, or no input yet)."""
    if run.token.cancelled:
        return "a stop is under way"
    if run.readopted:
        return "its runner was found again after a daemon restart: its input went with the old daemon"
    if run.stdin_closed:
        return "the run is ending: its runner's input is closed"
    return "the runner is not reading input yet"


class _KeyLock:
    """One idempotency key's lock, and how many spawns hold or wait for it."""

    __slots__ = ("lock", "holders")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.holders = 0


class RunManager:
    """Implements the control socket's Backend over the journal and the process layer."""

    def __init__(self, config: Config, journal: Journal, containment: Containment) -> None:
        self.config = config
        self.journal = journal
        self.containment = containment
        self.book = RunBook(journal)
        self.backlog = self.book.backlog
        self._live = self.book.live
        # Spares given their run at its spawn, before its first journal write (``_create``).
        self._assigned: dict[str, Spare] = {}
        # Runs started in their creation's commit, their place under max_concurrent held.
        self._started_at_spawn: set[str] = set()
        # Runs that asked for a spare at their spawn and found none: asking again at their
        # start is not one more spawn that wanted one (``Zygote.take_spare`` counts them).
        self._spare_asked: set[str] = set()
        # Spawns with an idempotency key, one at a time per key (dropped when none waits).
        self._key_locks: dict[str, _KeyLock] = {}
        self._limiter = trio.CapacityLimiter(config.max_concurrent)
        self._nursery: trio.Nursery | None = None
        self._accepting = False
        self._stopping = False  # ``shutdown`` began: the daemon is stopping its runs
        # Runners are forked by the zygote when it is usable and ready, else started cold.
        # The user namespace every run's own is made in: all runs' kernel counts bounded.
        self.nest = Nest(config)
        self._zygote = Zygote(config, containment, self.nest) if usable(config, containment) else None
        self._pool = WarmPool(config, containment, self._zygote, self.nest) if config.pool_size > 0 else None
        self.approvals = ApprovalDesk(
            Hooks(
                record=self.book.record,
                transition=lambda run, new, *, only_from: self.book.transition(run, new, only_from=only_from),
                cancel=lambda run_id, reason: self.cancel(run_id, reason=reason),
                record_durable=self.book.record_durable,
            )
        )
        self.lifecycle = Lifecycle(
            config,
            self.book,
            containment,
            self.approvals,
            cancel=lambda run_id, reason: self.cancel(run_id, reason=reason),
        )
        self._recovery = Recovery(self.book, self.lifecycle, containment)
        self.pending_watch = PendingWatch(
            config.state_dir,
            live=self._live,
            cancel=lambda run_id, reason: self.cancel(run_id, reason=reason),
            get_run=journal.get_run,
        )
        self.session_desk = SessionDesk(
            config, journal, live_sessions=lambda: {r.session_id for r in self._live.values() if r.session_id}
        )
        # A run that fills the disk is stopped (reason ``disk_full``): looked at when the
        # journal is written or cannot be, at a spawn, and on a slow tick while runs are live.
        self.disk = DiskGuard(
            config,
            self._live,
            record=self.book.record,
            cancel=lambda run_id, reason: self.cancel(run_id, reason=reason),
            profile_of=self._profile_of,
            evict_profile=self.session_desk.evict_profile,
        )
        self.backlog.on_written = self.disk.poke
        self.backlog.on_unavailable = self.disk.journal_failed

    # ------------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the runs nursery until cancelled. Call ``shutdown()`` first to stop runs."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.backlog.run)
                for run, source in await self._recovery.recover():
                    nursery.start_soon(self._supervise_adopted, run, source, name=f"run {run.run_id} (re-adopted)")
                # What a previous daemon killed -9 left of trees no run holds (its spares, its
                # warm runners): before this daemon makes trees of its own there.
                try:
                    keep = {Path(row["run_dir"]).name for row in await self.journal.live_runs() if row["run_dir"]}
                    swept = await trio.to_thread.run_sync(sweep_run_root, self.config.run_root, keep)
                except (JournalError, OSError) as exc:
                    logger.warning("could not look for run directories no run holds: %s", exc)
                else:
                    if swept:
                        logger.info("removed %d run directories no run holds (a previous daemon's spares)", swept)
                await self.nest.make()  # before any runner of this daemon starts
                if self._zygote is not None:
                    await nursery.start(self._zygote.run)
                if self._pool is not None:
                    await nursery.start(self._pool.run)
                await nursery.start(self.session_desk.run)
                await nursery.start(self.disk.run)
                # Runs left queued, queued again (``_requeue``): oldest first, ahead of any
                # new spawn, once what starts a runner is there (the nest, the zygote).
                for run in self._recovery.requeued:
                    self._live[run.run_id] = run
                    await nursery.start(self._start_requeued, run, name=f"run {run.run_id} (re-queued)")
                self._recovery.requeued = []
                # A stop recorded after recovery read the notes is applied now, not at the
                # next start (after the re-queued runs are live: a note may name one).
                self.pending_watch.skip(self._recovery.notes_read)
                await nursery.start(self.pending_watch.run)
                self._accepting = True
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.nest.close()  # (a run still in it keeps it alive: it is theirs)

    def _profile_of(self, run: Run) -> Path | None:
        """The browser profile a session's browser turn may write (its session's), or None."""
        if run.session_id is None or not run.spec.get("browser"):
            return None
        return self.session_desk.profile_path(run.session_id)

    def leave_runs(self) -> None:
        """The daemon's start failed: its live runs (re-adopted ones: it took no spawn
        yet) are left as they are for the next start, not ended as the runs nursery
        unwinds (``Lifecycle.leaving``)."""
        self._accepting = False
        self.lifecycle.leaving = True

    @property
    def live_count(self) -> int:
        return len(self._live)

    async def flush_journal(self) -> None:
        """At shutdown: write what waits for the journal, or say what is lost."""
        with trio.CancelScope(shield=True):
            if not await self.backlog.flush():
                self.backlog.report_unwritten()

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Stop accepting runs, cancel every live run (both paths) and wait for them."""
        self._accepting = False
        self._stopping = True
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
        key: str | None = None,
    ) -> dict[str, Any]:
        """Start a run. ``model_key``: its own model API key (see ``_validate_spec``).

        ``key``: the spawn's idempotency key (client-chosen). The first spawn with a key
        that creates a run records the key with it, in the run's creation commit; a
        spawn with a key already recorded starts nothing and returns that run, whatever
        its state now (``"existing": true``; its spec is not compared). Spawns with one
        key are taken one at a time. A spawn refused creates no run and records nothing.

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
        if key is None:
            return await self._spawn(spec, session_id, timeout_s, model_key, interrupt, None)
        if not isinstance(key, str) or not key.strip() or len(key) > MAX_ID_CHARS:
            raise SpawnError(f"invalid spawn key: a non-empty string of at most {MAX_ID_CHARS} chars")
        lock = self._key_locks.get(key)
        if lock is None:
            lock = self._key_locks[key] = _KeyLock()
        lock.holders += 1
        try:
            async with lock.lock:
                existing = await self.journal.run_for_key(key)
                if existing is not None:
                    run = self._live.get(existing)
                    record = await self.journal.get_run(existing) if run is None else None
                    state = str(run.state) if run is not None else str(record["state"]) if record else None
                    session = run.session_id if run is not None else record["session_id"] if record else None
                    return {"run_id": existing, "state": state, "session_id": session, "existing": True}
                return await self._spawn(spec, session_id, timeout_s, model_key, interrupt, key)
        finally:
            lock.holders -= 1
            if lock.holders == 0:
                del self._key_locks[key]

    async def _spawn(
        self,
        spec: dict[str, Any],
        session_id: str | None,
        timeout_s: float | None,
        model_key: Secret | None,
        interrupt: bool,
        key: str | None,
    ) -> dict[str, Any]:
        run_id = "r-" + uuid.uuid4().hex[:16]
        spec = dict(spec)
        spec["run_id"] = run_id
        if session_id is not None:
            spec["session_id"] = session_id
        else:
            session_id = spec.get("session_id")
            if session_id is not None and (
                not isinstance(session_id, str) or not session_id.strip() or len(session_id) > MAX_ID_CHARS
            ):
                # As the request's own session_id is checked (``protocol``): a session that
                # could never be closed, read or cancelled by its id is refused here.
                raise SpawnError(f"invalid run spec: session_id: a non-empty string of at most {MAX_ID_CHARS} chars")
        if timeout_s is None:
            timeout_s = self.config.default_timeout_s
        if "tool_paths" in spec:
            raise SpawnError("invalid run spec: tool_paths: the daemon sets it (what the run's tools need)")
        if "session" in spec:
            raise SpawnError(
                "invalid run spec: session: the daemon sets it for a turn of a session (its history, its "
                "browser profile); spawn with a session_id instead"
            )
        provider = validate_spec(spec, model_key, self.config)
        timeout_s = _with_deadline_backstop(timeout_s, spec)
        if provider is not None:
            # The provider chosen here, from this daemon's environment, is the one the run
            # uses and the one status shows: the runner does not choose again.
            spec["model"] = {**(spec.get("model") or {}), "provider": provider}
        if not isinstance(session_id, str):
            return await self._create(run_id, None, spec, timeout_s, model_key, key)
        async with self.session_desk.lock(session_id):
            await self.session_desk.open(session_id)
            live = [r for r in self._live.values() if r.session_id == session_id]
            if live and not interrupt:
                raise ControlProtocolError(
                    ErrorCode.SESSION_BUSY,
                    f"session {session_id!r} has a live turn, run {live[0].run_id!r} ({live[0].state}): "
                    "wait for it to end, cancel it, or start the new turn with interrupt (agentd spawn --interrupt)",
                )
            if live and self.backlog.degraded:
                # The new turn could not be created (no new run while the journal cannot be
                # written): its interrupt would stop the live turn for nothing.
                raise JournalUnavailable(
                    f"no new turn while the journal cannot be written ({self.backlog.error}); "
                    f"the live turn {live[0].run_id!r} goes on"
                )
            await self._end_turns(live, "user", f"a new turn of session {session_id!r}")
            try:
                return await self._create(run_id, session_id, spec, timeout_s, model_key, key)
            except JournalUnavailable as exc:
                if not live:
                    raise
                # Found only now (the first write that failed): said, not hidden.
                raise JournalUnavailable(
                    f"{exc}; the live turn {live[0].run_id!r} was stopped first (interrupt)", path=exc.path
                ) from exc

    async def _end_turns(self, runs: list[Run], reason: str, why: str) -> None:
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
            raise ControlProtocolError(
                ErrorCode.REFUSED, f"{why}: the live turn {left[0]!r} has not ended yet (stop sent)"
            )

    async def _create(
        self,
        run_id: str,
        session_id: str | None,
        spec: dict[str, Any],
        timeout_s: float | None,
        model_key: Secret | None,
        key: str | None = None,
    ) -> dict[str, Any]:
        if not self._accepting or self._nursery is None:
            raise SpawnError("the daemon is not accepting runs (shutting down)")
        run = Run(
            run_id=run_id,
            session_id=session_id,
            spec=spec,
            timeout_s=timeout_s,
            token=CancelToken(run_id),
            model_key=model_key,
        )
        if session_id is not None and not spec.get("browser"):
            await self._prepare_turn_early(run)
        # A spare runner gets the run now, before any of its journal writes: it reads its
        # spec and sandboxes itself while they commit (it takes no step before ``go``).
        # It starts at once, its place under max_concurrent taken now (no checkpoint
        # since there was one), so its start goes in its creation's commit: the run's
        # record, `queued`, `starting` and their events, its deadline and the spare's
        # process record, one fsync; `go` follows it (``_start_runner``).
        start = None
        if self._limiter.available_tokens > 0:
            spare = self._assign_spare(run)
            if spare is None:
                self._spare_asked.add(run_id)
            else:
                self._assigned[run_id] = spare
                try:
                    self._limiter.acquire_on_behalf_of_nowait(run)
                except trio.WouldBlock:  # others wait for a place: it queues behind them
                    pass
                else:
                    self._started_at_spawn.add(run_id)
                    start = spare.process_record()
        try:
            await self.book.create(run, created_at=time.time(), start=start, key=key)
        except BaseException as exc:
            self._undo_spawn(run)
            if not isinstance(exc, JournalUnavailable):
                raise
            self.backlog.note_failure(exc, "a new run")
            raise JournalUnavailable(f"no new runs while the journal cannot be written ({exc})", path=exc.path) from exc
        self.backlog.note_success()
        self._live[run_id] = run
        try:
            self._nursery.start_soon(self._start, run, name=f"run {run_id}")
        except BaseException:
            self._undo_spawn(run)
            raise
        return {"run_id": run_id, "state": str(run.state), "session_id": session_id}

    async def _prepare_turn_early(self, run: Run) -> None:
        """A session's turn gets its spec (the ended turns' history) before its creation, so
        that a spare can take it. Under the session's lock, with no turn of the session
        live, that history is the one its start would read. A failure here is left to its
        start, which prepares the turn again and ends the run on it.

        Not for a browser turn: its profile is taken under the session's lock, which the
        spawn holds here, and a profile made sweeps others under theirs (a lock order two
        spawns could deadlock on); it is prepared at its start, and Chromium's own start
        dwarfs what a spare saves."""
        assert run.session_id is not None
        try:
            run.runner_spec, run.session_event = await self.session_desk.prepare_turn(
                run.run_id, run.session_id, run.spec
            )
        except (OSError, JournalError) as exc:
            logger.info("run %s: its session's turn is prepared at its start instead: %s", run.run_id, exc)
            run.runner_spec = run.session_event = None

    def _undo_spawn(self, run: Run) -> None:
        """A spawn that failed after taking a spare or a place: both given back."""
        self._spare_asked.discard(run.run_id)
        spare = self._assigned.pop(run.run_id, None)
        if spare is not None:
            spare.discard()
        if run.run_id in self._started_at_spawn:
            self._started_at_spawn.discard(run.run_id)
            self._limiter.release_on_behalf_of(run)

    async def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        run = self._live.get(run_id)
        if run is None:
            row = await self.journal.get_run(run_id)
            if row is None:
                raise RunNotFound(run_id)
            return {"run_id": run_id, "was_active": False, "state": row["state"]}
        was_active, first = self._stop_now(run, reason)
        return await self._record_stop(run, reason, was_active, first)

    def _stop_now(self, run: Run, reason: str, asked: tuple[float, float] | None = None) -> tuple[bool, bool]:
        """A cancel's first half, with no await: the token, path A, the run's scopes.

        ``asked``: when the cancel was asked (Trio clock, wall clock; default now): a
        cancel of many runs asks every one at once, and each one's grace counts from then.
        Returns (was_active, first): the run was live; this cancel started its stop.
        """
        was_active = run.token.cancel(reason)
        first = was_active and run.token.first_cancel
        if first:
            run.stop_taken.set()  # (a steer waiting for room in its input gives up: ``_steers``)
            run.cancel_at, run.cancel_wall = asked if asked is not None else (trio.current_time(), time.time())
            run.stop_deadline = run.cancel_wall + self.config.grace_s
            # Path A: fire and forget, whole-group soft stop; its marker first, so the
            # runner knows the SIGTERM for the daemon's stop (``mark_stop``).
            if run.tree is not None:
                mark_stop(run, run.token.reason or reason)
                run.path_a = process.soft_stop(run.tree)
            # Path B: unwinding the run's scope ends in terminate_and_kill.
            if run.scope is not None:
                run.scope.cancel()
            if run.queue_scope is not None:
                run.queue_scope.cancel()
        return was_active, first

    async def _record_stop(self, run: Run, reason: str, was_active: bool, first: bool) -> dict[str, Any]:
        """A cancel's second half: the stop's durable intent, then the acknowledgement."""
        run_id = run.run_id
        if first:
            # Durable intent before the acknowledgement: a restarted daemon finishes it.
            # Shielded: a cancel whose own task is cancelled (a timeout's, as the run
            # ends) still records the stop it started, which other cancels wait for.
            with trio.CancelScope(shield=True):
                try:
                    why, at, until = run.token.reason or reason, run.cancel_wall, run.stop_deadline
                    assert at is not None and until is not None
                    detail = run.stop_detail  # (the disk guard's measurement), with the intent
                    await self.book.write(
                        run,
                        "stop intent",
                        lambda j: j.record_cancel(run_id, reason=why, at=at, stop_deadline=until, detail=detail),
                        True,
                        # While it waits for the journal: in the note on disk before the reply.
                        stop={"reason": why, "at": at, "stop_deadline": until, "detail": detail},
                    )
                    await self.book.transition(run, RunState.CANCELLING, reason=reason, only_from=_STOPPABLE)
                finally:
                    run.stop_recorded.set()
        elif was_active:
            # Another cancel started this stop: acknowledged once that one's intent is
            # durable, as the first one is (a `kill -9` after either reply loses no stop).
            await run.stop_recorded.wait()
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
        line = (json.dumps({"steer": text}) + "\n").encode()
        if len(line) > MAX_STEER_LINE_BYTES:
            raise ControlProtocolError(
                ErrorCode.BAD_ARGS,
                f"steering text too long: {len(line)} bytes as sent to the runner (at most {MAX_STEER_LINE_BYTES})",
            )
        run = self._live.get(run_id)
        if run is None:
            row = await self.journal.get_run(run_id)
            if row is None:
                raise RunNotFound(run_id)
            return {"run_id": run_id, "accepted": False, "state": row["state"], "why": "the run has ended"}
        async with run.stdin_lock:  # the feed's end (``PipeSource.feed``) changes run.stdin
            if run.token.cancelled or run.stdin is None:
                return {"run_id": run_id, "accepted": False, "state": str(run.state), "why": _no_input_why(run)}
            # Journaled before it can reach the runner (``_steers.send_steer``).
            why = await send_steer(self.book, run, text, line)
        if why is not None:
            return {"run_id": run_id, "accepted": False, "state": str(run.state), "why": why}
        return {"run_id": run_id, "accepted": True, "state": str(run.state)}

    async def approve(self, run_id: str, call_id: str) -> dict[str, Any]:
        """A person's OK for a call awaiting approval: it runs (``supervisor.core.approvals``)."""
        return await self.approvals.answer(await self._live_run(run_id), call_id, approve=True)

    async def deny(self, run_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """A person's no: the call never runs, the model is told why, the turn goes on."""
        return await self.approvals.answer(await self._live_run(run_id), call_id, approve=False, reason=reason)

    async def _live_run(self, run_id: str) -> Run:
        run = self._live.get(run_id)
        if run is not None:
            return run
        row = await self.journal.get_run(run_id)
        if row is None:
            raise RunNotFound(run_id)
        raise ControlProtocolError(
            ErrorCode.REFUSED, f"run {run_id!r} has ended ({row['state']}): nothing awaits approval"
        )

    async def history(self, session_id: str, **page: int) -> dict[str, Any]:
        """A session's transcript, one page of it, rebuilt from the journal
        (``supervisor.core.sessions``; ``page``: ``before_turn``, ``after_turn``, ``max_bytes``)."""
        live = {r.run_id: str(r.state) for r in self._live.values() if r.session_id == session_id}
        return await self.session_desk.history(session_id, live, **page)

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
            # The daemon's own leaf cgroup beside that subtree (per-run limits on cgroup v2:
            # ``trees/_placement.py``), or None: it stayed in the subtree's parent.
            "daemon_cgroup": str(self.containment.leaf) if self.containment.leaf is not None else None,
            # Each run's pids limit: where it lives ("v2", "v1") or None (no limit).
            "pids_limit": self.containment.pids.describe(),
            # Each run's memory limit: "v2" (its cgroup's memory.max), "v1" (a cgroup v1
            # memory group) or None (no limit).
            "memory_limit": self.containment.memory.describe(),
            "sandbox": self.config.sandbox,
            "warm_runners": self._pool.ready if self._pool is not None else 0,
            "zygote": self._zygote.describe() if self._zygote is not None else {"state": "off"},
            # The total all runs together may take of the uid's kernel counts (``trees/_nest.py``).
            "nest": self.nest.describe(),
            # A spawn is refused while the journal cannot be written (``journal`` says why).
            "accepting": self._accepting and not self.backlog.degraded,
            # Shutting down (``systemctl stop``, SIGTERM): its runs are being stopped.
            "stopping": self._stopping,
            "journal": {**self.backlog.describe(), **self._commit_counts()},
            "disk": self.disk.describe(),
            "containment_problem": self.containment.problem,
        }

    def _commit_counts(self) -> dict[str, int]:
        commits, durable = self.book.journal.commit_counts()
        return {"commits": commits, "durable_commits": durable}

    async def cancel_session(self, session_id: str, *, reason: str = "user", turn: str | None = None) -> dict[str, Any]:
        """Stop the session's live turn (none: an empty ``runs``); ``live_run`` is its live
        turn once the stop is recorded (the stopped one until it ends), or None.

        Without ``turn`` it stops whatever turn is live when the cancel arrives: a Stop
        pressed on turn 1 that arrives after turn 2 started stops turn 2. ``turn`` (a run id
        of the session) names the turn meant: that one is stopped if it is still live, and
        nothing else ever is (``runs`` is that turn alone, ``was_active`` false once it
        ended, with its terminal state).

        Raises:
            SessionNotFound: no run ever had this session (a mistyped id is not "no live run").
            RunNotFound: ``turn`` names no run.
            ControlProtocolError: ``bad_args``, ``turn`` is a run of another session or none.
        """
        if turn is None:
            hits = [r.run_id for r in list(self._live.values()) if r.session_id == session_id]
            if not hits:
                await self.session_desk.known(session_id)
        else:
            await self._check_turn(session_id, turn)
            hits = [turn]
        out = await self._cancel_many(hits, reason)
        live_run = next((r.run_id for r in self._live.values() if r.session_id == session_id), None)
        was_active = any(o.get("was_active") for o in out)
        return {"session_id": session_id, "was_active": was_active, "runs": out, "live_run": live_run}

    async def _check_turn(self, session_id: str, turn: str) -> None:
        """Raises unless run ``turn`` is (or was) a turn of ``session_id``."""
        run = self._live.get(turn)
        if run is not None:
            of = run.session_id
        else:
            row = await self.journal.get_run(turn)
            if row is None:
                raise RunNotFound(turn)
            of = row["session_id"]
        if of != session_id:
            whose = f"of session {of!r}" if of is not None else "of no session"
            raise ControlProtocolError(
                ErrorCode.BAD_ARGS, f"run {turn!r} is not a turn of session {session_id!r} ({whose})"
            )

    async def cancel_many(self, run_ids: list[str], *, reason: str = "user") -> list[dict[str, Any]]:
        """Cancel many runs at once (``cancel`` with ``run_ids``): each one's result, in
        order, or ``{"run_id", "error"}`` for an id with no run. Every live run's stop is
        under way (path A sent, its scope cancelled) before any of them is journaled; the
        reply comes once every stop is durable (the journal commits them together)."""
        return await self._cancel_many(run_ids, reason)

    async def _cancel_many(self, run_ids: list[str], reason: str) -> list[dict[str, Any]]:
        """Cancel side by side: every run's path A goes out, in one loop with no await
        between them, before any journal write (a thousand runs stopping must not wait
        behind each other's bookkeeping); then each stop's durable intent, concurrently."""
        out: dict[str, dict[str, Any]] = {}
        started: list[tuple[Run, bool, bool]] = []
        asked = (trio.current_time(), time.time())
        for run_id in dict.fromkeys(run_ids):
            run = self._live.get(run_id)
            if run is not None:
                started.append((run, *self._stop_now(run, reason, asked)))
        live = {run.run_id for run, _, _ in started}

        async def record(run: Run, was_active: bool, first: bool) -> None:
            out[run.run_id] = await self._record_stop(run, reason, was_active, first)

        async def ended(run_ids: list[str]) -> None:  # no live run: its stored state, or not found
            states = await self.journal.run_states(run_ids)  # one query for them all
            for run_id in run_ids:
                state = states.get(run_id)
                if state is None:
                    message = str(RunNotFound(run_id))
                    out[run_id] = {"run_id": run_id, "error": {"code": str(ErrorCode.NOT_FOUND), "message": message}}
                else:
                    out[run_id] = {"run_id": run_id, "was_active": False, "state": state}

        async with trio.open_nursery() as n:
            for run, was_active, first in started:
                n.start_soon(record, run, was_active, first)
            gone = [r for r in dict.fromkeys(run_ids) if r not in live]
            if gone:
                n.start_soon(ended, gone)
        return [out[r] for r in run_ids]

    async def status(self, run_id: str) -> dict[str, Any]:
        """The run's record, with what only the daemon knows beside it. A run re-adopted at
        a restart is shown once its events file has been read (what its runner did while no
        daemon watched), waiting ``STATUS_CATCH_UP_WAIT_S`` at most; past that the reply
        says ``catching_up: true``."""
        run = self._live.get(run_id)
        if run is not None and run.caught_up is not None:
            with trio.move_on_after(STATUS_CATCH_UP_WAIT_S):
                await run.caught_up.wait()
        record = await self.journal.get_run(run_id)
        if record is None:
            raise RunNotFound(run_id)
        run = self._live.get(run_id)
        if run is not None and run.state in TERMINAL_STATES and record["state"] not in TERMINAL_STATES:
            # Its end was written while the journal was read: its result is there now (a
            # terminal state laid over the older row said "completed" with no result).
            record = await self.journal.get_run(run_id) or record
            run = self._live.get(run_id)
        # The reply: the journal's record, and what only the daemon knows beside it.
        row: dict[str, Any] = {**record}
        row["live"] = run is not None
        row["approvals"] = run.approvals.view() if run is not None else []
        if run is not None and not (record["state"] in TERMINAL_STATES and run.state not in TERMINAL_STATES):
            # (A journaled end whose state is not yet set in memory stays the end.)
            row["state"] = str(run.state)
            if run.partial is not None:
                row["partial_snapshot"] = run.partial
        self.book.overlay_unwritten(row)
        row["sandbox"] = _sandbox_of(run, row)
        if run is not None and run.caught_up is not None and not run.caught_up.is_set():
            row["catching_up"] = True
        return row

    async def list_runs(
        self, *, limit: int = 50, state: str | None = None, session_id: str | None = None, key: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest runs first; with ``key``, the run a spawn with that key created (or none).
        A run re-adopted at a restart whose events file is not read yet says
        ``catching_up: true`` (its state may be behind; ``status`` of it waits for the read)."""
        states = [RunState(state)] if state else None
        records = await self.journal.list_runs(limit=limit, states=states, session_id=session_id, key=key)
        rows: list[dict[str, Any]] = [{**record} for record in records]
        for row in rows:
            run = self._live.get(row["id"])
            row["live"] = run is not None
            if run is not None:
                row["state"] = str(run.state)
                if run.caught_up is not None and not run.caught_up.is_set():
                    # Re-adopted, its events file not read yet: its state may be behind.
                    row["catching_up"] = True
            self.book.overlay_unwritten(row)
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
        # A journal EventRecord is a plain dict, as the reply wants it.
        return cast("list[dict[str, Any]]", list(page)), more

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

    # ------------------------------------------------------------------ starting a run

    async def _supervise_adopted(self, run: Run, source: FileSource) -> None:
        """A run re-adopted at the restart holds its place under ``max_concurrent`` while it
        lives, as it did under the old daemon: a run queued again waits behind it. (Beyond
        a ``max_concurrent`` lowered meanwhile it runs on without one: it is running.)"""
        try:
            self._limiter.acquire_on_behalf_of_nowait(run)
        except trio.WouldBlock:
            held = False
            logger.warning("run %s: re-adopted beyond max_concurrent (%d)", run.run_id, self.config.max_concurrent)
        else:
            held = True
        try:
            await self.lifecycle.supervise(run, source)
        finally:
            if held:
                self._limiter.release_on_behalf_of(run)

    async def _start_requeued(self, run: Run, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A run queued again at the restart: in the queue before ``start`` returns, so the
        runs take their places in the order they are started. (``task_status.started()``
        then the limiter's wait, with no checkpoint between: ``acquire_on_behalf_of`` parks
        at once when no place is free.) A session's turn goes after its session's live
        turn (one turn of a session is live at a time): it queues once that one ended."""
        before = [r for r in self._live.values() if r is not run and r.session_id and r.session_id == run.session_id]
        task_status.started()
        for turn in before:
            await turn.done.wait()
        await self._start(run)

    async def _start(self, run: Run) -> None:
        # A task root: nothing gets out of it (see the module docstring).
        try:
            await self._queue_and_start(run)
        except Exception:
            logger.exception("run %s: ending its supervision failed", run.run_id)

    async def _queue_and_start(self, run: Run) -> None:
        started = acquired = run.run_id in self._started_at_spawn
        self._started_at_spawn.discard(run.run_id)
        try:
            with trio.CancelScope() as run.queue_scope:
                if not run.token.cancelled and not acquired:
                    await self._limiter.acquire_on_behalf_of(run)
                    acquired = True
            run.queue_scope = None
            if run.token.cancelled:
                await self._never_started(run, let_go=started)
                return
            await self._execute(run, started=started)
        except Exception as exc:
            logger.exception("run %s: supervision failed", run.run_id)
            await self.lifecycle.finish_internal_error(run, exc, self.lifecycle.receipt_head(run))
        finally:
            self._spare_asked.discard(run.run_id)
            spare = self._assigned.pop(run.run_id, None)
            if spare is not None:
                spare.discard()  # cancelled while queued: it never ran
            if acquired:
                self._limiter.release_on_behalf_of(run)
            if not run.done.is_set():  # only on a bug: never leave waiters hanging
                self.book.let_go(run)

    async def _never_started(self, run: Run, *, let_go: bool) -> None:
        """A run stopped before it started: ``cancelled``, its receipt says when (queued, or
        before its runner was let go)."""
        note = "cancelled before its runner was let go" if let_go else "cancelled while queued"
        await self.book.finish(
            run,
            RunState.CANCELLED,
            reason=run.token.reason,
            result=None,
            partial=False,
            error=None,
            receipt={"note": f"{note}: never started", **self.lifecycle.receipt_head(run)},
        )

    async def _execute(self, run: Run, *, started: bool = False) -> None:
        """Start the run's runner (its session's turn prepared, its deadline journaled) and
        supervise it. ``started``: its start was journaled with its creation, and the
        spare assigned then (its process record in that commit) is the only one it takes."""
        spare = self._assigned.pop(run.run_id, None)
        asked = run.run_id in self._spare_asked
        self._spare_asked.discard(run.run_id)
        if spare is None and not started:
            spare = self._assign_spare(run, count=not asked)
        try:
            await self._start_runner(run, spare, started=started)
        finally:
            if spare is not None:
                spare.discard()  # not taken (``_start_runner`` took it, or gave up): it exits

    def _assign_spare(self, run: Run, *, count: bool = True) -> Spare | None:
        """A zygote's spare, given this run before its start is journaled (it reads its
        spec and sandboxes itself meanwhile, and takes no step before ``go``), or None.

        Not for a session's turn whose spec is not made yet (``_prepare_turn_early``), nor
        when a warm runner of the pool will serve the run."""
        if self._zygote is None or (run.session_id is not None and run.runner_spec is None):
            return None
        if self._pool is not None and self._pool.ready and run.model_key is None:
            return None
        spare = self._zygote.take_spare(count=count)
        if spare is None:
            return None
        extra_env = {"AGENTD_RUN_ID": run.run_id}
        if run.model_key is not None:
            extra_env["OPENAI_API_KEY"] = run.model_key.reveal()
        spec_line = (json.dumps(spec_for_runner(run.runner_spec or run.spec)) + "\n").encode()
        return spare if spare.assign([], extra_env, spec_line) else None

    async def _start_runner(self, run: Run, spare: Spare | None, *, started: bool = False) -> None:
        # `starting`, its event, its deadline and a spare's process record: one commit
        # (the creation's, when ``started``), before the spare is let go (a daemon that dies
        # before `go` leaves recovery a spare that exits on the hang-up having done nothing
        # of the run: it ends `lost`, never started twice).
        if not started:
            await self.book.start(run, process=spare.process_record() if spare is not None else None)
        # A turn prepared at its creation had its `session` event in its start's commit
        # (``RunBook``), unless the journal was down then: written on its own below.
        session_event, run.session_event = run.session_event, None
        if run.session_id is not None and run.runner_spec is None:
            # A stop ends the preparation: a browser turn takes its session's lock here,
            # which a `session close` or an `--interrupt` spawn holds while it waits for
            # this very turn to end (``queue_scope``: what ``_stop_now`` cancels).
            problem: str | None = None
            with trio.CancelScope() as run.queue_scope:
                if not run.token.cancelled:
                    try:
                        run.runner_spec, session_event = await self.session_desk.prepare_turn(
                            run.run_id, run.session_id, run.spec
                        )
                    except (OSError, JournalError) as exc:
                        logger.warning("run %s: could not prepare its session's turn: %s", run.run_id, exc)
                        problem = f"the session's history or profile: {exc}"
            run.queue_scope = None
            if run.runner_spec is None:
                await self.book.finish(
                    run,
                    RunState.CANCELLED if run.token.cancelled else RunState.FAILED,
                    reason=run.token.reason or "session_setup",
                    result=None,
                    partial=False,
                    error=None if problem is None else {"code": "session_setup", "message": problem},
                    receipt=None
                    if problem is not None
                    else {
                        "note": "cancelled before its runner started: never started",
                        **self.lifecycle.receipt_head(run),
                    },
                )
                return
        if session_event is not None:  # before `go`: ahead of the turn's own events
            await self.book.record(run, "session", session_event)
        # A warm runner's environment was set before its spec came: a run with its own
        # model key starts cold, with the key in its runner's environment.
        warm = None
        recorded = False  # the journal's process record is the runner's already (a spare's)
        if spare is not None:
            # Its start is journaled: the spare may run (or, gone, the run forks below).
            # Unless a stop came meanwhile (its start's commit, the spare's acknowledgement
            # are checkpoints): then it is never let go (``Spare.go``), and a stop ends the
            # wait for its acknowledgement (``queue_scope``: what ``_stop_now`` cancels).
            taken, spare = spare, None
            spare_tree = None
            if not run.token.cancelled:
                with trio.CancelScope() as run.queue_scope:
                    # Its start (the spare's process record) in the journal, not only
                    # queued, before the spare may run (as ``announce`` for a new tree).
                    await self.backlog.wait_written(run.run_id)
                    spare_tree = await taken.go(stopped=lambda: run.token.cancelled)
                run.queue_scope = None
            if spare_tree is not None:
                warm = Warm(tree=spare_tree, run_dir=taken.run_dir, spec_sent=taken.spec_sent)
                recorded = True
            elif run.token.cancelled:
                taken.discard(released=True)  # hung up on: it exits having done nothing
        elif self._pool is not None and run.model_key is None and not run.token.cancelled:
            warm = self._pool.take()
        if warm is None and run.token.cancelled:
            # Stopped before its runner was let go (or forked): none ever is; the spare
            # it had exits at its hang-up having done nothing of the run (``_execute``).
            await self._never_started(run, let_go=True)
            return
        if warm is None:
            extra_env = {"AGENTD_RUN_ID": run.run_id}
            if run.model_key is not None:
                extra_env["OPENAI_API_KEY"] = run.model_key.reveal()
            try:
                warm = await new_tree(
                    self.config, self.containment, warm=False, extra_env=extra_env, zygote=self._zygote, nest=self.nest
                )
            except (OSError, SpawnError) as exc:
                logger.warning("run %s: could not start the runner: %s", run.run_id, exc)
                await self.book.finish(
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
        run.tree = tree

        async def announce() -> None:
            fields: dict[str, Any] = {
                "pid": tree.pid,
                "pid_start_time": tree.start_time,
                "pgid": tree.pgid,
                "tree_id": tree.tree_id,
                "cgroup": str(tree.cgroup) if tree.cgroup else None,
                "containment": tree.containment,
                "run_dir": str(run_dir),
            }
            await self.book.write(run, "process record", lambda j: j.record_process(run.run_id, **fields), True)
            # Its spec once the record is in the journal, not only queued (degraded): a
            # daemon killed meanwhile leaves a runner that never had it (it exits at EOF),
            # not one running its run that no restarted daemon can find. A stop ends the wait.
            await self.backlog.wait_written(run.run_id)

        await self.lifecycle.supervise(
            run,
            PipeSource(tree, run_dir, early_stderr=warm.early_stderr, spec_sent=warm.spec_sent),
            announce=None if recorded else announce,
        )


def _sandbox_of(run: Run | None, row: dict[str, Any]) -> dict[str, Any] | None:
    """A run's sandbox report: live from its runner, else as its receipt or result kept it."""
    if run is not None and run.sandbox is not None:
        return run.sandbox
    for key in ("receipt", "result"):
        doc = row.get(key)
        sandbox = doc.get("sandbox") if isinstance(doc, dict) else None
        if isinstance(sandbox, dict):
            return sandbox
    return None
