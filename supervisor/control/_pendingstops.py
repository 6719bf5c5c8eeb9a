"""Stops pressed while no daemon answered: durable notes in the state dir, applied by a daemon.

``agentd cancel`` that finds no daemon (none started, killed -9, between a stop and a
restart) cannot deliver its stop; the runs go on (runners outlive their daemon, the next
one re-adopts them). So the CLI writes the stop here: one small JSON file per stop in
``<state_dir>/pending-stops/`` (0700, the user's), written whole to a temp file, fsynced,
renamed, the directory fsynced. The next daemon reads them while it recovers runs, before
it lets any go on, applies each as a user's cancel and removes it; a note written after
that (a daemon started between the CLI's two tries and did not answer) is applied by the
running daemon as soon as it appears (``supervisor.core._pendingwatch``). A note that is not one
(too big, not JSON, not a regular file) is set aside (``*.bad``) with a log line, never
fatal; the daemon keeps the newest ``KEEP_SET_ASIDE`` of those and removes the older ones. Bounded: ``MAX_NOTE_BYTES`` a note, ``MAX_NOTES`` waiting. A reason agentd gives its
own stops (``RESERVED_CANCEL_REASONS``) is refused as the daemon's ``cancel`` refuses it.
Stdlib and ``supervisor.protocol`` only (the CLI).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from supervisor.protocol import RESERVED_CANCEL_REASONS

__all__ = [
    "DIR",
    "MAX_NOTES",
    "MAX_NOTE_BYTES",
    "PendingStop",
    "TooManyPendingStops",
    "lock_holder",
    "prune_set_aside",
    "read_all",
    "remove",
    "set_aside",
    "write",
]

logger = logging.getLogger(__name__)

DIR: Final = "pending-stops"
SUFFIX: Final = ".stop"
SET_ASIDE_SUFFIX: Final = ".bad"
# A note names one run or session (ids and reason at most 256 chars each: the protocol's
# MAX_ID_CHARS, which the CLI's cancel checks the same way): well under this.
MAX_NOTE_BYTES: Final = 4096
# Stops waiting for a daemon at once; a CLI that finds this many refuses to write another.
MAX_NOTES: Final = 256
# A temp file a CLI left (killed between its write and its rename) older than this is
# removed by the daemon; a younger one may be a CLI writing now.
STALE_TEMP_S: Final = 600.0
# Notes set aside (``*.bad``) kept for a person to look at: the newest this many, the
# older removed by the daemon (logged), so that a stream of them cannot fill the disk.
KEEP_SET_ASIDE: Final = 16
_MAX_TEXT: Final = 256
# The file a live daemon holds an exclusive flock on for its life (``supervisor.daemon``'s
# ``LOCK_FILE``; named here too: the CLI does not import the daemon).
LOCK_FILE: Final = "daemon.lock"


class TooManyPendingStops(OSError):
    """``MAX_NOTES`` stops already wait for a daemon: this one was not recorded."""


@dataclass(frozen=True)
class PendingStop:
    """One stop a CLI recorded: a run's, or a session's (``turn``: the turn meant, if named)."""

    path: Path
    reason: str
    at: float  # wall clock, when the stop was pressed
    run_id: str | None = None
    session_id: str | None = None
    turn: str | None = None
    cli_pid: int | None = None

    def describe(self) -> str:
        if self.run_id is not None:
            return f"run {self.run_id}"
        turn = f" (turn {self.turn})" if self.turn is not None else ""
        return f"session {self.session_id}{turn}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    state_dir: Path,
    *,
    reason: str,
    run_id: str | None = None,
    session_id: str | None = None,
    turn: str | None = None,
) -> Path:
    """Record a stop for the next daemon on ``state_dir``; its note's path.

    Raises:
        TooManyPendingStops: ``MAX_NOTES`` wait already.
        OSError: the note could not be written (nothing was recorded).
    """
    if (run_id is None) == (session_id is None):
        raise ValueError("expected exactly one of run_id and session_id")
    _check_reason(reason)
    note = {"v": 1, "reason": reason, "at": time.time(), "cli_pid": os.getpid()}
    note.update({k: v for k, v in (("run_id", run_id), ("session_id", session_id), ("turn", turn)) if v is not None})
    data = json.dumps(note).encode()
    if len(data) > MAX_NOTE_BYTES:
        raise ValueError(f"expected a note of at most {MAX_NOTE_BYTES} bytes, got {len(data)}")
    d = state_dir / DIR
    os.makedirs(d, mode=0o700, exist_ok=True)
    # Notes alone count: a set-aside ``*.bad`` (kept for a person to look at, the newest
    # ``KEEP_SET_ASIDE``) or a dead CLI's temp file is no stop waiting, and 256 of them
    # refused every later stop for good.
    if sum(1 for e in os.scandir(d) if e.name.endswith(SUFFIX)) >= MAX_NOTES:
        raise TooManyPendingStops(f"{MAX_NOTES} stops already wait in {str(d)!r} for a daemon")
    name = f"{time.time_ns()}-{os.getpid()}{SUFFIX}"
    temp = d / f".{name}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, d / name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(d)
    return d / name


def lock_holder(state_dir: Path) -> int | None:
    """The pid of the daemon holding ``state_dir`` (its flock on ``LOCK_FILE``), read from
    ``/proc/locks`` without taking the lock (a CLI that took it, even shared and for an
    instant, could make a daemon starting then refuse to start); None when no process
    holds it, or it cannot be told (no ``/proc/locks``: not Linux).

    A daemon holds it while it runs, also when its endpoint or token file cannot be read
    (removed, truncated) and the CLI cannot reach it: the CLI writes no note then, and
    says which daemon holds the state dir."""
    try:
        st = os.stat(state_dir / LOCK_FILE)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:ino> 0 EOF"; "1: -> ..." waits
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE" and fields[5] == ident:
            try:
                pid = int(fields[4])
            except ValueError:
                continue
            return pid if pid > 0 else -1  # (-1: held, by a process of another pid namespace)
    return None


def _check_reason(reason: str) -> None:
    # A note is a user's stop: one claiming a reason of agentd's own stops (``timeout``,
    # ``disk_full``...) made the run's record, its receipt and the session's next turn say
    # agentd stopped it, which the daemon's ``cancel`` refuses (``bad_args``).
    if reason in RESERVED_CANCEL_REASONS:
        raise ValueError(f"reason {reason!r} is one agentd gives its own stops; a user's cancel may not claim it")


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


def _parse(path: Path, data: bytes) -> PendingStop:
    """The note in ``data``; ValueError saying what is wrong with it."""
    note = json.loads(data)
    if not isinstance(note, dict):
        raise ValueError(f"expected a JSON object, got {type(note).__name__}")
    run_id, session_id, turn = note.get("run_id"), note.get("session_id"), note.get("turn")
    if (run_id is None) == (session_id is None):
        raise ValueError("expected exactly one of 'run_id' and 'session_id'")
    for key, value in (("run_id", run_id), ("session_id", session_id), ("turn", turn), ("reason", note.get("reason"))):
        if (value is not None or key == "reason") and not _text(value):
            raise ValueError(f"expected {key!r} to be a string of 1 to {_MAX_TEXT} chars, got {value!r:.80}")
    if turn is not None and session_id is None:
        raise ValueError("expected 'turn' only with 'session_id'")
    _check_reason(note["reason"])
    at = note.get("at")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 < at < 2**40:
        raise ValueError(f"expected 'at' to be a wall-clock time, got {at!r:.80}")
    cli_pid = note.get("cli_pid")
    return PendingStop(
        path=path,
        reason=note["reason"],
        at=float(at),
        run_id=run_id,
        session_id=session_id,
        turn=turn,
        cli_pid=cli_pid if isinstance(cli_pid, int) and not isinstance(cli_pid, bool) else None,
    )


def _read_one(path: Path) -> PendingStop:
    """Raises OSError or ValueError: the note is not one (the caller sets it aside)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_NOTE_BYTES:
            raise ValueError(f"expected at most {MAX_NOTE_BYTES} bytes, got {st.st_size}")
        data = os.read(fd, MAX_NOTE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_NOTE_BYTES:
        raise ValueError(f"expected at most {MAX_NOTE_BYTES} bytes, got more")
    return _parse(path, data)


def set_aside(path: Path, why: str) -> None:
    """Keep a note that is not one out of the next start's way (renamed ``*.bad``)."""
    logger.warning("pending stop %s is not one (%s): set aside, not applied", path, why)
    try:
        os.rename(path, path.with_name(path.name + SET_ASIDE_SUFFIX))
    except OSError as exc:
        logger.warning("cannot set %s aside (%s): removing it", path, exc)
        try:
            os.unlink(path)
        except OSError as exc2:
            logger.warning("cannot remove %s either: %s", path, exc2)


def read_all(state_dir: Path) -> list[PendingStop]:
    """Every pending stop on ``state_dir``, oldest first (at most ``MAX_NOTES``). Never
    raises: a note that is not one is set aside, a directory that cannot be read logged."""
    d = state_dir / DIR
    try:
        entries = sorted(os.scandir(d), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("cannot read the pending stops in %s: %s", d, exc)
        return []
    out: list[PendingStop] = []
    now = time.time()
    for entry in entries:
        path = Path(entry.path)
        if entry.name.endswith(".tmp"):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                    os.unlink(path)  # a CLI killed before its rename: that stop was never recorded
            except OSError:
                pass
            continue
        if not entry.name.endswith(SUFFIX):
            continue  # (set aside already, or not ours)
        if len(out) >= MAX_NOTES:
            logger.warning("more than %d pending stops in %s: the rest wait for the next start", MAX_NOTES, d)
            break
        try:
            out.append(_read_one(path))
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # (ELOOP: a link, O_NOFOLLOW: not a note)
                # EIO, EMFILE, ENOMEM: a note that may be good, kept for the next start
                # (set aside, a stop pressed was never applied).
                logger.warning("pending stop %s cannot be read now (%s): kept for the next start", path, exc)
                continue
            set_aside(path, str(exc))
        except ValueError as exc:
            set_aside(path, str(exc))
    prune_set_aside(d)
    return out


def prune_set_aside(d: Path, keep: int = KEEP_SET_ASIDE) -> list[str]:
    """Remove all but the newest ``keep`` set-aside notes in ``d`` (newest: set aside
    last, by ``st_ctime``, which the rename sets); the names removed, each logged. Never raises."""
    try:
        found = []
        for entry in os.scandir(d):
            if entry.name.endswith(SUFFIX + SET_ASIDE_SUFFIX):
                try:
                    found.append((entry.stat(follow_symlinks=False).st_ctime_ns, entry.name))
                except OSError:
                    continue
    except OSError as exc:
        logger.warning("cannot read the set-aside pending stops in %s: %s", d, exc)
        return []
    removed = []
    for _, name in sorted(found, reverse=True)[keep:]:
        try:
            os.unlink(d / name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove the set-aside pending stop %s: %s", d / name, exc)
            continue
        removed.append(name)
    if removed:
        logger.warning(
            "removed %d set-aside pending stops in %s (the newest %d are kept): %s",
            len(removed),
            d,
            keep,
            ", ".join(sorted(removed)),
        )
    return removed


def remove(stop: PendingStop) -> None:
    """The note is applied (or found to name nothing live): gone, durably. Never raises."""
    try:
        os.unlink(stop.path)
        _fsync_dir(stop.path.parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove the pending stop %s (%s): it is applied again at the next start", stop.path, exc)
