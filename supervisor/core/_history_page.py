"""One page of a session's ``history``: a stretch of its turns, bounded in bytes.

A whole transcript in one reply cost the daemon many times its size while it was built,
encoded and sent, and blocked its loop; past a client's message limit it was unreadable.
A page is built a turn at a time (each from its own journal read) and stops before the
turn that would take it past ``max_bytes``; it always holds one turn, so a turn larger
than the bound comes alone, whole (never an error: every turn stays readable). Turns are
numbered from 1 in the order they were made; they are only ever appended, so a number
names the same turn on every page. Pure: the caller gives the turn ids and a builder.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

__all__ = ["Built", "Page", "walk"]


class Built(NamedTuple):
    """A turn as the reply holds it, and the bytes it takes there."""

    entry: dict[str, Any]
    size: int


class Page(NamedTuple):
    first: int  # the number of the page's first turn (where it would start, when empty)
    turns: list[Built]  # oldest first
    more: bool  # turns beyond the page in the direction asked: earlier, or later with ``after``


async def walk(
    count: int,
    build: Callable[[int], Awaitable[Built | None]],
    *,
    before: int | None,
    after: int | None,
    max_bytes: int,
) -> Page:
    """The turns numbered below ``before`` (the newest that fit; default: below
    ``count + 1``) or, with ``after``, above it (the oldest that fit).

    ``build(n)``: turn ``n`` (1-based), or None if it is gone (skipped).
    """
    if after is not None:
        numbers = range(after + 1, count + 1)
        first = after + 1
    else:
        top = count + 1 if before is None else min(before, count + 1)
        numbers = range(top - 1, 0, -1)
        first = top
    out: list[Built] = []
    size = 0
    more = False
    for n in numbers:
        built = await build(n)
        if built is None:
            continue
        if out and size + built.size > max_bytes:
            more = True
            break
        out.append(built)
        size += built.size
        if after is None:
            first = n
    if after is None:
        out.reverse()
    return Page(first, out, more)
