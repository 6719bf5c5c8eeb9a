"""The control socket's wire protocol: message types, encode/decode, validation, Backend.

Pure: no I/O, no trio at run time (the CLI's client imports this module). Every message
is one JSON object in one websocket text frame.

    request   {"id": any, "op": <Op>, ...args}
    reply     {"id", "ok": true, "result": ...} | {"id", "ok": false, "error": {"code", "message"}}
    pushed    {"op": "event", "sub", "run_id", "seq", "ts", "kind", "data"}
              {"op": "end", "sub", "run_id", "state", "last_seq"}   (the run is terminal)

Decoding never raises on bad input: it returns a ``BadRequest`` value carrying the error
code, so the server answers every malformed message and lives on. It is total: what could
fail later (a lone surrogate that SQLite cannot store, an integer no float or C long
holds, an infinity, nesting that would overflow an encoder's recursion) is refused here,
at the edge. Encoding is total too: a reply is always valid JSON (no NaN, no Infinity).

Size: the whole control contract in one place (one request shape per op, one decoder
each, the error codes): splitting it would scatter a contract clients read as a table.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from supervisor.errors import AgentdError, ControlProtocolError, RunNotFound, SpawnError
from supervisor.states import RunState

if TYPE_CHECKING:
    import trio

__all__ = [
    "PROTOCOL_VERSION",
    "Op",
    "ErrorCode",
    "Backend",
    "SpawnRequest",
    "Secret",
    "MAX_MODEL_KEY_CHARS",
    "CancelRequest",
    "MAX_CANCEL_RUN_IDS",
    "RESERVED_CANCEL_REASONS",
    "StatusRequest",
    "ListRequest",
    "EventsRequest",
    "SubscribeRequest",
    "UnsubscribeRequest",
    "PingRequest",
    "SteerRequest",
    "ApproveRequest",
    "DenyRequest",
    "HistoryRequest",
    "SessionsRequest",
    "SessionCloseRequest",
    "MAX_DENY_REASON_CHARS",
    "Request",
    "BadRequest",
    "decode_request",
    "encode_request",
    "encode_reply",
    "encode_error",
    "encode_event",
    "encode_end",
    "decode_server_message",
    "error_from_reply",
    "error_code_for",
    "sniff_id",
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "DEFAULT_EVENTS_LIMIT",
    "MAX_EVENTS_LIMIT",
]

PROTOCOL_VERSION: Final = 1

DEFAULT_LIST_LIMIT: Final = 50
MAX_LIST_LIMIT: Final = 1000
DEFAULT_EVENTS_LIMIT: Final = 1000
MAX_EVENTS_LIMIT: Final = 10000
# Identifiers (run ids, session ids, reasons) longer than this are refused as bad args.
MAX_ID_CHARS: Final = 256
# Reasons agentd gives its own stops (and the runner's own ending): a client's ``cancel``
# may not claim one, or the run's record, its receipt and the next turn's history would
# say the daemon stopped it (a timeout, a full disk, a SIGTERM no stop sent...).
RESERVED_CANCEL_REASONS: Final = frozenset(
    {"timeout", "approval_timeout", "shutdown", "disk_full", "signal", "signalled", "memory_limit", "runner_died"}
)
# Run ids one ``cancel`` may name (``run_ids``): a cancel-all of more is several requests.
MAX_CANCEL_RUN_IDS: Final = 10_000
# Containers nested deeper than this (anywhere in a message) are refused: every later
# encoder (the reply, the journal, the runner's spec) then stays far from the recursion limit.
MAX_DEPTH: Final = 64
# Objects and arrays in one message (outside its strings), counted before it is parsed:
# parsing a megabyte of brackets (~330k empty arrays) took the daemon's thread ~0.1 s.
MAX_CONTAINERS: Final = 100_000
# Integers outside a signed 64-bit range are refused: SQLite, C and float conversions
# downstream raise OverflowError on them.
MAX_INT: Final = 2**63 - 1
# A run's timeout_s above this (about 31 years) is refused rather than overflowing a clock.
MAX_TIMEOUT_S: Final = 1e9


class Op(enum.StrEnum):
    SPAWN = "spawn"  # {spec: object, session_id?: str, timeout_s?: number, model_key?: str, key?: str}
    # {run_id: str, reason?: str} | {session_id: str, run_id?: str, reason?: str} | {run_ids: [str], reason?: str};
    # session_id with run_id: that turn of the session only, never the one live instead
    CANCEL = "cancel"
    STATUS = "status"  # {run_id?: str}; without run_id: the daemon and its live runs
    LIST = "list"  # {limit?: int, state?: RunState, session_id?: str, key?: str}
    EVENTS = "events"  # {run_id: str, after_seq?: int, limit?: int}: one page of the journal
    SUBSCRIBE = "subscribe"  # {run_id: str, after_seq?: int}: replay, then live, then "end"
    UNSUBSCRIBE = "unsubscribe"  # {sub: str}
    PING = "ping"  # {}
    STEER = "steer"  # {run_id: str, text: str}: extra input for the running turn
    # Approvals (a tool call that waits for a person's OK; the run is awaiting_approval):
    APPROVE = "approve"  # {run_id: str, call_id: str}
    DENY = "deny"  # {run_id: str, call_id: str, reason?: str}
    # Sessions (a session is a conversation, each run one turn of it):
    # {session_id: str, before_turn?: int, after_turn?: int, max_bytes?: int}: the
    # transcript, as the next turn would see it, one page of it (bounded in bytes)
    HISTORY = "history"
    SESSIONS = "sessions"  # {limit?: int}: sessions, most recently active first
    SESSION_CLOSE = "session_close"  # {session_id: str}: stop its live turn, remove its browser profile


class ErrorCode(enum.StrEnum):
    BAD_JSON = "bad_json"  # not JSON (or not UTF-8, or nested too deep)
    BAD_MESSAGE = "bad_message"  # JSON, but not an object
    UNKNOWN_OP = "unknown_op"
    BAD_ARGS = "bad_args"  # a missing or ill-typed argument
    TOO_LARGE = "too_large"  # above Config.max_message_bytes
    NOT_FOUND = "not_found"  # no run with that id
    BAD_SPEC = "bad_spec"  # the backend refused the spec (SpawnError)
    UNSUPPORTED = "unsupported"  # the backend lacks an optional operation
    REFUSED = "refused"  # another AgentdError from the backend
    SESSION_BUSY = "session_busy"  # the session has a live turn (spawn without interrupt)
    INTERNAL = "internal"  # a bug: logged on the server, the connection lives on
    # Client-side only, never sent by the server:
    UNAUTHORIZED = "unauthorized"  # the handshake was refused (401/403)
    CONNECTION_LOST = "connection_lost"
    BAD_REPLY = "bad_reply"


class Backend(Protocol):
    """What the control socket needs from the run manager (``supervisor.core.runs.RunManager``).

    Run dicts and event dicts are plain JSON data. Event dicts are
    ``{"seq", "ts", "kind", "data"}`` (``run_id`` may be present), ``seq`` strictly
    increasing per run from 1. Three rules make replay gap-free: an event is durable
    (visible to ``events_after``) before it is delivered live; a subscription channel
    closes only after the run's terminal event is durable (or earlier, if the backend
    drops a slow subscriber: the control socket then catches up from the journal and
    subscribes again); and ``subscribe`` on a run already terminal yields a closed channel.

    Optional methods, used when present: ``cancel_session(session_id, *, reason)`` (a
    cancel naming its turn passes ``turn=`` too: that run of the session, or nothing),
    ``cancel_many(run_ids, *, reason) -> [{"run_id", "was_active", "state"} | {"run_id",
    "error"}]`` (one per id, in order; without it each id is a ``cancel``, side by side),
    ``steer(run_id, text) -> {"run_id", "accepted", "state"}``, ``approve(run_id,
    call_id)`` and ``deny(run_id, call_id, *, reason)`` (``{"run_id", "call_id",
    "decision", "state"}``), ``history(session_id)`` (a paged request passes
    ``before_turn=``, ``after_turn=``, ``max_bytes=``, those given), ``list_sessions(*, limit)``,
    ``close_session(session_id)`` (see ``docs/control-protocol.md``), ``summary() -> dict``
    (shown by ``status`` without a run id) and ``events_page(run_id, after_seq, *, limit,
    max_bytes) -> (events, more)``: like ``events_after`` but also bounded in bytes (the
    encoded size of the events' data; at least one event), ``more`` true when events after
    the page exist. Without it, replay pages are bounded in events only and read until one
    comes back empty (a short page may have been cut by size).
    """

    async def spawn(self, spec: dict[str, Any], *, session_id: str | None, timeout_s: float | None) -> dict[str, Any]:
        """Start a run. Returns at least ``{"run_id", "state"}``. Raises SpawnError.

        A spawn that carries a model key calls it with one more keyword, ``model_key`` (a
        ``Secret``, the run's model API key: for its runner's environment only, never to be
        journaled or logged); one without a key does not pass it. A spawn with
        ``interrupt: true`` passes ``interrupt=True`` (stop the session's live turn first);
        one without does not pass it. A session with a live turn refuses a new one with a
        ``ControlProtocolError`` coded ``session_busy``. A spawn with an idempotency key
        passes ``key=`` (one without does not): a key already used returns its run (with
        ``"existing": true``) and starts nothing.
        """
        ...

    async def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        """Returns ``{"run_id", "was_active", "state"}``. Raises RunNotFound."""
        ...

    async def status(self, run_id: str) -> dict[str, Any]:
        """The run as a dict (state, result, partial, receipt, ...). Raises RunNotFound."""
        ...

    async def list_runs(self, *, limit: int, state: str | None, session_id: str | None) -> list[dict[str, Any]]:
        """Newest first. A ``list`` with a key passes ``key=`` (the run its spawn created, if any)."""
        ...

    async def events_after(self, run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
        """Journal events with ``seq > after_seq``, in order, at most ``limit``. Raises RunNotFound."""
        ...

    def subscribe(self, run_id: str) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Live events from now on; the channel ends after the terminal event. Raises RunNotFound."""
        ...


# ---------------------------------------------------------------------------- requests
# NamedTuples, not dataclasses: the CLI imports this module and a dataclass costs ~0.5 ms
# to create, a NamedTuple a tenth of that.


class Secret:
    """A value that never shows itself: its repr, str and JSON (``default=str``) are
    redacted. ``reveal()`` is for the one place that hands it on."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


# A model API key longer than this is refused as a bad argument.
MAX_MODEL_KEY_CHARS: Final = 4096


class SpawnRequest(NamedTuple):
    id: Any
    spec: dict[str, Any]
    session_id: str | None = None
    timeout_s: float | None = None
    op: Op = Op.SPAWN
    # This run's model API key: handed to its runner's environment only, never journaled.
    model_key: Secret | None = None
    # Stop the session's live turn first (through the normal cancel path), then start this one.
    interrupt: bool = False
    # An idempotency key: a spawn whose key made a run already returns that run, starts nothing.
    key: str | None = None


class CancelRequest(NamedTuple):
    id: Any
    run_id: str | None = None  # exactly one of run_id, session_id, run_ids; or session_id and run_id:
    session_id: str | None = None  # the session's turn run_id only (it was live or nothing is stopped)
    reason: str = "user"
    op: Op = Op.CANCEL
    run_ids: tuple[str, ...] | None = None  # many runs at once: every stop under way before any is journaled


class SteerRequest(NamedTuple):
    id: Any
    run_id: str
    text: str
    op: Op = Op.STEER


# A deny's reason longer than this is refused (it is told to the model, whole: the answer
# channel's line holds the longest, ``supervisor.core.approvals``).
MAX_DENY_REASON_CHARS: Final = 1000


class ApproveRequest(NamedTuple):
    id: Any
    run_id: str
    call_id: str
    op: Op = Op.APPROVE


class DenyRequest(NamedTuple):
    id: Any
    run_id: str
    call_id: str
    reason: str | None = None
    op: Op = Op.DENY


class HistoryRequest(NamedTuple):
    id: Any
    session_id: str
    op: Op = Op.HISTORY
    # One page (``docs/control-protocol.md``, Sessions): at most one cursor; None: not given.
    before_turn: int | None = None
    after_turn: int | None = None
    max_bytes: int | None = None


class SessionsRequest(NamedTuple):
    id: Any
    limit: int = DEFAULT_LIST_LIMIT
    op: Op = Op.SESSIONS


class SessionCloseRequest(NamedTuple):
    id: Any
    session_id: str
    op: Op = Op.SESSION_CLOSE


class StatusRequest(NamedTuple):
    id: Any
    run_id: str | None = None
    op: Op = Op.STATUS


class ListRequest(NamedTuple):
    id: Any
    limit: int = DEFAULT_LIST_LIMIT
    state: str | None = None
    session_id: str | None = None
    op: Op = Op.LIST
    # Only the run a spawn with this idempotency key created (none or one).
    key: str | None = None


class EventsRequest(NamedTuple):
    id: Any
    run_id: str
    after_seq: int = 0
    limit: int = DEFAULT_EVENTS_LIMIT
    op: Op = Op.EVENTS


class SubscribeRequest(NamedTuple):
    id: Any
    run_id: str
    after_seq: int = 0
    op: Op = Op.SUBSCRIBE


class UnsubscribeRequest(NamedTuple):
    id: Any
    sub: str
    op: Op = Op.UNSUBSCRIBE


class PingRequest(NamedTuple):
    id: Any
    op: Op = Op.PING


Request = (
    SpawnRequest
    | CancelRequest
    | StatusRequest
    | ListRequest
    | EventsRequest
    | SubscribeRequest
    | UnsubscribeRequest
    | PingRequest
    | SteerRequest
    | ApproveRequest
    | DenyRequest
    | HistoryRequest
    | SessionsRequest
    | SessionCloseRequest
)


class BadRequest(NamedTuple):
    """A message that cannot be served, as a value: the server replies with this error."""

    id: Any
    code: ErrorCode
    message: str


class _Bad(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _message_size(message: str | bytes) -> int:
    if isinstance(message, bytes):
        return len(message)
    # A str of n chars is n..4n bytes in UTF-8; encode only when it matters.
    return len(message) if message.isascii() else len(message.encode("utf-8", "surrogatepass"))


_ID_PATTERN: Final = r'\s*\{\s*"id"\s*:\s*("(?:[^"\\]|\\.){0,256}"|-?\d{1,19})\s*[,}]'


def sniff_id(message: str | bytes) -> Any:
    """Best effort: the request id of a message too large to parse, if it comes first."""
    head = message[:1024]
    if isinstance(head, bytes):
        head = head.decode("utf-8", "replace")
    m = re.match(_ID_PATTERN, head)  # compiled on first use (re caches it), not at import
    if m is None:
        return None
    try:
        rid = json.loads(m.group(1))
    except ValueError:
        return None
    return _safe_id(rid)


def decode_request(message: str | bytes, *, max_bytes: int) -> Request | BadRequest:
    """Decode and validate one client message. Never raises on bad input."""
    if _message_size(message) > max_bytes:
        return BadRequest(
            sniff_id(message),
            ErrorCode.TOO_LARGE,
            f"expected a message of at most {max_bytes} bytes, got {_message_size(message)}",
        )
    try:
        text = message.decode("utf-8") if isinstance(message, bytes) else message
        shape = _brackets(text) if text.count("{") + text.count("[") > MAX_DEPTH else b""
        if (containers := shape.count(b"(")) > MAX_CONTAINERS:
            raise _Bad(
                ErrorCode.BAD_ARGS,
                f"expected at most {MAX_CONTAINERS} objects and arrays in a message, got {containers}",
            )
        obj = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int, parse_float=_parse_float)
    except _Bad as exc:
        return BadRequest(sniff_id(message), exc.code, exc.message)
    except (UnicodeDecodeError, ValueError) as exc:
        return BadRequest(None, ErrorCode.BAD_JSON, f"expected a json object, got invalid json ({exc})")
    except RecursionError:
        return BadRequest(None, ErrorCode.BAD_JSON, "expected a json object, got json nested too deep")
    if not isinstance(obj, dict):
        return BadRequest(None, ErrorCode.BAD_MESSAGE, f"expected a json object, got {_kind(obj)}")
    problem = _unstorable(obj, text, deep=bool(shape) and _too_deep(shape))
    if problem is not None:
        return BadRequest(_safe_id(obj.get("id")), ErrorCode.BAD_ARGS, problem)
    rid = obj.get("id")
    if not _valid_id(rid):
        return BadRequest(
            None,
            ErrorCode.BAD_ARGS,
            f"expected 'id' to be a string of at most {MAX_ID_CHARS} chars, a number or null, got {_kind(rid)}",
        )
    op = obj.get("op")
    if not isinstance(op, str):
        return BadRequest(rid, ErrorCode.BAD_ARGS, f"expected 'op' to be a string, got {_kind(op)}")
    try:
        parsed = Op(op)
    except ValueError:
        return BadRequest(rid, ErrorCode.UNKNOWN_OP, f"unknown op {op[:64]!r} (known: {', '.join(Op)})")
    try:
        return _PARSERS[parsed](rid, obj)
    except _Bad as exc:
        return BadRequest(rid, exc.code, exc.message)


def _parse_int(digits: str) -> int:
    # Called by the json scanner for every integer literal, before int() sees it: a
    # 5,000-digit literal is refused without the quadratic conversion.
    if len(digits) > 20:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected integers of at most 64 bits, got one of {len(digits)} digits")
    value = int(digits)
    if not -MAX_INT - 1 <= value <= MAX_INT:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected integers of at most 64 bits, got {value}")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Bad(ErrorCode.BAD_ARGS, f"expected finite numbers, got {text[:32]!r} (out of range)")
    return value


def _valid_id(rid: Any) -> bool:
    if rid is None or isinstance(rid, (bool, int, float)):
        return True  # numbers are finite and bounded by the parse hooks
    return isinstance(rid, str) and len(rid) <= MAX_ID_CHARS


def _safe_id(rid: Any) -> Any:
    """The request id to echo in an error reply, or None when it cannot be echoed."""
    if isinstance(rid, str) and not _encodable(rid):
        return None
    return rid if _valid_id(rid) else None


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# A JSON string escape that can decode to a lone surrogate (\ud800-\udfff).
_SURROGATE_ESCAPE: Final = r"\\u[dD][89a-fA-F]"


def _unstorable(obj: dict[str, Any], text: str, *, deep: bool) -> str | None:
    """Why a decoded message cannot be served safely: too deep (``deep``, ``_too_deep`` of
    its text), or a lone surrogate.

    Iterative (it must not recurse on what it checks), and only walked when the text could
    hold either problem: too deep, or a surrogate escape (text from a websocket is valid
    UTF-8, so a surrogate can only come from a ``\\u`` escape).
    """
    surrogates = not text.isascii() and not _encodable(text) or re.search(_SURROGATE_ESCAPE, text) is not None
    if not deep and not (surrogates and _has_surrogate(obj)):
        return None
    # Where it is, for the error (paths are built only now: a clean message of a hundred
    # thousand small objects cost a few hundred ms of the daemon's thread with them).
    todo: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while todo:
        value, depth, where = todo.pop()
        if isinstance(value, dict):
            if depth > MAX_DEPTH:
                return f"expected objects and arrays nested at most {MAX_DEPTH} deep, got deeper in {_shown(where)}"
            for k, v in value.items():
                path = f"{where}.{k}" if where else str(k)
                if not _encodable(k):
                    return f"expected text without lone surrogates (unpaired \\ud800-\\udfff), got one in a key of {_shown(where or '(top)')}"
                todo.append((v, depth + 1, path))
        elif isinstance(value, list):
            if depth > MAX_DEPTH:
                return f"expected objects and arrays nested at most {MAX_DEPTH} deep, got deeper in {_shown(where)}"
            todo.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str) and not _encodable(value):
            return f"expected text without lone surrogates (unpaired \\ud800-\\udfff), got one in {_shown(where)}"
    return None


_JSON_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Every byte but a bracket is deleted, and the brackets become ( and ).
_BRACKETS: Final = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS: Final = bytes(c for c in range(256) if c not in b"[]{}")


def _brackets(text: str) -> bytes:
    """The brackets of this JSON text outside its strings, each opening one ``(`` and each
    closing one ``)``: the shape of its objects and arrays. All in C: ~4 ms a megabyte."""
    data = _JSON_STRING.sub(b"", text.encode("utf-8", "surrogatepass"))
    return data.translate(_BRACKETS, _NOT_BRACKETS)


@functools.cache
def _nested_at_most(depth: int) -> re.Pattern[bytes]:
    """Matches a run of balanced ``(...)`` groups nested at most ``depth`` deep. Its
    repetitions are possessive: nothing is tried twice, one pass over the text."""
    pattern = b""
    for _ in range(depth):
        pattern = rb"(?:\(" + pattern + rb"\))*+"
    return re.compile(pattern)


def _too_deep(shape: bytes) -> bool:
    """Is any container of this (valid) JSON, as ``_brackets`` gives it, nested beyond
    ``MAX_DEPTH``? One pass of the regex engine, in C (it was ``MAX_DEPTH`` passes, each
    removing the innermost containers: ~0.6 s for a megabyte of brackets 64 deep)."""
    return _nested_at_most(MAX_DEPTH).fullmatch(shape) is None


def _has_surrogate(obj: dict[str, Any]) -> bool:
    """Does any key or text of ``obj`` hold a lone surrogate?"""
    todo: list[Any] = [obj]
    while todo:
        value = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str) and not _encodable(k):
                return True
            if isinstance(v, (dict, list)):
                todo.append(v)
            elif isinstance(v, str) and not _encodable(v):
                return True
    return False


def _shown(path: str) -> str:
    return repr(path if len(path) <= 80 else path[:77] + "...")


def _reject_constant(name: str) -> Any:
    # NaN, Infinity: valid to Python's decoder, not JSON; refused as 1e999 is (bad_args,
    # with the request's id), not as unreadable json with no id.
    raise _Bad(ErrorCode.BAD_ARGS, f"expected finite numbers, got {name} (not valid json)")


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string" if v.strip() else "an empty string" if not v else "a blank string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _ident(obj: Mapping[str, Any], key: str, *, required: bool) -> str | None:
    v = obj.get(key)
    if v is None:
        if required:
            raise _Bad(ErrorCode.BAD_ARGS, f"missing required argument {key!r}")
        return None
    if not isinstance(v, str) or not v.strip():
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} to be a non-empty string, got {_kind(v)}")
    if len(v) > MAX_ID_CHARS:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} of at most {MAX_ID_CHARS} chars, got {len(v)}")
    return v


def _int(obj: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = obj.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} to be an integer, got {_kind(v)}")
    if not lo <= v <= hi:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} in [{lo}, {hi}], got {v}")
    return v


def _spawn(rid: Any, obj: Mapping[str, Any]) -> SpawnRequest:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise _Bad(ErrorCode.BAD_ARGS, f"expected 'spec' to be an object, got {_kind(spec)}")
    timeout = obj.get("timeout_s")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise _Bad(ErrorCode.BAD_ARGS, f"expected 'timeout_s' to be a number, got {_kind(timeout)}")
        # Compared before any float(): an int compares exactly with a float, at any size.
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise _Bad(ErrorCode.BAD_ARGS, f"expected 'timeout_s' in (0, {MAX_TIMEOUT_S:g}], got {timeout!r}")
        timeout = float(timeout)
    interrupt = obj.get("interrupt", False)
    if interrupt is None:
        interrupt = False
    if not isinstance(interrupt, bool):
        raise _Bad(ErrorCode.BAD_ARGS, f"expected 'interrupt' to be true or false, got {_kind(interrupt)}")
    session_id = _ident(obj, "session_id", required=False)
    if interrupt and session_id is None and not isinstance(spec.get("session_id"), str):
        raise _Bad(ErrorCode.BAD_ARGS, "'interrupt' needs a 'session_id': it stops that session's live turn")
    return SpawnRequest(
        rid,
        spec,
        session_id,
        timeout,
        model_key=_model_key(obj.get("model_key")),
        interrupt=interrupt,
        key=_ident(obj, "key", required=False),
    )


def _model_key(v: Any) -> Secret | None:
    # The messages name the argument, never its value.
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise _Bad(ErrorCode.BAD_ARGS, f"expected 'model_key' to be a non-empty string, got {_kind(v)}")
    if len(v) > MAX_MODEL_KEY_CHARS:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected 'model_key' of at most {MAX_MODEL_KEY_CHARS} chars, got {len(v)}")
    if any(c in v for c in "\x00\r\n"):
        raise _Bad(ErrorCode.BAD_ARGS, "expected 'model_key' without NUL or line breaks")
    return Secret(v)


def _cancel(rid: Any, obj: Mapping[str, Any]) -> CancelRequest:
    run_id = _ident(obj, "run_id", required=False)
    session_id = _ident(obj, "session_id", required=False)
    run_ids = _idents(obj, "run_ids", MAX_CANCEL_RUN_IDS)
    # A session's cancel may name its turn (run_id): the stop a person pressed on turn 1
    # that arrives after turn 2 started stops nothing (DESIGN.md: a stop never leaks into
    # the next turn). The pair, not a field of its own: a daemon older than it refuses the
    # pair (bad_args) rather than ignore a field and stop the turn live now.
    named = [run_id, None if run_id is not None else session_id, run_ids]
    if named.count(None) != 2:
        raise _Bad(
            ErrorCode.BAD_ARGS,
            "expected exactly one of 'run_id', 'session_id' or 'run_ids' (or 'session_id' with the 'run_id' of its turn)",
        )
    reason = _ident(obj, "reason", required=False) or "user"
    if reason in RESERVED_CANCEL_REASONS:
        raise _Bad(
            ErrorCode.BAD_ARGS,
            f"reason {reason!r} is one agentd gives its own stops; a cancel may not claim it (use another word)",
        )
    return CancelRequest(rid, run_id, session_id, reason, run_ids=run_ids)


def _idents(obj: Mapping[str, Any], key: str, most: int) -> tuple[str, ...] | None:
    """An optional non-empty list of ids (each as ``_ident`` takes one)."""
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} to be a non-empty list of strings, got {_kind(v)}")
    if len(v) > most:
        raise _Bad(ErrorCode.BAD_ARGS, f"expected {key!r} of at most {most} ids, got {len(v)}")
    out = []
    for i, item in enumerate(v):
        if not isinstance(item, str) or not item.strip() or len(item) > MAX_ID_CHARS:
            raise _Bad(
                ErrorCode.BAD_ARGS,
                f"expected {key}[{i}] to be a non-empty string of at most {MAX_ID_CHARS} chars, got {_kind(item)}",
            )
        out.append(item)
    return tuple(out)


def _steer(rid: Any, obj: Mapping[str, Any]) -> SteerRequest:
    run_id = _ident(obj, "run_id", required=True)
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise _Bad(ErrorCode.BAD_ARGS, f"expected 'text' to be a non-empty string, got {_kind(text)}")
    assert run_id is not None
    return SteerRequest(rid, run_id, text)


def _call_ids(obj: Mapping[str, Any]) -> tuple[str, str]:
    run_id = _ident(obj, "run_id", required=True)
    call_id = _ident(obj, "call_id", required=True)
    assert run_id is not None and call_id is not None
    return run_id, call_id


def _approve(rid: Any, obj: Mapping[str, Any]) -> ApproveRequest:
    return ApproveRequest(rid, *_call_ids(obj))


def _deny(rid: Any, obj: Mapping[str, Any]) -> DenyRequest:
    run_id, call_id = _call_ids(obj)
    reason = obj.get("reason")
    if reason is not None:
        if not isinstance(reason, str):
            raise _Bad(ErrorCode.BAD_ARGS, f"expected 'reason' to be a string, got {_kind(reason)}")
        if len(reason) > MAX_DENY_REASON_CHARS:
            raise _Bad(
                ErrorCode.BAD_ARGS, f"expected 'reason' of at most {MAX_DENY_REASON_CHARS} chars, got {len(reason)}"
            )
        reason = reason.strip() or None
    return DenyRequest(rid, run_id, call_id, reason)


def _history(rid: Any, obj: Mapping[str, Any]) -> HistoryRequest:
    session_id = _ident(obj, "session_id", required=True)
    assert session_id is not None
    before, after, most = (
        None if obj.get(key) is None else _int(obj, key, 0, lo, 2**62)
        for key, lo in (("before_turn", 1), ("after_turn", 0), ("max_bytes", 1))
    )
    if before is not None and after is not None:
        raise _Bad(ErrorCode.BAD_ARGS, "expected at most one of 'before_turn' and 'after_turn', got both")
    return HistoryRequest(rid, session_id, before_turn=before, after_turn=after, max_bytes=most)


def _sessions(rid: Any, obj: Mapping[str, Any]) -> SessionsRequest:
    return SessionsRequest(rid, _int(obj, "limit", DEFAULT_LIST_LIMIT, 1, MAX_LIST_LIMIT))


def _session_close(rid: Any, obj: Mapping[str, Any]) -> SessionCloseRequest:
    session_id = _ident(obj, "session_id", required=True)
    assert session_id is not None
    return SessionCloseRequest(rid, session_id)


def _status(rid: Any, obj: Mapping[str, Any]) -> StatusRequest:
    return StatusRequest(rid, _ident(obj, "run_id", required=False))


def _list(rid: Any, obj: Mapping[str, Any]) -> ListRequest:
    state = obj.get("state")
    if state is not None:
        try:
            state = str(RunState(state))
        except ValueError:
            raise _Bad(ErrorCode.BAD_ARGS, f"expected 'state' in {[str(s) for s in RunState]}, got {state!r}") from None
    return ListRequest(
        rid,
        _int(obj, "limit", DEFAULT_LIST_LIMIT, 1, MAX_LIST_LIMIT),
        state,
        _ident(obj, "session_id", required=False),
        key=_ident(obj, "key", required=False),
    )


def _events(rid: Any, obj: Mapping[str, Any]) -> EventsRequest:
    run_id = _ident(obj, "run_id", required=True)
    assert run_id is not None
    return EventsRequest(
        rid,
        run_id,
        _int(obj, "after_seq", 0, 0, 2**62),
        _int(obj, "limit", DEFAULT_EVENTS_LIMIT, 1, MAX_EVENTS_LIMIT),
    )


def _subscribe(rid: Any, obj: Mapping[str, Any]) -> SubscribeRequest:
    run_id = _ident(obj, "run_id", required=True)
    assert run_id is not None
    return SubscribeRequest(rid, run_id, _int(obj, "after_seq", 0, 0, 2**62))


def _unsubscribe(rid: Any, obj: Mapping[str, Any]) -> UnsubscribeRequest:
    sub = _ident(obj, "sub", required=True)
    assert sub is not None
    return UnsubscribeRequest(rid, sub)


def _ping(rid: Any, obj: Mapping[str, Any]) -> PingRequest:
    return PingRequest(rid)


_PARSERS: Final[dict[Op, Callable[[Any, Mapping[str, Any]], Request]]] = {
    Op.SPAWN: _spawn,
    Op.CANCEL: _cancel,
    Op.STATUS: _status,
    Op.LIST: _list,
    Op.EVENTS: _events,
    Op.SUBSCRIBE: _subscribe,
    Op.UNSUBSCRIBE: _unsubscribe,
    Op.PING: _ping,
    Op.STEER: _steer,
    Op.APPROVE: _approve,
    Op.DENY: _deny,
    Op.HISTORY: _history,
    Op.SESSIONS: _sessions,
    Op.SESSION_CLOSE: _session_close,
}


# ---------------------------------------------------------------------------- encoding


def _dumps(obj: Any) -> str:
    """Strict JSON text of ``obj``: never NaN or Infinity (they become null).

    default=str: a backend value that is not JSON (a Path, a datetime) is sent as text
    rather than failing the reply. Lone surrogates are escaped (ensure_ascii).

    Raises:
        ValueError: ``obj`` is circular or nested beyond the recursion limit.
    """
    try:
        return json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False)
    except ValueError:
        pass  # NaN or infinity somewhere (or a cycle: the second try says so)
    except RecursionError:
        raise ValueError("expected a json value nested less deep than the recursion limit") from None
    try:
        return json.dumps(_finite(obj), separators=(",", ":"), default=str, allow_nan=False)
    except RecursionError:
        raise ValueError("expected a json value nested less deep than the recursion limit") from None


def _finite(obj: Any) -> Any:
    """A copy of ``obj`` with every non-finite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def encode_request(rid: Any, op: str, **args: Any) -> str:
    return _dumps({"id": rid, "op": op, **{k: v for k, v in args.items() if v is not None}})


def encode_reply(rid: Any, result: Any) -> str:
    return _dumps({"id": rid, "ok": True, "result": result})


def encode_error(rid: Any, code: str, message: str) -> str:
    return _dumps({"id": rid, "ok": False, "error": {"code": str(code), "message": message}})


def encode_event(sub: str, run_id: str, event: Mapping[str, Any]) -> str:
    return event_message(sub, run_id, encode_event_body(event))


def encode_event_body(event: Mapping[str, Any]) -> str:
    """What an event's pushed message holds of the event (``seq``, ``ts``, ``kind``,
    ``data``): the costly part of its encoding, the same for every subscription to it.

    Raises:
        ValueError: its data cannot be encoded (see ``_dumps``).
    """
    return _dumps(
        {"seq": event["seq"], "ts": event.get("ts"), "kind": event.get("kind"), "data": event.get("data", {})}
    )


def event_message(sub: str, run_id: str, body: str) -> str:
    """The pushed message ``{"op": "event", "sub", "run_id", ...body}`` of an encoded body."""
    return f'{{"op":"event","sub":{_dumps(sub)},"run_id":{_dumps(run_id)},{body[1:]}'


def encode_end(sub: str, run_id: str, state: str, last_seq: int) -> str:
    return _dumps({"op": "end", "sub": sub, "run_id": run_id, "state": state, "last_seq": last_seq})


def decode_server_message(text: str | bytes) -> dict[str, Any]:
    """Decode one server message for a client.

    Raises:
        ControlProtocolError: ``bad_reply`` when it is not a JSON object.
    """
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ControlProtocolError(
            ErrorCode.BAD_REPLY, f"expected a json object from the daemon, got invalid json ({exc})"
        ) from None
    if not isinstance(obj, dict):
        raise ControlProtocolError(ErrorCode.BAD_REPLY, f"expected a json object from the daemon, got {_kind(obj)}")
    return obj


def error_code_for(exc: BaseException) -> tuple[ErrorCode, str]:
    """Map a backend exception to the error reply it becomes (server side)."""
    if isinstance(exc, RunNotFound):
        return ErrorCode.NOT_FOUND, str(exc)
    if isinstance(exc, SpawnError):
        return ErrorCode.BAD_SPEC, str(exc)
    if isinstance(exc, ControlProtocolError):
        try:
            return ErrorCode(exc.code), str(exc)
        except ValueError:
            return ErrorCode.REFUSED, str(exc)
    if isinstance(exc, AgentdError):
        return ErrorCode.REFUSED, str(exc)
    return ErrorCode.INTERNAL, "internal error in the daemon (see its log)"


def error_from_reply(error: Any, *, run_id: str | None = None) -> AgentdError:
    """Turn an error reply's ``error`` object into the exception a client raises."""
    if not isinstance(error, dict):
        return ControlProtocolError(ErrorCode.BAD_REPLY, f"expected an error object, got {_kind(error)}")
    code = str(error.get("code", ErrorCode.INTERNAL))
    message = str(error.get("message", ""))
    if code == ErrorCode.NOT_FOUND and run_id is not None:
        return RunNotFound(run_id)
    if code == ErrorCode.BAD_SPEC:
        return SpawnError(message)
    return ControlProtocolError(code, message)
