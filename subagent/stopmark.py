"""The stop marker: how a runner tells the daemon's stop from any other SIGTERM.

A SIGTERM says "stop", not who asked: a run's own tool (a command the model runs, in the
run's tree) can signal its runner too. So before every SIGTERM it sends a runner (path A
at a cancel, a deadline, an approval timeout, shutdown; a re-adopted run's stop after a
restart; path B when no path A went first), the daemon writes the stop's reason into the
run's *stop marker*, ``<run dir>.stop``: beside the run directory, as the runner's events
and result files are (``subagent.emit.record_paths``), so out of its tools' reach (the
runs directory is a protected path of every run's sandbox). Write, then signal: the
runner reads the marker after the signal came, so it sees the write.

The daemon makes the marker, empty, with the run directory (``make_marker``); the runner
opens it read-only before its sandbox (``open_marker``: close-on-exec, so no tool inherits
it; the sandbox's private /tmp and Landlock close the path to it afterwards) and reads it
through that descriptor when a SIGTERM (or SIGINT) comes (``read_marker``): the daemon's
reason (``user``, ``timeout``, ``approval_timeout``, ``shutdown``, ...), or None when no
stop of the daemon's sent it. A tool cannot write it: the path is out of its sandbox's
reach, and what a private /tmp may show there is not the file the runner has open. A
runner without a marker (started by hand, or by a daemon that makes none) takes every
SIGTERM for a stop, as before. Stdlib only: the daemon imports it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Final

__all__ = [
    "STOP_SUFFIX",
    "SIGNALLED",
    "SIGNALLED_MESSAGE",
    "marker_path",
    "make_marker",
    "open_marker",
    "read_marker",
    "write_marker",
    "clear_marker",
]

STOP_SUFFIX: Final = ".stop"
# A runner's stop reason (``stop_requested``, the result's ``reason``) for a SIGTERM or
# SIGINT no stop of the daemon's sent: the word the daemon records for it too.
SIGNALLED: Final = "signalled"
SIGNALLED_MESSAGE: Final = (
    "the runner got a SIGTERM or SIGINT that agentd's stop did not send (a process of the run, "
    "or another one, signalled it); it stopped as it would for a stop"
)
# What a marker holds: one word (the daemon's own stop reasons are such words), or a
# client's reason that is not one (``cancel``'s ``reason``, at most 256 characters) as one
# json string in ASCII.
_REASON: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
_MAX_REASON_CHARS: Final = 256
# The longest marker: every character outside the BMP is two ``\uXXXX`` escapes (12 bytes),
# plus the quotes. (8 bytes a character cut a reason of 171 emoji, read back as 'stop'.)
_MAX_READ: Final = 12 * _MAX_REASON_CHARS + 2


def marker_path(run_dir: Path) -> Path:
    """A run's stop marker: beside its run directory, out of its tools' reach."""
    return run_dir.with_name(run_dir.name + STOP_SUFFIX)


def make_marker(run_dir: Path) -> None:
    """Make the run's stop marker, empty (the daemon, with the run directory). Blocking."""
    fd = os.open(marker_path(run_dir), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    os.close(fd)


def write_marker(run_dir: Path, reason: str) -> bool:
    """Write the daemon's stop reason into the run's marker, before it signals the runner.

    Into the file the runner holds open (never a new one: no create, no rename), and
    before the signal: ``write`` has returned when the signal is sent, so the runner,
    which reads after the signal, sees it. A few bytes on the caller's thread. Returns
    whether it was written (no marker: a runner made without one takes any SIGTERM for a
    stop anyway); never raises."""
    word = reason if _REASON.fullmatch(reason or "") else json.dumps((reason or "stop")[:_MAX_REASON_CHARS])
    try:
        fd = os.open(marker_path(run_dir), os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        data = (word + "\n").encode()
        return os.write(fd, data) == len(data)
    except OSError:
        return False
    finally:
        os.close(fd)


def clear_marker(run_dir: Path) -> bool:
    """Empty the run's marker: a restarted daemon's, for a run it re-adopts with no stop to
    resume. A daemon killed between ``write_marker`` and its signal (or before it recorded
    the stop) left a reason there that no stop of the new daemon's stands behind; a later
    SIGTERM from anyone else would have been read as that stop. The file the runner holds
    open (truncated, never replaced). Returns whether it is empty now; never raises."""
    try:
        fd = os.open(marker_path(run_dir), os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    os.close(fd)
    return True


def open_marker(run_dir: Path | None) -> int | None:
    """The runner's descriptor on its stop marker (before its sandbox), or None without
    one (no run directory, or the daemon made none). Close-on-exec, read-only."""
    if run_dir is None:
        return None
    try:
        return os.open(marker_path(run_dir), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None


def read_marker(fd: int) -> str | None:
    """The daemon's stop reason in the marker, or None if it holds none (no stop of the
    daemon's came: the signal came from someone else). Never raises."""
    try:
        data = os.pread(fd, _MAX_READ, 0)
    except OSError:
        return None
    text = data.decode("ascii", errors="replace").strip()
    if not text:
        return None
    if _REASON.fullmatch(text):
        return text
    try:
        reason = json.loads(text)
    except ValueError:
        return "stop"
    return reason if isinstance(reason, str) and reason.strip() else "stop"
