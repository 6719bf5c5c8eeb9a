"""The runs' book: every fact of a live run goes to the journal and out to its watchers here.

``RunBook`` owns the live runs by id and the journal's backlog (``_backlog.Backlog``:
while the journal cannot be written, facts wait in memory, terminal ones included).
``create`` writes a new run with its ``queued`` event (and, for a run a spare takes at
once, its start) and ``start`` a run's start (``starting``, its event, its deadline, a
spare's process record), each one commit; ``record`` journals an event and fans it out
to the run's subscribers; ``stage`` keeps a runner's event (with the tool-call record,
process group or checkpoint that comes with it) until ``flush`` writes all the staged
ones in one commit (a group commit: ~2 commits an event cost ~1 ms of the daemon's CPU
each) and only then fans them out, in order; ``transition``
moves a run's state by the table in ``states``; ``finish`` writes the one terminal fact
(a compare-and-set in the journal: a cancel racing a completion yields one outcome) and
lets the run go: token retired, subscribers closed, waiters woken. Never raises for a
run's bookkeeping in ``finish``: a fact that cannot be stored as it is is stored minimal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import trio

from supervisor.core._run import Run, Staged
from supervisor.errors import JournalUnavailable
from supervisor.states import TERMINAL_STATES, RunState, can_transition
from supervisor.store._bounds import tool_call_step
from supervisor.store._ops import tool_call_rank
from supervisor.store.backlog import Backlog
from supervisor.store.journal import EventWrite, Journal, RunStart

__all__ = [
    "RunBook",
    "SUBSCRIBER_BUFFER",
    "STAGED_MAX",
    "RESULT_RECORDS_PER_WRITE",
    "take_result_records",
    "tree_dead_wall",
]

logger = logging.getLogger(__name__)

# Buffered events per live subscriber; a subscriber that falls further behind is dropped
# (it reconnects and replays from its last sequence number).
SUBSCRIBER_BUFFER: Final = 4096

# A run's staged events are written once this many wait, whatever the read brought: one
# transaction holds the journal's thread (other runs' writes and reads) for a few ms at most.
STAGED_MAX: Final = 256

JournalOp = Callable[[Journal], Any]


class RunBook:
    """Live runs by id, and every fact of theirs on its way to the journal and watchers."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.live: dict[str, Run] = {}
        self.backlog = Backlog(journal, on_flushed=self._flushed)
        # Ended runs whose facts still wait for the journal (degraded mode).
        self._unflushed: dict[str, Run] = {}

    def _flushed(self, run_id: str) -> None:
        run = self._unflushed.pop(run_id, None)
        if run is not None:
            run.final = None

    def overlay_unwritten(self, row: dict[str, Any]) -> None:
        """What the journal does not hold yet (degraded mode) overrides what it holds."""
        run = self._unflushed.get(row["id"])
        if run is not None and run.final is not None:
            row.update(run.final)
            row["last_seq"] = max(row.get("last_seq") or 0, run.last_seq)
        if self.backlog.pending(row["id"]):
            row["journal"] = "pending: some facts of this run wait in memory for the journal"
            live = self.live.get(row["id"])
            if live is not None:  # its events handed out, not yet written (`events` has them)
                row["last_seq"] = max(row.get("last_seq") or 0, live.last_seq)

    async def write(
        self, run: Run, what: str, direct: JournalOp, predicted: Any, *, stop: Mapping[str, Any] | None = None
    ) -> Any:
        """One journal write of the run's, or queued while the journal cannot be written
        (``stop``: it is a stop's intent, noted on disk while it waits: ``Backlog.write``)."""
        return await self.backlog.write(run.run_id, direct, predicted, what=what, stop=stop)

    async def record(self, run: Run, kind: str, data: dict[str, Any], ts: float | None = None) -> int | None:
        """Journal one event of the run's and send it to its subscribers; its number."""
        async with run.lock:
            # The daemon's own events never go back in time within the run. (A runner's
            # event keeps its own stamp: a restarted daemon knows it by it, ``event_key``.)
            ts = max(time.time(), run.last_ts) if ts is None else ts
            seq = await self.backlog.append(run.run_id, run.last_seq + 1, kind, data, ts)
            if seq is None:  # the journal is down and this run's backlog is full: dropped
                return None
            self._send(run, seq, kind, data, ts)
        return seq

    async def record_durable(self, run: Run, kind: str, data: dict[str, Any]) -> int:
        """Journal one event of the run's now, in a FULL (fsynced) commit, and send it to its
        subscribers; its number. Never queued: a fact the daemon acts on only once it is on
        disk (an approval's answer, before it goes to the runner).

        Raises:
            JournalUnavailable: the journal cannot be written, or this run's facts wait for
                it already (this one would go after them); nothing of it is written.
        """
        async with run.lock:
            if self.backlog.pending(run.run_id):
                raise JournalUnavailable(f"run {run.run_id}'s earlier facts wait for the journal")
            ts = max(time.time(), run.last_ts)
            try:
                (seq,) = await self.journal.append_events(run.run_id, [(kind, data, ts)], durable=True)
            except JournalUnavailable as exc:
                self.backlog.note_failure(exc, f"run {run.run_id}'s event {kind}")
                raise
            self.backlog.note_success()
            self._send(run, seq, kind, data, ts)
        return seq

    def stage(self, run: Run, staged: Staged) -> None:
        """Keep a runner's event for ``flush``: nothing of it is written or sent before."""
        run.staged.append(staged)

    def staged_partial(self, run: Run) -> dict[str, Any] | None:
        """The run's partial result with its staged snapshots folded in."""
        return next((s.partial for s in reversed(run.staged) if s.partial is not None), run.partial)

    async def flush(self, run: Run) -> None:
        """Journal the run's staged events in one transaction (``Journal.append_run_events``:
        one commit), then send them to its subscribers, in order: a watcher is told of
        none before all are written. While the journal cannot be written (or this run's
        facts wait already) each is written, or queued, on its own, in the same order, as
        ``write`` and ``record`` do."""
        staged, run.staged = run.staged, []
        if not staged:
            return
        async with run.lock:
            if not self.backlog.pending(run.run_id):
                last, writes = run.last_ts, []
                for s in staged:
                    ts = max(time.time(), last) if s.ts is None else s.ts
                    last = max(last, ts)
                    writes.append(EventWrite(s.kind, s.data, ts, s.tool_call, s.group, s.group_ended, s.checkpoint))
                try:
                    seqs = await self.journal.append_run_events(run.run_id, writes)
                except JournalUnavailable as exc:
                    self.backlog.note_failure(exc, f"run {run.run_id}'s events")
                else:
                    self.backlog.note_success()
                    for seq, w, s in zip(seqs, writes, staged, strict=True):
                        self._send(run, seq, w.kind, s.data, w.ts)
                        if s.partial is not None:
                            run.partial = s.partial
                    return
        for s in staged:
            await self._write_one(run, s)

    async def _write_one(self, run: Run, s: Staged) -> None:
        """A staged event written on its own (or queued: the journal is down)."""
        run_id = run.run_id
        if s.tool_call is not None:
            record = s.tool_call
            await self.write(run, "tool call", lambda j: j.upsert_tool_call(run_id, record), True)
        if s.group is not None:
            pgid, kind, name, on_stop = s.group
            await self.write(
                run, "process group", lambda j: j.add_group(run_id, pgid, kind, name, on_stop=on_stop), None
            )
        if s.group_ended is not None:
            ended = s.group_ended
            await self.write(run, "process group ended", lambda j: j.remove_group(run_id, ended), True)
        seq = await self.record(run, s.kind, s.data, s.ts)
        if s.partial is not None:
            run.partial = s.partial
        if s.checkpoint is not None and seq is not None:
            cp = s.checkpoint
            await self.write(run, "partial result", lambda j: j.set_partial(run_id, cp, seq=seq), True)

    def _send(self, run: Run, seq: int, kind: str, data: dict[str, Any], ts: float) -> None:
        """Out to the run's subscribers: an event the journal numbered ``seq`` (under ``run.lock``)."""
        run.last_seq = max(run.last_seq, seq)
        run.last_ts = max(run.last_ts, ts)
        msg = {"run_id": run.run_id, "seq": seq, "ts": ts, "kind": kind, "data": data}
        for send in list(run.subscribers):
            try:
                send.send_nowait(msg)
            except trio.WouldBlock:
                logger.warning(
                    "run %s: dropping a subscriber that fell %d events behind", run.run_id, SUBSCRIBER_BUFFER
                )
                run.subscribers.discard(send)
                send.close()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.subscribers.discard(send)

    async def create(
        self, run: Run, *, created_at: float, start: dict[str, Any] | None = None, key: str | None = None
    ) -> None:
        """A new run: its record and its ``queued`` state event, one commit (fsynced).
        With ``start`` (its process record: a spare runner took it, and its place under
        ``max_concurrent`` is held) the run starts at once, as ``start`` writes it, in that
        same commit (a turn prepared at its creation: its ``session`` event too).

        With ``key`` (the spawn's idempotency key) the key is recorded as this run's, in
        that commit too.

        Not queued when the journal cannot be written: no new run then.

        Raises:
            JournalUnavailable, JournalError: from the journal (nothing was written).
        """
        queued: dict[str, Any] = {"state": str(RunState.QUEUED)}
        if run.model_key is not None:
            # Not the key (never journaled): that it had one, so a restarted daemon never
            # queues it again to run on its own key (``_requeue``).
            queued["own_model_key"] = True
        starting: dict[str, Any] = {"state": str(RunState.STARTING)}
        deadline = None if start is None else self._deadline(run, created_at)
        begun = [("state", starting, created_at), *_turn_events(run, created_at)]
        async with run.lock:
            seqs = await self.journal.create_run(
                run.run_id,
                session_id=run.session_id,
                spec=run.spec,
                created_at=created_at,
                timeout_s=run.timeout_s,
                events=[("state", queued, created_at)],
                start=None if start is None else RunStart(created_at, begun, deadline, start),
                key=key,
            )
            self._send(run, seqs[0], "state", queued, created_at)
            if start is not None and len(seqs) > 1:
                run.state = RunState.STARTING
                run.deadline = deadline
                self._send_begun(run, seqs[1:], begun)

    async def start(self, run: Run, *, process: dict[str, Any] | None) -> bool:
        """``queued`` -> ``starting`` with its event (and a prepared turn's ``session``
        event), the run's deadline (its timeout from now, absolute: a restart does not
        extend it) and its ``process`` record (where there are), in one commit (one
        fsync); False if the run may not start (changing nothing but the deadline and
        record, as apart).

        While the journal cannot be written (or this run's facts wait already), each is
        written (or queued) on its own, in the same order, as ``transition`` and ``write``.
        """
        run_id = run.run_id
        async with run.state_lock:
            if run.state in TERMINAL_STATES:
                return False
            if not self.backlog.pending(run_id):
                data: dict[str, Any] = {"state": str(RunState.STARTING)}
                async with run.lock:
                    ts = time.time()
                    deadline = self._deadline(run, ts)
                    begun = [("state", data, ts), *_turn_events(run, ts)]
                    try:
                        moved, seqs = await self.journal.start_run(
                            run_id, at=ts, events=begun, deadline=deadline, process=process
                        )
                    except JournalUnavailable as exc:
                        self.backlog.note_failure(exc, f"run {run_id}'s start")
                    else:
                        self.backlog.note_success()
                        if deadline is not None:
                            run.deadline = deadline
                        if moved:
                            run.state = RunState.STARTING
                            self._send_begun(run, seqs, begun)
                        return moved
        moved = await self.transition(run, RunState.STARTING)
        deadline = self._deadline(run, time.time())
        if deadline is not None:
            run.deadline = deadline
            await self.write(run, "deadline", lambda j: j.record_deadline(run_id, deadline), True)
        if process:
            fields = dict(process)
            await self.write(run, "process record", lambda j: j.record_process(run_id, **fields), True)
        return moved

    def _send_begun(self, run: Run, seqs: list[int], begun: list[tuple[str, dict[str, Any], float]]) -> None:
        """Out to subscribers: a start's events, journaled (a prepared turn's is used up)."""
        for seq, (kind, data, ts) in zip(seqs, begun, strict=False):
            self._send(run, seq, kind, data, ts)
        if len(seqs) == len(begun):
            run.session_event = None

    async def transition(
        self,
        run: Run,
        new: RunState,
        *,
        reason: str | None = None,
        only_from: Collection[RunState] | None = None,
        ts: float | None = None,
    ) -> bool:
        """Move a live run to ``new`` (journaled, then announced); False if not allowed,
        or (``only_from``) if the run is not in one of those states.

        Whole under the run's ``state_lock``: its end, written while this write was under
        way, waits for this change's event, and is not followed by it; a start under way
        is in (``only_from`` sees the state it left). ``ts``: its event's time (that of the
        runner's event that moved it, which follows it: default now).
        """
        async with run.state_lock:
            if run.state in TERMINAL_STATES or (only_from is not None and run.state not in only_from):
                return False
            ok = await self.write(
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
                await self.record(run, "state", data, ts)
            return bool(ok)

    async def finish(
        self,
        run: Run,
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
        minimal one is, naming the failure. Whatever happens, the run is let go.
        """
        with trio.CancelScope(shield=True):
            try:
                async with run.state_lock:  # after a change of state under way (``transition``)
                    ok = await self._write_terminal(run, state, reason, result, partial, error, receipt)
                    run.token.retire()
                    if ok:
                        run.state = state
                        data: dict[str, Any] = {"state": str(state), "partial": partial}
                        if reason:
                            data["reason"] = reason
                        await self.record(run, "state", data)
                    elif not self.backlog.pending(run.run_id):
                        row = await self.journal.get_run(run.run_id)
                        if row is not None:
                            if row["state"] not in TERMINAL_STATES:
                                logger.error(
                                    "run %s: its end (%s) was refused in state %s; it stays as it is",
                                    run.run_id,
                                    state,
                                    row["state"],
                                )
                            run.state = RunState(row["state"])
            except Exception:
                logger.exception("run %s: writing its end failed", run.run_id)
            finally:
                self.let_go(run)

    async def _write_terminal(
        self,
        run: Run,
        state: RunState,
        reason: str | None,
        result: dict[str, Any] | None,
        partial: bool,
        error: dict[str, Any] | None,
        receipt: dict[str, Any] | None,
    ) -> bool:
        ended_at = time.time()
        groups_ended_at = tree_dead_wall(receipt)
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

        def write(any_live: bool) -> JournalOp:
            return lambda j: j.finish(
                run.run_id,
                state,
                reason=reason,
                result=result,
                partial=partial,
                error=error,
                receipt=receipt,
                ended_at=ended_at,
                groups_ended_at=groups_ended_at,
                from_any_live_state=any_live,
            )

        # Named in the backlog's note on disk while it waits (a daemon killed meanwhile).
        end = {"state": str(state), "ended_at": ended_at, "groups_ended_at": groups_ended_at}
        try:
            ok = await self.backlog.write(
                run.run_id,
                write(False),
                predicted,
                what=f"terminal state {state}",
                replay=write(True),
                end={**end, "reason": reason},
            )
        except Exception:
            logger.exception("run %s: its terminal fact cannot be stored as it is; storing a minimal one", run.run_id)
            reason = "internal"
            result, receipt = None, None
            error = {"code": "internal", "message": "the run's end could not be recorded in full (see the daemon log)"}
            fact.update(reason=reason, result=run.partial if partial else None, error=error, receipt=None)
            ok = await self.backlog.write(
                run.run_id,
                write(False),
                predicted,
                what=f"terminal state {state} (minimal)",
                replay=write(True),
                end={**end, "reason": reason},
            )
        if ok and self.backlog.pending(run.run_id):
            run.final = fact
            self._unflushed[run.run_id] = run
        return bool(ok)

    @staticmethod
    def _deadline(run: Run, now: float) -> float | None:
        """The run's deadline to record, if it has a timeout and none yet."""
        if run.timeout_s is None or run.deadline is not None:
            return None
        return now + run.timeout_s

    def let_go(self, run: Run) -> None:
        """The run is over for the daemon: token retired, subscribers closed, waiters woken."""
        run.token.retire()
        for send in list(run.subscribers):
            send.close()
        run.subscribers.clear()
        self.live.pop(run.run_id, None)
        run.done.set()


def tree_dead_wall(receipt: dict[str, Any] | None) -> float | None:
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


def _turn_events(run: Run, ts: float) -> list[tuple[str, dict[str, Any], float]]:
    """A turn prepared at its creation: its ``session`` event goes in its start's commit."""
    return [] if run.session_event is None else [("session", run.session_event, ts)]


# A run's end takes its result's tool-call records into the journal this many to a write.
RESULT_RECORDS_PER_WRITE: Final = 256


async def take_result_records(book: RunBook, run: Run, result: dict[str, Any]) -> None:
    """A finished run's result's records into the journal, ``RESULT_RECORDS_PER_WRITE`` to
    a write (a commit per record: 5,000 records held the journal's thread for 3 s)."""
    good = []
    for record in result.get("tool_calls") or []:
        try:
            tool_call_rank(record), tool_call_step(record)
            good.append(record)
        except (AttributeError, TypeError, ValueError):
            logger.warning("run %s: bad tool-call record in the result: %r", run.run_id, record)
    for at in range(0, len(good), RESULT_RECORDS_PER_WRITE):
        chunk = good[at : at + RESULT_RECORDS_PER_WRITE]
        await book.write(run, "tool calls", _upsert_all(run.run_id, chunk), len(chunk))


def _upsert_all(run_id: str, records: list[dict[str, Any]]) -> JournalOp:
    return lambda j: j.upsert_tool_calls(run_id, records)
