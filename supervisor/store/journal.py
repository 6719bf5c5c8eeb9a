"""The durable store: runs, their events, tool-call records and terminal facts, in SQLite.

Invariants: one worker thread owns the only sqlite3 connection and runs every call in
submission order, each as one transaction of its own or, when calls queued up while it
was busy, as one savepoint of a shared transaction (a group commit: a call that fails
leaves no write, the others' stand; one commit, fsynced if any of them needs it); a run's terminal state is written once
(compare-and-set in SQL, backed by a trigger) and nothing changes it afterwards; event
sequence numbers are assigned in the database per run, start at 1, have no gaps and
survive restarts; a call that returned has committed, and one that carried a terminal
fact (or a state, a pid, a group) was fsynced first. Errors reach callers as
``JournalError`` (naming the file) or ``RunNotFound``, never as sqlite3 exceptions; a
condition of the store rather than of the data (disk full, read-only, I/O error) is a
``JournalUnavailable``, which the same call may not meet later. Text that SQLite cannot
store (lone surrogates) is written with those characters escaped, never refused. A
journal file removed or replaced under the open journal is put back at its path with
everything written to it before any call that wrote after that returns (the other file
kept aside: ``supervisor.store._restore``); until it can be, it is read-only and a write
fails as ``JournalUnavailable``.

Size: the async face of every journal operation (one short method each, in the worker
thread), plus the typed records callers read.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, TypeVar, final

import trio

from supervisor.errors import AgentdError, JournalError, JournalUnavailable
from supervisor.states import TERMINAL_STATES, RunState
from supervisor.store._bounds import tool_call_step
from supervisor.store._ops import (
    EventRecord,
    GroupRecord,
    NeedsDurableCommit,
    RunRecord,
    Store,
    dumps,
    tool_call_rank,
)
from supervisor.store._restore import CHECK_S, FileIds, Restored, file_id, file_ids, restore, take_interrupted
from supervisor.store._schema import BUSY_TIMEOUT_MS, SCHEMA_VERSION, connect
from supervisor.store._sessions import SessionRecord, SessionSummary, TurnRecord

__all__ = [
    "Journal",
    "RunStart",
    "EventWrite",
    "RunRecord",
    "EventRecord",
    "GroupRecord",
    "SessionRecord",
    "SessionSummary",
    "TurnRecord",
    "SCHEMA_VERSION",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Calls queued while the worker was busy run together: one transaction, one commit (one
# fsync when any of them needs one), at most this many.
GROUP_COMMIT_MAX: Final = 128

# How long a call waits for a lock another process holds on the journal (ms), once a write
# found it held and until a write goes through again (``BUSY_TIMEOUT_MS`` otherwise). The
# one worker runs every call in order: while a lock was held for minutes, each of the
# backlog's retries waited the whole 5 s for it, and every call queued behind them (any
# run's ``status``) waited as long, each time.
LOCKED_BUSY_TIMEOUT_MS: Final = 50

# What a run's process record holds (``record_process``'s fields).
_PROCESS_FIELDS: Final = frozenset({"pid", "pid_start_time", "pgid", "tree_id", "cgroup", "containment", "run_dir"})

# SQLite's primary result codes that describe the store, not the statement: the same
# write may succeed once space, permissions or the device come back.
_UNAVAILABLE_CODES: Final = frozenset(
    {
        3,  # SQLITE_PERM
        5,  # SQLITE_BUSY
        6,  # SQLITE_LOCKED
        7,  # SQLITE_NOMEM
        8,  # SQLITE_READONLY
        10,  # SQLITE_IOERR
        13,  # SQLITE_FULL
        14,  # SQLITE_CANTOPEN
        15,  # SQLITE_PROTOCOL
    }
)


def _journal_error(path: str, exc: sqlite3.Error) -> JournalError:
    code = getattr(exc, "sqlite_errorcode", None)
    cls = JournalUnavailable if code is not None and code & 0xFF in _UNAVAILABLE_CODES else JournalError
    error = cls(f"journal {path!r}: {exc}", path=path)
    error.__cause__ = exc
    return error


def _text(value: str) -> str:
    """``value`` as SQLite can bind it: lone surrogates written as ``\\udXXX`` text."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _opt_text(value: str | None) -> str | None:
    return None if value is None else _text(value)


@dataclass(frozen=True, slots=True)
class RunStart:
    """A run's start as ``Journal.start_run`` writes it: when (its ``started_at``), its
    events (its ``starting`` state), its deadline and its process record, if any."""

    at: float
    events: Sequence[tuple[str, Mapping[str, Any], float]]
    deadline: float | None = None
    process: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class EventWrite:
    """One event of a run's as ``Journal.append_run_events`` writes it, with the facts that
    come with it: ``tool_call``, the tool-call record it carries (upserted before it, as
    ``upsert_tool_call``); ``group`` (pgid, kind, name, on_stop), a process group it says
    is alive (as ``add_group``), or ``group_ended``, the pgid of one it says ended (as
    ``remove_group``; either at the event's time, ``ts``); ``checkpoint``, a partial-result
    checkpoint as of it (as ``set_partial`` with its number; of several in one call, the
    last is stored: each supersedes the one before)."""

    kind: str
    data: Mapping[str, Any]
    ts: float
    tool_call: Mapping[str, Any] | None = None
    group: tuple[int, str, str, str | None] | None = None
    group_ended: int | None = None
    checkpoint: Mapping[str, Any] | None = None


def _event_write_op(run_id: str, writes: Sequence[EventWrite], at: float) -> Callable[[Store], list[int]]:
    """``writes`` as one operation (see ``Journal.append_run_events``); encoded here, on
    the caller's thread, as each write alone is."""
    rows = []
    for w in writes:
        call = None
        if w.tool_call is not None:
            rec = dict(w.tool_call)
            rank = tool_call_rank(rec)
            call = (_text(rec["id"]), tool_call_step(rec), _text(str(rec.get("state", "not_started"))), rank)
            call_text = dumps(rec)
        group = None
        if w.group is not None:
            pgid, kind, name, on_stop = w.group
            group = (int(pgid), _text(kind), _text(name), _opt_text(on_stop))
        ended = None if w.group_ended is None else int(w.group_ended)
        item = (_text(str(w.kind)), dumps(dict(w.data)), float(w.ts))
        cp = None if w.checkpoint is None else (w.checkpoint.get("_id"), dumps(dict(w.checkpoint)))
        rows.append((None if call is None else (*call, call_text), group, ended, item, cp))

    def op(s: Store) -> list[int]:
        # The records and groups in order (a call's later record after its earlier one),
        # then the events in one append: the run's row (its counter, beside its spec and
        # its partial-result checkpoint, megabytes on a long run) is rewritten once for
        # the lot, not once an event; then the last checkpoint, as of its event (an
        # earlier one in the same commit is superseded by it).
        for call, group, ended, item, _cp in rows:
            if call is not None:
                cid, step, state, rank, text = call
                s.upsert_tool_call(run_id, cid, step, state, rank, text, at)
            if group is not None:
                pgid, kind, name, on_stop = group
                s.add_group(run_id, pgid, kind, name, item[2], on_stop)
            if ended is not None:
                s.remove_group(run_id, ended, item[2])
        seqs = s.append_events(run_id, [row[3] for row in rows])
        last = [(seq, row[4]) for seq, row in zip(seqs, rows, strict=True) if row[4] is not None][-1:]
        for seq, (snap_id, snap) in last:
            s.set_partial(run_id, snap_id, snap, seq)
        return seqs

    return op


def _start_op(run_id: str, start: RunStart) -> Callable[[Store], tuple[bool, list[int]]]:
    """``start`` as one operation of a transaction (see ``Journal.start_run``)."""
    items = _event_items(start.events)
    deadline = start.deadline
    fields: dict[str, object] = {}
    for name, value in (start.process or {}).items():
        if name not in _PROCESS_FIELDS:
            raise ValueError(f"expected process record fields {sorted(_PROCESS_FIELDS)}, got {name!r}")
        fields[name] = _text(value) if isinstance(value, str) else value

    def op(s: Store) -> tuple[bool, list[int]]:
        moved = s.transition(run_id, RunState.STARTING, None, start.at)
        seqs = s.append_events(run_id, items) if moved and items else []
        if deadline is not None:
            s.record_deadline(run_id, deadline)
        if fields:
            s.record_process(run_id, fields)
        return moved, seqs

    return op


def _event_items(events: Iterable[tuple[str, Mapping[str, Any], float]]) -> list[tuple[str, str, float]]:
    return [(_text(str(kind)), dumps(dict(data)), float(ts)) for kind, data, ts in events]


class _Job(Generic[T]):
    """One call for the worker thread, and the way its outcome gets back to Trio."""

    __slots__ = ("fn", "token", "done", "value", "error")

    def __init__(self, fn: Callable[[Store], T]) -> None:
        self.fn = fn
        self.token = trio.lowlevel.current_trio_token()
        self.done = trio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def resolve(self) -> None:
        # Event.set is not thread-safe: it runs on the Trio thread.
        try:
            self.token.run_sync_soon(self.done.set)
        except trio.RunFinishedError:
            pass  # the caller's Trio run is gone; nobody is waiting any more


class _Worker:
    """The thread that owns the connection. sqlite3 objects never leave it. Before and
    after each group of calls, and every ``CHECK_S`` when idle, it checks that the file
    at its path is the one it opened, and puts the journal back there if it is not
    (``supervisor.store._restore``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"agentd-journal:{path}", daemon=True)
        self._conn: sqlite3.Connection | None = None
        self._store: Store | None = None
        self._opened: FileIds = (None, None, None)
        self._broken: JournalError | None = None  # why it does not open, while it does not
        self._unrestored: JournalUnavailable | None = None  # why it is not back at its path
        self._retry_at = 0.0  # a restore that failed is not tried again before (monotonic)
        self._locked = False  # a write found the journal locked by another process (``_note_lock``)
        # Each time the journal was put back at its path (read from other threads).
        self.restorations: list[Restored] = []
        # Write transactions of the stores the journal had before it was put back (``commit_counts``).
        self.carried_commits = (0, 0)

    @property
    def store(self) -> Store | None:
        """The thread's store (its counters are read elsewhere); None while none is open."""
        return self._store

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: _Job[Any]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Ask the thread to close the connection once every job before this one ran."""
        self._jobs.put(None)

    def join(self) -> None:
        self._thread.join()

    def _open(self) -> None:
        try:
            take_interrupted(self.path)
            self._conn = connect(self.path)
        except OSError as exc:
            self._broken = JournalError(f"cannot open journal {self.path!r}: {exc}", path=self.path)
            return
        except JournalError as exc:
            self._broken = exc
            return
        self._store = Store(self._conn, self.path)
        self._opened = file_ids(self.path)
        self._broken = None
        self._locked = False  # a new connection waits BUSY_TIMEOUT_MS

    def _check(self) -> None:
        """Is the file at the path the journal that is open? If not, put it back there."""
        if self._conn is None:
            if self.restorations:  # put back, but it did not open: try again
                self._open()
            return
        if file_id(self.path) == self._opened[0]:
            if self._unrestored is not None:  # back at its path (a hard link made again)
                self._query_only(False)
                self._unrestored = None
            return
        if self._unrestored is not None and time.monotonic() < self._retry_at:
            return  # a copy that failed (a full disk) is not made again at every call
        try:
            restored = restore(self._conn, self.path, self._opened)
        except JournalUnavailable as exc:
            if self._unrestored is None or str(self._unrestored) != str(exc):
                logger.error("%s", exc)
            if self._unrestored is None:
                # Until it is back at its path: read (status, list, events go on), never
                # written (what is written to a file nobody will open again is lost).
                self._query_only(True)
            self._unrestored = exc
            self._retry_at = time.monotonic() + CHECK_S
            return
        self._unrestored = None
        if self._store is not None:
            c, d = self.carried_commits
            self.carried_commits = (c + self._store.commits, d + self._store.durable_commits)
        self._conn = self._store = None
        self._open()
        self.restorations.append(restored)
        kept = f"; the file found there is kept as {restored.kept_aside}" if restored.kept_aside else ""
        if self._store is None:
            logger.error("journal %s: put back at its path, but it does not open: %s", self.path, self._broken)
        else:
            logger.warning(
                "journal %s: the file was %s while the daemon ran; the journal was put back at its "
                "path with everything written to it%s",
                self.path,
                "removed" if restored.found == "missing" else "replaced",
                kept,
            )

    def _note_lock(self, jobs: list[_Job[Any]], *, wrote: bool) -> None:
        """After calls ran: a write that met another process's lock shortens the wait of
        the calls after it (``LOCKED_BUSY_TIMEOUT_MS``); a write that went through restores it."""
        met = any(
            isinstance(j.error, JournalUnavailable) and getattr(j.error.__cause__, "sqlite_errorcode", 0) & 0xFF == 5
            for j in jobs
        )
        if self._conn is None or met == self._locked or not (met or wrote):
            return
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {LOCKED_BUSY_TIMEOUT_MS if met else BUSY_TIMEOUT_MS}")
        except sqlite3.Error:
            logger.exception("journal %s: setting busy_timeout failed", self.path)
            return
        self._locked = met
        if met:
            logger.warning(
                "journal %s: locked by another process; calls wait %d ms for it until a write goes through",
                self.path,
                LOCKED_BUSY_TIMEOUT_MS,
            )

    def _query_only(self, on: bool) -> None:
        if self._conn is not None:
            try:
                self._conn.execute(f"PRAGMA query_only = {int(on)}")
            except sqlite3.Error:
                logger.exception("journal %s: setting query_only failed", self.path)

    def _serve(self) -> None:
        self._open()
        try:
            stopping = False
            while not stopping:
                try:
                    job = self._jobs.get(timeout=CHECK_S)
                except queue.Empty:
                    self._check()
                    continue
                if job is None:
                    break
                # Whatever queued up meanwhile goes with it: one transaction, one commit.
                jobs = [job]
                while len(jobs) < GROUP_COMMIT_MAX:
                    try:
                        more = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stopping = True
                        break
                    jobs.append(more)
                self._check()
                store = self._store
                if store is None:
                    for j in jobs:
                        j.error = self._broken
                else:
                    unrestored = self._unrestored  # then it is query_only: reads only
                    before = store.changes()
                    if len(jobs) == 1:
                        self._run(store, job)
                    else:
                        self._run_group(store, jobs)
                    wrote = store.changes() != before
                    self._note_lock(jobs, wrote=wrote)  # (before a check that may replace the store)
                    # What was just written went to the file at the path: one removed or
                    # replaced meanwhile is put back before any caller hears of it, and
                    # if it cannot be, what was written is not said to be. (A group that
                    # only read leaves it to the next look.)
                    if wrote:
                        self._check()
                        if self._unrestored is not None and self._store is store:
                            self._fail(jobs, self._unrestored)
                    if unrestored is not None:  # a write refused as read-only: say why
                        for j in jobs:
                            if isinstance(j.error, JournalUnavailable):
                                j.error = unrestored
                for j in jobs:
                    j.resolve()
        finally:
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error:
                    logger.exception("journal %s: closing the connection failed", self.path)

    def _run(self, store: Store, job: _Job[Any]) -> None:
        try:
            job.value = job.fn(store)
        except AgentdError as exc:
            job.error = exc
        except sqlite3.Error as exc:
            job.error = _journal_error(self.path, exc)
        except Exception as exc:  # a bug: hand it to the caller rather than kill the thread
            logger.exception("journal %s: a call failed unexpectedly", self.path)
            job.error = exc

    def _run_group(self, store: Store, jobs: list[_Job[Any]]) -> None:
        """Group commit: the jobs in order, each in a savepoint of one transaction, one
        commit for all, as durable as the most durable of them needs. Every outcome is a
        job's own as if it had run alone, and none is handed back before the commit.

        The group starts in the connection's current mode; a job that needs FULL in a
        NORMAL group ends it there (what came before commits NORMAL, as it would have
        alone) and the rest go in a FULL one. A failed commit, or a transaction SQLite
        rolled back under the group, fails every job whose writes it held; a job that
        wrote nothing (a read: a ``status`` while the disk is full) runs again alone."""
        i = 0
        durable = store.durable_mode
        wrote: set[int] = set()  # the jobs (by index) that changed rows
        while i < len(jobs):
            try:
                store.begin_group(durable=durable)
            except sqlite3.Error:
                store.abandon_group()
                for job in jobs[i:]:  # each alone, as before: its own outcome
                    self._run(store, job)
                return
            first = i
            while i < len(jobs):
                job = jobs[i]
                before = store.changes()
                try:
                    job.value = store.group_op(job.fn)
                except NeedsDurableCommit:
                    durable = True  # commit what came before; the rest go in a FULL group
                    break
                except AgentdError as exc:
                    job.error = exc
                except sqlite3.Error as exc:
                    job.error = _journal_error(self.path, exc)
                except Exception as exc:  # a bug: hand it to the caller
                    logger.exception("journal %s: a call failed unexpectedly", self.path)
                    job.error = exc
                if store.changes() != before:
                    wrote.add(i)
                i += 1
                if not store.group_alive():  # rolled back under us: nothing of it stands
                    store.abandon_group()
                    self._fail_group(store, jobs, first, i, wrote, job.error)
                    break
            if store.in_group:
                try:
                    store.commit_group()
                except sqlite3.Error as exc:
                    self._fail_group(store, jobs, first, i, wrote, _journal_error(self.path, exc))

    def _fail_group(
        self, store: Store, jobs: list[_Job[Any]], first: int, end: int, wrote: set[int], error: BaseException | None
    ) -> None:
        """The group ``jobs[first:end]`` was not committed: the jobs that wrote fail; those
        that only read, and succeeded, run again, each alone (their values may have seen
        the lost writes): their outcome is their own, as if they had run alone. A job
        that failed keeps its own error."""
        reads = [jobs[k] for k in range(first, end) if k not in wrote and jobs[k].error is None]
        self._fail([jobs[k] for k in range(first, end) if k in wrote or jobs[k].error is not None], error)
        for job in reads:
            job.value = None
            self._run(store, job)

    def _fail(self, jobs: list[_Job[Any]], error: BaseException | None) -> None:
        """Jobs whose writes were not committed: each gets the error, none a value."""
        err = (
            error
            if error is not None
            else JournalUnavailable(f"journal {self.path!r}: the transaction was rolled back", path=self.path)
        )
        for job in jobs:
            job.value = None
            if job.error is None:
                job.error = err


@final
class Journal:
    """The daemon's durable store. Open it with ``await Journal.open(path)``.

    Every method is a call on the journal's worker thread. Once a call is submitted it
    is not cancellable: it runs to completion and returns its outcome, and a caller whose
    scope was cancelled meanwhile sees ``Cancelled`` at its next checkpoint. A write that
    returned is committed, so a terminal fact is never half-written by a stop.
    """

    def __init__(self, worker: _Worker) -> None:
        # Private: the worker must be running and its connection open (see ``open``).
        self._worker = worker
        self._closing = False
        self._closed = trio.Event()

    @classmethod
    async def open(cls, path: str | os.PathLike[str]) -> Journal:
        """Open (creating or migrating) the journal at ``path``.

        Raises:
            JournalError: the file is not a usable agentd journal (not a database,
                damaged, unwritable, or from a newer agentd). It names the path.
        """
        worker = _Worker(os.fspath(path))
        worker.start()
        journal = cls(worker)
        try:
            await journal._call(lambda store: None)
        except BaseException:
            with trio.CancelScope(shield=True):
                await journal.aclose()
            raise
        return journal

    @property
    def path(self) -> str:
        return self._worker.path

    @property
    def restorations(self) -> list[dict[str, Any]]:
        """Each time the file at the path was found removed or replaced while the journal
        was open and the journal was put back there, oldest first: ``at`` (wall clock),
        ``found`` (``missing`` or ``another file``), ``kept_aside`` (where the file found
        there was moved, or None)."""
        return [r.as_dict() for r in list(self._worker.restorations)]

    async def aclose(self) -> None:
        """Let queued calls finish, close the connection and end the thread. Idempotent."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            self._worker.stop()
            await trio.to_thread.run_sync(self._worker.join)
        finally:
            self._closed.set()

    def commit_counts(self) -> tuple[int, int]:
        """Write transactions committed since the journal opened, and how many of them
        FULL (fsynced at the commit; the others are written to the WAL and fsynced at its
        checkpoints): what its writers cost it (``status``'s ``journal``)."""
        worker = self._worker
        (c, d), store = worker.carried_commits, worker.store
        return (c, d) if store is None else (c + store.commits, d + store.durable_commits)

    async def __aenter__(self) -> Journal:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _call(self, fn: Callable[[Store], T]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closing:
            raise JournalError(f"journal {self.path!r} is closed", path=self.path)
        job = _Job(fn)
        self._worker.submit(job)
        with trio.CancelScope(shield=True):
            await job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]  # set whenever error is None

    # -- runs ------------------------------------------------------------------------

    async def create_run(
        self,
        run_id: str,
        *,
        session_id: str | None,
        spec: Mapping[str, Any],
        created_at: float,
        timeout_s: float | None,
        events: Iterable[tuple[str, Mapping[str, Any], float]] = (),
        start: RunStart | None = None,
        key: str | None = None,
    ) -> list[int]:
        """Record a new run in state ``queued`` (durably), with its first ``(kind, data,
        ts)`` events (its ``queued`` state) in the same transaction, and with ``start``
        its start as ``start_run`` writes it, in that transaction too (a run that starts
        at once: one commit, one fsync). With ``key`` (the spawn's idempotency key) the
        key is recorded as this run's in that transaction too (``run_for_key``). The
        numbers of the events written.

        Raises:
            JournalError: a run with this id exists, or a run with this key.
        """
        spec_json = dumps(dict(spec))
        rid = _text(run_id)
        items = _event_items(events)
        started = None if start is None else _start_op(rid, start)

        def create(s: Store) -> list[int]:
            s.create_run(rid, _opt_text(session_id), spec_json, created_at, timeout_s, _opt_text(key))
            seqs = s.append_events(rid, items) if items else []
            if started is not None:
                seqs += started(s)[1]
            return seqs

        return await self._call(lambda s: s.together([create])[0])

    async def start_run(
        self,
        run_id: str,
        *,
        at: float,
        events: Iterable[tuple[str, Mapping[str, Any], float]],
        deadline: float | None = None,
        process: Mapping[str, object] | None = None,
    ) -> tuple[bool, list[int]]:
        """The run's start, in one transaction (one fsync): ``queued`` -> ``starting``
        (compare-and-set, as ``transition``) and, only if it moved, its ``events`` (its
        ``starting`` state); its ``deadline`` (as ``record_deadline``); its ``process``
        record (as ``record_process``: what recovery needs to find a runner that is not
        let go before this returns). Returns whether it moved, and the events' numbers.

        Raises:
            RunNotFound: no run has this id.
        """
        op = _start_op(_text(run_id), RunStart(at, tuple(events), deadline, process))
        return await self._call(lambda s: s.together([op])[0])

    async def transition(
        self, run_id: str, new: RunState, *, reason: str | None = None, at: float | None = None
    ) -> bool:
        """Move a live run to the live state ``new`` if ``states.ALLOWED`` permits it.

        Compare-and-set: returns False, changing nothing, when the run's current state
        does not allow the move (a terminal run allows none). ``reason`` replaces the
        stored one when given. Entering starting/running sets ``started_at`` once.
        Terminal states are written only by ``finish``.

        Raises:
            RunNotFound: no run has this id.
        """
        if new in TERMINAL_STATES:
            raise ValueError(f"expected a live state, got {new!r}: use finish()")
        ts = time.time() if at is None else at
        return await self._call(lambda s: s.transition(_text(run_id), new, _opt_text(reason), ts))

    async def finish(
        self,
        run_id: str,
        state: RunState,
        *,
        reason: str | None,
        result: Mapping[str, Any] | None,
        partial: bool,
        error: Mapping[str, Any] | None = None,
        receipt: Mapping[str, Any] | None = None,
        ended_at: float | None = None,
        groups_ended_at: float | None = None,
        from_any_live_state: bool = False,
    ) -> bool:
        """Write the run's terminal fact, once, durably (fsynced before returning).

        Compare-and-set: returns True for the one call that ended the run; any later
        call (a cancel racing a completion) returns False and changes nothing. With
        ``result=None`` and ``partial=True`` the result is the last partial snapshot,
        taken atomically with the write. Either way the run's partial result (its last
        checkpoint with the snapshot events after it folded in) is stored whole with it. ``receipt`` (if given) is stored with it.
        ``groups_ended_at`` (when the stop receipt saw the whole tree dead): every group
        still recorded alive is marked ended at that time, in the same transaction.
        ``from_any_live_state``: whatever live state the stored run is in (a fact kept in
        memory while the journal was down, written after states that may not have been).

        Raises:
            RunNotFound: no run has this id.
        """
        if state not in TERMINAL_STATES:
            raise ValueError(f"expected a terminal state, got {state!r}")
        args = (
            None if result is None else dumps(dict(result)),
            partial,
            None if error is None else dumps(dict(error)),
            None if receipt is None else dumps(dict(receipt)),
            time.time() if ended_at is None else ended_at,
        )
        return await self._call(
            lambda s: s.finish(
                _text(run_id),
                state,
                _opt_text(reason),
                *args,
                groups_ended_at=groups_ended_at,
                any_live=from_any_live_state,
            )
        )

    async def mark_lost(
        self,
        run_id: str,
        *,
        reason: str,
        partial_result: Mapping[str, Any] | None = None,
        error: Mapping[str, Any] | None = None,
        ended_at: float | None = None,
    ) -> bool:
        """Recovery: end a run whose process is gone as ``lost``, marked partial.

        Its result is ``partial_result`` if given, else its last stored snapshot. In the
        same transaction its running tool calls become ``unknown`` and its announced
        ones ``not_started``, both with ``reason``. Returns False if it was terminal.

        Raises:
            RunNotFound: no run has this id.
        """
        result = None if partial_result is None else dumps(dict(partial_result))
        err = None if error is None else dumps(dict(error))
        ts = time.time() if ended_at is None else ended_at
        return await self._call(
            lambda s: s.finish(
                _text(run_id),
                RunState.LOST,
                _text(reason),
                result,
                True,
                err,
                None,
                ts,
                settle_reason=_text(reason),
            )
        )

    async def record_cancel(
        self,
        run_id: str,
        *,
        reason: str,
        at: float,
        stop_deadline: float,
        detail: Mapping[str, Any] | None = None,
    ) -> bool:
        """Record (durably) a stop the daemon is about to acknowledge: its reason, when it
        was asked (wall clock), when its grace ends (wall clock), and ``detail``, what the
        daemon measured when it stopped the run for a reason of its own (the receipt's
        ``stop_detail``).

        Only the first cancel of a live run is recorded (False for a later one, or once the
        run is terminal): a restarted daemon resumes that stop, not a newer one.

        Raises:
            RunNotFound: no run has this id.
        """
        text = None if detail is None else dumps(dict(detail))
        return await self._call(lambda s: s.record_cancel(_text(run_id), _text(reason), at, stop_deadline, text))

    async def record_deadline(self, run_id: str, deadline: float) -> bool:
        """Record (durably) the run's timeout as a wall-clock deadline, once.

        Raises:
            RunNotFound: no run has this id.
        """
        return await self._call(lambda s: s.record_deadline(_text(run_id), deadline))

    async def set_partial(self, run_id: str, snapshot: Mapping[str, Any], *, seq: int | None = None) -> bool:
        """Store a checkpoint of the run's partial result (its ``step_snapshot`` events
        folded), as of its event ``seq``: whoever reads the run gets this checkpoint with
        the run's ``step_snapshot`` events after ``seq`` folded in (``seq`` None: all of
        them, which a delta already in it does not change), and ``finish`` stores it whole.

        Accepted only while the run is live and only if ``snapshot["_id"] == run_id``: a
        stale run's write and a write after the terminal result are refused (False).

        Raises:
            RunNotFound: no run has this id.
        """
        data = dumps(dict(snapshot))
        snap_id = snapshot.get("_id")
        return await self._call(lambda s: s.set_partial(_text(run_id), snap_id, data, seq))

    async def set_receipt(self, run_id: str, receipt: Mapping[str, Any]) -> bool:
        """Store the stop receipt: any time while live, once after the run is terminal.

        Raises:
            RunNotFound: no run has this id.
        """
        data = dumps(dict(receipt))
        return await self._call(lambda s: s.set_receipt(_text(run_id), data))

    async def record_process(
        self,
        run_id: str,
        *,
        pid: int | None = None,
        pid_start_time: float | None = None,
        pgid: int | None = None,
        tree_id: str | None = None,
        cgroup: str | None = None,
        containment: str | None = None,
        run_dir: str | None = None,
    ) -> bool:
        """Record (durably) what recovery needs to find the run's processes.

        Fields left None keep their stored value, so intent (tree_id, run_dir, cgroup)
        can be recorded before the spawn and pid/pgid after. Refused (False) once the
        run is terminal.

        Raises:
            RunNotFound: no run has this id.
        """
        fields: dict[str, object] = {
            "pid": pid,
            "pid_start_time": pid_start_time,
            "pgid": pgid,
            "tree_id": tree_id,
            "cgroup": cgroup,
            "containment": containment,
            "run_dir": run_dir,
        }
        return await self._call(lambda s: s.record_process(_text(run_id), fields))

    async def add_group(
        self,
        run_id: str,
        pgid: int,
        kind: str,
        name: str,
        *,
        at: float | None = None,
        on_stop: str | None = None,
    ) -> None:
        """Record (durably) a live process group the run owns (an MCP server, a command).

        Accepted after the run ended too: leftovers must stay known to the sweep.
        A pgid seen again (reused after its group ended) is alive again. ``on_stop`` is a
        command's stop policy (``interrupt``: path A may SIGTERM the group).

        Raises:
            RunNotFound: no run has this id.
        """
        ts = time.time() if at is None else at
        await self._call(lambda s: s.add_group(_text(run_id), pgid, _text(kind), _text(name), ts, _opt_text(on_stop)))

    async def remove_group(self, run_id: str, pgid: int, *, at: float | None = None) -> bool:
        """The group ended: it leaves the run's live groups (its record stays, not alive).

        Returns False if it was not known alive.

        Raises:
            RunNotFound: no run has this id.
        """
        ts = time.time() if at is None else at
        return await self._call(lambda s: s.remove_group(_text(run_id), pgid, ts))

    async def end_groups(self, run_id: str, *, at: float | None = None) -> int:
        """Every group of the run still recorded alive ended (its tree was seen dead).

        Returns how many changed.

        Raises:
            RunNotFound: no run has this id.
        """
        ts = time.time() if at is None else at
        return await self._call(lambda s: s.end_groups(_text(run_id), ts))

    # -- events ----------------------------------------------------------------------

    async def append_event(self, run_id: str, kind: str, data: Mapping[str, Any], ts: float | None = None) -> int:
        """Append one event; returns its sequence number. Never changes the run's state.

        Raises:
            RunNotFound: no run has this id.
        """
        (seq,) = await self.append_events(run_id, [(kind, data, ts)])
        return seq

    async def append_events(
        self, run_id: str, events: Iterable[tuple[str, Mapping[str, Any], float | None]], *, durable: bool = False
    ) -> list[int]:
        """Append ``(kind, data, ts)`` events in one transaction; returns their numbers.
        Committed NORMAL, or FULL (fsynced) with ``durable``.

        Raises:
            RunNotFound: no run has this id.
        """
        now = time.time()
        items = [(_text(str(kind)), dumps(dict(data)), now if ts is None else float(ts)) for kind, data, ts in events]
        return await self._call(lambda s: s.append_events(_text(run_id), items, durable=durable))

    async def append_run_events(self, run_id: str, writes: Sequence[EventWrite]) -> list[int]:
        """``writes`` (a run's events with the facts that come with them: ``EventWrite``),
        in order, in one transaction: one commit for the lot (a group commit of what one
        read of a runner's output brought), NORMAL as each write alone would be, FULL
        (fsynced) if a process group becomes alive in it (as ``add_group``). Nothing of it
        is written unless all of it is. Returns the events' numbers, in order.

        Raises:
            ValueError: a tool-call record has no string ``id`` or an unknown ``state``
                (nothing written).
            RunNotFound: no run has this id.
        """
        if not writes:
            return []
        op = _event_write_op(_text(run_id), writes, time.time())
        durable = any(w.group is not None for w in writes)
        return await self._call(lambda s: s.together([op], durable=durable)[0])

    async def put_events(self, run_id: str, events: Iterable[tuple[int, str, Mapping[str, Any], float]]) -> int:
        """Store ``(seq, kind, data, ts)`` events whose numbers were given out earlier.

        For events kept in memory while the journal could not be written: idempotent (an
        event already stored under its number stays as it is) and the run's counter moves
        to at least the highest number. Returns how many were new.

        Raises:
            RunNotFound: no run has this id.
        """
        items = [(int(seq), _text(str(kind)), dumps(dict(data)), float(ts)) for seq, kind, data, ts in events]
        return await self._call(lambda s: s.put_events(_text(run_id), items))

    async def events_page(
        self, run_id: str, after_seq: int = 0, *, limit: int = 1000, max_bytes: int | None = None
    ) -> tuple[list[EventRecord], bool]:
        """Like ``events_after``, also bounded by the stored size of the events' data.

        Returns the page (at least one event if any follow ``after_seq``) and whether more
        events follow it.

        Raises:
            RunNotFound: no run has this id.
        """
        if limit < 1:
            raise ValueError(f"expected a limit of at least 1, got {limit!r}")
        return await self._call(lambda s: s.events_page(_text(run_id), after_seq, limit, max_bytes))

    async def events_after(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        """Events with ``seq > after_seq`` in order, at most ``limit`` of them.

        Raises:
            RunNotFound: no run has this id.
        """
        if limit < 1:
            raise ValueError(f"expected a limit of at least 1, got {limit!r}")
        return await self._call(lambda s: s.events_after(_text(run_id), after_seq, limit))

    async def steering_texts(self, run_id: str) -> tuple[list[str], list[str], list[str]]:
        """The steering texts sent to the run's runner, those it said it read, and those
        it said it applied or left unapplied, in order (a restarted daemon's account of
        what it never read, or read and never applied)."""
        return await self._call(lambda s: s.steering_texts(_text(run_id)))

    async def approvals_sent(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The answers sent to the run's runner, by call id (the first per call, unless
        one journaled unsent after it): ``{"decision", "reason"}``; a restarted daemon's
        account of the calls answered already, and what it sends again."""
        return await self._call(lambda s: s.approvals_sent(_text(run_id)))

    # -- tool calls ------------------------------------------------------------------

    async def upsert_tool_call(self, run_id: str, record: Mapping[str, Any]) -> bool:
        """Insert or update a tool-call record (a ``ToolCallRecord`` dict) by its id.

        Records only move forward (not started < running < unknown < a known outcome):
        a late record behind the stored one is refused (False), and a known outcome
        (succeeded, failed, cancelled, or not_started with a reason) is final, but for
        one amendment of a call whose background command the run's end or its stop ended
        (``stop_effect`` ``background_ended``; ``_ops.tool_call_rank``).

        Raises:
            ValueError: the record has no string ``id`` or an unknown ``state``.
            RunNotFound: no run has this id.
        """
        rec = dict(record)
        rank = tool_call_rank(rec)
        state = str(rec.get("state", "not_started"))
        step = tool_call_step(rec)
        data = dumps(rec)
        ts = time.time()
        return await self._call(
            lambda s: s.upsert_tool_call(_text(run_id), _text(rec["id"]), step, _text(state), rank, data, ts)
        )

    async def upsert_tool_calls(self, run_id: str, records: Sequence[Mapping[str, Any]]) -> int:
        """``upsert_tool_call`` for each of ``records``, in order, in one transaction (one
        commit): a run's end takes its result's records in (thousands, at a time: one
        commit each cost ~0.6 ms of the journal's thread apiece). How many were written.

        Raises:
            ValueError: a record has no string ``id`` or an unknown ``state`` (nothing written).
            RunNotFound: no run has this id.
        """
        rows = []
        for record in records:
            rec = dict(record)
            rank = tool_call_rank(rec)
            rows.append((_text(rec["id"]), tool_call_step(rec), _text(str(rec.get("state", "not_started"))), rank, rec))
        rid = _text(run_id)
        ts = time.time()

        def upsert_all(s: Store) -> int:
            return sum(
                s.upsert_tool_call(rid, cid, step, state, rank, dumps(rec), ts) for cid, step, state, rank, rec in rows
            )

        return await self._call(lambda s: s.together([upsert_all])[0])

    async def settle_tool_calls(
        self,
        run_id: str,
        *,
        reason: str,
        pending_reason: str | None = None,
        stop_effects: tuple[str, str] | None = None,
    ) -> int:
        """Close open records of an ended run: running ones become ``unknown`` with
        ``reason``, announced ones ``not_started`` with ``pending_reason`` (default
        ``reason``). Under a stop, ``stop_effects`` = the (running, announced) records'
        ``stop_effect``. Returns how many changed.

        Raises:
            RunNotFound: no run has this id.
        """
        ts = time.time()
        return await self._call(
            lambda s: s.settle_tool_calls(_text(run_id), _text(reason), ts, _opt_text(pending_reason), stop_effects)
        )

    async def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
        """The run's tool-call records, by step then first appearance.

        Raises:
            RunNotFound: no run has this id.
        """
        return await self._call(lambda s: s.tool_calls(_text(run_id)))

    # -- reading runs ----------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        return await self._call(lambda s: s.get_run(_text(run_id)))

    async def run_for_key(self, key: str) -> str | None:
        """The id of the run a spawn with this idempotency key created, if one did."""
        return await self._call(lambda s: s.run_for_key(_text(key)))

    async def run_states(self, run_ids: Iterable[str]) -> dict[str, str]:
        """Run id -> state, for those of ``run_ids`` that exist: one call, however many."""
        ids = [_text(r) for r in run_ids]
        return await self._call(lambda s: s.run_states(ids))

    async def list_runs(
        self,
        *,
        limit: int = 50,
        states: Iterable[RunState] | None = None,
        session_id: str | None = None,
        key: str | None = None,
    ) -> list[RunRecord]:
        """The newest runs first, optionally only those in ``states``, of one session, or
        the one a spawn with this idempotency ``key`` created."""
        wanted = None if states is None else [RunState(s) for s in states]
        return await self._call(lambda s: s.list_runs(limit, wanted, _opt_text(session_id), _opt_text(key)))

    async def live_runs(self) -> list[RunRecord]:
        """Every run not in a terminal state, oldest first: what recovery looks at."""
        return await self._call(lambda s: s.live_runs())

    # -- sessions ------------------------------------------------------------------------

    async def open_session(self, session_id: str, *, at: float | None = None) -> float | None:
        """Record (durably) that the session exists; returns when it was closed (None: open)."""
        ts = time.time() if at is None else at
        return await self._call(lambda s: s.open_session(_text(session_id), ts))

    async def close_session(self, session_id: str, *, at: float | None = None) -> bool:
        """Mark the session closed, once (durably); returns whether it was open."""
        ts = time.time() if at is None else at
        return await self._call(lambda s: s.close_session(_text(session_id), ts))

    async def set_profile(self, session_id: str, path: str | None, *, used_at: float | None = None) -> str | None:
        """Record the session's browser profile (None: removed); returns the previous path."""
        return await self._call(lambda s: s.set_profile(_text(session_id), _opt_text(path), used_at))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self._call(lambda s: s.get_session(_text(session_id)))

    async def profiles(self) -> list[SessionRecord]:
        """Sessions that have a browser profile, least recently used first."""
        return await self._call(lambda s: s.profiles())

    async def sessions(self, *, limit: int = 50) -> list[SessionSummary]:
        """Sessions with runs, most recently active first."""
        return await self._call(lambda s: s.sessions(limit))

    async def session_turns(self, session_id: str) -> list[TurnRecord]:
        """A session's runs, oldest first, each with its tool-call records and the events
        its history is rebuilt from (``assistant_text``, ``steering``)."""
        return await self._call(lambda s: s.session_turns(_text(session_id)))

    async def session_turn_ids(self, session_id: str) -> list[tuple[str, str]]:
        """A session's runs as (id, state), oldest first (``session_turns`` without records)."""
        return await self._call(lambda s: s.session_turn_ids(_text(session_id)))

    async def session_turn(self, run_id: str) -> TurnRecord | None:
        """One run of a session as ``session_turns`` gives it, or None."""
        return await self._call(lambda s: s.session_turn(_text(run_id)))
