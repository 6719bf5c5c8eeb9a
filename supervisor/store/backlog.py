"""Degraded mode: a run's journal writes, kept in order in memory while the journal is down.

Every write the run manager makes for a run goes through ``Backlog.write``. While the run
has nothing waiting, the write goes straight to the journal. When the journal cannot be
written (``JournalUnavailable``: disk full, read-only, an I/O error) the write joins the
run's queue instead, the daemon is *degraded*, and the caller gets the outcome the write
would have had: the manager is the run's only writer, so it knows it. From then on that
run's writes queue behind it, in order, and ``run()`` retries the queues every
``RETRY_S``; the daemon is healthy again once every queue is empty.

Replays are safe to repeat: events keep the numbers they were given (``put_events`` is
idempotent), states and terminal facts are compare-and-set. A run's queued events are
bounded; beyond the bound new events are dropped and counted (a state, a process record
or a terminal fact is never dropped). What is still queued at shutdown is logged.

What waits dies with the daemon's memory. Which runs had writes waiting, and the end of
those that ended (``write(end=...)``: state, reason, when), is kept on disk meanwhile
(``supervisor.store._unwritten``): a daemon killed while degraded is followed by one that
says so at its start (its log, ``describe()['unwritten_before_restart']``), gives each of
those runs a ``journal_gap`` event and writes the ends it finds there (the result is the
run's last stored checkpoint, marked partial), before it recovers the runs: a run a client
was told ended ``cancelled`` is not found ``lost``; an end the journal cannot take then
either is recovery's to write (``carried_ends``), not to decide again. A stop acknowledged while its intent
waits (``write(stop=...)``: reason, wall times) is in the note before the cancel's reply;
the next daemon hands it to recovery (``carried_stops``), which resumes it as a journaled
one: nothing keeps running past a Stop's grace because the daemon that took it died.

``on_written`` and ``on_unavailable`` tell the disk guard (``supervisor.core.diskguard``)
of each write that went through and each that could not: a full disk is usually a run's
doing, and the guard stops that run so the queues can be written.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import trio

from supervisor.errors import JournalError, JournalUnavailable, RunNotFound
from supervisor.store._unwritten import NAME as NOTE_NAME
from supervisor.store._unwritten import UnwrittenNote, noted_end, noted_end_event, noted_finish_args
from supervisor.store.journal import EventRecord, Journal

__all__ = ["Backlog"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often queued writes are retried while the journal cannot be written.
RETRY_S: Final = 1.0
# Events of one run kept in memory while the journal cannot be written, in number and in
# bytes of their JSON; newer ones are dropped (and counted) beyond either.
MAX_EVENTS_PER_RUN: Final = 10_000
MAX_EVENT_BYTES_PER_RUN: Final = 16 * 1024 * 1024

Write = Callable[[Journal], Awaitable[Any]]


@dataclass(slots=True)
class _Op:
    apply: Write
    what: str
    event: EventRecord | None = None
    size: int = 0


class Backlog:
    """The run manager's journal writes, straight through or queued per run (see module)."""

    def __init__(self, journal: Journal, *, on_flushed: Callable[[str], None] | None = None) -> None:
        self.journal = journal
        self._on_flushed = on_flushed
        self._queues: dict[str, deque[_Op]] = {}
        self._event_bytes: dict[str, int] = {}
        self._event_count: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self.error: str | None = None  # the last write failure, while degraded
        self.since: float | None = None  # wall time the daemon became degraded
        self.flushed = 0  # queued writes written later, in all
        self._wake = trio.Event()
        self._flushing = trio.Lock()
        # Told of each write that went through and of each that could not (the disk guard
        # looks at the free space then: ``supervisor.core.diskguard``). Must not raise.
        self.on_written: Callable[[], None] | None = None
        self.on_unavailable: Callable[[], None] | None = None
        # Which runs have writes waiting, on disk (``_unwritten``), and what the previous
        # daemon's note said (None: nothing waited when it ended).
        self._note = UnwrittenNote(Path(journal.path).parent / NOTE_NAME)
        self._ends: dict[str, dict[str, Any]] = {}  # queued runs' ends, for the note
        self._stops: dict[str, dict[str, Any]] = {}  # queued runs' acknowledged stops, too
        self._noted: tuple[frozenset[str], ...] = (frozenset(), frozenset(), frozenset())
        self._noting = trio.Lock()
        self.unwritten_before_restart: dict[str, Any] | None = None
        # Stops the previous daemon acknowledged and noted, never journaled, by run id:
        # recovery resumes them (``supervisor.core.recovery``).
        self.carried_stops: dict[str, dict[str, Any]] = {}
        # Ends it noted that the journal could not take at this start either: recovery
        # writes them (``write_carried_end``) rather than decide the run's end again.
        self.carried_ends: dict[str, dict[str, Any]] = {}
        self._waiters: dict[str, trio.Event] = {}  # ``wait_written``'s, by run id

    # ------------------------------------------------------------------ state

    @property
    def degraded(self) -> bool:
        return self.since is not None

    def pending(self, run_id: str) -> bool:
        """Does this run have writes that are not in the journal yet?"""
        return run_id in self._queues

    async def wait_written(self, run_id: str) -> None:
        """Until nothing of this run waits for the journal (at once if nothing does)."""
        if run_id in self._queues:
            await self._waiters.setdefault(run_id, trio.Event()).wait()

    def pending_events(self, run_id: str, after_seq: int) -> list[EventRecord]:
        """The run's queued events with ``seq > after_seq``, in order."""
        queue = self._queues.get(run_id)
        if not queue:
            return []
        return [op.event for op in queue if op.event is not None and op.event["seq"] > after_seq]

    def describe(self) -> dict[str, Any]:
        """For ``status``: is the journal writable, and what waits in memory."""
        return {
            "writable": not self.degraded,
            "error": self.error,
            "degraded_since": self.since,
            "pending_runs": len(self._queues),
            "pending_writes": sum(len(q) for q in self._queues.values()),
            "dropped_events": sum(self._dropped.values()),
            "flushed_writes": self.flushed,
            # Each time its file was found removed or replaced, and it was put back.
            "restored": self.journal.restorations[-10:],
            # The previous daemon ended with these runs' writes in memory: lost.
            "unwritten_before_restart": self.unwritten_before_restart,
        }

    # ------------------------------------------------------------------ writes

    async def write(
        self,
        run_id: str,
        direct: Write,
        predicted: T,
        *,
        what: str,
        replay: Write | None = None,
        end: Mapping[str, Any] | None = None,
        stop: Mapping[str, Any] | None = None,
    ) -> T:
        """Write now, or queue the write and return ``predicted`` (the journal is down).

        ``replay`` (default ``direct``) is what the flush runs; it must be safe to repeat.
        ``end``: the write is the run's end (``state``, ``reason``, ``ended_at``,
        ``groups_ended_at``), named in the note on disk while it waits (see the module).
        ``stop``: the write is the intent of a stop about to be acknowledged (``reason``,
        ``at``, ``stop_deadline``, ``detail``), in the note on disk, fsynced, before this
        returns if it waits.

        Raises:
            Whatever ``direct`` raises except ``JournalUnavailable`` (a bug, or bad data:
            not a condition of the store).
        """
        if run_id not in self._queues:
            try:
                value: T = await direct(self.journal)
            except JournalUnavailable as exc:
                self._degrade(exc, what, run_id)
            else:
                self._written()
                return value
        self._enqueue(run_id, _Op(replay or direct, what))
        if end is not None:
            self._ends[run_id] = dict(end)
        if stop is not None:
            self._stops.setdefault(run_id, dict(stop))  # the first one: the one resumed
        await self._note_runs()
        return predicted

    async def append(self, run_id: str, seq: int, kind: str, data: dict[str, Any], ts: float) -> int | None:
        """Append one event numbered ``seq`` (the run's next); returns its number.

        None: it was dropped (the journal is down and the run's queue is full of events).
        The journal's number wins when the write goes through.
        """
        event = EventRecord(seq=seq, ts=ts, kind=kind, data=data)

        async def direct(j: Journal) -> int:
            return await j.append_event(run_id, kind, data, ts)

        async def replay(j: Journal) -> int:
            return await j.put_events(run_id, [(seq, kind, data, ts)])

        if run_id not in self._queues:
            try:
                got = await direct(self.journal)
            except JournalUnavailable as exc:
                self._degrade(exc, f"event {kind}", run_id)
            else:
                self._written()
                return got
        count = self._event_count.get(run_id, 0)
        size = len(repr(data))  # a cheap bound on its JSON; no second encoding
        if count >= MAX_EVENTS_PER_RUN or self._event_bytes.get(run_id, 0) + size > MAX_EVENT_BYTES_PER_RUN:
            dropped = self._dropped[run_id] = self._dropped.get(run_id, 0) + 1
            if dropped == 1:
                logger.warning(
                    "run %s: %d events wait for the journal; dropping newer ones until it can be written",
                    run_id,
                    count,
                )
            return None
        self._event_count[run_id] = count + 1
        self._event_bytes[run_id] = self._event_bytes.get(run_id, 0) + size
        self._enqueue(run_id, _Op(replay, f"event {kind}", event, size))
        await self._note_runs()
        return seq

    def note_failure(self, exc: JournalUnavailable, what: str) -> None:
        """A write that is not queued (a new run's record) failed: the daemon is degraded
        until a later write goes through."""
        self._degrade(exc, what, None)

    def note_success(self) -> None:
        """A write that is not queued went through."""
        self._written()

    def _written(self) -> None:
        if self.degraded and not self._queues:
            self._healthy()
        if self.on_written is not None:
            self.on_written()

    def _enqueue(self, run_id: str, op: _Op) -> None:
        self._queues.setdefault(run_id, deque()).append(op)
        self._wake.set()

    def _degrade(self, exc: JournalUnavailable, what: str, run_id: str | None) -> None:
        self.error = str(exc)
        if self.on_unavailable is not None:
            self.on_unavailable()
        if self.since is None:
            self.since = time.time()
            logger.error(
                "journal cannot be written (%s: %s): degraded; live runs go on, their facts wait "
                "in memory and are written when it can be",
                what,
                exc,
            )
        elif run_id is not None and run_id not in self._queues:
            logger.warning("run %s: journal cannot be written (%s); its facts wait in memory", run_id, what)

    def _healthy(self) -> None:
        logger.warning(
            "journal writable again after %.1f s: %d waiting writes written, %d events dropped",
            time.time() - (self.since or time.time()),
            self.flushed,
            sum(self._dropped.values()),
        )
        self.since = None
        self.error = None

    # ------------------------------------------------------------------ flushing

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Retry what waits every ``RETRY_S`` until cancelled (a daemon service).

        First, before it says it started (before the runs a previous daemon left are
        recovered): what that daemon's note says it lost (see the module)."""
        try:
            await self._take_previous_note()
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self._queues:
                    await trio.sleep(RETRY_S)
                    await self.flush()
        finally:
            # What still waits stays named in the note, for the next daemon to say.
            self._note.close()

    async def _take_previous_note(self) -> None:
        previous = await trio.to_thread.run_sync(self._note.read)
        if previous is not None:
            self.unwritten_before_restart = previous
            runs = previous["runs"]
            logger.error(
                "the previous daemon (pid %s) ended while the journal could not be written (since %s)%s: "
                "what waited in its memory was lost; %d runs are told so by a journal_gap event%s",
                previous.get("pid", "?"),
                previous.get("since", "?"),
                " and its note of which runs had writes waiting is unreadable" if previous.get("unreadable") else "",
                len(runs),
                f" ({previous['more']} more were not named)" if previous.get("more") else "",
            )
            gap = {
                "message": "the daemon ended while facts of this run waited in its memory for the journal: "
                "its last events, state or end may be missing",
                "degraded_since": previous.get("since"),
                "daemon_pid": previous.get("pid"),
            }
            noted = previous.get("ends")
            ends: dict[str, Any] = noted if isinstance(noted, dict) else {}
            stops: dict[str, Any] = previous.get("stops") or {}
            for run_id in runs:
                try:
                    await self.journal.append_event(run_id, "journal_gap", gap)
                except (RunNotFound, JournalError) as exc:
                    logger.warning("run %s: what its note says could not be written: %s", run_id, exc)
                if run_id in stops:  # before its end: the ended run's record has its stop too
                    await self._write_noted_stop(run_id, {**stops[run_id], "daemon_pid": previous.get("pid")})
                try:
                    await self._write_noted_end(run_id, ends.get(run_id))
                except (RunNotFound, JournalError) as exc:
                    logger.warning("run %s: what its note says could not be written: %s", run_id, exc)
            if self.carried_stops or previous.get("more_stops"):
                logger.error(
                    "the previous daemon acknowledged %d stops it could not journal: journaled now (or noted "
                    "again), resumed where their runs are live%s",
                    len(self.carried_stops),
                    f" ({previous['more_stops']} more did not fit its note and are not)"
                    if previous.get("more_stops")
                    else "",
                )
        await trio.to_thread.run_sync(self._note.reset)

    async def _write_noted_stop(self, run_id: str, stop: dict[str, Any]) -> None:
        """The stop a dead daemon acknowledged and only noted, journaled before the runs are
        recovered (before this daemon's note is reset: a second kill loses nothing), and
        kept for recovery, which resumes it (``carried_stops``). One the journal had after
        all (the dead daemon wrote it, or the run ended) is not this note's to carry."""
        try:
            if not await self.journal.record_cancel(
                run_id,
                reason=stop["reason"],
                at=stop["at"],
                stop_deadline=stop["stop_deadline"],
                detail=stop.get("detail") if isinstance(stop.get("detail"), dict) else None,
            ):
                return
        except RunNotFound:
            return
        except JournalError as exc:  # recovery tries again, through the backlog
            logger.warning("run %s: its noted stop could not be journaled yet: %s", run_id, exc)
        self.carried_stops[run_id] = stop

    async def _write_noted_end(self, run_id: str, end: Any) -> None:
        """The end a dead daemon decided for the run and noted, written if the run is live
        in the journal: its result is its last checkpoint, marked partial. One the journal
        cannot take now is kept for recovery (``carried_ends``)."""
        noted = noted_end(end)
        if noted is None:
            return
        state, reason, ended_at, _groups = noted
        try:
            finished = await self.journal.finish(run_id, state, **noted_finish_args(noted))
        except JournalError:
            self.carried_ends[run_id] = dict(end)
            raise
        if finished:
            await self.journal.append_event(run_id, "state", noted_end_event(state, reason), ended_at)
            logger.warning("run %s: its end (%s) written from the previous daemon's note", run_id, state)

    async def write_carried_end(self, run_id: str, seq: int) -> bool:
        """The noted end of a run (``carried_ends``), through the queue (noted again while it
        waits), with its ``state`` event numbered ``seq``; False if it has none: the dead
        daemon had decided that end, which is the run's, whatever recovery finds now."""
        end = self.carried_ends.get(run_id)
        noted = noted_end(end)
        if end is None or noted is None:
            return False
        state, reason, ended_at, groups = noted
        await self.write(
            run_id,
            lambda j: j.finish(run_id, state, **noted_finish_args(noted)),
            True,
            what=f"noted end {state}",
            end={"state": str(state), "reason": reason, "ended_at": ended_at, "groups_ended_at": groups},
        )
        await self.append(run_id, seq, "state", noted_end_event(state, reason), ended_at or time.time())
        logger.warning("run %s: its end (%s) is the previous daemon's, from its note", run_id, state)
        return True

    async def _note_runs(self) -> None:
        """The note on disk names the runs that have writes waiting now (see the module)."""
        async with self._noting:
            runs = frozenset(self._queues)
            noted = (runs, frozenset(self._ends), frozenset(self._stops))
            if noted == self._noted:
                return
            note = None
            if runs:
                note = {
                    "pid": os.getpid(),
                    "since": self.since,
                    "runs": sorted(runs),
                    "ends": dict(self._ends),
                    "stops": dict(self._stops),
                }
            await trio.to_thread.run_sync(self._note.save, note)
            self._noted = noted

    async def flush(self) -> bool:
        """Write what waits, run by run, in order. True if nothing waits any more."""
        async with self._flushing:
            done = await self._flush()
        await self._note_runs()
        return done

    async def _flush(self) -> bool:
        wrote = False
        for run_id in list(self._queues):
            queue = self._queues[run_id]
            while queue:
                op = queue[0]
                try:
                    await op.apply(self.journal)
                except JournalUnavailable as exc:
                    self.error = str(exc)
                    if self.on_unavailable is not None:
                        self.on_unavailable()
                    return False
                except RunNotFound:
                    logger.error("run %s: gone from the journal; dropping its waiting writes", run_id)
                    queue.clear()
                    break
                except Exception:
                    logger.exception("run %s: a waiting write (%s) fails; dropping it", run_id, op.what)
                else:
                    wrote = True
                if queue and queue[0] is op:
                    queue.popleft()
                    if op.event is not None:
                        self._event_count[run_id] -= 1
                        self._event_bytes[run_id] -= op.size
                self.flushed += 1
            self._forget(run_id)
        if not self._queues:
            if self.degraded and wrote:
                self._healthy()
            return True
        return False

    def _forget(self, run_id: str) -> None:
        if self._queues.get(run_id):
            return  # refilled while the last write was in flight
        self._queues.pop(run_id, None)
        self._ends.pop(run_id, None)
        self._stops.pop(run_id, None)  # journaled now, with the rest of its writes
        self._event_bytes.pop(run_id, None)
        self._event_count.pop(run_id, None)
        dropped = self._dropped.pop(run_id, 0)
        if dropped:
            logger.warning(
                "run %s: %d of its events were dropped while the journal could not be written", run_id, dropped
            )
        waiter = self._waiters.pop(run_id, None)
        if waiter is not None:
            waiter.set()
        if self._on_flushed is not None:
            self._on_flushed(run_id)

    def report_unwritten(self) -> None:
        """At shutdown: say what is lost with the daemon's memory."""
        for run_id, queue in self._queues.items():
            logger.error(
                "run %s: %d writes never reached the journal (%s): after a restart it may be lost",
                run_id,
                len(queue),
                ", ".join(op.what for op in list(queue)[:8]),
            )
