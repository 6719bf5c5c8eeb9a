"""The one run lifecycle: supervise a runner's tree until its terminal fact is written.

``Lifecycle.supervise(run, source)`` is every run's supervision, whether this daemon
started the runner (``PipeSource``) or found it again after a restart (``FileSource``):
the source's events are pumped by tasks *outside* the run's cancel scope, so a stop
does not deafen us (the runner's last snapshot and final result written during its
grace are still read); the scope (``run.scope``) waits for the runner's exit; cancelling
it is path B: it unwinds into a shielded ``process.terminate_and_kill`` (SIGTERM, grace,
SIGKILL the whole tree, reap), which also runs when the runner ends by itself. Then the
run's result decides its terminal fact (``conclude``), and what the tree left is removed.

A task root: nothing gets out of ``supervise``. A failure in a run's bookkeeping (a
pump, a journal write, the conclusion) ends that run alone, with its tree stopped (path
B runs in a ``finally``) and an ``internal`` error on its record.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import trio

from subagent.events import BadLine, Event, EventKind, ExitCode, RunStatus, fold_snapshot
from supervisor.config import Config
from supervisor.core._background import amend_background
from supervisor.core._book import STAGED_MAX, RunBook, take_result_records, tree_dead_wall
from supervisor.core._limits import add_memory, add_pids
from supervisor.core._run import Run, Staged, mark_stop
from supervisor.core._sources import EventSource
from supervisor.core._steers import unreported_steering
from supervisor.core._stop_receipt import describe_tool_stops, runner_death
from supervisor.core.approvals import ApprovalDesk
from supervisor.core.progress import checkpoint_due
from supervisor.errors import JournalError
from supervisor.states import TERMINAL_STATES, RunState
from supervisor.store._bounds import group_id, tool_call_step
from supervisor.store._ops import tool_call_rank
from supervisor.store.journal import Journal
from supervisor.trees import process
from supervisor.trees._handles import AnyTree
from supervisor.trees.containment import Containment
from supervisor.trees.pool import remove_dir

__all__ = ["Lifecycle", "MEMORY_LIMIT", "STARTING_LOST"]

logger = logging.getLogger(__name__)

# A run a restarted daemon found `starting` whose runner then ended (or was gone) without
# a result: its process record was journaled before its runner was let go (a spare gets
# `go` only after that commit), so the runner may never have been let go; such a one
# exits at the daemon's hang-up having done nothing of the run. Not started again here.
STARTING_LOST: Final = (
    "the daemon restarted while the run was starting and its runner ended without a result "
    "(a runner the daemon had not let go yet exits at its hang-up, having done nothing of the run); "
    "not started again"
)

# The reason of a run whose runner the kernel's OOM killer killed at the run's memory
# limit (``config.run_memory_max_mib``, ``trees/_memlimit.py``): its group counted it.
MEMORY_LIMIT: Final = "memory_limit"

# The runner's events the daemon acts on beyond journaling them (after what came before).
_ACTS_ON: Final = frozenset(
    {EventKind.RUNNER_STARTED, EventKind.STOP_REQUESTED, EventKind.APPROVAL_REQUESTED, EventKind.APPROVAL_ANSWERED}
)


class Lifecycle:
    """Supervision of live runs: events in, both cancel paths, the terminal fact out.

    Args:
        cancel: the run manager's cancel (``run_id``, ``reason``): a timeout is a stop.
    """

    def __init__(
        self,
        config: Config,
        book: RunBook,
        containment: Containment,
        approvals: ApprovalDesk,
        cancel: Callable[[str, str], Awaitable[object]],
    ) -> None:
        self.config = config
        self.book = book
        self.containment = containment
        self.approvals = approvals
        self._cancel = cancel
        # The daemon's start failed after the runs a previous daemon left were found
        # again: each is left as it is (its tree, its files, its journal row) for the next
        # start, as a daemon killed -9 leaves it, not ended on the way out.
        self.leaving = False

    # ------------------------------------------------------------------ supervision

    async def supervise(
        self, run: Run, source: EventSource, *, announce: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        """Supervise ``run`` until its terminal fact is written; never raises.

        Args:
            source: where its events and result come from.
            announce: awaited inside the run's scope once its events flow (a spawned
                run's process record); a stop during it is path B like any other. The
                runner gets its spec only once it is through: a runner that has its spec
                acts, and one whose record is not in the journal would be found by no
                recovery (a daemon killed meanwhile left it running its run, unsupervised,
                which the next start recorded `lost` and whose directory it removed).
        """
        tree = source.tree
        announced = trio.Event()
        if announce is None:
            announced.set()

        async def feed() -> None:
            await announced.wait()
            await source.feed(run)

        try:
            receipt: dict[str, Any] = {}
            async with trio.open_nursery() as io:
                io.start_soon(feed)
                io.start_soon(self.approvals.watch, run)
                if run.deadline is not None and not run.token.cancelled:
                    io.start_soon(self._timeout, run)
                # The events are read outside the run's scope (a stop must not deafen us).
                async with trio.open_nursery() as pumps:
                    pumps.start_soon(source.pump, lambda items: self.on_events(run, tree, items))
                    with trio.CancelScope() as run.scope:
                        if run.token.cancelled:  # the stop came while it was starting
                            if not run.path_a:
                                mark_stop(run, run.token.reason)
                                run.path_a = process.soft_stop(tree)
                            run.scope.cancel()
                        exited = False
                        try:
                            if announce is not None:
                                await announce()
                                announced.set()
                            await process.wait_leader(tree)
                            exited = True
                            run.leader_exited_at = trio.current_time()
                        finally:
                            # Path B (scope cancelled) or the runner ended by itself: either
                            # way the whole tree is ended and confirmed dead, shielded, bounded.
                            # (Unless the daemon is leaving its runs: then it is cancelled.)
                            if not self.leaving:
                                if not exited and not run.path_a:
                                    # Path B's SIGTERM is the runner's first: the daemon's stop
                                    # too (its supervision failed, say), marked as such.
                                    mark_stop(run, run.token.reason or "internal")
                                with trio.CancelScope(shield=True):
                                    stop = await process.terminate_and_kill(
                                        tree, grace_s=self._grace(run), sigterm_sent=bool(run.path_a)
                                    )
                                    receipt = run.stop_receipt = stop.to_dict()
                source.annotate(receipt)
                io.cancel_scope.cancel(reason="the run's tree is stopped and its output read")
            await self.conclude(run, source.exit_code(), receipt, source.result())
        except Exception as exc:
            logger.exception("run %s: supervision failed", run.run_id)
            await self.finish_internal_error(run, exc, self.receipt_head(run))
        finally:
            # Also after a failure in the run's bookkeeping: the tree was stopped (path B
            # runs in the supervision's finally); what it leaves behind goes too.
            if not self.leaving:
                with trio.CancelScope(shield=True):
                    await self.clean_up(run, tree, run.run_dir)
            if not run.done.is_set():  # only on a bug: never leave waiters hanging
                self.book.let_go(run)

    def _grace(self, run: Run) -> float:
        """Path B's grace: counted from the cancel (its journaled ``stop_deadline``), not
        from when path B got to run. A stop a previous daemon acknowledged keeps what is
        left of its grace; so does one whose path B starts late here (a thousand runs
        stopping at once on two cores do not each get a full grace after the last)."""
        if run.readopted and run.token.cancelled:
            return self.grace_left(run)
        if run.cancel_at is not None:
            return max(0.0, run.cancel_at + self.config.grace_s - trio.current_time())
        return self.config.grace_s

    def grace_left(self, run: Run) -> float:
        """Path B's grace for a resumed stop: what is left, counted from the original cancel."""
        if run.stop_deadline is None:
            return self.config.grace_s
        return max(0.0, run.stop_deadline - time.time())

    async def _timeout(self, run: Run) -> None:
        assert run.deadline is not None
        await trio.sleep(max(0.0, run.deadline - time.time()))
        await self._cancel(run.run_id, "timeout")

    async def clean_up(self, run: Run, tree: AnyTree, run_dir: Path | None) -> None:
        """Remove what a stopped tree leaves (its dir, its cgroup, untraceable orphans)."""
        try:
            if run_dir is not None:
                try:
                    await trio.to_thread.run_sync(remove_dir, run_dir)
                finally:
                    run.removal_tried.set()  # done or failed: the disk guard waits no longer
            self.containment.remove(tree)
            # An orphan that shed every trace of its tree can only be ended when no tree
            # is live to claim it.
            strays = await process.kill_strays(self.containment, only_if_idle=True)
            if strays:
                logger.warning("run %s: killed %d untraceable orphans: %s", run.run_id, len(strays), strays)
        except Exception:
            logger.exception("run %s: cleaning up after its tree failed", run.run_id)

    # ------------------------------------------------------------------ events

    async def on_events(self, run: Run, tree: AnyTree, items: list[Event | BadLine]) -> None:
        """What one read of the runner's output brought, in order, each taken by ``on_event``;
        the events it staged (nearly all: those that only need journaling) are journaled
        together at the end, in one commit (``RunBook.flush``; every ``STAGED_MAX`` on a
        long read), and only then sent to watchers. A busy daemon reads more at a time, so
        its commits per event fall as its load grows; a quiet one writes each at once."""
        try:
            for item in items:
                await self.on_event(run, tree, item)
                if len(run.staged) >= STAGED_MAX:
                    await self.book.flush(run)
        finally:
            await self.book.flush(run)  # what was read before a failure is kept, as it was

    async def on_event(self, run: Run, tree: AnyTree, item: Event | BadLine) -> None:
        """One line from the runner: staged (``on_events`` writes it), or, if the daemon
        acts on it, journaled at once after what was staged before it, and acted on."""
        book = self.book
        if isinstance(item, BadLine):
            book.stage(run, Staged("stderr", {"text": item.text, "problem": item.problem}, None))
            return
        data = item.data
        kind = item.kind
        staged = Staged(str(kind), data, item.ts)
        acts = kind in _ACTS_ON
        if acts:
            await book.flush(run)  # what came before it is written before it acts
        try:
            if kind == EventKind.RUNNER_STARTED:
                if isinstance(data.get("sandbox"), dict):
                    run.sandbox = data["sandbox"]
                if run.state == RunState.STARTING:
                    # Stamped as the runner's start it comes just before (stamped later, it
                    # went back in time from it).
                    await book.transition(run, RunState.RUNNING, ts=item.ts)
            elif kind == EventKind.PROCESS_GROUP:
                pgid = group_id(data["pgid"])
                on_stop = data.get("on_stop")
                on_stop = str(on_stop) if on_stop is not None else None
                if data.get("alive", True):
                    tree.add_group(pgid)
                    # Path A may SIGTERM this group at cancel time only if a stop interrupts its tool.
                    tree.set_interruptible(pgid, data.get("kind") == "command" and on_stop == "interrupt")
                    staged.group = (pgid, str(data.get("kind", "")), str(data.get("name", "")), on_stop)
                else:
                    tree.set_interruptible(pgid, False)
                    staged.group_ended = pgid
            elif kind == EventKind.TOOL_CALL:
                record = data.get("record")
                if isinstance(record, dict) and "id" in record:
                    tool_call_rank(record), tool_call_step(record)  # a bad one is a bad event
                    staged.tool_call = record
            elif kind == EventKind.STEERING:
                text, how = data.get("text"), data.get("state")
                if isinstance(text, str) and how == "queued":
                    run.steers_read.append(text)
                elif isinstance(text, str) and how in ("applied", "unapplied"):
                    run.steers_settled.append(text)  # said what became of it
            elif kind == EventKind.STEP_SNAPSHOT:
                # The partial-result cache: a stale writer's _id does not match; a terminal
                # run keeps its result. The event is a delta since the runner's previous
                # snapshot (from an older runner, a whole one), folded into the whole one;
                # the journal keeps the event as sent, and the whole now and then
                # (``checkpoint_due``), after its event: a reader folds the deltas after it.
                if data.get("_id") == run.run_id and run.state not in TERMINAL_STATES:
                    before = book.staged_partial(run)
                    whole = fold_snapshot(before, data)
                    if whole is not before:  # (a delta folded already, read again: nothing)
                        staged.partial = whole
                        staged.checkpoint = checkpoint_due(run, data, whole)
        except (KeyError, TypeError, ValueError) as exc:
            text = json.dumps(item.to_dict())[:2000]
            book.stage(run, Staged("stderr", {"text": text, "problem": f"bad {kind} event: {exc!r}"}, None))
            return
        if not acts:
            book.stage(run, staged)
            return
        await book.record(run, str(kind), data, ts=item.ts)
        if kind == EventKind.STOP_REQUESTED and data.get("reason") == "timeout" and not run.token.cancelled:
            # The runner stopped itself at its spec's deadline: that stop is the daemon's
            # too (both paths, the grace from now, the stop intent journaled). Otherwise a
            # call let finish ran on until the daemon's own backstop, then a second grace.
            await self._cancel(run.run_id, "timeout")
        if kind in (EventKind.APPROVAL_REQUESTED, EventKind.APPROVAL_ANSWERED):
            # After the event: a watcher sees what is asked, then the state it puts the run in.
            await self.approvals.on_event(run, kind, data)

    # ------------------------------------------------------------------ the end

    async def conclude(
        self, run: Run, code: int | None, receipt: dict[str, Any], result: dict[str, Any] | BadLine
    ) -> None:
        """The run's terminal fact, from its runner's result (or its absence) and the receipt."""
        full_receipt = {**self.receipt_head(run), "exit_code": code, "path_b": receipt}
        add_pids(self.containment, run, full_receipt)
        memory = add_memory(self.containment, run, full_receipt)
        unread = await unreported_steering(self.book, run, result_written=isinstance(result, dict))
        # Whether the stop (if any) came before the runner ended: one that came after (a
        # cancel racing the run's own end) does not make its failure a cancel. Read once,
        # here: a cancel during the awaits below must not change the outcome either.
        stopped = run.stopped_first
        error: dict[str, Any] | None
        if run.cancel_at is not None and receipt.get("tree_dead_at") is not None:
            full_receipt["cancel_to_tree_dead_s"] = max(0.0, receipt["tree_dead_at"] - run.cancel_at)
        if isinstance(result, dict):
            if unread:
                result = {**result, "unapplied_steering": [*(result.get("unapplied_steering") or []), *unread]}
            await take_result_records(self.book, run, result)
            await self._add_tool_stops(run, full_receipt, result.get("tool_calls"))
            status = result.get("status")
            if status == RunStatus.COMPLETED:
                state = RunState.COMPLETED
                if run.state == RunState.STARTING:
                    # Its runner ran (it left a result) though its `runner_started` never
                    # reached a daemon (it was in the pipe of one that died): say so first.
                    await self.book.transition(run, RunState.RUNNING)
            elif status == RunStatus.CANCELLED:
                state = RunState.CANCELLED
            else:
                # A failure the runner decided before any stop reached it is its own, even
                # if a stop was asked before it exited (a cancel racing the failure).
                own = result.get("failed_before_stop") is True
                state = RunState.CANCELLED if stopped and not own else RunState.FAILED
            reason = run.token.reason if state == RunState.CANCELLED and stopped else result.get("reason")
            error = result.get("error")
            if state == RunState.CANCELLED and not stopped and reason == "signal" and not run.readopted:
                # A stop is a cancel, never inferred: nobody cancelled this run, yet its
                # runner took a signal for one (a tool of the run, or another process,
                # signalled it). A runner with a stop marker says so itself (its result
                # `failed`, `signalled`, taken as it is above); one without (started by a
                # daemon that made none) is corrected here.
                state, reason = RunState.FAILED, "signalled"
                error = {
                    "code": "signalled",
                    "message": "the runner got a SIGTERM or SIGINT that no cancel sent (a process of the run, or "
                    "another one, signalled it); it stopped as it would for a stop",
                }
            await self.book.finish(
                run, state, reason=reason, result=result, partial=False, error=error, receipt=full_receipt
            )
            return
        # No final JSON: killed before it wrote one, or it crashed. Keep the last snapshot;
        # a tool that was running has an unknown outcome, one only announced never ran.
        died = None if receipt.get("escalated") else runner_death(code, memory, gone=receipt.get("leader") == "gone")
        await self._settle_unreported(run, stopped, died)
        # Its background commands' calls, which its runner never amended: the daemon's account.
        grace = "the stop's grace" if stopped else "its grace"
        how = f"the runner died ({died})" if died is not None else f"the runner was killed at the end of {grace}"
        await amend_background(self.book, run, how=how, stopped=stopped, tree_dead_wall=tree_dead_wall(receipt))
        await self._add_tool_stops(run, full_receipt, None)
        if stopped:
            state, reason, error = RunState.CANCELLED, run.token.reason, None
        elif run.readopted and run.state == RunState.STARTING:
            state, reason = RunState.LOST, STARTING_LOST
            error = {"code": _exit_name(code), "message": f"runner exited with code {code} without a result"}
        elif code == -signal.SIGKILL and memory is not None and (memory["oom_kills"] or memory["failcnt"]):
            # The kernel's OOM killer, at the run's own memory limit: its group counted the
            # kill (or, where the kernel counts no kills, the charges its limit refused).
            state, reason = RunState.FAILED, MEMORY_LIMIT
            error = {
                "code": _exit_name(code),
                "message": f"the runner was killed by the kernel's OOM killer at the run's memory limit "
                f"({memory['max'] >> 20} MiB, run_memory_max_mib): no result",
            }
        else:
            state, reason = RunState.FAILED, "runner_died"
            error = {
                "code": _exit_name(code),
                "message": f"runner exited with code {code} without a result ({result.problem})",
            }
        partial = run.partial
        if unread and isinstance(partial, dict):  # said in the result, as a runner's own would be
            partial = {**partial, "unapplied_steering": [*(partial.get("unapplied_steering") or []), *unread]}
        await self.book.finish(
            run,
            state,
            reason=reason,
            result=partial,
            partial=partial is not None,
            error=error,
            receipt=full_receipt,
        )

    async def _settle_unreported(self, run: Run, stopped: bool, died: str | None = None) -> None:
        """Close the records a runner that left no result never closed (``stopped``: a
        stop came before it ended; ``died``: how it ended if path B did not kill it at the
        end of the grace, ``_stop_receipt.runner_death``: its calls did not run out of grace)."""
        settle: Callable[[Journal], Awaitable[object]]
        if stopped:
            effect, how = (
                ("grace_ran_out", "the runner was killed at the end of the stop's grace")
                if died is None
                else ("runner_died", f"the runner died during the stop ({died}), not at the end of its grace,")
            )
            settle = lambda j: j.settle_tool_calls(  # noqa: E731
                run.run_id,
                reason=f"{effect}: {how} while this call ran; its outcome is unknown",
                pending_reason="stopped_before_start: the runner was stopped before this call started",
                stop_effects=(effect, "stopped_before_start"),
            )
        else:
            settle = lambda j: j.settle_tool_calls(  # noqa: E731
                run.run_id, reason="the runner ended without reporting this call's outcome"
            )
        await self.book.write(run, "tool calls settled", settle, 0)

    async def _add_tool_stops(self, run: Run, receipt: dict[str, Any], records: Any) -> None:
        """The receipt says what the stop did to the running tool (and to the calls after it).

        ``records``: the runner's own (its result's), else the journal's (settled).
        """
        if not run.token.cancelled:
            return
        if not isinstance(records, list):
            try:
                records = await self.book.journal.tool_calls(run.run_id)
            except JournalError as exc:  # degraded: the receipt goes without them
                logger.warning("run %s: tool records unreadable for the receipt: %s", run.run_id, exc)
                return
        tools = describe_tool_stops([r for r in records if isinstance(r, dict)], cancel_wall=run.cancel_wall)
        if tools:
            receipt["tools"] = tools
            receipt["tool_summary"] = "; ".join(t["text"] for t in tools)

    async def finish_internal_error(self, run: Run, exc: Exception, receipt: dict[str, Any]) -> None:
        """A bug in supervision still ends the run once: cancelled if a stop was asked."""
        if run.stop_receipt is not None and "path_b" not in receipt:
            receipt = {**receipt, "path_b": run.stop_receipt}
        await self.book.finish(
            run,
            RunState.CANCELLED if run.token.cancelled else RunState.FAILED,
            reason=run.token.reason or "internal",
            result=run.partial,
            partial=run.partial is not None,
            error={"code": "internal", "message": f"supervision failed: {_leaf_errors(exc)}"},
            receipt=receipt,
        )

    def receipt_head(self, run: Run) -> dict[str, Any]:
        head = {
            "cancel_reason": run.token.reason,
            "cancel_requested_wall": run.cancel_wall,
            "path_a": run.path_a,
            "containment": run.tree.containment if run.tree else None,
            "sandbox": run.sandbox,
        }
        if run.stop_detail is not None:
            head["stop_detail"] = run.stop_detail
        if run.stop_carried is not None:
            head["stop_carried"] = run.stop_carried
        return head


def _leaf_errors(exc: BaseException) -> str:
    """What actually failed inside an exception group, for the run's record."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_leaf_errors(e) for e in exc.exceptions)
    return repr(exc)


def _exit_name(code: int | None) -> str:
    if code is None:
        return "unknown_exit"
    if code == ExitCode.COMPLETED:  # not "completed": the run failed, with no result
        return "no_result"
    if code < 0:
        return f"signal_{-code}"
    try:
        return ExitCode(code).name.lower()
    except ValueError:
        return f"exit_{code}"
