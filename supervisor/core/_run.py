"""One run as the daemon holds it while it is live: ``Run``, a plain record.

Owned by the run manager (``supervisor.core.runs``); its lifecycle (``supervisor.core._lifecycle``),
its facts (``supervisor.core._book``) and recovery (``supervisor.core.recovery``) read and write
it, nothing else. ``tree`` is honest about what it holds: a ``Tree`` this daemon spawned,
or an ``AdoptedTree`` found again after a restart (``readopted``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from subagent.stopmark import write_marker
from supervisor.core.approvals import RunApprovals
from supervisor.core.token import CancelToken
from supervisor.protocol import Secret
from supervisor.states import RunState
from supervisor.trees._handles import AnyTree

__all__ = ["Run", "Staged", "mark_stop"]


@dataclass(slots=True)
class Staged:
    """One of a run's events read from its runner, waiting to be journaled with the rest
    of its read in one commit (``RunBook.stage``, ``RunBook.flush``): its event (``ts``
    None: the daemon's own, stamped when written), the facts that come with it (as
    ``journal.EventWrite``), and ``partial``, the run's partial result once it is written
    (a snapshot folded)."""

    kind: str
    data: dict[str, Any]
    ts: float | None
    tool_call: dict[str, Any] | None = None
    group: tuple[int, str, str, str | None] | None = None
    group_ended: int | None = None
    checkpoint: dict[str, Any] | None = None
    partial: dict[str, Any] | None = None


@dataclass(eq=False)
class Run:
    run_id: str
    session_id: str | None
    spec: dict[str, Any]
    timeout_s: float | None
    token: CancelToken
    state: RunState = RunState.QUEUED
    run_dir: Path | None = None
    tree: AnyTree | None = None
    readopted: bool = False  # found again after a daemon restart: no pipes, no exit status
    scope: trio.CancelScope | None = None  # cancelled: path B
    queue_scope: trio.CancelScope | None = None  # cancelled: leave the queue
    partial: dict[str, Any] | None = None  # the last step_snapshot
    # Checkpoints of ``partial`` (``progress.PartialCheckpoints``): about how many bytes of
    # snapshot deltas were journaled since the last one, and how big that one was.
    partial_since: int = 0
    partial_checkpoint: int = 0
    cancel_at: float | None = None  # trio clock
    # When this daemon saw its runner exit by itself (trio clock): a stop asked after that
    # did not end it (``stopped_first``).
    leader_exited_at: float | None = None
    cancel_wall: float | None = None
    stop_deadline: float | None = None  # wall clock: the end of the stop's grace
    deadline: float | None = None  # wall clock: the timeout
    path_a: list[str] = field(default_factory=list)
    subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=set)
    lock: trio.Lock = field(default_factory=trio.Lock)  # its events' numbering and fan-out
    # Its state's changes, each whole (journal write, state, event): a change whose write
    # was under way when the run's end was written came after it, the state back from a
    # terminal one and its event after the end (``RunBook.transition``, ``start``, ``finish``).
    state_lock: trio.Lock = field(default_factory=trio.Lock)
    done: trio.Event = field(default_factory=trio.Event)
    # Set once the removal of what its tree left (its run dir) was tried, done or failed
    # (``Lifecycle.clean_up``, after ``done``): the disk guard waits for no more than that.
    removal_tried: trio.Event = field(default_factory=trio.Event)
    stop_recorded: trio.Event = field(default_factory=trio.Event)  # its stop's intent is journaled
    stop_taken: trio.Event = field(default_factory=trio.Event)  # its token was cancelled (no await after)
    stdin: trio.abc.SendStream | None = None  # steering goes here while the runner reads it
    stdin_lock: trio.Lock = field(default_factory=trio.Lock)
    stdin_closed: bool = False  # its runner's input was closed (the run is ending)
    # Steering written to its stdin, what its runner said it read (``steering`` queued),
    # and what it said became of it (``applied``, ``unapplied``): what it never read, or
    # read and never settled before it ended without a result, is reported unapplied at
    # its end (``supervisor.core._steers``).
    steers_sent: list[str] = field(default_factory=list)
    steers_read: list[str] = field(default_factory=list)
    steers_settled: list[str] = field(default_factory=list)
    # This run's own model API key: for its runner's environment only, never journaled.
    model_key: Secret | None = field(default=None, repr=False)
    last_seq: int = 0  # the number of its last event (given out, maybe not yet journaled)
    # Its events read from its runner and not yet journaled (``RunBook.stage``): written
    # together, then sent to its watchers, at the end of the read that brought them.
    staged: list[Staged] = field(default_factory=list)
    last_ts: float = 0.0  # its last event's time: the next one is never earlier
    stop_receipt: dict[str, Any] | None = None  # path B's, once the tree was stopped
    # Why the daemon itself stopped the run, beyond its reason (a full disk's measurement:
    # ``supervisor.core.diskguard``); in its receipt as ``stop_detail``. Journaled with the
    # stop's intent (``Journal.record_cancel``): a restarted daemon finds it again.
    stop_detail: dict[str, Any] | None = None
    # A stop a daemon acknowledged while the journal could not be written, carried across
    # its death by the journal-unwritten note (``supervisor.core.recovery``): in the receipt.
    stop_carried: dict[str, Any] | None = None
    final: dict[str, Any] | None = None  # its terminal fact while it waits for the journal
    sandbox: dict[str, Any] | None = None  # the runner's report (runner_started)
    approvals: RunApprovals = field(default_factory=RunApprovals)  # calls awaiting a person's OK
    # A re-adopted run's catch-up: set once what its runner wrote to its events file while
    # no daemon read it has been taken in (``FileSource.pump``). None: nothing to catch up.
    caught_up: trio.Event | None = None
    runner_spec: dict[str, Any] | None = None  # what the runner reads: spec + its session's history
    session_event: dict[str, Any] | None = None  # a turn prepared at its creation: recorded at its start

    @property
    def stopping(self) -> bool:
        return self.token.cancelled

    @property
    def stopped_first(self) -> bool:
        """A stop was asked before its runner ended by itself, so it may be why it ended.
        A stop asked after (a cancel that met the run's own end while its tree was being
        ended and its output read) does not turn the runner's own outcome into a cancel."""
        if not self.token.cancelled:
            return False
        return self.leader_exited_at is None or self.cancel_at is None or self.cancel_at <= self.leader_exited_at


def mark_stop(run: Run, reason: str | None) -> None:
    """Say in the run's stop marker that this SIGTERM is the daemon's stop, and why: called
    before every SIGTERM the daemon sends a live runner (``subagent.stopmark``; the write
    has returned before the signal goes, so the runner, which reads it after the signal,
    sees it). A SIGTERM sent without it is taken by the runner for someone else's."""
    if run.run_dir is not None:
        write_marker(run.run_dir, reason or "stop")
