"""``agentd dashboard --open``: a one-time login link handed to a browser off its command line.

A browser's argv is in ``/proc/<pid>/cmdline``, which any process on the host that sees
the browser can read (a run without a ``/proc`` of its own: README, sandbox), and the
link is good for anyone until it is used. So the browser is given a page instead: a file
of mode 0600 in a directory of mode 0700 made in the state dir (as private as the control
token beside it; the system's temporary directory if the state dir cannot be written)
that sends the browser on to the link. Its argv holds only the page's ``file://`` URL.

The page must outlive the opener (``webbrowser.open`` returns as soon as a browser was
started or asked, before it reads anything) and not the CLI: the CLI waits until the page
has been read and then ``SETTLE_S`` without another open (an opener that looks into the
file before the browser does, ``xdg-open``), at most ``LINGER_S``; whatever ends the wait
(the browser, the bound, Ctrl-C) removes the directory. Only a CLI killed outright leaves
one behind: the next ``--open`` removes those older than a link's life. The wait on reads
is inotify's; without it (not Linux) the page stays ``LINGER_S``. Stdlib only.
"""

from __future__ import annotations

import ctypes
import html
import os
import select
import shutil
import struct
import sys
import tempfile
import time
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Final

from supervisor.control._dashlink import LOGIN_TTL_S

__all__ = ["LINGER_S", "SETTLE_S", "PREFIX", "open_link"]

# The page stays at most this long (seconds): a cold browser has this long to read it.
LINGER_S: Final = 30.0
# After a read, the page goes once this long passed without another open (seconds).
SETTLE_S: Final = 3.0
PREFIX: Final = "dashboard-login-"

_IN_OPEN: Final = 0x20
_IN_CLOSE_NOWRITE: Final = 0x10
_IN_NONBLOCK: Final = 0o4000
_IN_CLOEXEC: Final = 0o2000000


def _page(url: str) -> str:
    link = html.escape(url, quote=True)
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8"><meta name="referrer" content="no-referrer">\n'
        f'<meta http-equiv="refresh" content="0;url={link}">\n<title>agentd dashboard</title></head>\n'
        f'<body><p><a href="{link}">Open the agentd dashboard</a></p></body></html>\n'
    )


def _sweep(parent: Path) -> None:
    """Remove what a killed CLI left: directories of ours older than a link's life."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for e in entries:
        try:
            if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False):
                if e.stat(follow_symlinks=False).st_mtime < time.time() - LOGIN_TTL_S:
                    shutil.rmtree(e.path, ignore_errors=True)
        except OSError:
            continue


def _private_dir(state_dir: Path) -> str:
    """A new 0700 directory (``mkdtemp``): in the state dir, else the temporary dir."""
    try:
        _sweep(state_dir)
        return tempfile.mkdtemp(prefix=PREFIX, dir=state_dir)
    except OSError:
        return tempfile.mkdtemp(prefix=PREFIX)


class _Reads:
    """Opens and reads of one file, by inotify (``None`` where there is none)."""

    def __init__(self, path: str) -> None:
        self.fd: int | None = None
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_OPEN | _IN_CLOSE_NOWRITE) < 0:
            os.close(fd)
            return
        self.fd = fd

    def _next(self, timeout: float) -> list[int]:
        """The event masks within ``timeout`` seconds (empty: none came)."""
        assert self.fd is not None
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return []
        masks, at = [], 0
        while at + 16 <= len(data):
            _, mask, _, size = struct.unpack_from("iIII", data, at)
            masks.append(mask)
            at += 16 + size
        return masks

    def wait_read(self, linger_s: float, settle_s: float) -> None:
        """Until the file was read and then left alone ``settle_s``, at most ``linger_s``."""
        deadline = time.monotonic() + linger_s
        if self.fd is None:
            time.sleep(linger_s)  # nothing tells when it is read: the bound
            return
        open_now, read = 0, False
        while (left := deadline - time.monotonic()) > 0:
            quiet = read and open_now <= 0
            masks = self._next(min(left, settle_s) if quiet else left)
            if not masks and quiet:
                return
            for m in masks:
                open_now += bool(m & _IN_OPEN) - bool(m & _IN_CLOSE_NOWRITE)
                read = read or bool(m & _IN_CLOSE_NOWRITE)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def open_link(
    url: str,
    state_dir: Path,
    *,
    opener: Callable[[str], bool] | None = None,
    linger_s: float = LINGER_S,
    settle_s: float = SETTLE_S,
) -> bool:
    """Open ``url`` in a browser by way of a private page (the module's docstring); whether
    a browser was started (``opener``: ``webbrowser.open``, which ``$BROWSER`` chooses). Returns
    once the page was read, or after ``linger_s``; the page is gone then."""
    d = _private_dir(state_dir)
    try:
        page = os.path.join(d, "login.html")
        fd = os.open(page, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_page(url))
        reads = _Reads(page)  # before the browser starts: its first read is seen
        try:
            opened = bool((opener or webbrowser.open)(Path(page).as_uri()))
            if opened:
                reads.wait_read(linger_s, settle_s)
        finally:
            reads.close()
        return opened
    finally:
        shutil.rmtree(d, ignore_errors=True)
