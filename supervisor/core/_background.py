"""The daemon's account of a background command whose runner never said how it ended.

A ``run_command`` with ``background: true`` is recorded ``succeeded``, its output "started
in the background: id bgN, pid P; ..."; at the run's end its runner sends the record again,
amended (``stop_effect`` ``background_ended``, or a reason ``background_ended_with_run:``;
``subagent.tools.background.settle_call``). A runner killed before that (the stop's grace
ran out, the OOM killer, a crash) never does, and the record said "started" for ever,
while the daemon had ended the run's whole tree and knew it. ``amendments`` writes that
account from what the daemon knows: the group P its runner reported (``process_group``),
still alive when the runner died, or reported gone at a time; when path B saw the tree
dead. Each amended record carries ``amended_by: "daemon"``. Pure: records in, records out;
``amend_background`` reads and writes them for a run through its book.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from subagent.events import StopEffect, ToolCallState
from supervisor.core._book import RunBook
from supervisor.core._run import Run
from supervisor.errors import JournalError

__all__ = ["AMENDED_BY_DAEMON", "amend_background", "amendments"]

logger = logging.getLogger(__name__)

# The ``amended_by`` of a record the daemon amended (a runner's own amendment has none).
AMENDED_BY_DAEMON: Final = "daemon"
# (``subagent.tools.background``: the call's output, and the reason of its amendment
# without a stop; a test runs a real runner's through this.)
_STARTED: Final = re.compile(r"started in the background: id (bg\d+), pid (\d+)")
_ENDED_WITH_RUN: Final = "background_ended_with_run:"


def _started(rec: Mapping[str, Any]) -> tuple[str, int] | None:
    """(its id, its group) for a call that started a background command and whose record
    nobody amended yet; else None."""
    if rec.get("name") != "run_command" or rec.get("state") != ToolCallState.SUCCEEDED:
        return None
    if rec.get("stop_effect") is not None or str(rec.get("reason") or "").startswith(_ENDED_WITH_RUN):
        return None
    found = _STARTED.match(str(rec.get("output") or ""))
    return None if found is None else (found[1], int(found[2]))


def amendments(
    records: Iterable[Mapping[str, Any]],
    groups: Iterable[Mapping[str, Any]],
    *,
    how: str,
    stop_wall: float | None,
    tree_dead_wall: float | None,
) -> list[dict[str, Any]]:
    """The records of calls whose background command the daemon's end of the run ended,
    amended; the others are left out (a command that ended before the stop, or before
    its runner died, was not ended by either: its record stays as it was).

    Args:
        records: the run's tool-call records (the journal's).
        groups: its process groups (the journal's: ``pgid``, ``kind``, ``alive``, ``ended_at``).
        how: how its runner ended, e.g. "the runner was killed at the end of the stop's grace".
        stop_wall: when the daemon took its stop (wall clock); None: no stop ended it.
        tree_dead_wall: when path B saw the whole tree dead (wall clock); None: not seen.
    """
    by_pgid = {int(g["pgid"]): g for g in groups if g.get("kind") == "command"}
    out: list[dict[str, Any]] = []
    for rec in records:
        started = _started(rec)
        if started is None:
            continue
        job, pgid = started
        group = by_pgid.get(pgid)
        ended = group.get("ended_at") if group is not None and not group.get("alive", True) else None
        if isinstance(ended, (int, float)):
            # Its runner saw it end: by the stop (after it), or on its own before it.
            if stop_wall is None or ended < stop_wall:
                continue
            end, what = float(ended), "its runner saw its group end"
        elif tree_dead_wall is not None:
            end, what = tree_dead_wall, "agentd ended it with the run's tree"
        else:
            end, what = None, "agentd ended the run's tree, and did not see all of it die (the receipt's survivors)"
        amended = {**rec, "amended_by": AMENDED_BY_DAEMON}
        subject = f"its background command {job} (process group {pgid}) was still running when"
        if stop_wall is not None:
            after = None if end is None else round(max(0.0, end - stop_wall), 4)
            when = "" if after is None else f", {after:.3g} s after the stop"
            amended["stop_effect"] = str(StopEffect.BACKGROUND_ENDED)
            amended["stop_requested_at"] = stop_wall
            amended["stop_to_end_s"] = after
            amended["reason"] = (
                f"background_ended: {subject} the run was stopped; {how} before it said so; {what}{when} "
                "(agentd's account)"
            )
        else:
            amended["reason"] = f"{_ENDED_WITH_RUN} {subject} {how}; {what} (agentd's account)"
        out.append(amended)
    return out


async def amend_background(book: RunBook, run: Run, *, how: str, stopped: bool, tree_dead_wall: float | None) -> int:
    """Amend, in the journal, the records of ``run``'s calls whose background command its
    runner left unaccounted for (``amendments``), before its end is written. How many."""
    try:
        row = await book.journal.get_run(run.run_id)
    except JournalError as exc:  # degraded: the records stay as they are
        logger.warning("run %s: tool records unreadable for its background commands: %s", run.run_id, exc)
        return 0
    if row is None:
        return 0
    stop_wall = run.cancel_wall if stopped else None
    amended = amendments(row["tool_calls"], row["groups"], how=how, stop_wall=stop_wall, tree_dead_wall=tree_dead_wall)
    if amended:
        await book.write(
            run, "background calls amended", lambda j: j.upsert_tool_calls(run.run_id, amended), len(amended)
        )
    return len(amended)
