"""inotify through ctypes: waits that are kernel events instead of polls.

A ``Watch`` is one inotify descriptor on one or more paths; it turns readable when one of
them changes, and ``drain()`` empties it. What changed is read again by the caller (the
events only say *that* something happened). Used for ``cgroup.events`` (``populated``
goes to 0 when a cgroup's last process exits: kernfs notifies it as a modification), for
a cgroup subtree's directory being removed, and for a file another process appends to
(a re-adopted runner's ``events.jsonl``). Linux only: ``Watch.open`` returns None where
inotify is missing (callers poll then).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final, final

__all__ = ["Watch", "IN_MODIFY", "IN_DELETE_SELF", "IN_MOVE_SELF", "IN_DELETE", "IN_ATTRIB", "IN_CLOSE_WRITE"]

IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_DELETE: Final = 0x00000200
IN_DELETE_SELF: Final = 0x00000400
IN_MOVE_SELF: Final = 0x00000800
_IN_NONBLOCK: Final = 0o4000
_IN_CLOEXEC: Final = 0o2000000


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
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return got
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return got
            if not data:
                return got
            got = True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
