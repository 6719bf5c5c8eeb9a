"""The numbers from a runner the store binds as SQLite integers, checked before they are.

A runner's record or event is checked where it is taken in (a bad one is a bad event, a
``stderr`` note): a value SQLite cannot bind (an integer beyond 64 bits, ``int(1e300)``)
raised OverflowError from the journal's thread instead, which ended the run's supervision
and lost the result its runner wrote. Both checks raise ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["MAX_PGID", "tool_call_step", "group_id"]

# A signed 64-bit integer: what SQLite binds.
_MIN_INT: Final = -(2**63)
_MAX_INT: Final = 2**63 - 1
# A pgid is a pid_t, a C int (Linux allows at most 2**22 of them).
MAX_PGID: Final = 2**31 - 1


def _whole(value: Any, what: str) -> int:
    try:
        return int(value)
    except OverflowError:  # int(inf)
        raise ValueError(f"expected {what} to be an integer, got {value!r}") from None


def tool_call_step(record: Mapping[str, Any]) -> int:
    """A tool-call record's ``step`` (0 when absent) as the store keeps it.

    Raises:
        ValueError: not an integer of at most 64 bits.
        TypeError: not a number at all (null, a list).
    """
    step = _whole(record.get("step", 0), "a tool-call step")
    if not _MIN_INT <= step <= _MAX_INT:
        raise ValueError(f"expected a tool-call step of at most 64 bits, got {step}")
    return step


def group_id(value: Any) -> int:
    """A ``process_group`` event's ``pgid``.

    Raises:
        ValueError: not a process group id (``1..MAX_PGID``).
        TypeError: not a number at all.
    """
    pgid = _whole(value, "a pgid")
    if not 0 < pgid <= MAX_PGID:
        raise ValueError(f"expected a pgid in [1, {MAX_PGID}], got {pgid}")
    return pgid
