"""Which of the runs a restarted daemon finds live the stops pressed while none ran name.

``supervisor.control._pendingstops`` keeps the notes; recovery asks ``stop_for`` of each
live run it finds and applies the stop returned (a user's cancel, before the run goes on).
A run note names its run. A session note stops that session's turns that existed when
the stop was pressed (created before it; ``turn``: only that one), never a later turn. A
note is removed once recovery is done with it, kept for the next start if a run it names
could not be recovered; one that names no live run (unknown, or ended) is logged and
removed. No I/O here but the notes' removal (``settle``, in a thread).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from supervisor.control import _pendingstops
from supervisor.control._pendingstops import PendingStop

__all__ = ["PendingStops", "pending_receipt"]

logger = logging.getLogger(__name__)


class PendingStops:
    """The notes found at this start, and what became of each."""

    def __init__(self, notes: list[PendingStop]) -> None:
        self.notes = notes
        self.applied: dict[PendingStop, list[str]] = {note: [] for note in notes}
        self._keep: set[PendingStop] = set()

    def _names(self, note: PendingStop, row: Any) -> bool:
        if note.run_id is not None:
            return bool(note.run_id == row["id"])
        if note.session_id != row["session_id"]:
            return False
        if note.turn is not None:
            return bool(note.turn == row["id"])
        # The turn live when the stop was pressed (no daemon ran: none began since).
        created = row["created_at"]
        return not isinstance(created, (int, float)) or created <= note.at

    def stop_for(self, row: Any) -> PendingStop | None:
        """The note whose stop this live run is to get now (the first, if several); None
        when none names it, or its stop is under way already (a cancel journaled)."""
        found = None
        for note in self.notes:
            if self._names(note, row):
                self.applied[note].append(str(row["id"]))
                found = found or note
        return found if row["cancel_reason"] is None else None

    def keep_for(self, row: Any) -> None:
        """The run could not be recovered: the notes naming it wait for the next start."""
        self._keep.update(note for note in self.notes if self._names(note, row))

    def unmatched(self) -> list[PendingStop]:
        return [note for note, runs in self.applied.items() if not runs and note not in self._keep]

    def settle(self) -> None:
        """Remove every note recovery is done with (blocking: call it in a thread)."""
        for note in self.notes:
            if note in self._keep:
                logger.warning(
                    "pending stop for %s: kept for the next start (a run it names failed to recover)", note.describe()
                )
                continue
            if self.applied[note]:
                logger.info("pending stop for %s: applied to %s", note.describe(), ", ".join(self.applied[note]))
            _pendingstops.remove(note)


def pending_receipt(note: PendingStop, *, running: bool = False) -> dict[str, Any]:
    """For the run's receipt (``stop_carried``): where its stop came from. ``running``:
    applied by a daemon that was running already (``_pendingwatch``), not at its start."""
    message = (
        "the stop was pressed while no daemon answered and recorded in a pending-stop note in the state dir; "
        "the daemon, running already (it had found its runs again before the note was written), "
        "applied it as the user's cancel as soon as the note appeared"
        if running
        else "the stop was pressed while no daemon ran and recorded in a pending-stop note in the state dir; "
        "the restarted daemon applied it as the user's cancel before letting the run go on"
    )
    out: dict[str, Any] = {
        "by": "pending-stop",
        "note": note.path.name,
        "pressed_at": note.at,
        "waited_s": round(max(0.0, time.time() - note.at), 3),
        "cli_pid": note.cli_pid,
        "applied": "while-running" if running else "at-start",
        "message": message,
    }
    if note.session_id is not None:
        out["session_id"] = note.session_id
        out["turn"] = note.turn
    return out
