"""The journal put back at its path after its file was removed or replaced under the daemon.

The worker's connection keeps the file it opened (its inode) open: removed, or another
file moved to its path, that file goes on taking writes nobody will read again (a restart
opens the path) and is freed when the daemon exits. So the worker compares the file at
the path with the one it opened (device, inode: one ``stat``) before and after each group
of calls and every ``CHECK_S`` when idle, and when they differ it restores the journal:

1. the open connection's whole database (everything committed so far, live runs and
   ended ones alike) is copied with SQLite's backup API to a new file beside the path,
   fsynced;
2. whatever now sits at the path (a file that is not this journal: garbage, another
   database) is kept aside, renamed ``<path>.replaced-<UTC time>`` (its ``-wal`` and
   ``-shm`` beside it under that name); the open journal's own ``-wal`` and ``-shm``
   left at their paths are removed (what they hold is in the copy; a stale WAL beside a
   new file would be replayed into it);
3. the old connection is closed, the copy renamed to the path (the directory fsynced)
   and opened as the journal.

A copy that fails (no space, the directory gone) leaves the old connection open and
changes nothing at the path: the connection is made read-only (``PRAGMA query_only``:
reads go on, ``status`` answers), a write fails as ``JournalUnavailable`` (the daemon is
degraded, its run manager keeps its writes in memory) and the restore is tried again
every ``CHECK_S``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Final

from supervisor.errors import JournalUnavailable

__all__ = ["CHECK_S", "FileIds", "Restored", "file_id", "file_ids", "restore", "take_interrupted"]

logger = logging.getLogger(__name__)

# How often an idle worker looks at the file at its path.
CHECK_S: Final = 1.0

_SIDE_FILES: Final = ("-wal", "-shm")

FileId = tuple[int, int] | None
# (device, inode) of the journal file, its -wal and its -shm (None: no such file).
FileIds = tuple[FileId, FileId, FileId]


def file_id(name: str) -> FileId:
    """The file at ``name``: (device, inode), or None if there is none (one ``stat``)."""
    try:
        st = os.stat(name)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def file_ids(path: str) -> FileIds:
    """The journal file at ``path`` and its ``-wal`` and ``-shm``: (device, inode) each."""
    return file_id(path), file_id(path + "-wal"), file_id(path + "-shm")


@dataclass(frozen=True, slots=True)
class Restored:
    """One restore: when, what the path held (``missing``: nothing; ``another file``),
    where that other file was kept (None: there was none)."""

    at: float
    found: str
    kept_aside: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at, "found": self.found, "kept_aside": self.kept_aside}


def _fsync(name: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(name, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def _aside_name(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name, n = f"{path}.replaced-{stamp}", 1
    while any(os.path.lexists(name + s) for s in ("", *_SIDE_FILES)):
        n += 1
        name = f"{path}.replaced-{stamp}.{n}"
    return name


def _copy(conn: sqlite3.Connection, path: str) -> str:
    """The open journal's whole database in a new file beside ``path``, fsynced."""
    tmp = f"{path}.restoring"
    _remove(tmp)
    _remove(tmp + "-journal")
    try:
        os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        dst = sqlite3.connect(tmp, isolation_level=None)
        try:
            dst.execute("PRAGMA synchronous = FULL")
            conn.backup(dst)
        finally:
            dst.close()
        _fsync(tmp)
    except BaseException:
        _remove(tmp)
        _remove(tmp + "-journal")
        raise
    return tmp


def restore(conn: sqlite3.Connection, path: str, opened: FileIds) -> Restored:
    """Put the journal ``conn`` has open back at ``path`` (see the module), and close
    ``conn``: the caller opens the journal at ``path`` again. ``opened`` is what
    ``file_ids`` said once ``conn`` was open.

    Raises:
        JournalUnavailable: it could not be done; ``conn`` is left open (another file
            at the path may have been kept aside already) and this may be called again.
    """
    try:
        tmp = _copy(conn, path)
    except (sqlite3.Error, OSError) as exc:
        raise JournalUnavailable(
            f"journal {path!r}: the file was removed or replaced while the daemon ran, and "
            f"copying it back failed ({exc}); tried again (until it is back, a restart loses it)",
            path=path,
        ) from exc
    now = file_ids(path)
    aside: str | None = None
    try:
        if now[0] is not None:
            aside = _aside_name(path)
            os.rename(path, aside)
        for suffix, mine, there in zip(_SIDE_FILES, opened[1:], now[1:], strict=True):
            if there is None:
                continue
            if there == mine:
                _remove(path + suffix)  # the open journal's own: what it holds is in the copy
            else:
                aside = aside or _aside_name(path)
                os.rename(path + suffix, aside + suffix)
        # From here on the file at the path is the copy: a crash before the rename left
        # it as `<path>.restoring`, which the next open takes (``take_interrupted``).
        os.rename(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        _remove(tmp)
        raise JournalUnavailable(
            f"journal {path!r}: the file was removed or replaced while the daemon ran; its "
            f"copy could not be put in its place ({exc}); tried again",
            path=path,
        ) from exc
    # The path holds another file now: SQLite sees the old one as moved and closes it
    # without a checkpoint and without removing a -wal by its name.
    try:
        conn.close()
    except sqlite3.Error:
        logger.exception("journal %s: closing the replaced file's connection failed", path)
    return Restored(time.time(), "missing" if now[0] is None else "another file", aside)


def take_interrupted(path: str) -> bool:
    """At the journal's open: a daemon that died in a restore between moving the file
    at the path aside and putting its copy there left the copy, complete and fsynced,
    as ``<path>.restoring`` and nothing at the path: it is the journal. True if taken."""
    tmp = f"{path}.restoring"
    if os.path.lexists(path) or not os.path.isfile(tmp) or os.path.lexists(tmp + "-journal"):
        return False
    os.rename(tmp, path)
    logger.warning("journal %s: taken from %s, left by a restore a daemon did not finish", path, tmp)
    return True
