"""The backlog's note on disk: which runs' writes wait in memory while the journal is down.

What degraded mode keeps in memory (``supervisor.store.backlog``) dies with a daemon killed
meanwhile (``kill -9``, the OOM killer, a power cut). The writes themselves cannot be
kept here cheaply (they may be many, and the disk is often full), but which runs had some
waiting can: ``journal-unwritten`` beside the journal holds, while the daemon is degraded,
the daemon's pid, since when it is degraded, the ids of the runs whose writes wait and
the ends (state, reason, when) of those whose end waits, as JSON ended by a NUL. The file is written whole with zeros (``SIZE``) at each start, so
that rewriting it needs no new block on a full disk; it is rewritten in place (``pwrite``,
``fdatasync``) when that set of runs changes, and emptied once nothing waits.

The next daemon reads it at its start (before it recovers runs), says in its log and in
``status`` (``summary.journal.unwritten_before_restart``) that the previous daemon ended
with writes unwritten, gives each of those runs a ``journal_gap`` event (its last facts
may be missing from the journal) and writes the ends the note has, the result being the
run's last checkpoint, marked partial (``supervisor.store.backlog``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Final

__all__ = ["NAME", "SIZE", "UnwrittenNote"]

logger = logging.getLogger(__name__)

NAME: Final = "journal-unwritten"
# Room for a few thousand run ids; a longer list is cut (``more`` says how many were cut).
SIZE: Final = 64 * 1024


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
        data = b""
        if note is not None:
            runs = list(note.get("runs", []))
            data = json.dumps(note).encode()
            while len(data) >= SIZE and runs:
                cut = max(1, len(runs) // 4)
                runs = runs[: len(runs) - cut]
                more = len(note["runs"]) - len(runs)
                ends = {r: e for r, e in (note.get("ends") or {}).items() if r in set(runs)}
                data = json.dumps({**note, "runs": runs, "ends": ends, "more": more}).encode()
        try:
            os.pwrite(self._fd, data + b"\0", 0)
            os.fdatasync(self._fd)
        except OSError as exc:
            logger.warning("cannot write %s (a daemon killed now will not say what it lost): %s", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
