"""The backlog's note on disk: which runs' writes wait in memory while the journal is down.

What degraded mode keeps in memory (``supervisor.store.backlog``) dies with a daemon killed
meanwhile (``kill -9``, the OOM killer, a power cut). The writes themselves cannot be
kept here cheaply (they may be many, and the disk is often full), but which runs had some
waiting can: ``journal-unwritten`` beside the journal holds, while the daemon is degraded,
the daemon's pid, since when it is degraded, the ids of the runs whose writes wait, the
ends (state, reason, when) of those whose end waits and the stops acknowledged while
their intent waits (``stops``: reason, wall time asked, wall end of the grace, the disk
guard's detail), as JSON ended by a NUL. The file is written whole with zeros (``SIZE``)
at each start, so that rewriting it needs no new block on a full disk; it is rewritten in
place (``pwrite``, ``fdatasync``) when that set of runs changes (a stop: before the
cancel's reply), and emptied once nothing waits. Past ``SIZE`` the run list is cut (runs
with a stop kept first, then those with an end): ``more`` counts the runs cut,
``more_stops`` the stops cut with them (``encode``).

The next daemon reads it at its start (before it recovers runs), says in its log and in
``status`` (``summary.journal.unwritten_before_restart``) that the previous daemon ended
with writes unwritten, gives each of those runs a ``journal_gap`` event (its last facts
may be missing from the journal) and writes the ends the note has, the result being the
run's last checkpoint, marked partial (``supervisor.store.backlog``); the stops it has are
resumed as journaled ones are (``supervisor.core.recovery``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Final

from supervisor.states import TERMINAL_STATES, RunState

__all__ = ["NAME", "SIZE", "UnwrittenNote", "encode", "noted_end", "noted_end_event", "noted_finish_args"]

logger = logging.getLogger(__name__)

NAME: Final = "journal-unwritten"
# Room for a few thousand run ids, or some hundreds of stops; a longer note is cut
# (``more`` and ``more_stops`` say how many were cut).
SIZE: Final = 64 * 1024


def encode(note: dict[str, Any]) -> bytes:
    """The note as it is written: its JSON, shorter than ``SIZE`` (the NUL after it fits).

    Runs with a stop waiting come first, then those with an end, then the rest (each in
    the note's order): a note cut to fit drops a bare run id before an end, and an end
    before an acknowledged stop. A cut sets ``more`` (runs cut) and ``more_stops`` (stops
    cut with their runs).
    """
    stops: dict[str, Any] = note.get("stops") or {}
    ends: dict[str, Any] = note.get("ends") or {}
    named = list(note.get("runs", []))
    runs = sorted(named, key=lambda r: 0 if r in stops else 1 if r in ends else 2)
    data = json.dumps({**note, "runs": runs}).encode()
    while len(data) >= SIZE and runs:
        runs = runs[: len(runs) - max(1, len(runs) // 4)]
        kept = set(runs)
        cut = {
            "runs": runs,
            "ends": {r: e for r, e in ends.items() if r in kept},
            "stops": {r: s for r, s in stops.items() if r in kept},
            "more": len(named) - len(runs),
            "more_stops": sum(1 for r in stops if r not in kept),
        }
        data = json.dumps({**note, **cut}).encode()
    return data


def _stop(value: Any) -> bool:
    """A noted stop this daemon can resume: its reason and its two wall times."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("reason"), str)
        and all(isinstance(value.get(k), (int, float)) for k in ("at", "stop_deadline"))
    )


class UnwrittenNote:
    """The note at ``path`` (see the module). Its methods do blocking I/O: call them in a
    thread. None of them raises: a note that cannot be read or written is logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> dict[str, Any] | None:
        """What a previous daemon left: None if nothing waited when it ended."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(SIZE)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("cannot read %s: %s", self.path, exc)
            return None
        text = data.split(b"\0", 1)[0].strip()
        if not text:
            return None
        try:
            note = json.loads(text)
        except ValueError:
            note = None
        if not isinstance(note, dict) or not isinstance(note.get("runs"), list):
            # Torn by the crash it tells of: something waited, what is not known.
            return {"runs": [], "unreadable": True}
        note["runs"] = [r for r in note["runs"] if isinstance(r, str)]
        stops = note.get("stops")
        note["stops"] = {r: v for r, v in stops.items() if _stop(v)} if isinstance(stops, dict) else {}
        return note

    def reset(self) -> None:
        """Start this daemon's note: empty, ``SIZE`` bytes written, fsynced."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            logger.warning("cannot open %s (a daemon killed while degraded will not say so): %s", self.path, exc)
            return
        try:
            os.pwrite(fd, b"\0" * SIZE, 0)
            os.ftruncate(fd, SIZE)
            os.fdatasync(fd)
        except OSError as exc:
            logger.warning("cannot write %s: %s", self.path, exc)
        self.close()
        self._fd = fd

    def save(self, note: dict[str, Any] | None) -> None:
        """Rewrite the note in place (None: nothing waits), fsynced."""
        if self._fd is None:
            return
        data = b"" if note is None else encode(note)
        try:
            os.pwrite(self._fd, data + b"\0", 0)
            os.fdatasync(self._fd)
        except OSError as exc:
            logger.warning("cannot write %s (a daemon killed now will not say what it lost): %s", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def noted_end(end: Any) -> tuple[RunState, str | None, float | None, float | None] | None:
    """A noted end's state (terminal), reason, end time and its groups' end time; None if
    it is not one."""
    if not isinstance(end, dict):
        return None
    try:
        state = RunState(str(end.get("state")))
    except ValueError:
        return None
    if state not in TERMINAL_STATES:
        return None
    reason = end.get("reason") if isinstance(end.get("reason"), str) else None
    ended_at = end.get("ended_at") if isinstance(end.get("ended_at"), (int, float)) else None
    groups = end.get("groups_ended_at") if isinstance(end.get("groups_ended_at"), (int, float)) else None
    return state, reason, ended_at, groups


def noted_finish_args(noted: tuple[RunState, str | None, float | None, float | None]) -> dict[str, Any]:
    """``Journal.finish``'s arguments for a noted end: no result of its own (its last
    checkpoint, marked partial), from whatever live state the journal has."""
    _state, reason, ended_at, groups = noted
    return {
        "reason": reason,
        "result": None,
        "partial": True,
        "ended_at": ended_at,
        "groups_ended_at": groups,
        "from_any_live_state": True,
    }


def noted_end_event(state: RunState, reason: str | None) -> dict[str, Any]:
    """The ``state`` event of a run whose noted end is written."""
    data: dict[str, Any] = {"state": str(state), "partial": True}
    if reason:
        data["reason"] = reason
    return data
