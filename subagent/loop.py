"""The agent loop: model turn, complete tool calls, results back, until an end.

Invariants (seed 004, DESIGN "Cancellation"): the stop flag is read at the start of
each step, before each tool call and after each tool batch; a tool that is running when
the stop comes gets its own stop policy (``subagent.stop_policy``: interrupted, abandoned,
told to stop, or let finish), written in its record; a model turn in flight is aborted
at once by a stop. Only calls of a *whole* turn with valid arguments run; a call cut
mid-arguments is never run and never repaired. Every call of a turn is announced (a
``not_started`` record without a reason, with its policy) before the first one runs, so
a runner killed mid-batch still leaves a record of each; every record is emitted on
every state change (an MCP call's again once its request is handed to its server:
``sent_at``, emitted right after the hand-off, never for a call that was not sent) and
every call gets a tool message in the history that says what really happened. A
``step_snapshot`` follows each model turn that said anything and each tool batch: a
delta since the previous one (``events.SnapshotDeltas``), which the daemon
folds into the whole snapshot, the run's partial result. A call the spec's ``approval`` names waits for a person's answer before it
runs (``subagent.approvals``): approved, it runs; denied, the model is told why and the
turn goes on; a stop during the wait makes it ``rejected`` (it never ran). A turn of a
session starts from the session's history (``spec.session.history``). The loop returns a
``RunOutcome``; it never writes the result.

Size: one loop and the records it keeps, with the stop checked at each of its points
(step, call, batch, approval wait, streamed text, hand-off): split, each half would read
and write the other's records. The streamed text's throttle (``subagent.textstream``)
and a stop's outcome words (``subagent.stopmark``) already live apart.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from subagent.approvals import MAX_APPROVAL_ARGUMENTS_CHARS, ApprovalGate
from subagent.emit import Emitter
from subagent.events import (
    Approval,
    EventKind,
    ExitCode,
    RunStatus,
    SnapshotDeltas,
    StopEffect,
    StopPolicy,
    ToolCallRecord,
    ToolCallState,
)
from subagent.history import (
    HISTORY_DENIED,
    HISTORY_FINISHED_AFTER_STOP,
    HISTORY_FINISHED_BEFORE_STOP,
    HISTORY_INTERRUPTED,
    refused_calls_note,
    tool_result_text,
)
from subagent.model.provider import DraftCall, ModelError, ModelTurn, Provider, TurnAssembler
from subagent.spec import RunSpec
from subagent.steering import SteeringQueue
from subagent.stop import StopControl
from subagent.stopmark import SIGNALLED, SIGNALLED_MESSAGE
from subagent.textstream import TextStream
from subagent.tools.background import BackgroundEnd, settle_call
from subagent.tools.toolbox import REASON_STOPPED_BEFORE_START, ToolBox

__all__ = [
    "AgentLoop",
    "RunOutcome",
    "DEFAULT_SYSTEM_PROMPT",
    "HISTORY_INTERRUPTED",
    "HISTORY_FINISHED_AFTER_STOP",
    "HISTORY_FINISHED_BEFORE_STOP",
]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a sub-agent that completes one task using the tools you are given. "
    "When the task is done, answer with a short summary and no tool call."
)
# What the model is told, per stop effect, lives in ``subagent.history`` (the daemon
# rebuilds a session's earlier turns with the same words); re-exported here.


@dataclass
class RunOutcome:
    status: RunStatus
    exit_code: ExitCode
    reason: str | None = None
    final_text: str | None = None
    error: dict[str, str] | None = None


# A model whose stream is cut this many turns in a row fails the run (model_stream).
MAX_CUTS_IN_A_ROW = 3
# An answer (no calls) that ended for one of these reasons is cut short: said so.
CUT_SHORT = {
    "length": "the model's answer stopped at its output limit (finish_reason length)",
    "content_filter": "the model server's content filter stopped the answer (finish_reason content_filter)",
}


def _failed(exit_code: ExitCode, reason: str, code: str, message: str) -> RunOutcome:
    return RunOutcome(RunStatus.FAILED, exit_code, reason=reason, error={"code": code, "message": message})


def stopped_outcome(reason: str | None) -> RunOutcome:
    """How a stopped run ends: ``cancelled`` with its stop's reason, except a stop on a
    signal no stop of the daemon's sent (``signalled``): nobody cancelled the run, so it
    failed, in the words the daemon records for it (``subagent.stopmark``)."""
    if reason == SIGNALLED:
        return _failed(ExitCode.SIGNALLED, SIGNALLED, SIGNALLED, SIGNALLED_MESSAGE)
    return RunOutcome(RunStatus.CANCELLED, ExitCode.CANCELLED, reason=reason)


@dataclass
class AgentLoop:
    spec: RunSpec
    provider: Provider
    tools: ToolBox
    stop: StopControl
    emitter: Emitter
    run_id: str | None
    steering: SteeringQueue | None = None
    approvals: ApprovalGate | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    records: list[ToolCallRecord] = field(default_factory=list)
    progress_parts: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    usage_known: bool = False
    steps: int = 0
    snapshots: SnapshotDeltas = field(default_factory=SnapshotDeltas)
    # Where the progress ends with model text that is not a whole turn, as the last snapshot
    # said (``events.SnapshotDeltas``): the result says it too.
    unfinished_text: dict[str, Any] | None = None
    # The records changed since the last snapshot (by id, in order): a snapshot looks at
    # these alone. Looking at every record of the run each time cost each snapshot the
    # whole run so far (a run of many steps of many calls: the square of its length).
    dirty: dict[str, ToolCallRecord] = field(default_factory=dict)
    # The turns that asked for more calls than ``limits.max_tool_calls_per_step``: what
    # was refused (the result's ``refused_calls``), and the note the model is still owed.
    refused_calls: list[dict[str, Any]] = field(default_factory=list)
    refused_note: str | None = None
    # The next suffix to try per call-id base (``_call_id``): a model that gave every
    # call of a turn the same id cost a scan of all the suffixes taken so far per call.
    id_suffixes: dict[str, int] = field(default_factory=dict)
    # The calls that started a background command, by its id (``settle_background``).
    background_calls: dict[str, ToolCallRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A turn of a session starts from the session's earlier turns (the daemon rebuilt
        # them from its journal), then this turn's task.
        self.messages = [
            {"role": "system", "content": self.spec.system_prompt or DEFAULT_SYSTEM_PROMPT},
            *(dict(m) for m in self.spec.session.history),
            {"role": "user", "content": self.spec.task},
        ]

    @property
    def progress(self) -> str:
        return "\n\n".join(p for p in self.progress_parts if p)

    # --- events --------------------------------------------------------------------

    def _emit_record(self, rec: ToolCallRecord) -> None:
        self.dirty[rec.id] = rec
        self.emitter.emit(EventKind.TOOL_CALL, record=rec.to_dict())

    def _snapshot(self, *, progress: str | None = None, unfinished: dict[str, Any] | None = None) -> None:
        # A delta since the last snapshot (the text said since, the records changed since):
        # the daemon folds them into the whole snapshot, its partial result. Sent whole each
        # time, a run's snapshots grew with the square of its length.
        self.unfinished_text = unfinished
        delta = self.snapshots.next(
            step=self.steps,
            progress=self.progress if progress is None else progress,
            records=[_snapshot_record(r) for r in self.dirty.values()],
            unfinished=unfinished,
        )
        self.dirty.clear()
        self.emitter.emit(EventKind.STEP_SNAPSHOT, **delta, _id=self.run_id)

    def _unfinished(self, turn: ModelTurn) -> dict[str, Any]:
        """Where this step's text (taken, the progress's last part; left short) begins in it."""
        return {"step": self.steps, "at": len(self.progress) - len(turn.text), "streaming": False}

    def stream_snapshot(self, text: str) -> None:
        """The model's text of this step as streamed so far, as a snapshot (``subagent.textstream``)."""
        before = self.progress
        at = len(before) + (2 if before else 0)
        progress = f"{before}\n\n{text}" if before else text
        self._snapshot(progress=progress, unfinished={"step": self.steps, "at": at, "streaming": True})

    def _cancelled(self) -> RunOutcome:
        return stopped_outcome(self.stop.reason)

    # --- the loop ------------------------------------------------------------------

    async def run(self) -> RunOutcome:
        schemas = self.tools.schemas()
        cuts = 0  # turns in a row whose stream ended before the turn finished
        while True:
            if self.stop.requested:
                return self._cancelled()
            if self.steps >= self.spec.limits.max_steps:
                msg = f"the model did not answer within max_steps={self.spec.limits.max_steps}"
                if cuts:
                    msg += f" (the stream of its last {cuts} turn(s) ended before the turn finished)"
                return _failed(ExitCode.FAILED, "max_steps", "max_steps", msg)
            self.steps += 1
            self.emitter.emit(EventKind.STEP_STARTED, step=self.steps)
            self._apply_steering()
            sink = TurnAssembler()
            streamed = TextStream(sink, self.stream_snapshot)
            aborted = False
            try:
                with self.stop.model_request() as scope:
                    await streamed.play(self.provider.stream_turn, self.messages, schemas)
                aborted = scope.cancelled_caught
            except ModelError as exc:
                turn = sink.result(aborted=True)
                self._take_turn(turn, failed=f"model_error: {exc.message}")
                if turn.text and streamed.sent:
                    # Its text went out as it streamed: the partial result keeps it, cut short.
                    self._snapshot(unfinished=self._unfinished(turn))
                return _failed(ExitCode.MODEL_ERROR, "model_error", exc.kind, exc.message)
            if not aborted and not sink.received_any:
                msg = "the model's stream ended without sending anything"
                return _failed(ExitCode.MODEL_ERROR, "model_error", "model_stream", msg)
            turn = sink.result(aborted=aborted)
            records = self._take_turn(turn)
            if turn.text or turn.calls:
                # What the model said is progress as soon as it is said (a runner killed
                # during the batch keeps it), and the calls are announced in it. Its text
                # went out as it streamed (``subagent.textstream``): only the rest travels now, and
                # a turn a stop or a cut stream ended says its text is not whole.
                self._snapshot(unfinished=None if turn.whole else self._unfinished(turn))
            if aborted:
                return self._cancelled()
            if not turn.finished:
                # A cut stream: nothing of this turn runs; the model is told and asked again,
                # not for ever: each ask is billed, and a server that cuts every stream
                # fails the run for what it is, not as max_steps.
                cuts += 1
                self.emitter.log("warning", f"step {self.steps}: the model's stream ended before its turn finished")
                if cuts >= MAX_CUTS_IN_A_ROW:
                    msg = f"the model's stream ended before its turn finished {cuts} times in a row"
                    return _failed(ExitCode.MODEL_ERROR, "model_error", "model_stream", msg)
                continue
            cuts = 0
            if not turn.calls:
                if (
                    self.steering is not None
                    and self.steering.pending
                    and not self.stop.requested
                    and self.steps < self.spec.limits.max_steps
                ):
                    continue  # new input arrived: the next step applies it
                # (At max_steps no step is left to apply it: the answer stands, and the
                # input is reported unapplied, not the answer dropped as max_steps.)
                cut_short = CUT_SHORT.get(turn.finish_reason or "")
                if cut_short is not None:
                    # Still the model's answer, but not a whole one: said, not hidden.
                    self.emitter.log("warning", f"step {self.steps}: {cut_short}")
                return RunOutcome(
                    RunStatus.COMPLETED,
                    ExitCode.COMPLETED,
                    final_text=turn.text,
                    reason=None if cut_short is None else f"answer_{turn.finish_reason}: {cut_short}",
                )
            await self._run_batch(turn.calls, records)
            self._snapshot()
            broken = self.tools.protocol_errors()
            if broken:
                server, line = broken[0]
                msg = f"mcp server {server!r} broke the protocol: it wrote a non-JSON line on stdout: {line}"
                return _failed(ExitCode.TOOL_PROTOCOL, "tool_protocol", "tool_protocol", msg)
            if self.stop.requested:
                return self._cancelled()

    def _note_refused(self) -> None:
        """Tell the model of the calls of its last turn that were refused (after that
        turn's tool results: each call the history keeps has its result first)."""
        if self.refused_note is not None:
            self.messages.append({"role": "user", "content": self.refused_note})
            self.refused_note = None

    def _refuse_excess(self, turn: ModelTurn) -> None:
        """Keep the first ``limits.max_tool_calls_per_step`` calls of ``turn``; refuse the
        rest: never run, never announced one by one (each would cost the daemon an event,
        a record and journal writes: the flood the bound is for), left out of the history
        the model sees, and said once: a ``log`` event (``code: too_many_calls``), the
        result's ``refused_calls``, and a note to the model after the turn's results."""
        limit = self.spec.limits.max_tool_calls_per_step
        if len(turn.calls) <= limit:
            return
        asked = len(turn.calls)
        refused = turn.calls[limit:]
        turn.calls = turn.calls[:limit]
        names = sorted({c.name or "unknown" for c in refused})
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        self.refused_calls.append(
            {"step": self.steps, "asked": asked, "limit": limit, "refused": len(refused), "names": names[:10]}
        )
        why = (
            f"too_many_calls: the model asked for {asked} tool calls in one step; at most {limit} run per step "
            f"(limits.max_tool_calls_per_step): the first {limit} were taken, the other {len(refused)} "
            f"({shown}) were refused and never ran"
        )
        self.emitter.log(
            "warning",
            f"step {self.steps}: {why}",
            code="too_many_calls",
            step=self.steps,
            asked=asked,
            limit=limit,
            refused=len(refused),
        )
        self.refused_note = refused_calls_note(asked, limit, len(refused), names[:10])

    def _apply_steering(self) -> None:
        self._note_refused()  # the last turn's refused calls, before any new input
        # Not once the stop has come (the step's emit can wait on a busy daemon's pipe):
        # a steer applied then is carried by no model turn, yet was reported applied.
        if self.steering is None or self.stop.requested:
            return
        for text in self.steering.take(self.steps):
            self.messages.append({"role": "user", "content": text})

    def _take_turn(self, turn: ModelTurn, *, failed: str | None = None) -> list[ToolCallRecord]:
        """Record the turn: text, usage, one record per call, and the assistant message.

        Calls that cannot run (cut, aborted, invalid) get their final record and their
        tool message here; runnable calls get theirs from ``_run_batch``.
        """
        # A call's id names it to the daemon (its record, an approval's answer), so it is
        # unique within the run and one a person can send back. A model may repeat one (a
        # server that sends none gets ``call_auto_N`` again every step; a script may reuse
        # "x"), or choose one ``approve``/``deny`` refuse (blank, too long): such an id is
        # renamed here, before the history the model sees holds it.
        self._refuse_excess(turn)
        used = {r.id for r in self.records}
        for c in turn.calls:
            c.id = _call_id(c.id, used, self.id_suffixes)
            used.add(c.id)
        if turn.usage is not None:
            self.usage_known = True
            for k in ("prompt_tokens", "completion_tokens"):
                self.usage[k] += turn.usage.get(k, 0)
        if turn.text:
            self.progress_parts.append(turn.text)
            self.emitter.emit(EventKind.ASSISTANT_TEXT, step=self.steps, text=turn.text, complete=turn.whole)
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    # History must stay valid for the next request: a call that never ran
                    # shows empty arguments; its record keeps the text as streamed.
                    "function": {
                        "name": c.name or "unknown",
                        "arguments": c.arguments if c.parsed is not None else "{}",
                    },
                }
                for c in turn.calls
            ]
        if turn.text or turn.calls:
            self.messages.append(message)
        records = []
        results: list[tuple[str, str]] = []
        for c in turn.calls:
            policy = self.tools.policy(c.name) if c.name else None
            rec = ToolCallRecord(
                id=c.id, name=c.name, arguments=c.arguments, step=self.steps, on_stop=str(policy) if policy else None
            )
            self.records.append(rec)
            records.append(rec)
            problem = failed or c.problem
            if problem is not None:
                invalid = problem.startswith(("invalid_arguments", "invalid_call"))
                rec.state = ToolCallState.FAILED if invalid else ToolCallState.NOT_STARTED
                rec.reason = problem
                rec.finished_at = time.time()
                results.append((c.id, f"not executed: {problem}"))
            # Announced (or final) before any call of the turn runs.
            self._emit_record(rec)
        for cid, text in results:
            self.messages.append({"role": "tool", "tool_call_id": cid, "content": text})
        return records

    async def _run_batch(self, calls: list[DraftCall], records: list[ToolCallRecord]) -> None:
        for call, rec in zip(calls, records, strict=True):
            if rec.reason is not None:
                continue  # already final (invalid); its tool message is in the history
            text = self._run_one_prepare(call, rec)
            if (
                text is None
                and self.approvals is not None
                and self.approvals.needs_approval(call.name, call.parsed or {})
            ):
                text = await self._await_approval(call, rec, self.approvals)
            if text is None:
                text = await self._run_one(call, rec)
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})

    def _run_one_prepare(self, call: DraftCall, rec: ToolCallRecord) -> str | None:
        if self.stop.requested:
            rec.state, rec.reason, rec.finished_at = ToolCallState.NOT_STARTED, REASON_STOPPED_BEFORE_START, time.time()
            rec.stop_effect = str(StopEffect.STOPPED_BEFORE_START)
            self._emit_record(rec)
            return f"not executed: {REASON_STOPPED_BEFORE_START}"
        if not self.tools.has(call.name):
            known = ", ".join(self.tools.names()) or "none"
            rec.state, rec.reason, rec.finished_at = ToolCallState.FAILED, "unknown_tool", time.time()
            rec.error = f"unknown tool {call.name!r} (available: {known})"
            self._emit_record(rec)
            return f"error: {rec.error}"
        return None

    async def _await_approval(self, call: DraftCall, rec: ToolCallRecord, gate: ApprovalGate) -> str | None:
        """Wait for a person's answer. None: approved, run it; else the call's history text."""
        if len(rec.arguments) > MAX_APPROVAL_ARGUMENTS_CHARS:
            # A person would be shown these cut (the event line's limit): never asked, never run.
            rec.state, rec.finished_at = ToolCallState.FAILED, time.time()
            rec.reason = (
                f"invalid_arguments: {len(rec.arguments)} characters, too long to be shown whole to the "
                f"person who must approve this call (at most {MAX_APPROVAL_ARGUMENTS_CHARS})"
            )
            self._emit_record(rec)
            return f"not executed: {rec.reason}"
        timeout = gate.spec.timeout_s
        rec.approval, rec.approval_deadline = str(Approval.PENDING), time.time() + timeout
        self._emit_record(rec)
        self.emitter.emit(
            EventKind.APPROVAL_REQUESTED,
            call_id=rec.id,
            name=rec.name,
            arguments=rec.arguments,
            step=rec.step,
            timeout_s=timeout,
            deadline=rec.approval_deadline,
        )
        phase, self.stop.phase = self.stop.phase, "approval"
        try:
            answer = await gate.wait(call.id, self.stop)
        finally:
            self.stop.phase = phase
        rec.approval_deadline = None
        rec.approval_reason = answer.reason
        if answer.decision == "approved":
            rec.approval = str(Approval.APPROVED)
            self.emitter.emit(EventKind.APPROVAL_ANSWERED, call_id=rec.id, decision="approved", reason=answer.reason)
            return None
        rec.state, rec.finished_at = ToolCallState.REJECTED, time.time()
        if answer.decision == "denied":
            rec.approval = str(Approval.DENIED)
            rec.reason = f"denied: {HISTORY_DENIED}" + (f": {answer.reason}" if answer.reason else "")
        else:
            rec.approval = str(Approval.REJECTED)
            rec.reason = f"stopped_while_awaiting_approval: the run was stopped ({answer.reason}) while this call awaited approval; it never ran"
            rec.stop_requested_at, rec.stop_effect = self.stop.stopped_wall, str(StopEffect.REJECTED_AWAITING_APPROVAL)
            rec.stop_to_end_s = 0.0
        self.emitter.emit(EventKind.APPROVAL_ANSWERED, call_id=rec.id, decision=rec.approval, reason=answer.reason)
        self._emit_record(rec)
        return tool_result_text(rec, stop_reason=self.stop.reason)

    async def _run_one(self, call: DraftCall, rec: ToolCallRecord) -> str:
        assert call.parsed is not None
        rec.state, rec.started_at = ToolCallState.RUNNING, time.time()
        self._emit_record(rec)
        started = trio.current_time()
        interrupt = self.stop.tool_interrupt()

        def note_the_stop() -> None:
            # The record shows at once that a stop reached this call (and its policy says
            # what happens now: a dashboard can show "tool finishing").
            rec.stop_requested_at = self.stop.stopped_wall
            self._emit_record(rec)

        def output_so_far(text: str, truncated: bool) -> None:
            # Past the stop, the record keeps what the call has written: if the grace runs
            # out and the runner is killed, that much of its output is not lost.
            rec.output, rec.output_truncated = text, truncated
            self._emit_record(rec)

        def handed_over() -> None:
            # An MCP call's request is with its server's transport: a stop from now on
            # meets a sent call (its policy), not an unsent one (``stopped_before_start``).
            rec.sent_at = time.time()
            self._emit_record(rec)

        self.stop.running_tool = {"id": rec.id, "name": rec.name, "on_stop": rec.on_stop}
        self.stop.on_stop_during_tool = note_the_stop
        try:
            outcome = await self.tools.execute(call.name, call.parsed, interrupt, self.stop, output_so_far, handed_over)
        finally:
            self.stop.tool_done()
        if outcome.background_id is not None:
            self.background_calls[outcome.background_id] = rec
        rec.state, rec.output, rec.output_truncated = outcome.state, outcome.output, outcome.truncated
        rec.error, rec.reason, rec.finished_at = outcome.error, outcome.reason, time.time()
        stop_at = self.stop.stopped_at
        if rec.state == ToolCallState.NOT_STARTED:  # the stop came as it was about to start
            rec.started_at, rec.stop_effect = None, str(StopEffect.STOPPED_BEFORE_START)
        elif outcome.finished_before_stop:
            # Done before any stop (a command whose shell had exited): a stop met only its
            # clean-up, which is not the call's outcome.
            rec.stop_requested_at = None
        elif stop_at is not None and stop_at >= started:
            # The stop came while this call ran: say what it did, and when the call ended.
            rec.stop_requested_at = self.stop.stopped_wall
            rec.stop_to_end_s = round(max(0.0, trio.current_time() - stop_at), 4)
            if outcome.stop_effect is not None:
                rec.stop_effect = str(outcome.stop_effect)
            elif rec.state == ToolCallState.FAILED and self.tools.server_of(call.name) in self.stop.closed_servers:
                # Its server was closed under it as the grace ran out (a session's browser,
                # to keep its login): it was ended, not let finish.
                rec.stop_effect = str(StopEffect.INTERRUPTED)
                rec.reason = (
                    "interrupted: its server was closed before the stop's grace ran out; "
                    f"it ended {rec.stop_to_end_s:.3g} s after the stop"
                )
            elif rec.state in (ToolCallState.SUCCEEDED, ToolCallState.FAILED):
                rec.stop_effect = str(StopEffect.FINISHED_AFTER_STOP)
                if rec.reason is None:
                    why = "it was allowed to finish" if rec.on_stop == StopPolicy.FINISH else "it answered the stop"
                    rec.reason = f"finished_after_stop: {why}; it ended {rec.stop_to_end_s:.3g} s after the stop"
        self._emit_record(rec)
        return tool_result_text(rec, stop_reason=self.stop.reason)

    def settle_background(self, ends: Iterable[BackgroundEnd]) -> None:
        """The run's background commands are ended (its end, ``BackgroundCommands.aclose``):
        each call whose command was still running then, or when the stop came, says so in
        its record (``background.settle_call``), sent again; the next turn's history then
        tells the model its command no longer runs."""
        for end in ends:
            rec = self.background_calls.get(end.id)
            if rec is not None and settle_call(rec, end, self.stop.stopped_at, self.stop.stopped_wall):
                self._emit_record(rec)

    def result(self, outcome: RunOutcome, **extra: Any) -> dict[str, Any]:
        # Only an internal error can leave a call running or unstarted without a reason:
        # say so in its record and give it a tool message, so the history stays whole.
        for rec in self.records:
            if rec.state == ToolCallState.RUNNING:
                rec.state, rec.reason = ToolCallState.UNKNOWN, "runner_failed: the runner failed during this call"
            elif rec.state == ToolCallState.NOT_STARTED and rec.reason is None:
                rec.reason = "runner_failed: the run ended before this call started"
            else:
                continue
            rec.finished_at = time.time()
            self._emit_record(rec)
        answered = {m.get("tool_call_id") for m in self.messages if m.get("role") == "tool"}
        for rec in self.records:
            if rec.id not in answered:
                self.messages.append(
                    {"role": "tool", "tool_call_id": rec.id, "content": tool_result_text(rec, stop_reason=None)}
                )
        self._note_refused()
        return {
            "status": str(outcome.status),
            "reason": outcome.reason,
            "final_text": outcome.final_text,
            "progress": self.progress,
            "unfinished_text": self.unfinished_text,
            "steps": self.steps,
            "tool_calls": [r.to_dict() for r in self.records],
            "usage": dict(self.usage) if self.usage_known else None,
            "error": outcome.error,
            "messages": self.messages,
            **({"refused_calls": self.refused_calls} if self.refused_calls else {}),
            **extra,
        }


# A snapshot's records keep each output short (the full output went out in the call's own
# tool_call event and is in the result): the partial result's records are these.
SNAPSHOT_OUTPUT_CHARS = 2000


def _snapshot_record(rec: ToolCallRecord) -> dict[str, Any]:
    d = rec.to_dict()
    out = d.get("output")
    if isinstance(out, str) and len(out) > SNAPSHOT_OUTPUT_CHARS:
        d["output"] = out[:SNAPSHOT_OUTPUT_CHARS]
        d["output_truncated"] = True
    return d


# The longest call id a person can answer: the daemon's protocol refuses longer ids (and
# blank ones) as bad arguments (``supervisor.protocol.MAX_ID_CHARS``).
MAX_CALL_ID_CHARS: Final = 256
# What a call id the runner keeps may hold: printable ASCII without blanks, so it can be
# typed (or pasted) back to ``agentd approve`` as it is shown.
_SAFE_ID: Final = re.compile(r"[!-~]+")


def _call_id(raw: str, used: set[str], suffixes: dict[str, int] | None = None) -> str:
    """The id a call goes by in this run: the model's own if it is safe and new, else one
    made of its safe characters (``call`` if none), cut to leave room for a suffix, and
    made unique among ``used``. ``suffixes``: where each base's search for a free suffix
    goes on from (kept by the caller across calls)."""
    if raw not in used and len(raw) <= MAX_CALL_ID_CHARS and _SAFE_ID.fullmatch(raw):
        return raw
    base = "".join(_SAFE_ID.findall(raw))[: MAX_CALL_ID_CHARS - 16] or "call"
    return base if base not in used else _fresh_id(base, used, {} if suffixes is None else suffixes)


def _fresh_id(base: str, used: set[str], suffixes: dict[str, int]) -> str:
    """``base`` made unique among ``used``: ``base_2``, ``base_3``, ... The search goes on
    from where the last one for ``base`` ended (``suffixes``): ids are never given back,
    so every suffix below it was found taken. (From 2 each time, N calls of one id cost
    N^2/2 look-ups.)"""
    n = suffixes.get(base, 2)
    while f"{base}_{n}" in used:
        n += 1
    suffixes[base] = n + 1
    return f"{base}_{n}"
