"""Run states and the transitions allowed between them.

Stdlib-only leaf with no I/O: the registry, the journal and the protocol all import it.
A run has exactly one terminal state, written once; nothing leaves a terminal state.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["RunState", "TERMINAL_STATES", "LIVE_STATES", "ALLOWED", "can_transition"]


class RunState(enum.StrEnum):
    QUEUED = "queued"  # accepted, waiting for a concurrency slot
    STARTING = "starting"  # the runner process is being spawned
    RUNNING = "running"
    # A tool call waits for a person's OK (approve/deny); a cancel or the approval's
    # timeout ends the wait like any stop.
    AWAITING_APPROVAL = "awaiting_approval"
    CANCELLING = "cancelling"  # a stop was requested; the tree is being ended
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"  # a user stop or a timeout; never "failed"
    LOST = "lost"  # the daemon restarted and found the run's process gone


TERMINAL_STATES: Final = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.LOST})
LIVE_STATES: Final = frozenset(
    {RunState.QUEUED, RunState.STARTING, RunState.RUNNING, RunState.AWAITING_APPROVAL, RunState.CANCELLING}
)

ALLOWED: Final[dict[RunState, frozenset[RunState]]] = {
    RunState.QUEUED: frozenset({RunState.STARTING, RunState.CANCELLED, RunState.FAILED, RunState.LOST}),
    RunState.STARTING: frozenset(
        {RunState.RUNNING, RunState.CANCELLING, RunState.FAILED, RunState.CANCELLED, RunState.LOST}
    ),
    RunState.RUNNING: frozenset(
        {
            RunState.AWAITING_APPROVAL,
            RunState.CANCELLING,
            RunState.COMPLETED,
            RunState.FAILED,
            RunState.CANCELLED,
            RunState.LOST,
        }
    ),
    # Back to running once every pending call is answered; a stop ends the wait.
    RunState.AWAITING_APPROVAL: frozenset(
        {RunState.RUNNING, RunState.CANCELLING, RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.LOST}
    ),
    # A run that completes while its stop is in flight is recorded as what really happened.
    RunState.CANCELLING: frozenset({RunState.CANCELLED, RunState.COMPLETED, RunState.FAILED, RunState.LOST}),
    RunState.COMPLETED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
    RunState.LOST: frozenset(),
}


def can_transition(old: RunState, new: RunState) -> bool:
    return new in ALLOWED[old]
