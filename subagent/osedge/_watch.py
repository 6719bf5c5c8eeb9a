"""inotify through ctypes: waits that are kernel events instead of polls.

A ``Watch`` is one inotify descriptor on one or more paths; it turns readable when one of
them changes, and ``drain()`` empties it. What changed is read again by the caller (the
events only say *that* something happened). Used for ``cgroup.events`` (``populated``
goes to 0 when a cgroup's last process exits: kernfs notifies it as a modification), for
a cgroup subtree's directory being removed, and for a file another process appends to
(a re-adopted runner's events file). Linux only: ``Watch.open`` returns None where
inotify is missing (callers poll then).

``WatchSet`` is one inotify descriptor for many paths, added and removed as they come
and go, its events sorted by watch: closing an inotify descriptor waits for an RCU grace
period (5-40 ms here, blocking the caller), which a descriptor per stop paid every time.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final, final

__all__ = [
    "Watch",
    "WatchSet",
    "IN_MODIFY",
    "IN_DELETE_SELF",
    "IN_MOVE_SELF",
    "IN_DELETE",
    "IN_ATTRIB",
    "IN_CLOSE_WRITE",
    "IN_MOVED_TO",
]

IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_MOVED_TO: Final = 0x00000080  # a file renamed into a watched directory
IN_DELETE: Final = 0x00000200
IN_DELETE_SELF: Final = 0x00000400
IN_MOVE_SELF: Final = 0x00000800
IN_IGNORED: Final = 0x00008000  # the watch is gone (removed, or its path deleted)
_EVENT_HEADER: Final = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_IN_NONBLOCK: Final = 0o4000
_IN_CLOEXEC: Final = 0o2000000


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - present?
        libc.inotify_add_watch  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@final
class Watch:
    """An inotify descriptor (non-blocking, close-on-exec): wait until ``fd`` is readable,
    then ``drain()``. Close it with ``close()`` (idempotent) or as a context manager."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._closed = False

    @classmethod
    def open(cls, paths: Iterable[tuple[Path | str, int]]) -> Watch | None:
        """Watch each (path, mask); None if inotify is missing or no path can be watched."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        watched = 0
        for path, mask in paths:
            if libc.inotify_add_watch(fd, os.fsencode(path), ctypes.c_uint32(mask)) >= 0:
                watched += 1
        if not watched:
            os.close(fd)
            return None
        return cls(fd)

    def drain(self) -> bool:
        """Read every pending event; True if there was any."""
        got = False
        for _ in _pending(self.fd):
            got = True
        return got

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@final
class WatchSet:
    """One inotify descriptor (non-blocking, close-on-exec) for many paths: ``add`` a
    path (its watch descriptor), ``remove`` it (cheap: no grace period), wait until
    ``fd`` is readable, then ``read()`` which watches had events. ``close()`` once."""

    def __init__(self, fd: int, libc: ctypes.CDLL) -> None:
        self.fd = fd
        self._libc = libc
        self._closed = False

    @classmethod
    def open(cls) -> WatchSet | None:
        """None if inotify is missing (or out of instances): callers poll then."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        return cls(fd, libc) if fd >= 0 else None

    def add(self, path: Path | str, mask: int) -> int | None:
        """Watch ``path``; its watch descriptor (the same for the same file), or None."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), ctypes.c_uint32(mask))
        return int(wd) if wd >= 0 else None

    def remove(self, wd: int) -> None:
        """Stop watching (nothing if the watch is already gone, its path deleted)."""
        self._libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> set[int] | None:
        """The watches with events since the last read (``IN_IGNORED`` included: the
        watch is gone); None if the queue overflowed (any watch may have changed)."""
        found: set[int] = set()
        for data in _pending(self.fd):
            at = 0
            while at + _EVENT_HEADER.size <= len(data):
                wd, _mask, _cookie, length = _EVENT_HEADER.unpack_from(data, at)
                at += _EVENT_HEADER.size + length
                if wd == -1:  # IN_Q_OVERFLOW
                    return None
                found.add(wd)
        return found

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)


def _pending(fd: int) -> Iterator[bytes]:
    """What a non-blocking inotify descriptor holds now, read by chunks until it is empty
    (or unreadable)."""
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return
        if not data:
            return
        yield data
