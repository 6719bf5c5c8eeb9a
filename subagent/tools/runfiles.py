"""Opening files in a run's directory, which the run's own tools can write.

A tool (a command, an MCP server) may replace such a file with a FIFO, whose plain
``open()`` blocks until a peer comes (forever: the runner's Trio thread stops, and with
it every deadline), or with a link to a file elsewhere. So these files are opened with
``O_NONBLOCK`` and ``O_NOFOLLOW``, and only a regular file is accepted (``fstat``); no
``mcp`` or Trio import here, as the runner opens some before importing either.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

__all__ = ["NotRegularFile", "open_regular"]


class NotRegularFile(OSError):
    """The path is there but is no regular file (a FIFO, a device, a directory...)."""


def open_regular(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never blocks, follows no final link, and gives only a regular file.

    Returns a blocking, close-on-exec descriptor (``O_NONBLOCK`` is cleared once the file
    is known to be regular: the descriptor may be handed to a child).

    Raises:
        NotRegularFile: the path is not a regular file.
        OSError: it cannot be opened (``ELOOP`` for a link, ``ENXIO`` for a FIFO opened
            for writing with no reader).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd
