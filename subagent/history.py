"""What the model is told about tool calls and earlier turns: the honest history.

One module for both sides: the runner's loop tells the model what each call of this turn
really did (``tool_result_text``), and the daemon rebuilds a session's earlier turns from
its journal (``turn_messages``) for the next turn. Rules (seed 004, DESIGN "Conversations"):
every call in the history has exactly one result, and the result says what happened
(ran, interrupted with the output known, finished after the stop, never ran, denied); a
call whose arguments were cut mid-stream (its turn never finished) is not a call at all:
only the turn's text stays; a turn that did not complete ends with one short note. In
such a turn, text the model never finished (its stream stopped, cut or failed:
``assistant_text`` with ``complete: false``; or still streaming when its runner was
killed, so only the turn's partial result holds it: ``unfinished_text``) is the
assistant's words all the same, marked as cut short (``HISTORY_CUT_SHORT``), and told
once. (A completed turn's cut stream, asked again, is shown as its model saw it.) The words are stable on
purpose: models and tests read them.
Pure and stdlib only (the daemon imports it): records are ``ToolCallRecord`` dicts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from subagent.events import CUT_MARK, Approval, StopEffect, ToolCallState
from subagent.stopmark import SIGNALLED

__all__ = [
    "HISTORY_INTERRUPTED",
    "HISTORY_INTERRUPTED_SIGNALLED",
    "HISTORY_FINISHED_AFTER_STOP",
    "HISTORY_FINISHED_BEFORE_STOP",
    "HISTORY_BACKGROUND_ENDED_BY_STOP",
    "HISTORY_BACKGROUND_ENDED_WITH_RUN",
    "HISTORY_DENIED",
    "HISTORY_REJECTED",
    "HISTORY_AWAITING_APPROVAL",
    "HISTORY_NOT_STARTED_YET",
    "HISTORY_CUT_SHORT",
    "LOST_BEFORE_START",
    "STOP_NOTES",
    "tool_result_text",
    "is_cut",
    "replay_arguments",
    "stop_note",
    "refused_calls_note",
    "turn_messages",
    "unfinished_text",
]

# What the model is told, per stop effect, ahead of what is known.
HISTORY_INTERRUPTED: Final = "interrupted by the stop; output known before the interruption:"
# The same for a run that stopped on a signal no stop of the daemon's sent (``signalled``).
HISTORY_INTERRUPTED_SIGNALLED: Final = (
    "interrupted as the run stopped on a SIGTERM not sent by agentd's stop; output known before the interruption:"
)
HISTORY_FINISHED_AFTER_STOP: Final = (
    "[finished after the stop: this call was allowed to finish; the result above is real]"
)
HISTORY_FINISHED_BEFORE_STOP: Final = "[this call finished before the run was stopped]"
# A call that started a background command still running when the stop came (``stop_effect``
# ``background_ended``), or when its run ended without one: it did start it, and it no
# longer runs.
HISTORY_BACKGROUND_ENDED_BY_STOP: Final = (
    "[this call finished before the run was stopped, but the background command it started was "
    "still running then: the stop ended it; it no longer runs]"
)
HISTORY_BACKGROUND_ENDED_WITH_RUN: Final = (
    "[the background command this call started was still running when the run ended: it was ended "
    "with the run; it no longer runs]"
)
HISTORY_DENIED: Final = "denied by the user"
HISTORY_REJECTED: Final = "not executed: stopped while awaiting approval"
# A call of a live turn that has not run yet (no reason: nothing final happened to it). It
# may still run, so "not executed" would be a lie; a turn's end gives each such call its
# final reason (the runner's result, or the journal's settling of a lost run).
HISTORY_AWAITING_APPROVAL: Final = "awaiting approval: this call has not run yet"
HISTORY_NOT_STARTED_YET: Final = "not started yet: this call has not run yet"
# After model text the turn ended before the model finished (stopped, cut, or its runner
# killed while it streamed): what it had said, not a whole answer.
HISTORY_CUT_SHORT: Final = "[cut short: the turn ended before the model finished this text]"
# The states whose partial result may hold text no ``assistant_text`` carried.
_ENDED_EARLY: Final = frozenset({"cancelled", "failed", "lost"})

# Reasons a call was never a whole call: its turn's stream was cut, aborted or failed
# before the turn finished (``subagent.model.provider``). Such a call is never replayed as a call.
_CUT_PREFIXES: Final = ("arguments_incomplete:", "turn_incomplete:", "model_error:")
_ABORTED_TURN: Final = "stopped_before_start: the stop aborted the model's turn"
# (``subagent.tools.background.BACKGROUND_ENDED_WITH_RUN``: this module stays stdlib-only.)
_BACKGROUND_ENDED_WITH_RUN: Final = "background_ended_with_run:"

# The note after a turn that did not complete, by its outcome (and a stop's reason).
STOP_NOTES: Final[Mapping[str, str]] = {
    "user": "[The user stopped this turn before it finished.]",
    "timeout": "[This turn was stopped before it finished: it ran out of time.]",
    "approval_timeout": "[This turn was stopped before it finished: a tool call waited too long for approval.]",
    "shutdown": "[This turn was stopped before it finished: agentd was shutting down.]",
    "disk_full": "[This turn was stopped before it finished: the files it wrote filled the disk, and were removed.]",
}
_STOPPED_NOTE: Final = "[This turn was stopped before it finished ({reason}).]"
_FAILED_NOTE: Final = "[This turn failed before it finished ({reason}).]"
_LOST_NOTE: Final = (
    "[This turn was lost: agentd restarted and its runner was gone; what it did after the last record is unknown.]"
)
# The reason of a turn a restarted daemon found with no process record: its runner never
# had its spec (it gets it once that record is journaled), so nothing of the turn ran.
LOST_BEFORE_START: Final = "the daemon restarted before the run's process started"
_LOST_BEFORE_START_NOTE: Final = (
    "[This turn never started: agentd restarted before its runner started; nothing of it ran.]"
)


def _get(rec: Any, key: str) -> Any:
    return rec.get(key) if isinstance(rec, Mapping) else getattr(rec, key, None)


def tool_result_text(rec: Any, *, stop_reason: str | None) -> str:
    """What the model is told about one call (a ``ToolCallRecord`` or its dict): the truth,
    including a stop. ``stop_reason``: the run's stop reason, if it was stopped."""
    state = str(_get(rec, "state") or "")
    body = _get(rec, "output")
    body = body if isinstance(body, str) else ""
    reason, error = _get(rec, "reason"), _get(rec, "error")
    why = reason or error or "no reason was recorded"  # never a bare "None" to the model
    effect = _get(rec, "stop_effect")
    after_stop = effect == StopEffect.FINISHED_AFTER_STOP
    if state == ToolCallState.SUCCEEDED:
        if effect == StopEffect.BACKGROUND_ENDED:
            return f"{body}\n{HISTORY_BACKGROUND_ENDED_BY_STOP} ({why})"
        if isinstance(reason, str) and reason.startswith(_BACKGROUND_ENDED_WITH_RUN):
            return f"{body}\n{HISTORY_BACKGROUND_ENDED_WITH_RUN} ({why})"
        if after_stop:
            return f"{body}\n{HISTORY_FINISHED_AFTER_STOP}"
        note = "" if stop_reason is None else f"\n{HISTORY_FINISHED_BEFORE_STOP}"
        return f"{body}{note}"
    if state == ToolCallState.FAILED:
        note = f"\n{HISTORY_FINISHED_AFTER_STOP}" if after_stop else ""
        return f"error: {error or why}\n{body}".rstrip() + note
    if state == ToolCallState.CANCELLED:
        if effect in (StopEffect.INTERRUPTED, StopEffect.ABANDONED, StopEffect.CANCEL_UNANSWERED):
            if stop_reason == SIGNALLED:
                if body:
                    return f"{HISTORY_INTERRUPTED_SIGNALLED}\n{body}"
                return f"interrupted as the run stopped on a SIGTERM not sent by agentd's stop; no output was known ({why})"
            if body:
                return f"{HISTORY_INTERRUPTED}\n{body}"
            return f"interrupted by the stop; no output was known ({why})"
        known = f"\noutput before the interruption:\n{body}" if body else ""
        return f"interrupted: {why}{known}"
    if state == ToolCallState.REJECTED:
        if _get(rec, "approval") == Approval.DENIED:
            denial = _get(rec, "approval_reason")
            return f"{HISTORY_DENIED}: {denial}" if denial else HISTORY_DENIED
        return HISTORY_REJECTED
    if state == ToolCallState.NOT_STARTED:
        if reason:
            return f"not executed: {reason}"
        return HISTORY_AWAITING_APPROVAL if _get(rec, "approval") == Approval.PENDING else HISTORY_NOT_STARTED_YET
    if state == ToolCallState.RUNNING:
        return "outcome not known yet: the call is still running"
    return f"outcome unknown: {why}" + (f"\n{body}" if body else "")


def is_cut(rec: Mapping[str, Any]) -> bool:
    """Was this never a whole call (its turn's stream was cut, aborted or failed)?"""
    if rec.get("state") != ToolCallState.NOT_STARTED:
        return False
    reason = rec.get("reason")
    return isinstance(reason, str) and (reason.startswith(_CUT_PREFIXES) or reason == _ABORTED_TURN)


def replay_arguments(text: Any) -> str:
    """A call's arguments as history may carry them: the text if it is a JSON object, else
    ``{}`` (a call that never ran for bad arguments keeps its text in its record only).
    Nesting too deep for the decoder is bad arguments too: the model's text (a RecursionError
    here broke every later turn of its session, and its ``history``)."""
    if isinstance(text, str):
        try:
            if isinstance(json.loads(text), dict):
                return text
        except (ValueError, RecursionError):
            pass
    return "{}"


def _cut_copy(text: str, of: str) -> bool:
    """Is ``text`` a copy of ``of`` that the runner cut to bound a line or its result?"""
    return text.endswith(CUT_MARK) and of.startswith(text[: -len(CUT_MARK)]) and len(of) > len(text) - len(CUT_MARK)


def refused_calls_note(asked: int, limit: int, refused: int, names: Iterable[str]) -> str:
    """What the model is told, after a turn's tool results, of the calls of that turn
    beyond ``limits.max_tool_calls_per_step``: refused, never run, not shown."""
    listed = list(names)
    shown = f" ({', '.join(listed)})" if listed else ""
    return (
        f"[agentd: your last message asked for {asked} tool calls; at most {limit} run in one step. "
        f"Only the first {limit} were taken (their results are above); the other {refused}{shown} "
        f"were refused, never ran, and are not shown. Ask again, at most {limit} at a time, "
        "for those you still need.]"
    )


def stop_note(state: str, reason: str | None) -> str | None:
    """The short note after a turn that did not complete; None after a completed (or live) one."""
    if state == "cancelled":
        return STOP_NOTES.get(reason or "user", _STOPPED_NOTE.format(reason=reason))
    if state == "failed":
        return _FAILED_NOTE.format(reason=reason or "an error")
    if state == "lost":
        return _LOST_BEFORE_START_NOTE if reason == LOST_BEFORE_START else _LOST_NOTE
    return None


def unfinished_text(result: Any) -> tuple[int, str] | None:
    """The model text a turn's result ends with that is not a whole turn, as ``(step,
    text)``, or None: the progress from ``unfinished_text.at`` on (``events.STEP_SNAPSHOT``).
    A runner killed while its model streamed leaves it only there (its partial result):
    no ``assistant_text`` was sent for it."""
    if not isinstance(result, Mapping):
        return None
    where, progress = result.get("unfinished_text"), result.get("progress")
    if not isinstance(where, Mapping) or not isinstance(progress, str):
        return None
    step, at = where.get("step"), where.get("at")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(at, int) or isinstance(at, bool):
        return None
    if not 0 <= at < len(progress):
        return None
    return step, progress[at:]


def turn_messages(
    task: str,
    records: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    *,
    state: str,
    reason: str | None = None,
    final_text: str | None = None,
    unfinished: tuple[int, str] | None = None,
    refused: Iterable[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """One turn of a session as OpenAI-shaped messages, from what the journal recorded.

    Args:
        task: the turn's task (its first user message).
        records: its tool-call records (dicts), in order.
        events: its ``assistant_text`` and ``steering`` events (``{"kind", "data"}``), in order.
        state: the run's state (a terminal one gets its note; a live one is shown as far as it went).
        reason: the stop's reason (cancelled) or the failure's (failed).
        final_text: the result's answer, used when no ``assistant_text`` event carries it.
        unfinished: the text the result ends with that is not a whole turn
            (``unfinished_text``), used for a turn that ended early when no
            ``assistant_text`` event of its step carries it (its runner was killed while
            the model streamed): shown cut short.
        refused: the result's ``refused_calls`` (``{step, asked, limit, refused, names}``):
            the calls of a step beyond its bound, told after that step's tool results.
    """
    texts: dict[int, str] = {}
    cut_short: set[int] = set()  # steps whose text the model never finished
    steering: dict[int, list[str]] = {}
    for ev in events:
        data = ev.get("data") or {}
        step = data.get("step")
        if not isinstance(step, int):
            continue
        if ev.get("kind") == "assistant_text" and isinstance(data.get("text"), str) and data["text"]:
            texts[step] = texts.get(step, "") + data["text"]
            if data.get("complete") is False and state in _ENDED_EARLY:
                cut_short.add(step)
        elif ev.get("kind") == "steering" and data.get("state") == "applied" and isinstance(data.get("text"), str):
            steering.setdefault(step, []).append(data["text"])
    if state in _ENDED_EARLY and unfinished is not None and unfinished[1] and unfinished[0] not in texts:
        # Said while it streamed, its runner killed before the step ended: the partial
        # result alone holds it. (Carried by an event already, it is not told twice.)
        texts[unfinished[0]] = unfinished[1]
        cut_short.add(unfinished[0])
    notes: dict[int, str] = {}
    for r in refused:
        try:
            names = [str(n) for n in r.get("names") or []]
            notes[int(r["step"])] = refused_calls_note(int(r["asked"]), int(r["limit"]), int(r["refused"]), names)
        except (KeyError, TypeError, ValueError):
            continue  # not one the runner wrote: nothing to tell
    calls: dict[int, list[Mapping[str, Any]]] = {}
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and isinstance(rec.get("id"), str) and not is_cut(rec):
            calls.setdefault(step, []).append(rec)
    # (A turn that failed on a signal no stop of the daemon's sent stopped all the same.)
    stop_reason = reason if state == "cancelled" or reason == SIGNALLED else None
    out: list[dict[str, Any]] = [{"role": "user", "content": task}]
    last_text: dict[str, Any] | None = None  # the last message, if it is text alone
    for step in sorted(set(texts) | set(steering) | set(calls)):
        out.extend({"role": "user", "content": t} for t in steering.get(step, []))
        text, step_calls = texts.get(step), calls.get(step, [])
        if not text and not step_calls:
            continue
        if text and step in cut_short:
            text = f"{text}\n{HISTORY_CUT_SHORT}"
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if step_calls:
            message["tool_calls"] = [
                {
                    "id": rec["id"],
                    "type": "function",
                    "function": {
                        "name": rec.get("name") or "unknown",
                        "arguments": replay_arguments(rec.get("arguments")),
                    },
                }
                for rec in step_calls
            ]
        out.append(message)
        last_text = message if not step_calls else None
        out.extend(
            {"role": "tool", "tool_call_id": rec["id"], "content": tool_result_text(rec, stop_reason=stop_reason)}
            for rec in step_calls
        )
        if step_calls and step in notes:
            out.append({"role": "user", "content": notes[step]})
    if state == "completed" and final_text:
        # The answer is the last step's text, also in its event: shown once, whole. Either
        # copy may have been cut (a large history cut the result's; a huge text its event's).
        shown = last_text["content"] if last_text is not None else None
        if last_text is not None and isinstance(shown, str) and _cut_copy(shown, final_text):
            last_text["content"] = final_text
        elif not (isinstance(shown, str) and (shown == final_text or _cut_copy(final_text, shown))):
            out.append({"role": "assistant", "content": final_text})
    note = stop_note(state, reason)
    if note is not None:
        out.append({"role": "system", "content": note})
    return out
