"""Windows tree kills: ``taskkill`` command lines, built here and run by ``process.py``.

Pure functions. ``/T`` ends the process and every process it started; ``/F`` forces it
(a soft ``taskkill`` asks windowed processes to close and console ones may ignore it).
"""

from __future__ import annotations

__all__ = ["soft_kill_command", "hard_kill_command"]


def _check_pid(pid: int) -> str:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"expected a positive process id, got {pid!r}")
    return str(pid)


def soft_kill_command(pid: int) -> list[str]:
    """Path A: ask the tree rooted at ``pid`` to end (``taskkill /T /PID n``)."""
    return ["taskkill", "/T", "/PID", _check_pid(pid)]


def hard_kill_command(pid: int) -> list[str]:
    """Path B's escalation: force the whole tree down (``taskkill /F /T /PID n``)."""
    return ["taskkill", "/F", "/T", "/PID", _check_pid(pid)]
