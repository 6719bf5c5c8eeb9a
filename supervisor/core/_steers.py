"""Steering a run's end leaves unreported: what its runner never read, or read and never applied.

A client told a steer was ``accepted`` learns what became of it from the run's
``steering`` events: ``applied`` at a step, or ``unapplied`` (DESIGN "Steering": input
never applied is reported, never dropped). The runner reports what it read and did not
apply, in its result (``unapplied_steering``) and its events; it cannot report a steer it
never read (its input was written as the run ended), nor, if it leaves no result (killed
at the end of its grace, by the OOM killer, or it crashed), one it read (``queued``) and
had not applied yet. The daemon's account (``Run.steers_sent``, ``steers_read``,
``steers_settled``, rebuilt from the journal after a restart) reports both here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import trio

from subagent.events import EventKind
from supervisor.core._book import RunBook
from supervisor.core._run import Run

__all__ = ["STEER_SETTLE_S", "unreported_steering", "minus"]

# At a run's end, how long a steer still being written to its runner's input may take to
# settle (``unreported_steering``).
STEER_SETTLE_S: Final = 2.0


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
