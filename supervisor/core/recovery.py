"""Runs a previous daemon left live: re-adopted when provably the same, otherwise ended.

At start the journal's live runs are checked against the process table: a runner whose
pid still runs with the recorded start time is re-adopted, and supervised by the one run
lifecycle with a ``FileSource`` (its pipes went with the old daemon, so its events are
read from its events file and its result from its result file (beside its run dir,
out of its tools' reach: ``subagent.emit.record_paths``); both
cancel paths still reach its tree). A stop the old daemon acknowledged is resumed at
once, without a second cancel: path A again, path B with what is left of the grace
counted from the original cancel, the original reason kept; a timeout keeps its
wall-clock deadline, and so does a call awaiting approval (still answerable through the
run's answer channel; one its runner asked about while no daemon ran is known once the
run's events file is read, which an answer to it waits for: ``Run.caught_up``). So is a
stop acknowledged while the journal could not be written, which the dead daemon only
noted (``supervisor.store._unwritten``): journaled now, its receipt says so; and so is
a stop pressed while no daemon ran (``agentd cancel``'s pending-stop note,
``supervisor.core._pending``): applied as a user's cancel to a live runner (or one never
started) before it goes on, the note removed, its receipt naming it. A run
whose runner is gone is what its complete result file says it was (completed, failed,
cancelled, with its tool records); only a run without a result is marked ``lost`` with
its last partial result. A run left ``queued`` (no runner ever had it) with no stop asked
is queued again (``_requeue``: ``requeued`` for the run manager). Any leftovers are swept.
Nothing terminal changes.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import trio

from subagent.history import LOST_BEFORE_START
from subagent.stopmark import clear_marker
from supervisor.control import _pendingstops
from supervisor.control._pendingstops import PendingStop
from supervisor.core._background import amend_background
from supervisor.core._book import RunBook
from supervisor.core._lifecycle import STARTING_LOST, Lifecycle
from supervisor.core._pending import PendingStops, pending_receipt
from supervisor.core._requeue import requeue
from supervisor.core._run import Run, mark_stop
from supervisor.core._sources import FileSource, event_key
from supervisor.core._steers import unreported_steering
from supervisor.core.token import CancelToken
from supervisor.states import RunState
from supervisor.trees import process
from supervisor.trees.containment import Containment
from supervisor.trees.pool import remove_dir

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)

# In a stop's intent noted while the journal is down: the pending-stop note it came from.
PENDING_KEY = "pending_stop"


class Recovery:
    """Finds again what a previous daemon left live, through the book and the lifecycle."""

    def __init__(self, book: RunBook, lifecycle: Lifecycle, containment: Containment) -> None:
        self.book = book
        self.lifecycle = lifecycle
        self.containment = containment
        # Runs left ``queued`` with no stop asked, queued again (``_requeue``), oldest first:
        # filled by ``recover`` for the run manager's queue.
        self.requeued: list[Run] = []
        # The pending-stop notes read at this start: the running daemon's watch skips them.
        self.notes_read: set[str] = set()

    async def recover(self) -> list[tuple[Run, FileSource]]:
        """Runs to supervise again (each with its events file); the others are ended.

        One run's failure here is that run's: it is logged and left live in the journal
        for the next start, and the others are recovered.
        """
        adopted: list[tuple[Run, FileSource]] = []
        self.requeued = []
        state_dir = self.lifecycle.config.state_dir
        pending = PendingStops(await trio.to_thread.run_sync(_pendingstops.read_all, state_dir))
        self.notes_read.update(note.path.name for note in pending.notes)  # (not the watch's: ``_pendingwatch``)
        for row in await self.book.journal.live_runs():
            try:
                found = await self._recover_one(row, pending)
            except Exception:
                logger.exception("run %s: recovering it failed; left for the next start", row["id"])
                pending.keep_for(row)
                continue
            if found is not None:
                adopted.append(found)
        for note in pending.unmatched():
            known = await self.book.journal.get_run(note.run_id) if note.run_id is not None else None
            what = f"it has ended ({known['state']})" if known is not None else "no such run is live"
            logger.warning("pending stop for %s, pressed while no daemon ran: ignored, %s", note.describe(), what)
        await trio.to_thread.run_sync(pending.settle)
        self.book.backlog.carried_stops.clear()
        self.book.backlog.carried_ends.clear()
        return adopted

    async def _recover_one(self, row: Any, pending: PendingStops) -> tuple[Run, FileSource] | None:
        run_id = row["id"]
        carried = self.book.backlog.carried_stops.get(run_id)
        if carried is not None and row["cancel_reason"] is None:
            # (The backlog could not journal it before recovery: the journal is down still.)
            row = await self._journal_carried_stop(row, carried)
        receipt_note = _carried(carried)
        pid, tree_id = row["pid"], row["tree_id"]
        if pid is None or tree_id is None:
            if (pstop := pending.stop_for(row)) is not None:
                row = await self._journal_pending_stop(row, pstop)
                receipt_note = pending_receipt(pstop)
            await self._never_started(row, receipt_note)
            return None
        groups = [g["pgid"] for g in row["groups"] if g["alive"]]
        found = await trio.to_thread.run_sync(
            functools.partial(
                process.find_tree,
                tree_id,
                pid=pid,
                start_time=row["pid_start_time"],
                cgroup=row["cgroup"],
                groups=groups,
                containment=row["containment"],
                table=self.containment.table,
            )
        )
        # Its pids group (an earlier daemon's v1 one, found by name): read for its receipt,
        # removed with the tree.
        found.tree.pids_group = self.containment.pids.group_of(tree_id, found.tree.cgroup)
        found.tree.memory_group = self.containment.memory.group_of(tree_id, found.tree.cgroup)
        if found.leader_alive and (pstop := pending.stop_for(row)) is not None:
            # Pressed while no daemon ran: the user's cancel, applied before the run goes
            # on (a runner that ended meanwhile is what its result says, not stopped).
            row = await self._journal_pending_stop(row, pstop)
            receipt_note = pending_receipt(pstop)
        for g in row["groups"]:
            if g["alive"] and g["kind"] == "command":
                found.tree.set_interruptible(g["pgid"], g.get("on_stop") == "interrupt")
        run = Run(
            run_id=run_id,
            session_id=row["session_id"],
            spec=row["spec"],
            timeout_s=row["timeout_s"],
            token=CancelToken(run_id),
            state=RunState(row["state"]),
            run_dir=Path(row["run_dir"]) if row["run_dir"] else None,
            tree=found.tree,
            partial=row["partial_snapshot"],
            readopted=True,
            last_seq=row["last_seq"],
        )
        run.deadline = row["deadline"]
        # What the dead daemon sent the runner's input, what the runner said it read and
        # what it said became of it: a steer it was sent and never read (or read and never
        # applied, if it leaves no result) is reported unapplied at the run's end, as the
        # dead daemon would have (its account was in its memory only).
        run.steers_sent, run.steers_read, run.steers_settled = await self.book.journal.steering_texts(run_id)
        # Calls that were awaiting approval still are: their records say so, deadlines
        # included; one the dead daemon had answered (journaled) is not answered again,
        # and its answer is sent again once the run has caught up (``ApprovalDesk.watch``).
        run.approvals.restore(row["tool_calls"], sent=await self.book.journal.approvals_sent(run_id))
        if run.deadline is None and run.timeout_s is not None and row["started_at"] is not None:
            run.deadline = row["started_at"] + run.timeout_s  # a journal from before deadlines
        if row["cancel_reason"] is not None:
            _resume_stop_intent(run, row)
            run.stop_carried = receipt_note
        source = FileSource(found.tree, run.run_dir, journaled=await self._journaled(run_id))
        run.caught_up = source.caught_up
        if found.leader_alive:
            logger.info("run %s: re-adopted runner pid %d (%d live processes)", run_id, pid, len(found.members))
            self.book.live[run_id] = run
            note: dict[str, Any] = {"note": "re-adopted after a daemon restart", "members": found.members}
            if not run.token.cancelled and run.run_dir is not None:
                # No stop to resume: a reason the dead daemon wrote (killed between its
                # mark and its signal, or before it recorded the stop) is no stop of ours.
                clear_marker(run.run_dir)
            if run.token.cancelled:
                # The acknowledged stop goes on at once: path A again, before any await
                # (its marker first: this daemon's SIGTERM is the stop's too).
                mark_stop(run, run.token.reason)
                run.path_a = process.soft_stop(found.tree)
                note["resumed_stop"] = {"reason": run.token.reason, "grace_left_s": self.lifecycle.grace_left(run)}
                if run.stop_carried is not None:
                    note["resumed_stop"]["carried_by"] = run.stop_carried["by"]
            await self.book.record(run, "daemon", note)
            if run.token.cancelled:
                await self.book.transition(
                    run,
                    RunState.CANCELLING,
                    reason=run.token.reason,
                    only_from=(RunState.STARTING, RunState.RUNNING, RunState.AWAITING_APPROVAL),
                )
            elif run.approvals.pending and run.state == RunState.RUNNING:
                # Killed between a call's approval request and the run's move to awaiting it:
                # the state follows the calls (it stayed "running" with a call awaiting).
                await self.book.transition(run, RunState.AWAITING_APPROVAL, only_from=(RunState.RUNNING,))
            elif not run.approvals.pending and run.state == RunState.AWAITING_APPROVAL:
                await self.book.transition(run, RunState.RUNNING, only_from=(RunState.AWAITING_APPROVAL,))
            return run, source
        stop = await process.terminate_and_kill(found.tree, grace_s=0.0)
        await self._ended_while_down(run, row, source, stop, found.members, pending)
        if run.run_dir is not None:
            await trio.to_thread.run_sync(remove_dir, run.run_dir)
        self.containment.remove(found.tree)
        return None

    async def _journal_carried_stop(self, row: Any, stop: dict[str, Any]) -> Any:
        """The stop the dead daemon acknowledged and only noted, journaled now (noted again
        if the journal still cannot be written); the row, as if it had been journaled."""
        run_id = row["id"]
        reason, at, until = stop["reason"], stop["at"], stop["stop_deadline"]
        detail = stop.get("detail") if isinstance(stop.get("detail"), dict) else None
        intent = {"reason": reason, "at": at, "stop_deadline": until, "detail": detail}
        if isinstance(stop.get(PENDING_KEY), dict):
            intent[PENDING_KEY] = stop[PENDING_KEY]  # (noted again, its origin with it)
        await self._write_stop(run_id, intent)
        logger.warning(
            "run %s: its stop (%s), acknowledged by the previous daemon (pid %s) while the journal could not be "
            "written and carried by its note, is resumed; its grace ends at %s",
            run_id,
            reason,
            stop.get("daemon_pid"),
            until,
        )
        return _stopped_row(row, intent)

    async def _journal_pending_stop(self, row: Any, pstop: PendingStop) -> Any:
        """A stop pressed while no daemon ran, journaled now as a cancel asked now (its
        grace counts from now: no signal reached the run before), the row as if it had been.
        Noted with where it came from: a journal that cannot take it leaves it to the
        journal-unwritten note, and the next daemon's receipt still names the pending stop."""
        run_id, at, reason, named = row["id"], time.time(), pstop.reason, pstop.describe()
        until = at + self.lifecycle.config.grace_s
        intent = {
            "reason": reason,
            "at": at,
            "stop_deadline": until,
            "detail": None,
            PENDING_KEY: {"note": pstop.path.name, "pressed_at": pstop.at, "cli_pid": pstop.cli_pid},
        }
        await self._write_stop(run_id, intent)
        logger.warning(
            "run %s: a stop (%s) pressed while no daemon ran (pending stop for %s) is applied before it goes on",
            run_id,
            reason,
            named,
        )
        return _stopped_row(row, intent)

    async def _write_stop(self, run_id: str, intent: dict[str, Any]) -> None:
        """Journal a stop's intent (``reason``, ``at``, ``stop_deadline``, ``detail``), or
        note it while the journal is down (its other keys travel in the note)."""
        reason, at, until, detail = intent["reason"], intent["at"], intent["stop_deadline"], intent["detail"]
        await self.book.backlog.write(
            run_id,
            lambda j: j.record_cancel(run_id, reason=reason, at=at, stop_deadline=until, detail=detail),
            True,
            what="stop intent",
            stop=intent,
        )

    async def _never_started(self, row: Any, carried: dict[str, Any] | None = None) -> None:
        run_id = row["id"]
        reason = row["cancel_reason"]
        backlog = self.book.backlog
        if await backlog.write_carried_end(run_id, row["last_seq"] + 1):
            return  # the dead daemon's own end for it, noted (its process record was lost)
        if reason is not None:
            # Its stop was acknowledged before it had a process: that stop is what happened.
            receipt: dict[str, Any] = {"note": "cancelled before its runner started; finished by the restarted daemon"}
            if carried is not None:
                receipt["stop_carried"] = carried
            await backlog.write(
                run_id,
                lambda j: j.finish(
                    run_id, RunState.CANCELLED, reason=reason, result=None, partial=False, receipt=receipt
                ),
                True,
                what="cancelled",
            )
            # Its terminal event, as every end has (a watcher, `logs`, a resumed subscriber).
            end = {"state": str(RunState.CANCELLED), "partial": False, "reason": reason}
            await backlog.append(run_id, row["last_seq"] + 1, "state", end, time.time())
            logger.warning("run %s: cancelled (its stop was acknowledged before it started)", run_id)
            return
        if row["state"] == str(RunState.QUEUED):
            # Acknowledged, journaled, never given to a runner: queued again, not dropped.
            run = await requeue(self.book, self.lifecycle.config, row)
            if run is not None:
                self.requeued.append(run)
            return
        await backlog.write(
            run_id,
            lambda j: j.mark_lost(run_id, reason=LOST_BEFORE_START),
            True,
            what="lost",
        )
        await backlog.append(
            run_id, row["last_seq"] + 1, "state", {"state": str(RunState.LOST), "partial": True}, time.time()
        )
        logger.warning("run %s: lost (never started before the daemon restarted)", run_id)

    async def _ended_while_down(
        self, run: Run, row: Any, source: FileSource, stop: process.StopReceipt, swept: list[int], pending: PendingStops
    ) -> None:
        """The runner ended while no daemon watched: its complete result says what the run was."""
        run_id = run.run_id
        # Its events after the old daemon died went to its events file: keep them (tool records).
        await source.read_once(lambda items: self.lifecycle.on_events(run, source.tree, items))
        result = source.result()
        if isinstance(result, dict):
            logger.warning("run %s: finished while the daemon was down: %s", run_id, result.get("status"))
            run.stop_receipt = stop.to_dict()
            receipt = {**run.stop_receipt, "note": "the run ended while the daemon was down", "swept": swept}
            await self.lifecycle.conclude(run, None, receipt, result)
            return
        if await self.book.backlog.write_carried_end(run_id, run.last_seq + 1):
            # The dead daemon ended it (its tree, its directory and its result file) and
            # noted the end it decided, which the journal could not take then nor at this
            # start: that end is the run's (a completed run is not `cancelled` by a stop
            # noted as it ended, nor `lost`).
            return
        if run.state == RunState.STARTING and not run.token.cancelled and (pstop := pending.stop_for(row)):
            # Never let go (a spare at its gate exits at the hang-up, having done nothing of
            # the run): a stop pressed while no daemon ran ends it `cancelled`, as it ends a
            # queued run, not `lost` with the stop ignored.
            row = await self._journal_pending_stop(row, pstop)
            await self._never_started({**row, "last_seq": run.last_seq}, pending_receipt(pstop))
            if not stop.survivors:
                await self.book.write(run, "groups ended", lambda j: j.end_groups(run_id), 0)
            return
        if run.token.cancelled:
            # A stop the old daemon acknowledged, whose runner died without a result: what
            # the live path records then (cancelled, its last snapshot as partial result).
            logger.warning("run %s: its acknowledged stop ended it while the daemon was down", run_id)
            if run.partial is None and row["partial_snapshot"] is not None:
                run.partial = row["partial_snapshot"]
            run.stop_receipt = stop.to_dict()
            receipt = {**run.stop_receipt, "note": "the run ended while the daemon was down", "swept": swept}
            await self.lifecycle.conclude(run, None, receipt, result)
            return
        # Steering its runner never read, or read and never applied, is reported, as at
        # the end of any run that left no result.
        unapplied = await unreported_steering(self.book, run, result_written=False)
        snapshot = run.partial if run.partial is not None else row["partial_snapshot"]
        if unapplied and isinstance(snapshot, dict):
            snapshot = {**snapshot, "unapplied_steering": [*(snapshot.get("unapplied_steering") or []), *unapplied]}
        reason = (
            STARTING_LOST
            if run.state == RunState.STARTING
            else "the runner was gone when the daemon restarted, without a result"
        )
        book = self.book
        # Its background commands' calls, which its runner never amended: the daemon's
        # account (the sweep above ended what was left of its tree).
        how = "the daemon, restarted, found its runner gone"
        dead = None if stop.survivors else time.time()
        await amend_background(book, run, how=how, stopped=False, tree_dead_wall=dead)
        await book.write(
            run,
            "lost",
            lambda j: j.mark_lost(run_id, reason=reason, partial_result=snapshot),
            True,
        )
        recovery_receipt = {"recovery": stop.to_dict(), "swept": swept}
        await book.write(run, "receipt", lambda j: j.set_receipt(run_id, recovery_receipt), True)
        if not stop.survivors:
            await book.write(run, "groups ended", lambda j: j.end_groups(run_id), 0)
        await book.record(run, "state", {"state": str(RunState.LOST), "partial": True})
        logger.warning("run %s: lost; swept %d leftover processes", run_id, len(swept))

    async def _journaled(self, run_id: str) -> list[tuple[str, float, str]]:
        """The run's journaled events, as ``event_key`` tells them apart."""
        keys: list[tuple[str, float, str]] = []
        after = 0
        while page := await self.book.journal.events_after(run_id, after, limit=1000):
            keys.extend(event_key(e["kind"], e["ts"], e["data"]) for e in page)
            after = page[-1]["seq"]
        return keys


def _stopped_row(row: Any, intent: dict[str, Any]) -> dict[str, Any]:
    """The journal's row of a run as it reads once ``intent`` is journaled."""
    return {
        **row,
        "cancel_reason": intent["reason"],
        "cancel_requested_at": intent["at"],
        "stop_deadline": intent["stop_deadline"],
        "stop_detail": intent["detail"],
    }


def _carried(stop: dict[str, Any] | None) -> dict[str, Any] | None:
    """For the receipt: the stop came across the restart in the journal-unwritten note."""
    if stop is None:
        return None
    pressed = stop.get(PENDING_KEY)
    if isinstance(pressed, dict):
        # A stop pressed while no daemon ran, which the daemon that read its note could not
        # journal: not one that daemon acknowledged to anyone.
        return {
            "by": "pending-stop",
            "note": pressed.get("note"),
            "pressed_at": pressed.get("pressed_at"),
            "cli_pid": pressed.get("cli_pid"),
            "then": "journal-unwritten",
            "daemon_pid": stop.get("daemon_pid"),
            "message": "the stop was pressed while no daemon ran and recorded in a pending-stop note; the daemon "
            "that applied it could not journal it and ended before it could: its journal-unwritten note "
            "carried it across the restart",
        }
    return {
        "by": "journal-unwritten",
        "daemon_pid": stop.get("daemon_pid"),
        "message": "the stop was acknowledged while the journal could not be written and the daemon that took it "
        "was killed before it could journal it: its journal-unwritten note carried it across the restart",
    }


def _resume_stop_intent(run: Run, row: Any) -> None:
    """The stop the old daemon acknowledged, as it was: reason, time, end of its grace."""
    run.token.cancel(row["cancel_reason"])
    run.stop_taken.set()
    run.stop_recorded.set()  # durable already: a cancel now is acknowledged at once
    run.stop_detail = row.get("stop_detail")  # what the daemon measured for it (a full disk)
    run.cancel_wall = row["cancel_requested_at"]
    run.stop_deadline = row["stop_deadline"]
    if run.cancel_wall is not None:
        # On this daemon's Trio clock, for the receipt's cancel-to-dead figure.
        run.cancel_at = trio.current_time() - max(0.0, time.time() - run.cancel_wall)
