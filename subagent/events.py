"""The wire format between the daemon and a runner child: one module, both sides import it.

A runner talks to its parent through three pipes:

- stdin: the run spec, one JSON object (see ``subagent.spec``), terminated by a newline
  or by EOF.
- stderr: events, one JSON object per line, flushed per event (``encode_event``).
- stdout: the final result, one JSON object (``encode_result``), written once at the end.

Invariants: this module is a stdlib-only leaf (the daemon imports it without paying for
``openai`` or ``mcp``); decoding never raises on bad input, it returns a ``BadLine``
value; every record here is plain JSON data so it can go to the journal unchanged.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from subagent._wirejson import MAX_WIRE_DEPTH, finite_timestamp, result_fields, wire_loads

__all__ = [
    "WIRE_VERSION",
    "EventKind",
    "ToolCallState",
    "RunStatus",
    "ToolCallRecord",
    "Event",
    "BadLine",
    "ExitCode",
    "StopPolicy",
    "StopEffect",
    "Approval",
    "MAX_EVENT_LINE_BYTES",
    "MAX_WIRE_DEPTH",
    "CUT_MARK",
    "TS_REPLACED",
    "encode_event",
    "decode_event_line",
    "encode_result",
    "decode_result",
    "make_event",
    "SnapshotDeltas",
    "fold_snapshot",
    "STREAM_SNAPSHOT_EVERY_S",
    "STREAM_SNAPSHOT_MAX_CHARS",
]

WIRE_VERSION: Final = 1

# A longer stderr line is not an event: the reader cuts it and reports a BadLine.
MAX_EVENT_LINE_BYTES: Final = 1024 * 1024
# What a string the runner had to cut to bound a line or its result ends with (the part
# before it is the string's start): a reader can tell a cut copy from another text.
CUT_MARK: Final = "...[cut]"
# Set (true) in an event's data by the reader when the runner's ``ts`` was not a finite
# number and the daemon's time took its place.
TS_REPLACED: Final = "ts_replaced"
# While the model streams, the runner sends the text streamed so far as a ``step_snapshot``
# delta at most this often (seconds), the first one this long after the request began: a
# turn that streams faster sends none (no extra event on a fast step), a slow one shows its
# text within this long, and a runner killed mid-stream loses at most this much of it.
STREAM_SNAPSHOT_EVERY_S: Final = 0.25
# ... or sooner, once this many characters wait (one event stays far below the line limit).
STREAM_SNAPSHOT_MAX_CHARS: Final = 32 * 1024


class EventKind(enum.StrEnum):
    """Kinds of event a runner writes on stderr. Fields listed are beyond ``event``/``ts``."""

    RUNNER_STARTED = "runner_started"  # pid, pgid, run_id, provider
    STEP_STARTED = "step_started"  # step
    ASSISTANT_TEXT = "assistant_text"  # step, text (the model's text of this step, complete)
    # record: ToolCallRecord as dict; sent on every state change (and an MCP call's again,
    # still running, with sent_at once its request is handed to the server's transport)
    TOOL_CALL = "tool_call"
    # pgid, pid, kind ("mcp_server"|"command"), name, alive: bool, on_stop: a command's
    # stop policy ("interrupt": the daemon's path A may SIGTERM the group at cancel time,
    # "finish": never before the grace); absent for MCP servers (the runner stops their calls)
    PROCESS_GROUP = "process_group"
    # A delta since the runner's previous snapshot (``SnapshotDeltas``): step, snapshot_n,
    # progress_at, progress_added, tool_calls_changed, _id, and (newer runners) where the
    # model's text is not whole: unfinished_text ({step, at, streaming}, absent when the
    # progress ends whole: the progress from ``at`` on is step ``step``'s model text as
    # streamed so far). ``streaming: true``: sent while the model streams, at most every
    # ``STREAM_SNAPSHOT_EVERY_S`` (a run that ends with it, its runner killed mid-stream,
    # ends with that text cut short); ``false``: after a turn that a stop, a cut stream or
    # a model error ended, its text cut short. ``fold_snapshot`` makes the whole
    # snapshot (step, progress, tool_calls, _id, snapshot_n, unfinished_text where set)
    # from them. A runner of an older version sends the whole snapshot (step, progress,
    # tool_calls, _id): also accepted.
    STEP_SNAPSHOT = "step_snapshot"
    # reason ("signal"|"timeout"|"approval_timeout"|"signalled"), during
    # ("model"|"tool"|"setup"|"idle"|"approval"); during a tool also tool: {id, name,
    # on_stop} of the running call. "signal": a stop the daemon sent (its SIGTERM, its
    # stop marker read: ``subagent.stopmark``), whose reason is in stop_reason ("user",
    # "timeout", "shutdown", ...); "signalled": a SIGTERM or SIGINT no stop of the
    # daemon's sent (a run's own tool may signal its runner): the run stops, but it fails
    # (result reason "signalled"), it is not cancelled
    STOP_REQUESTED = "stop_requested"
    STEERING = "steering"  # state ("queued"|"applied"|"unapplied"), text, step
    # A call that needs a person's OK before it runs: call_id, name, arguments (as
    # streamed), step, timeout_s, deadline (wall clock: the daemon stops the run with
    # reason "approval_timeout" then)
    APPROVAL_REQUESTED = "approval_requested"
    # call_id, decision ("approved"|"denied"|"rejected": a stop ended the wait), reason
    APPROVAL_ANSWERED = "approval_answered"
    LOG = "log"  # level, message


class ToolCallState(enum.StrEnum):
    """The lifecycle of one tool call, kept separate from the run's state."""

    NOT_STARTED = "not_started"  # never executed: the stop came first, or its arguments were cut
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # cancelled while running: output so far is known
    UNKNOWN = "unknown"  # outcome unknown: the tool was running when we lost it
    # never ran because it was not approved: denied by a person, or a stop (a cancel, the
    # approval's timeout) ended its wait for approval; no output
    REJECTED = "rejected"


TERMINAL_TOOL_STATES: Final = frozenset(
    {
        ToolCallState.NOT_STARTED,
        ToolCallState.SUCCEEDED,
        ToolCallState.FAILED,
        ToolCallState.CANCELLED,
        ToolCallState.UNKNOWN,
        ToolCallState.REJECTED,
    }
)


class RunStatus(enum.StrEnum):
    """The status a runner reports in its final result."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ExitCode(enum.IntEnum):
    """Runner exit codes. The daemon maps them to run outcomes; each error class has its own."""

    COMPLETED = 0
    FAILED = 1  # the run failed (model error, max steps without an answer, ...)
    BAD_SPEC = 2  # the spec on stdin was not a valid run spec: nothing ran
    CANCELLED = 3  # stopped by SIGTERM or by its deadline (result.reason says which)
    TOOL_SETUP = 4  # a tool could not be set up (an MCP server failed to start, unknown tool)
    MODEL_ERROR = 5  # the model provider failed (connection, auth, bad response)
    TOOL_PROTOCOL = 6  # a tool broke its protocol (e.g. non-JSON on an MCP server's stdout)
    # stopped by a SIGTERM/SIGINT that no stop of the daemon's sent (result reason "signalled")
    SIGNALLED = 7
    INTERNAL = 70  # a bug in the runner (EX_SOFTWARE)


class StopPolicy(enum.StrEnum):
    """What a stop does to a tool call that is running (DESIGN "Cancellation", seed 004)."""

    INTERRUPT = "interrupt"  # a command: SIGTERM to its group at once, SIGKILL after a short grace
    ABANDON = "abandon"  # a read-only MCP call: abandoned at once, notifications/cancelled sent
    CANCEL = "cancel"  # a cancellable MCP call: notifications/cancelled, then a short bounded wait
    FINISH = "finish"  # a non-interruptible write: allowed to finish within the run's grace


class Approval(enum.StrEnum):
    """Where a call that needs approval stands (``ToolCallRecord.approval``)."""

    PENDING = "pending"  # waiting for approve/deny
    APPROVED = "approved"  # a person approved it: it ran (or runs)
    DENIED = "denied"  # a person denied it: rejected, the model is told why
    REJECTED = "rejected"  # a stop ended the wait: rejected, never ran


class StopEffect(enum.StrEnum):
    """What a stop did to one tool call (``ToolCallRecord.stop_effect``)."""

    INTERRUPTED = "interrupted"  # a command's group was ended by the stop; output so far is known
    ABANDONED = "abandoned"  # a read-only MCP call was abandoned (notifications/cancelled sent)
    CANCEL_UNANSWERED = "cancel_unanswered"  # notifications/cancelled sent, no answer in the wait
    FINISHED_AFTER_STOP = "finished_after_stop"  # allowed to finish (or answered the cancel): real result
    STOPPED_BEFORE_START = "stopped_before_start"  # announced, never started
    GRACE_RAN_OUT = "grace_ran_out"  # still running when the runner was killed at the grace
    # Still running when the runner died during the stop, inside its grace and not by the
    # daemon's hand (its own tool killed it, the OOM killer, a crash): outcome unknown.
    RUNNER_DIED = "runner_died"
    REJECTED_AWAITING_APPROVAL = "rejected_awaiting_approval"  # waited for approval; never ran
    # A call that started a background command (it succeeded: the command started) whose
    # command was still running when the stop came: the stop ended it (the call's record,
    # updated at the run's end, says so; its ``stop_to_end_s``: until the command ended).
    BACKGROUND_ENDED = "background_ended"


@dataclass(slots=True)
class ToolCallRecord:
    """What is known about one tool call the model made.

    ``arguments`` is the raw argument text as the model streamed it, complete or not;
    a call whose arguments were cut is ``NOT_STARTED`` with ``reason`` saying so and is
    never executed. Every call of a turn is announced (``NOT_STARTED``, no reason) before
    the first one runs. ``on_stop`` is the call's ``StopPolicy``; if a stop came while it
    ran, ``stop_requested_at`` (wall clock) is set at once, and at its end ``stop_effect``
    (a ``StopEffect``) and ``stop_to_end_s`` (seconds from the stop to the call's end).
    An MCP call's ``sent_at`` (wall clock) is set once its request has been handed to
    its server's transport, and the record is sent again then (still ``RUNNING``): a
    stop before that leaves it unsent (``NOT_STARTED``, ``stopped_before_start``, no
    ``sent_at``); a stop after it gets the call's stop policy. None for other tools and
    in records of older runners. A call that needs approval carries ``approval`` (an
    ``Approval``), while pending its ``approval_deadline`` (wall clock), and once answered
    ``approval_reason`` (a denial's reason, or why the wait ended: the stop's reason, the
    daemon's own, e.g. ``user`` or ``approval_timeout``, when its stop marker gave one).
    """

    id: str
    name: str
    arguments: str
    step: int
    state: ToolCallState = ToolCallState.NOT_STARTED
    reason: str | None = None  # why not started / failed / cancelled / unknown
    output: str | None = None  # known output, bounded
    output_truncated: bool = False
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    on_stop: str | None = None
    stop_requested_at: float | None = None
    stop_effect: str | None = None
    stop_to_end_s: float | None = None
    approval: str | None = None
    approval_deadline: float | None = None
    approval_reason: str | None = None
    sent_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = str(self.state)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCallRecord:
        return cls(
            id=str(d["id"]),
            name=str(d["name"]),
            arguments=str(d.get("arguments", "")),
            step=int(d.get("step", 0)),
            state=ToolCallState(d.get("state", ToolCallState.NOT_STARTED)),
            reason=d.get("reason"),
            output=d.get("output"),
            output_truncated=bool(d.get("output_truncated", False)),
            error=d.get("error"),
            started_at=d.get("started_at"),
            finished_at=d.get("finished_at"),
            on_stop=d.get("on_stop"),
            stop_requested_at=d.get("stop_requested_at"),
            stop_effect=d.get("stop_effect"),
            stop_to_end_s=d.get("stop_to_end_s"),
            approval=d.get("approval"),
            approval_deadline=d.get("approval_deadline"),
            approval_reason=d.get("approval_reason"),
            sent_at=d.get("sent_at"),
        )


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded stderr event: its kind, its wall-clock time and its other fields."""

    kind: EventKind
    ts: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"event": str(self.kind), "ts": self.ts, **self.data}


@dataclass(frozen=True, slots=True)
class BadLine:
    """A stderr line that is not a valid event: kept as a value, never raised."""

    text: str
    problem: str


def make_event(kind: EventKind, /, **data: Any) -> Event:
    # Positional-only: process_group events carry a data field named "kind".
    return Event(kind=kind, ts=time.time(), data=data)


def encode_event(event: Event) -> bytes:
    """One event as one newline-terminated JSON line (no embedded newlines)."""
    return (json.dumps(event.to_dict(), separators=(",", ":"), default=str) + "\n").encode()


def decode_event_line(line: bytes | str) -> Event | BadLine:
    """Decode one stderr line. Garbage (a traceback, a library's print) becomes a BadLine."""
    if isinstance(line, bytes):
        text = line.decode("utf-8", errors="replace")
    else:
        text = line
    text = text.rstrip("\r\n")
    try:
        obj = wire_loads(text)
    except ValueError as exc:
        return BadLine(text=text, problem=str(exc))
    if not isinstance(obj, dict):
        return BadLine(text=text, problem=f"expected a json object, got {type(obj).__name__}")
    kind = obj.pop("event", None)
    try:
        ev_kind = EventKind(kind)
    except ValueError:
        return BadLine(text=text, problem=f"unknown event kind {kind!r}")
    ts = finite_timestamp(obj.pop("ts", None))
    if ts is None:
        # Replaced by the daemon's time, which differs at each read: flagged, so that a
        # restarted daemon's read of the events file knows it journaled it already (its
        # ``ts`` is not compared: ``supervisor.core._sources.event_key``).
        obj[TS_REPLACED] = True
    return Event(kind=ev_kind, ts=time.time() if ts is None else ts, data=obj)


def encode_result(result: dict[str, Any]) -> bytes:
    """The final result as one JSON line for stdout.

    Fields: ``v``, ``status`` (RunStatus), ``reason`` (None, "signal", "timeout", an error
    code such as "signalled"), ``stop_reason`` (with "signal": the daemon's reason for its
    stop, from the stop marker; absent otherwise), ``final_text``, ``progress`` (assistant content so far), ``steps``,
    ``tool_calls`` (record dicts), ``usage`` ({prompt_tokens, completion_tokens} where
    known), ``error`` ({code, message} or None), ``unapplied_steering`` (texts).
    """
    out = {"v": WIRE_VERSION, **result}
    return (json.dumps(out, separators=(",", ":"), default=str) + "\n").encode()


def decode_result(data: bytes | str) -> dict[str, Any] | BadLine:
    """Decode what a runner wrote on stdout: the last JSON object line wins."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            obj = wire_loads(line)
        except ValueError:  # not json, or nested too deep: not a result
            continue
        if isinstance(obj, dict) and "status" in obj:
            try:
                RunStatus(obj["status"])
            except ValueError:
                return BadLine(text=line, problem=f"unknown status {obj['status']!r}")
            return result_fields(obj)
    return BadLine(text=text[-500:], problem="no result object on stdout")


# ----------------------------------------------------------------------------- snapshots


class SnapshotDeltas:
    """The runner's side of ``step_snapshot``: each snapshot as a delta since the last one.

    A whole snapshot repeats all progress and every record so far: a run of N steps sent
    O(N^2) bytes on the pipe and into the journal. A delta carries the step, the
    snapshot's number in the run (``snapshot_n``: 1, 2, ...), the progress text added
    since the previous snapshot (``progress_added``) and where it goes (``progress_at``:
    the length of the progress the previous one left), and only the records that are new
    or changed since (``tool_calls_changed``). ``fold_snapshot`` rebuilds the whole one.
    """

    def __init__(self) -> None:
        self.n = 0
        self._progress = ""
        self._sent: dict[str, dict[str, Any]] = {}

    def next(
        self,
        *,
        step: int,
        progress: str,
        records: list[dict[str, Any]],
        unfinished: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The fields of the next snapshot event (``_id`` aside). ``unfinished``: where the
        progress ends with model text that is not a whole turn (``{step, at}``), or None.

        The text goes from where it first differs from what was sent: a whole turn's text
        that streamed already travels once (a character the stream ended on half-way, a
        surrogate cleaned differently once whole, is sent again from there, never twice)."""
        self.n += 1
        old = self._progress
        if progress.startswith(old):
            at = len(old)
        else:
            at = _common_prefix(old, progress)
        added = progress[at:]
        self._progress = progress
        changed = []
        for rec in records:
            rid = str(rec.get("id"))
            if self._sent.get(rid) != rec:
                changed.append(rec)
                self._sent[rid] = rec
        delta: dict[str, Any] = {
            "step": step,
            "snapshot_n": self.n,
            "progress_at": at,
            "progress_added": added,
            "tool_calls_changed": changed,
        }
        if unfinished is not None:
            delta["unfinished_text"] = unfinished
        return delta


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # by halves: the slices compare in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _int_field(data: Mapping[str, Any], key: str) -> int:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{key}: expected an integer >= 0, got {v!r}")
    return v


def fold_snapshot(base: dict[str, Any] | None, data: Mapping[str, Any]) -> dict[str, Any]:
    """The whole snapshot after ``data`` (a ``step_snapshot`` event's fields), given the
    whole one before it (``base``, None for none).

    A whole snapshot (a runner of an older version: no ``progress_at``) replaces ``base``.
    A delta is folded into it: its text goes at ``progress_at`` (a delta whose earlier text
    never arrived, ``progress_at`` past the end, is appended: what did arrive is kept), its
    records replace those with the same id, new ones follow in order. A delta that is not
    newer than ``base`` (``snapshot_n`` not above base's: one already folded, read again
    after a restart) changes nothing: ``base`` itself is returned. A delta's
    ``unfinished_text`` (where the progress ends with model text that is not a whole turn)
    is the whole snapshot's, present only when set: it is the latest delta's alone. Pure;
    raises ValueError or TypeError on a malformed delta.
    """
    if "progress_at" not in data:
        return dict(data)
    n = _int_field(data, "snapshot_n")
    at = _int_field(data, "progress_at")
    added = data.get("progress_added", "")
    changed = data.get("tool_calls_changed", [])
    if not isinstance(added, str):
        raise TypeError(f"progress_added: expected a string, got {type(added).__name__}")
    if not isinstance(changed, list) or not all(isinstance(r, dict) and "id" in r for r in changed):
        raise TypeError("tool_calls_changed: expected a list of records with an id")
    old: dict[str, Any] = base if base is not None else {}
    old_n = old.get("snapshot_n")
    if base is not None and isinstance(old_n, int) and not isinstance(old_n, bool) and n <= old_n:
        return base
    progress = old.get("progress")
    progress = progress if isinstance(progress, str) else ""
    progress = progress[:at] + added if at <= len(progress) else progress + added
    calls = [r for r in old.get("tool_calls") or [] if isinstance(r, dict)]
    where = {r.get("id"): i for i, r in enumerate(calls)}
    for rec in changed:
        i = where.get(rec["id"])
        if i is None:
            where[rec["id"]] = len(calls)
            calls.append(rec)
        else:
            calls[i] = rec
    whole: dict[str, Any] = {
        "step": data.get("step"),
        "progress": progress,
        "tool_calls": calls,
        "_id": data.get("_id"),
        "snapshot_n": n,
    }
    unfinished = data.get("unfinished_text")
    if isinstance(unfinished, dict):
        whole["unfinished_text"] = unfinished
    return whole
