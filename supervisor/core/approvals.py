"""Approvals on the daemon's side: calls waiting for a person's OK, answers, deadlines.

A runner asks (``approval_requested``, and the call's record says ``approval: pending``
with its wall-clock deadline); the run goes to ``awaiting_approval`` and ``status`` lists
the call. ``approve``/``deny`` write one answer line into the run's *answer channel*, a
FIFO next to its run directory (``answers_path``) that the runner opened before it
sandboxed itself, so a restarted daemon answers a re-adopted runner the same way and the
run's own tools cannot answer for it. The answer is journaled (``approval_sent``, an
fsynced commit) *before* it is written: nothing reaches the runner that the journal does
not hold, so a daemon killed between the two leaves a record, and the restarted daemon
refuses a second answer and sends the journaled one again once it has read the runner's
events file (``watch``; the runner takes the first answer to a call and ignores the
rest). An answer that could not be journaled is not sent; one of which nothing went into
the channel is journaled ``approval_unsent`` and the call can be answered again. The
runner says what it did with it (``approval_answered``) and the run goes back to
``running``. At the earliest deadline still pending the run is cancelled with reason
``approval_timeout``, through the manager's normal cancel (both paths, journaled intent):
a timeout is a stop. Pending calls live in the journal (the records), so ``restore``
rebuilds them for a re-adopted run, deadlines included; a call its runner asked about
while no daemon ran is only in its events file, which the restarted daemon reads once
it serves: an answer to a re-adopted run waits (``CATCH_UP_WAIT_S`` at most) until that
read has caught up (``Run.caught_up``), so it is not refused for a call not yet known;
nor is a restored deadline acted on before it (the call may have been answered in time).

The manager owns the runs; this module sees it through ``Hooks`` (record an event, move
a run's state, cancel a run) and keeps each run's pending calls in its ``RunApprovals``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import trio

from subagent.approvals import MAX_ANSWER_LINE_BYTES
from subagent.events import Approval, EventKind, ToolCallState
from supervisor.core._fdwrite import write_whole
from supervisor.errors import ControlProtocolError, JournalUnavailable
from supervisor.protocol import ErrorCode
from supervisor.states import RunState

__all__ = [
    "ANSWERS_SUFFIX",
    "APPROVAL_TIMEOUT_REASON",
    "CATCH_UP_WAIT_S",
    "Pending",
    "RunApprovals",
    "Hooks",
    "Transition",
    "ApprovalDesk",
    "answers_path",
    "make_channel",
    "remove_channel",
]

logger = logging.getLogger(__name__)

ANSWERS_SUFFIX: Final = ".answers"
APPROVAL_TIMEOUT_REASON: Final = "approval_timeout"
# An answer line (bytes): the runner reads lines up to this long, and the longest answer
# the protocol accepts fits (a deny's reason of MAX_DENY_REASON_CHARS and a call id of
# MAX_ID_CHARS, every character escaped; ``_line``), so a reason reaches the model whole.
MAX_ANSWER_BYTES: Final = MAX_ANSWER_LINE_BYTES
# How long an answer may wait for room in the channel (seconds): the runner reads it at
# once; a runner that does not has stopped listening, and the answer is refused.
SEND_TIMEOUT_S: Final = 10.0
# How long an answer to a re-adopted run waits for the run's catch-up on its events file
# (seconds): one run's slow catch-up delays only answers to that run, and not forever.
CATCH_UP_WAIT_S: Final = 10.0


def answers_path(run_dir: Path) -> Path:
    """The run's answer channel: beside its run directory, so outside the run's sandbox."""
    return run_dir.with_name(run_dir.name + ANSWERS_SUFFIX)


def make_channel(run_dir: Path) -> Path:
    """Make the run's answer FIFO (mode 0600). Blocking."""
    path = answers_path(run_dir)
    os.mkfifo(path, 0o600)
    return path


def remove_channel(run_dir: Path) -> None:
    """Remove the run's answer FIFO, if any. Blocking; idempotent."""
    try:
        answers_path(run_dir).unlink()
    except FileNotFoundError:
        pass


@dataclass(slots=True)
class Pending:
    call_id: str
    name: str
    arguments: str
    step: int | None
    deadline: float | None  # wall clock
    due: float | None = None  # the deadline on Trio's clock, as it was when the call was added
    sent: str | None = None  # "approve" / "deny" once an answer went out
    reason: str | None = None  # the sent answer's reason (a deny's)
    resend: bool = False  # restored as sent by a restarted daemon: its runner may not have it

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
            "step": self.step,
            "deadline": self.deadline,
        }
        if self.sent is not None:
            out["answer_sent"] = self.sent
        return out


@dataclass
class RunApprovals:
    """One run's calls waiting for an answer."""

    pending: dict[str, Pending] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)
    # Held while an answer is decided, and while a line is written: a call is answered
    # once, and one line at a time goes into the channel (a line may be longer than
    # PIPE_BUF). Not while a write waits for room with none of its line in (``_write``):
    # a runner that does not read holds no other answer of its run for the wait.
    sending: trio.Lock = field(default_factory=trio.Lock)

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def add(self, data: Mapping[str, Any]) -> Pending | None:
        call_id = data.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            return None
        deadline = data.get("deadline")
        step = data.get("step")
        # Not a boolean (true is 1: 1970, a deadline passed at once).
        at = float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else None
        p = Pending(
            call_id=call_id,
            name=str(data.get("name") or ""),
            arguments=str(data.get("arguments") or ""),
            step=step if isinstance(step, int) else None,
            deadline=at,
            due=None if at is None else trio.current_time() + (at - time.time()),
        )
        self.pending[call_id] = p
        self._changed()
        return p

    def mark_sent(self, p: Pending, decision: str, reason: str | None = None) -> None:
        """An answer to ``p`` went out: its deadline no longer runs (the runner acts on it)."""
        p.sent, p.reason = decision, reason
        self._changed()

    def unmark(self, p: Pending) -> None:
        """The answer to ``p`` never went into the channel: it waits for one again."""
        p.sent = p.reason = None
        self._changed()

    def drop(self, call_id: str) -> bool:
        found = self.pending.pop(call_id, None) is not None
        if found:
            self._changed()
        return found

    def restore(
        self, records: Iterable[Mapping[str, Any]], sent: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """A re-adopted run's pending calls, from its journaled records; ``sent``: the
        answers the dead daemon journaled (``approval_sent``: ``{"decision", "reason"}``)
        by call id. A call answered already, whose runner had not acted on the answer when
        that daemon died, is not answered again (the runner takes the first answer: a
        second would be told as what happens while the first one does), its deadline no
        longer runs, and its answer is sent again (``resend``): that daemon may have died
        after journaling it and before writing it."""
        for rec in records:
            if (
                rec.get("approval") == Approval.PENDING
                and rec.get("state") == ToolCallState.NOT_STARTED
                and not rec.get("reason")
            ):
                p = self.add(
                    {
                        "call_id": rec.get("id"),
                        "name": rec.get("name"),
                        "arguments": rec.get("arguments"),
                        "step": rec.get("step"),
                        "deadline": rec.get("approval_deadline"),
                    }
                )
                answer = (sent or {}).get(p.call_id) if p is not None else None
                if p is not None and answer is not None:
                    reason = answer.get("reason")
                    self.mark_sent(p, str(answer.get("decision")), reason if isinstance(reason, str) else None)
                    p.resend = True

    def view(self) -> list[dict[str, Any]]:
        return [p.view() for p in self.pending.values()]

    def next_due(self) -> float | None:
        """The earliest deadline (Trio's clock) of a call nobody has answered yet."""
        dues = [p.due for p in self.pending.values() if p.due is not None and p.sent is None]
        return min(dues) if dues else None


class Transition(Protocol):
    """Move a live run to ``new``, only if it is in one of ``only_from`` (checked under its
    state lock: ``RunBook.transition``)."""

    def __call__(self, run: Any, new: RunState, *, only_from: Collection[RunState]) -> Awaitable[Any]: ...


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the desk asks of the run manager."""

    record: Callable[[Any, str, dict[str, Any]], Awaitable[Any]]  # (run, kind, data): journal + fan out
    transition: Transition
    cancel: Callable[[str, str], Awaitable[Any]]  # (run_id, reason): the normal cancel
    # (run, kind, data): journal now, fsynced, or raise ``JournalUnavailable`` (never
    # queued); ``record`` if None (tests).
    record_durable: Callable[[Any, str, dict[str, Any]], Awaitable[Any]] | None = None


class ApprovalDesk:
    """Pending calls of every run, through each run's ``approvals`` (a ``RunApprovals``),
    its ``stopping`` flag (a stop is under way: answers are refused) and its ``caught_up``
    (a re-adopted run's catch-up on its events file: answers wait for it, bounded)."""

    def __init__(self, hooks: Hooks) -> None:
        self._hooks = hooks

    async def on_event(self, run: Any, kind: str, data: Mapping[str, Any]) -> None:
        """A runner's ``approval_requested`` / ``approval_answered``: the run's state follows."""
        approvals: RunApprovals = run.approvals
        if kind == EventKind.APPROVAL_REQUESTED:
            if approvals.add(data) is not None and run.state == RunState.RUNNING:
                await self._hooks.transition(run, RunState.AWAITING_APPROVAL, only_from=(RunState.RUNNING,))
        elif kind == EventKind.APPROVAL_ANSWERED:
            call_id = data.get("call_id")
            if isinstance(call_id, str):
                approvals.drop(call_id)
            # A rejection is a stop's doing (the daemon's cancel, or the runner's own
            # backstop, read late by a restarted daemon): the run is ending, not running
            # again. Nor is any answer the runner acts on once the run's stop is under way.
            if data.get("decision") == Approval.REJECTED or run.stopping:
                return
            if not approvals.pending and run.state == RunState.AWAITING_APPROVAL:
                await self._hooks.transition(run, RunState.RUNNING, only_from=(RunState.AWAITING_APPROVAL,))

    async def answer(self, run: Any, call_id: str, *, approve: bool, reason: str | None = None) -> dict[str, Any]:
        """Send a person's answer to a pending call: journaled (fsynced) first, then written
        into the run's channel; the reply says it was taken only once it is in the channel.

        Raises:
            ControlProtocolError: ``refused`` when the call is not waiting (never asked,
                answered already, the run is stopping), the runner does not listen (or
                does not read it), or the answer cannot be journaled (it is not sent).
        """
        decision = "approve" if approve else "deny"
        approvals: RunApprovals = run.approvals
        caught_up = await _caught_up(run)
        async with approvals.sending:
            p: Pending | None = approvals.pending.get(call_id)
            if p is None:
                behind = (
                    ""
                    if caught_up
                    else f"; what its runner wrote while the daemon was down is still being read "
                    f"(waited {CATCH_UP_WAIT_S:g} s): try again"
                )
                raise ControlProtocolError(
                    ErrorCode.REFUSED,
                    f"call {call_id!r} of run {run.run_id!r} is not awaiting approval (run state: {run.state}){behind}",
                )
            if p.sent is not None:
                raise ControlProtocolError(
                    ErrorCode.REFUSED, f"call {call_id!r} of run {run.run_id!r} was answered already ({p.sent})"
                )
            if run.stopping:
                raise ControlProtocolError(
                    ErrorCode.REFUSED,
                    f"run {run.run_id!r} is being stopped: call {call_id!r} will be rejected, not run",
                )
            if caught_up and p.due is not None and p.due <= trio.current_time():
                # Its deadline is the run's stop (``_deadlines``, which may not have run yet
                # at this instant): an answer now would let the call start after it.
                raise ControlProtocolError(
                    ErrorCode.REFUSED,
                    f"call {call_id!r} of run {run.run_id!r}: its approval deadline has passed; the run is "
                    f"being stopped ({APPROVAL_TIMEOUT_REASON}) and the call will not run",
                )
            if run.run_dir is None:
                raise ControlProtocolError(ErrorCode.REFUSED, f"run {run.run_id!r} has no runner to answer")
            line = _line(call_id, decision, reason)
            fd = _open(answers_path(run.run_dir), run.run_id)  # nobody listening: refused, nothing journaled
            try:
                # On disk before it can reach the runner: a daemon killed between the two
                # leaves a record, which its successor honours and sends again.
                durable = self._hooks.record_durable or self._hooks.record
                try:
                    await durable(run, "approval_sent", {"call_id": call_id, "decision": decision, "reason": reason})
                except JournalUnavailable as exc:
                    raise ControlProtocolError(
                        ErrorCode.REFUSED,
                        f"run {run.run_id!r}: the answer to call {call_id!r} cannot be journaled ({exc}); "
                        f"it was not sent",
                    ) from exc
                approvals.mark_sent(p, decision, reason)  # the call's answer: a second one is refused
            except BaseException:
                os.close(fd)
                raise
        try:
            # Journaled: from here it is written, or said unsent, whatever else comes (a
            # client gone cancels this request); bounded by SEND_TIMEOUT_S, the lock held
            # only to write (a full channel holds no other answer of the run meanwhile).
            with trio.CancelScope(shield=True):
                written, why = await _write(fd, line, approvals.sending)
        finally:
            os.close(fd)
        if why is not None:
            with trio.CancelScope(shield=True):
                await self._unsent(run, p, line, written, why)
        return {
            "run_id": run.run_id,
            "call_id": call_id,
            "decision": "approved" if approve else "denied",
            "state": str(run.state),
        }

    async def _unsent(self, run: Any, p: Pending, line: bytes, written: int, why: str) -> None:
        """The answer to ``p`` (journaled) did not go into the channel whole: refused, and,
        unless the runner can still read it, journaled ``approval_unsent`` (the call waits
        for an answer again). A line cut before its closing brace is junk the runner drops
        at the next line's leading newline; one cut only before its last newline is whole
        JSON, which the runner takes at that newline: it stays the call's answer.

        Raises:
            ControlProtocolError: ``refused``, always.
        """
        msg = f"run {run.run_id!r}: cannot answer: {why}"
        if written >= len(line) - 1:
            raise ControlProtocolError(
                ErrorCode.REFUSED,
                f"{msg}; the answer ({p.sent}) is in the channel but for its last newline: it is the call's "
                f"answer, and its runner takes it when the channel is next written",
            )
        approvals: RunApprovals = run.approvals
        approvals.unmark(p)
        await self._hooks.record(run, "approval_unsent", {"call_id": p.call_id, "why": why})
        raise ControlProtocolError(ErrorCode.REFUSED, f"{msg}; the answer was not sent")

    async def _resend(self, run: Any) -> None:
        """Send again the answers a dead daemon journaled to calls its runner has not said
        it acted on (restored ``resend``): that daemon may have died before writing them.
        The runner takes the first answer to a call and ignores the rest, so one it had
        read already changes nothing. All of them within ``SEND_TIMEOUT_S``, the run's
        ``sending`` held only to write (``_write``): a runner that does not read holds
        no other answer of its run meanwhile."""
        approvals: RunApprovals = run.approvals
        with trio.move_on_after(SEND_TIMEOUT_S) as bound:
            for p in list(approvals.pending.values()):
                if not p.resend or p.sent is None or run.stopping or run.run_dir is None:
                    continue
                p.resend = False
                line = _line(p.call_id, p.sent, p.reason)
                try:
                    fd = _open(answers_path(run.run_dir), run.run_id)
                except ControlProtocolError as exc:
                    logger.warning("run %s: cannot send the answer to call %s again: %s", run.run_id, p.call_id, exc)
                    return
                try:
                    _written, why = await _write(fd, line, approvals.sending)
                finally:
                    os.close(fd)
                if why is not None:
                    logger.warning("run %s: cannot send the answer to call %s again: %s", run.run_id, p.call_id, why)
                else:
                    logger.info("run %s: sent the journaled answer to call %s again", run.run_id, p.call_id)
        if bound.cancelled_caught:
            logger.warning(
                "run %s: the runner has not read its answers for %g s: journaled answers not all sent again",
                run.run_id,
                SEND_TIMEOUT_S,
            )

    async def watch(self, run: Any) -> None:
        """Cancel the run (reason ``approval_timeout``) at the earliest deadline of a call
        nobody answered. A call answered (sent) before its deadline no longer counts, even
        if the runner has not acted on the answer yet.

        A re-adopted run's calls were restored from the journal: what its runner wrote while
        no daemon read it (an answer it acted on) is known once its catch-up has read its
        events file, so no deadline is acted on before that (``CATCH_UP_WAIT_S`` at most): a
        deadline that passed while no daemon ran would otherwise stop a run whose call was
        answered in time.

        Once caught up (or ``CATCH_UP_WAIT_S`` later), it sends again the answers the dead
        daemon journaled to calls still pending (``_resend``), beside the deadlines.

        Runs beside the run's supervision until the run ends (its nursery cancels it).
        """
        await _caught_up(run)
        async with trio.open_nursery() as beside:
            # Beside the deadlines: a re-send waiting on a runner that does not read
            # delays no deadline's stop.
            beside.start_soon(self._resend, run)
            await self._deadlines(run)
            beside.cancel_scope.cancel(reason="the run is being stopped for its approval's deadline")

    async def _deadlines(self, run: Any) -> None:
        """``watch``'s deadline loop: returns once it has cancelled the run."""
        approvals: RunApprovals = run.approvals
        while True:
            changed = approvals.changed
            due = approvals.next_due()
            if due is None or run.stopping:
                await changed.wait()
                continue
            with trio.move_on_at(due):
                await changed.wait()
                continue
            due = approvals.next_due()  # again: an answer may have come with the deadline
            if due is not None and due <= trio.current_time() and not run.stopping:
                logger.info("run %s: an approval ran out of time; stopping the run", run.run_id)
                await self._hooks.cancel(run.run_id, APPROVAL_TIMEOUT_REASON)
                return


async def _caught_up(run: Any) -> bool:
    """Wait, at most ``CATCH_UP_WAIT_S``, until a re-adopted run has taken in what its
    runner wrote while no daemon read it (a call it asked about meanwhile is known then);
    whether it has. A run this daemon started has nothing to catch up."""
    event: trio.Event | None = run.caught_up
    if event is None:
        return True
    with trio.move_on_after(CATCH_UP_WAIT_S):
        await event.wait()
    return event.is_set()


def _line(call_id: str, decision: str, reason: str | None) -> bytes:
    """One answer line, never cut: a reason reaches the model as the person wrote it.

    ASCII JSON (every other character escaped: at most 12 bytes each), so its length has a
    known bound; it starts with a newline, which ends a fragment a dead daemon may have
    left in the channel (``subagent.approvals.MAX_ANSWER_LINE_BYTES``).

    Raises:
        ControlProtocolError: ``bad_args``, the line would be longer than the runner reads
            (never for an id and a reason the protocol accepts).
    """
    obj: dict[str, Any] = {"call_id": call_id, "decision": decision}
    if reason:
        obj["reason"] = reason
    data = ("\n" + json.dumps(obj, ensure_ascii=True) + "\n").encode("ascii")
    if len(data) > MAX_ANSWER_BYTES:
        raise ControlProtocolError(
            ErrorCode.BAD_ARGS, f"the answer to call {call_id!r} is too long for its channel ({len(data)} bytes)"
        )
    return data


def _open(path: Path, run_id: str) -> int:
    """The channel's write end (non-blocking); a runner that is not listening is a refusal.

    Raises:
        ControlProtocolError: ``refused``.
    """
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "the runner is not listening (it has ended)" if exc.errno in (errno.ENXIO, errno.ENOENT) else str(exc)
        raise ControlProtocolError(ErrorCode.REFUSED, f"run {run_id!r}: cannot answer: {why}") from exc


async def _write(fd: int, data: bytes, sending: trio.Lock) -> tuple[int, str | None]:
    """Write one answer line into the channel, whole (waiting for room, ``SEND_TIMEOUT_S``
    at most: the runner reads at once); how many bytes went in, and why not all (None: all).
    ``sending``: the run's (``RunApprovals.sending``), held only to write: a wait for room
    in a full channel holds no other answer of the run (``write_whole``)."""
    return await write_whole(
        fd,
        data,
        timeout_s=SEND_TIMEOUT_S,
        late=f"the runner has not read its answers for {SEND_TIMEOUT_S:g} s",
        lock=sending,
    )
