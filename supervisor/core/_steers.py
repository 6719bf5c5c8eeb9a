"""Steering a run's end leaves unreported: what its runner never read, or read and never applied.

A client told a steer was ``accepted`` learns what became of it from the run's
``steering`` events: ``applied`` at a step, or ``unapplied`` (DESIGN "Steering": input
never applied is reported, never dropped). The runner reports what it read and did not
apply, in its result (``unapplied_steering``) and its events; it cannot report a steer it
never read (its input was written as the run ended), nor, if it leaves no result (killed
at the end of its grace, by the OOM killer, or it crashed), one it read (``queued``) and
had not applied yet. The daemon's account (``Run.steers_sent``, ``steers_read``,
``steers_settled``, rebuilt from the journal after a restart) reports both here.

``send_steer`` sends one: journaled (``steer_sent``, fsynced) before it is written into the
runner's stdin, as an approval's answer is (``supervisor.core.approvals``): a daemon killed
between the two leaves a steer its journal holds and its runner never read (its end
reports it unapplied, ``unread``), never one its runner applied that its journal lacks.
Once journaled it is written whole (shielded, ``STEER_SEND_TIMEOUT_S`` at most) or
journaled ``steer_unsent`` and refused; so is one a stop overtook while it was journaled,
or while it waited for room in the runner's input with none of it written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import trio

from subagent.events import EventKind
from supervisor.core._book import RunBook
from supervisor.core._fdwrite import write_whole
from supervisor.core._run import Run
from supervisor.errors import JournalUnavailable

__all__ = ["STEER_SEND_TIMEOUT_S", "STEER_SETTLE_S", "send_steer", "unreported_steering", "minus"]

# At a run's end, how long a steer still being written to its runner's input may take to
# settle (``unreported_steering``).
STEER_SETTLE_S: Final = 2.0

# How long a journaled steer may wait for room in its runner's stdin (seconds): the runner
# reads its input at once; one that does not (frozen, wedged) has its steer refused, and
# its input closed if part of the line went in (the rest of its input would be junk).
STEER_SEND_TIMEOUT_S: Final = 10.0


def minus(texts: Iterable[str], taken: Iterable[str]) -> list[str]:
    """``texts`` without ``taken``, as multisets, in ``texts``' order."""
    left = Counter(taken)
    out = []
    for text in texts:
        if left[text] > 0:
            left[text] -= 1
        else:
            out.append(text)
    return out


async def unreported_steering(book: RunBook, run: Run, *, result_written: bool) -> list[str]:
    """Report, as ``steering`` events (``unapplied``), the steers the run's end leaves
    unreported; return their texts (for the result's ``unapplied_steering``).

    Always the steers its runner never read (``unread: true``); with no result from the
    runner (``result_written`` false), also those it read and never applied nor reported.
    """
    # A steer still being written settles first (sent, or taken back): what a client
    # was told was refused is never reported unapplied. (The runner is gone by now: a
    # write to its input fails at once; the bound is for a pipe a child still holds.)
    with trio.move_on_after(STEER_SETTLE_S):
        async with run.stdin_lock:
            pass
    unread = minus(run.steers_sent, run.steers_read)
    dropped = [] if result_written else minus(run.steers_read, run.steers_settled)
    events: list[dict[str, Any]] = [
        *({"state": "unapplied", "text": text, "step": None, "unread": True} for text in unread),
        *({"state": "unapplied", "text": text, "step": None} for text in dropped),
    ]
    for data in events:
        await book.record(run, str(EventKind.STEERING), data)
    return [*dropped, *unread]


async def send_steer(book: RunBook, run: Run, text: str, line: bytes) -> str | None:
    """Journal the steer ``text`` (fsynced), then write its ``line`` into the run's stdin,
    whole; None once it is in, else why it was not sent (a refusal: nothing of it reaches
    the runner, and an ``steer_unsent`` after its ``steer_sent`` says so). The caller holds
    ``run.stdin_lock`` and has checked that the run takes input (``run.stdin``)."""
    stdin = run.stdin
    assert stdin is not None and isinstance(stdin, trio.lowlevel.FdStream), stdin
    try:
        await book.record_durable(run, "steer_sent", {"text": text})
    except JournalUnavailable as exc:
        return f"it cannot be journaled ({exc}); it was not sent"
    # Journaled: from here it is written, or said unsent, whatever else comes (a client
    # gone cancels this request); bounded.
    with trio.CancelScope(shield=True):
        if run.token.cancelled:
            # A stop taken while it was journaled (an await): refused, as one asked after
            # it is; the stopped runner's input never gets it.
            stopping = "a stop is under way"
            await book.record(run, "steer_unsent", {"text": text, "why": stopping})
            return stopping
        # Before the write (the run's end may come during it): its end reports it if unread.
        run.steers_sent.append(text)
        late = f"the runner has not read its input for {STEER_SEND_TIMEOUT_S:g} s"
        # A stop taken while it waits for room, none of it in: refused, never written
        # into the stopped runner's input (as one the stop overtook above).
        written, why = await write_whole(
            stdin.fileno(),
            line,
            timeout_s=STEER_SEND_TIMEOUT_S,
            late=late,
            give_up=(run.stop_taken, "a stop is under way"),
        )
        if why is None:
            return None
        if written:
            # Part of it went in: what follows would be read as one junk line with it.
            # Closed, the runner reads EOF, which ends a line that lacked only its newline.
            run.stdin, run.stdin_closed = None, True
            await stdin.aclose()
            if written >= len(line) - 1:
                return None  # whole JSON: its runner takes it at that EOF
        run.steers_sent.pop()
        await book.record(run, "steer_unsent", {"text": text, "why": why})
    return why
