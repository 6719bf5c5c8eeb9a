"""Find and SIGKILL processes by a path in their command line (Linux /proc; a no-op elsewhere).

For processes that lost every other mark: Chromium's helpers overwrite /proc/PID/environ
with their process title and may sit in a session and group of their own, but their
command lines keep naming the profile dir. Zombies count as gone; the caller's own pid is
never matched. Stdlib only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from typing import Final

__all__ = ["naming", "kill_naming", "KILL_WAIT_S"]

# How long ``kill_naming`` waits for SIGKILLed processes to be gone (seconds).
KILL_WAIT_S: Final = 2.0
# Between two scans while waiting (seconds).
_POLL_S: Final = 0.02

_PROC: Final = "/proc"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _gone(pid: str) -> bool:
    stat = _read(f"{_PROC}/{pid}/stat")
    # comm may hold spaces and parens: the state follows the last ')'.
    return not stat or stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def naming(paths: Iterable[str]) -> list[int]:
    """Pids of live processes whose command line contains any of ``paths``."""
    needles = [p.encode() for p in paths if p]
    if not needles or not os.path.isdir(_PROC):
        return []
    me = str(os.getpid())
    found = []
    for pid in os.listdir(_PROC):
        if not pid.isdigit() or pid == me:
            continue
        cmd = _read(f"{_PROC}/{pid}/cmdline")
        if cmd and any(n in cmd for n in needles) and not _gone(pid):
            found.append(int(pid))
    return sorted(found)


def kill_naming(paths: Iterable[str], *, wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every process ``naming(paths)`` finds, rescanning (new helpers may appear
    while the rest dies) until none is left or ``wait_s`` passes. Blocking.

    Returns:
        The pids still alive at the end (normally none).
    """
    paths = list(paths)
    deadline = time.monotonic() + wait_s
    pids = naming(paths)
    while pids:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # gone already; or not ours, and then reported below if it stays
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
        pids = naming(paths)
    return pids
