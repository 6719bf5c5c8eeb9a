"""Reading a runner's JSON lines (its events, its result) as data the daemon can keep.

A stdlib-only leaf under ``subagent.events``. Decoding is total for what the daemon then
does with the data: NaN, Infinity, out-of-range floats and integers beyond 64 bits
become null, a timestamp is a
finite float, nesting is bounded (``MAX_WIRE_DEPTH``), and a result's fields the daemon
acts on have their documented types (``result_fields``). Garbage raises ValueError, which
``subagent.events`` turns into a ``BadLine`` value.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

__all__ = ["MAX_WIRE_DEPTH", "wire_loads", "finite_timestamp", "result_fields"]

# An event line or result nested deeper than this (objects and arrays) is garbage: a
# runner's own are a few deep, and the daemon's encoders (the journal, the control
# socket's replies and pages) must stay far from the recursion limit.
MAX_WIRE_DEPTH: Final = 64
# Integers outside a signed 64-bit range become null: SQLite cannot bind them and no
# float holds the largest (a runner's pgid or deadline of 1 and 30 zeros ended its
# run's supervision with OverflowError).
MIN_INT: Final = -(2**63)
MAX_INT: Final = 2**63 - 1
# How much of a result field of the wrong type is kept as text in its place.
BAD_FIELD_KEEP_CHARS: Final = 1000


def finite_timestamp(ts: Any) -> float | None:
    """``ts`` as a finite float; None when it is none (absent, text, NaN, beyond a float)."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return None
    try:
        value = float(ts)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def wire_loads(text: str) -> Any:
    """A runner's line as JSON data the daemon can store and send on.

    NaN, Infinity, floats out of range (1e400) and integers beyond 64 bits become null:
    the wire is JSON, and a Python runner's ``json.dumps`` writes them. Nesting deeper than ``MAX_WIRE_DEPTH``
    is refused (deeper than the decoder's recursion limit it raised RecursionError, which
    ended the run's supervision: the run was recorded failed, its result lost).

    Raises:
        ValueError: not JSON, or nested too deep (the message says which).
    """
    try:
        obj = json.loads(text, parse_constant=_none, parse_float=_finite_float, parse_int=_int64)
    except RecursionError:
        raise ValueError("json nested too deep") from None
    except ValueError:
        raise ValueError("not json") from None
    if text.count("[") + text.count("{") > MAX_WIRE_DEPTH and _deeper_than(obj, MAX_WIRE_DEPTH):
        raise ValueError(f"json nested more than {MAX_WIRE_DEPTH} deep")
    return obj


def _none(name: str) -> None:
    return None


def _finite_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _int64(text: str) -> int | None:
    # Longer than any 64-bit integer: not converted (int() of thousands of digits is slow).
    if len(text) > 20:
        return None
    value = int(text)
    return value if MIN_INT <= value <= MAX_INT else None


def _deeper_than(obj: Any, most: int) -> bool:
    """Are containers nested more than ``most`` deep in ``obj``? Iterative."""
    todo: list[tuple[Any, int]] = [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        if depth > most:
            return True
        todo.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False


def result_fields(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the fields the daemon acts on in their documented types: ``reason``
    text or null, ``error`` an object or null, ``unapplied_steering`` a list of texts,
    ``tool_calls`` a list.

    A field of another type (``"error": "text"``) failed the run's terminal write, and its
    whole result was lost (``unapplied_steering: 5`` or ``tool_calls: 5`` failed its
    supervision): it is kept, as text, in that type (``tool_calls``: empty), and
    ``malformed_fields`` names each field so changed.
    """
    fixed: dict[str, Any] = {}
    reason = result.get("reason")
    if reason is not None and not isinstance(reason, str):
        fixed["reason"] = _text(reason)
    error = result.get("error")
    if error is not None and not isinstance(error, dict):
        fixed["error"] = {"code": "malformed_error", "message": _text(error)}
    calls = result.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        fixed["tool_calls"] = []  # records: nothing of another type is one
    steering = result.get("unapplied_steering")
    if steering is not None and not (isinstance(steering, list) and all(isinstance(t, str) for t in steering)):
        items = steering if isinstance(steering, list) else [steering]
        fixed["unapplied_steering"] = [t if isinstance(t, str) else _text(t) for t in items]
    if not fixed:
        return result
    return {**result, **fixed, "malformed_fields": sorted(fixed)}


def _text(value: Any) -> str:
    return json.dumps(value, default=str)[:BAD_FIELD_KEEP_CHARS]
