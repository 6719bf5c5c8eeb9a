"""Pending-stop notes that appear while the daemon runs: applied at once, not at its next start.

``agentd cancel`` that finds no daemon writes a note (``supervisor.control._pendingstops``)
and tries once more. A daemon that started between its two tries, read ``pending-stops/``
in its recovery before the note was there and did not answer the retry in time never saw
that note: it waited for the next start while the run went on. So the running daemon
watches the directory (inotify: a rename into it, a file written in it, the directory
itself removed or moved; without inotify it looks every ``SLOW_CHECK_S``; an idle daemon
stays idle) and applies each note that appears as the live ``cancel`` op would: a user's
cancel of each live run it names (its receipt's ``stop_carried`` naming the note, ``by:
"pending-stop"``, ``applied: "while-running"``), then the note removed. A note for an
unknown or ended run is logged and removed; one for a run left live in the journal and
not recovered waits for the next start, as recovery keeps it; one that is not a note is
set aside (``*.bad``) by ``read_all``, as at the start.

Never twice: the watch starts once recovery is done with the notes it read (applied and
removed, or kept) and skips those; each note's name is taken before any await, by one
task. Never fatal: a note that fails to apply is logged and left for the next start; a
watch that fails is logged and opened again after ``RETRY_S``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Final

import trio

from subagent.osedge import Watch
from subagent.osedge._watch import IN_CLOSE_WRITE, IN_DELETE_SELF, IN_MOVE_SELF, IN_MOVED_TO
from supervisor.control import _pendingstops
from supervisor.control._pendingstops import PendingStop
from supervisor.core._pending import pending_receipt
from supervisor.core._run import Run
from supervisor.states import TERMINAL_STATES, RunState

__all__ = ["PendingWatch"]

logger = logging.getLogger(__name__)

# A note is renamed into the directory (the CLI) or written in it (by hand); the directory
# itself removed or moved away is watched again, made anew.
MASK: Final = IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF
# Without inotify (missing, or out of instances): how often the directory is read.
SLOW_CHECK_S: Final = 5.0
# After the watch itself failed: before it is opened again.
RETRY_S: Final = 5.0


class PendingWatch:
    """Applies the pending-stop notes written after recovery read them (``run``)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        live: dict[str, Run],
        cancel: Callable[[str, str], Awaitable[dict[str, Any]]],
        get_run: Callable[[str], Awaitable[Any]],
    ) -> None:
        self.state_dir = state_dir
        self.dir = state_dir / _pendingstops.DIR
        self._live = live
        self._cancel = cancel
        self._get_run = get_run
        # Notes recovery read, and those this watch took: never applied (again) here.
        self._taken: set[str] = set()
        self.inotify = False  # (for tests: the watch is kernel events, not the slow check)

    def skip(self, names: Iterable[str]) -> None:
        """Notes recovery read (applied and removed, or kept for the next start)."""
        self._taken.update(names)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled. Never raises but Cancelled: a failure is logged."""
        task_status.started()
        while True:
            try:
                await self._watch()
            except Exception:
                logger.exception("pending stops: watching %s failed; watched again in %g s", self.dir, RETRY_S)
                await trio.sleep(RETRY_S)

    async def _watch(self) -> None:
        watch, ino = await trio.to_thread.run_sync(self._open)
        self.inotify = watch is not None
        try:
            while True:
                # Read after the watch is in place: a note written before is found here, one
                # written after wakes the wait below.
                await self.check()
                if watch is None:
                    await trio.sleep(SLOW_CHECK_S)
                    continue
                await trio.lowlevel.wait_readable(watch.fd)
                watch.drain()
                if _inode(self.dir) != ino:
                    logger.warning("pending stops: %s was removed or replaced; watching it anew", self.dir)
                    return
        finally:
            if watch is not None:
                trio.lowlevel.notify_closing(watch.fd)
                watch.close()

    def _open(self) -> tuple[Watch | None, int | None]:
        """The directory (made if missing) and its watch; None: looked at slowly."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            logger.warning("pending stops: cannot make %s (%s): looked at every %g s", self.dir, exc, SLOW_CHECK_S)
            return None, None
        ino = _inode(self.dir)
        watch = Watch.open([(self.dir, MASK)])
        if watch is None:
            logger.warning("pending stops: cannot watch %s (no inotify): looked at every %g s", self.dir, SLOW_CHECK_S)
        return watch, ino

    async def check(self) -> None:
        """Apply every note not taken yet, oldest first."""
        notes = await trio.to_thread.run_sync(_pendingstops.read_all, self.state_dir)
        # Names no longer there are forgotten (each note's name is new: time and pid).
        self._taken.intersection_update({n.path.name for n in notes})
        for note in notes:
            if note.path.name in self._taken:
                continue
            self._taken.add(note.path.name)  # before any await: one application, ever
            try:
                await self._apply(note)
            except Exception:
                logger.exception("pending stop for %s (%s): applying it failed; kept", note.describe(), note.path.name)

    async def _apply(self, note: PendingStop) -> None:
        targets = await self._targets(note)
        if not targets:
            if await self._unmatched(note):
                await trio.to_thread.run_sync(_pendingstops.remove, note)
            return
        for run_id in targets:
            run = self._live.get(run_id)
            if run is None:
                continue  # (ended meanwhile)
            first = not run.token.cancelled
            if first:
                # Set with no await before the cancel takes the run's token: its receipt.
                run.stop_carried = pending_receipt(note, running=True)
            await self._cancel(run_id, note.reason)
            logger.warning(
                "run %s: a stop (%s) recorded in pending stop %s while no daemon answered is applied by this "
                "daemon, running%s",
                run_id,
                note.reason,
                note.path.name,
                "" if first else " (its stop was under way already)",
            )
        await trio.to_thread.run_sync(_pendingstops.remove, note)

    async def _targets(self, note: PendingStop) -> list[str]:
        """The live runs the note names: its run, or its session's turns that existed
        when it was pressed (``turn``: that one alone), as recovery's ``PendingStops``."""
        if note.run_id is not None:
            return [note.run_id] if note.run_id in self._live else []
        if note.turn is not None:
            run = self._live.get(note.turn)
            return [note.turn] if run is not None and run.session_id == note.session_id else []
        out = []
        for run_id in [r.run_id for r in self._live.values() if r.session_id == note.session_id]:
            row = await self._get_run(run_id)
            created = row["created_at"] if row is not None else None
            if not isinstance(created, (int, float)) or created <= note.at:
                out.append(run_id)
        return out

    async def _unmatched(self, note: PendingStop) -> bool:
        """Log a note that names no live run; True when it is to be removed."""
        row = await self._get_run(note.run_id) if note.run_id is not None else None
        if row is not None and RunState(row["state"]) not in TERMINAL_STATES:
            # Live in the journal, not here: a run recovery failed to recover, left for
            # the next start, which the note waits for as recovery keeps it.
            logger.warning("pending stop for %s: kept for the next start (its run was not recovered)", note.describe())
            return False
        what = f"it has ended ({row['state']})" if row is not None else "no such run is live"
        logger.warning("pending stop for %s, recorded while this daemon ran: ignored, %s", note.describe(), what)
        return True


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None
