"""Runs a previous daemon left live: re-adopted when provably the same, otherwise lost.

At start the journal's live runs are checked against the process table: a runner whose
pid still runs with the recorded start time is re-adopted (its pipes went with the old
daemon, so its events are read from ``events.jsonl`` in its run dir and its result from
``result.json``; both cancel paths still reach its tree). A stop the old daemon
acknowledged is resumed at once, without a second cancel: path A again, path B with what
is left of the grace counted from the original cancel, the original reason kept; a
timeout keeps its wall-clock deadline, and so does a call awaiting approval (still
answerable through the run's answer channel). A run whose runner is gone is what its complete
``result.json`` says it was (completed, failed, cancelled, with its tool records); only a
run without a result is marked ``lost`` with its last partial result. Any leftovers are
swept. Nothing terminal changes.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from subagent.events import BadLine, decode_result
from supervisor import process
from supervisor.pool import remove_dir
from supervisor.progress import LineSplitter
from supervisor.states import RunState
from supervisor.token import CancelToken

if TYPE_CHECKING:
    from supervisor.runs import RunManager, _Run

__all__ = ["recover_runs", "adopted_lifecycle", "read_result_file"]

logger = logging.getLogger(__name__)

# How often a re-adopted run's events.jsonl is read (its stderr went with the old daemon).
TAIL_POLL_S = 0.2


async def recover_runs(self: RunManager) -> list[_Run]:
    """Runs a previous daemon left live: re-adopt the provably same, sweep and lose the rest.

    One run's failure here is that run's: it is logged and left live in the journal for
    the next start, and the others are recovered.
    """
    adopted: list[_Run] = []
    for row in await self.journal.live_runs():
        try:
            run = await _recover_one(self, row)
        except Exception:
            logger.exception("run %s: recovering it failed; left for the next start", row["id"])
            continue
        if run is not None:
            adopted.append(run)
    return adopted


async def _recover_one(self: RunManager, row: Any) -> _Run | None:
    run_id = row["id"]
    pid, tree_id = row["pid"], row["tree_id"]
    if pid is None or tree_id is None:
        await _never_started(self, row)
        return None
    groups = [g["pgid"] for g in row["groups"] if g["alive"]]
    found = await trio.to_thread.run_sync(
        functools.partial(
            process.find_tree,
            tree_id,
            pid=pid,
            start_time=row["pid_start_time"],
            cgroup=row["cgroup"],
            groups=groups,
            containment=row["containment"],
        )
    )
    for g in row["groups"]:
        if g["alive"] and g["kind"] == "command":
            found.tree.set_interruptible(g["pgid"], g.get("on_stop") == "interrupt")
    from supervisor.runs import _Run as Run

    run = Run(
        run_id=run_id,
        session_id=row["session_id"],
        spec=row["spec"],
        timeout_s=row["timeout_s"],
        token=CancelToken(run_id),
        state=RunState(row["state"]),
        run_dir=Path(row["run_dir"]) if row["run_dir"] else None,
        tree=found.tree,
        partial=row["partial_snapshot"],
        readopted=True,
        last_seq=row["last_seq"],
    )
    run.deadline = row["deadline"]
    # Calls that were awaiting approval still are: their records say so, deadlines included.
    run.approvals.restore(row["tool_calls"])
    if run.deadline is None and run.timeout_s is not None and row["started_at"] is not None:
        run.deadline = row["started_at"] + run.timeout_s  # a journal from before deadlines
    if row["cancel_reason"] is not None:
        _resume_stop_intent(run, row)
    if found.leader_alive:
        logger.info("run %s: re-adopted runner pid %d (%d live processes)", run_id, pid, len(found.members))
        self._live[run_id] = run
        note: dict[str, Any] = {"note": "re-adopted after a daemon restart", "members": found.members}
        if run.token.cancelled:
            # The acknowledged stop goes on at once: path A again, before any await.
            run.path_a = process.soft_stop(found.tree)
            note["resumed_stop"] = {"reason": run.token.reason, "grace_left_s": _grace_left(self, run)}
        await self._record(run, "daemon", note)
        if run.token.cancelled and run.state in (RunState.STARTING, RunState.RUNNING, RunState.AWAITING_APPROVAL):
            await self._transition(run, RunState.CANCELLING, reason=run.token.reason)
        return run
    stop = await process.terminate_and_kill(found.tree, grace_s=0.0)
    await _ended_while_down(self, run, row, stop, found.members)
    if run.run_dir is not None:
        await trio.to_thread.run_sync(remove_dir, run.run_dir)
    self.containment.remove(found.tree)
    return None


def _resume_stop_intent(run: _Run, row: Any) -> None:
    """The stop the old daemon acknowledged, as it was: reason, time, end of its grace."""
    run.token.cancel(row["cancel_reason"])
    run.cancel_wall = row["cancel_requested_at"]
    run.stop_deadline = row["stop_deadline"]
    if run.cancel_wall is not None:
        # On this daemon's Trio clock, for the receipt's cancel-to-dead figure.
        run.cancel_at = trio.current_time() - max(0.0, time.time() - run.cancel_wall)


def _grace_left(self: RunManager, run: _Run) -> float:
    """Path B's grace: what is left of the stop's, counted from the original cancel."""
    if run.stop_deadline is None:
        return self.config.grace_s
    return max(0.0, run.stop_deadline - time.time())


async def _never_started(self: RunManager, row: Any) -> None:
    run_id = row["id"]
    reason = row["cancel_reason"]
    if reason is not None:
        # Its stop was acknowledged before it had a process: that stop is what happened.
        receipt = {"note": "cancelled before its runner started; finished by the restarted daemon"}
        await self.backlog.write(
            run_id,
            lambda j: j.finish(run_id, RunState.CANCELLED, reason=reason, result=None, partial=False, receipt=receipt),
            True,
            what="cancelled",
        )
        logger.warning("run %s: cancelled (its stop was acknowledged before it started)", run_id)
        return
    await self.backlog.write(
        run_id,
        lambda j: j.mark_lost(run_id, reason="the daemon restarted before the run's process started"),
        True,
        what="lost",
    )
    logger.warning("run %s: lost (never started before the daemon restarted)", run_id)


async def _ended_while_down(
    self: RunManager, run: _Run, row: Any, stop: process.StopReceipt, swept: list[int]
) -> None:
    """The runner ended while no daemon watched: its complete result says what the run was."""
    assert run.tree is not None
    run_id = run.run_id
    # Its events after the old daemon died went to events.jsonl: keep them (tool records).
    await tail_events_file(self, run, run.tree, follow=False)
    result = read_result_file(run.run_dir / "result.json") if run.run_dir else None
    if isinstance(result, dict):
        logger.warning("run %s: finished while the daemon was down: %s", run_id, result.get("status"))
        run.stop_receipt = stop.to_dict()
        await self._conclude(run, None, {**run.stop_receipt, "note": "the run ended while the daemon was down", "swept": swept})
        return
    snapshot = run.partial if run.partial is not None else row["partial_snapshot"]
    await self.backlog.write(
        run_id,
        lambda j: j.mark_lost(
            run_id, reason="the runner was gone when the daemon restarted, without a result", partial_result=snapshot
        ),
        True,
        what="lost",
    )
    receipt = {"recovery": stop.to_dict(), "swept": swept}
    await self.backlog.write(run_id, lambda j: j.set_receipt(run_id, receipt), True, what="receipt")
    if not stop.survivors:
        await self.backlog.write(run_id, lambda j: j.end_groups(run_id), 0, what="groups ended")
    await self._record(run, "state", {"state": str(RunState.LOST), "partial": True})
    logger.warning("run %s: lost; swept %d leftover processes", run_id, len(swept))


async def adopted_lifecycle(self: RunManager, run: _Run) -> None:
    """A run re-adopted after a restart: no pipes; its events come from events.jsonl.

    A task root like ``RunManager._lifecycle``: nothing gets out of it.
    """
    try:
        await _adopted_lifecycle(self, run)
    except Exception:
        logger.exception("run %s: ending the supervision of a re-adopted run failed", run.run_id)


async def _adopted_lifecycle(self: RunManager, run: _Run) -> None:
    tree = run.tree
    assert tree is not None
    receipt: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as io:
            io.start_soon(tail_events_file, self, run, tree)
            io.start_soon(self.approvals.watch, run)
            if run.deadline is not None and not run.token.cancelled:
                io.start_soon(self._timeout, run)
            with trio.CancelScope() as run.scope:
                if run.token.cancelled:
                    run.scope.cancel()
                try:
                    await process.wait_leader(tree)
                finally:
                    with trio.CancelScope(shield=True):
                        grace = _grace_left(self, run) if run.token.cancelled else self.config.grace_s
                        stop = await process.terminate_and_kill(tree, grace_s=grace, sigterm_sent=bool(run.path_a))
                        receipt = run.stop_receipt = stop.to_dict()
            io.cancel_scope.cancel()
        await tail_events_file(self, run, tree, follow=False)
        await self._conclude(run, None, receipt)
    except Exception as exc:
        logger.exception("run %s: supervision of a re-adopted run failed", run.run_id)
        await self._finish_internal_error(run, exc, self._receipt_head(run))
    finally:
        with trio.CancelScope(shield=True):
            await self._clean_up(run, tree, run.run_dir)
        if not run.done.is_set():
            self._let_go(run)

async def tail_events_file(self: RunManager, run: _Run, tree: process.AnyTree, *, follow: bool = True) -> None:
    """Read the events a runner appends to events.jsonl once its stderr is gone."""
    if run.run_dir is None:
        return
    path = run.run_dir / "events.jsonl"
    splitter = LineSplitter()
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(run.tail_offset)
                data = f.read()
        except OSError:
            data = b""
        if data:
            run.tail_offset += len(data)
            for item in splitter.feed(data):
                await self._on_item(run, tree, item)
        if not follow:
            return
        await trio.sleep(TAIL_POLL_S)


def read_result_file(path: Path) -> dict[str, Any] | BadLine:
    try:
        data = path.read_bytes()
    except OSError:
        return BadLine(text="", problem="no result on stdout and no result.json")
    return decode_result(data)
