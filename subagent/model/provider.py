"""What a model turn is, and how a stream of deltas becomes one.

``TurnAssembler`` is the only place that decides whether a tool call is complete: a call
is executable only if the stream *finished* (a finish_reason arrived) and its arguments
parse as a JSON object. A stream that was cut or aborted leaves every call of that turn
unexecutable; the call that was still streaming is marked ``arguments_incomplete`` and
its text is kept as received, never repaired. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ModelError",
    "DraftCall",
    "ModelTurn",
    "TurnAssembler",
    "Provider",
    "REASON_ARGS_INCOMPLETE",
    "REASON_TURN_INCOMPLETE",
    "clean_text",
]

REASON_ARGS_INCOMPLETE = "arguments_incomplete: the stream was cut inside this call's arguments"
REASON_TURN_INCOMPLETE = "turn_incomplete: the model's stream ended before its turn finished"
REASON_ARGS_AT_LIMIT = "arguments_incomplete: the model hit its output limit inside this call's arguments"
REASON_ABORTED_IN_ARGS = "arguments_incomplete: the stop aborted the stream inside this call's arguments"
REASON_ABORTED_TURN = "stopped_before_start: the stop aborted the model's turn"
# What one turn keeps of the model's text, and of one call's arguments (characters). The
# rest is counted and dropped as it streams: a model that streamed hundreds of MB kept
# them all (the runner at GBs, then seconds of CPU fitting its result, deaf to a stop).
MAX_TURN_TEXT_CHARS = 256 * 1024
MAX_CALL_ARGUMENTS_CHARS = 1024 * 1024
REASON_ARGS_TOO_LONG = f"invalid_arguments: longer than {MAX_CALL_ARGUMENTS_CHARS} characters"


# A surrogate pair (JSON's two ``\\udXXX`` escapes of one character, which a server that
# counts UTF-16 units may send in two deltas), and a lone surrogate (half a character: a
# broken emoji on a page). Neither can be encoded as UTF-8.
_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` as it can be encoded: each surrogate pair joined into its character, each
    lone surrogate replaced by U+FFFD. Text with a lone surrogate failed every later request
    of the session once it was in the history, and no event could carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _PAIR.sub(lambda m: m.group().encode("utf-16-le", "surrogatepass").decode("utf-16-le"), text)
        return _SURROGATE.sub("\ufffd", text)
    return text


class ModelError(Exception):
    """The model provider failed (connection, auth, bad response, scripted error)."""

    def __init__(self, message: str, *, kind: str = "model_error") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind


@dataclass(slots=True)
class DraftCall:
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""
    too_long: bool = False  # its arguments passed MAX_CALL_ARGUMENTS_CHARS: the rest dropped
    # Set by TurnAssembler.result(): None when executable, else why not.
    problem: str | None = None
    parsed: dict[str, Any] | None = None


@dataclass(slots=True)
class ModelTurn:
    text: str
    calls: list[DraftCall]
    finished: bool  # a finish_reason arrived: the turn is whole
    aborted: bool  # the stop aborted it
    finish_reason: str | None
    usage: dict[str, int] | None

    @property
    def whole(self) -> bool:
        return self.finished and not self.aborted


@dataclass(slots=True)
class TurnAssembler:
    """Accumulates one streamed turn. Providers feed it; the loop reads ``result()``."""

    text_parts: list[str] = field(default_factory=list)
    calls: dict[int, DraftCall] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    received_any: bool = False
    text_dropped: int = 0  # characters past MAX_TURN_TEXT_CHARS
    # Called (synchronously, no argument) after text was added: how the loop shows the text
    # as it streams. Not called for text dropped past the bound.
    on_text: Callable[[], None] | None = None
    _text_chars: int = 0
    _last_index: int | None = None

    @property
    def text_chars(self) -> int:
        """Characters of text kept so far (``MAX_TURN_TEXT_CHARS`` at most)."""
        return self._text_chars

    def text_so_far(self) -> str:
        """The text kept so far, as it can be encoded (a character still half-way, a lone
        surrogate, is U+FFFD until its other half comes)."""
        return clean_text("".join(self.text_parts))

    def text(self, delta: str) -> None:
        if delta:
            self.received_any = True
            room = MAX_TURN_TEXT_CHARS - self._text_chars
            if len(delta) > room:
                self.text_dropped += len(delta) - max(room, 0)
                delta = delta[: max(room, 0)]
                if not delta:
                    return
            self._text_chars += len(delta)
            self.text_parts.append(delta)
            if self.on_text is not None:
                self.on_text()

    def tool_delta(
        self, index: int, *, id: str | None = None, name: str | None = None, arguments: str | None = None
    ) -> None:
        self.received_any = True
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = DraftCall(index=index)
        if id:
            call.id = id
        if name:
            # Some servers repeat the name in every delta; others send it once.
            call.name = name if not call.name or call.name == name else call.name + name
        if arguments and not call.too_long:
            if len(call.arguments) + len(arguments) > MAX_CALL_ARGUMENTS_CHARS:
                call.too_long = True
            else:
                call.arguments += arguments
        self._last_index = index

    def finish(self, reason: str | None) -> None:
        self.received_any = True
        self.finish_reason = reason or "stop"

    def add_usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        self.usage = {
            "prompt_tokens": int(prompt_tokens or 0),
            "completion_tokens": int(completion_tokens or 0),
        }

    def joined_text(self) -> str:
        # Cleaned once the deltas are joined: a pair split over two deltas is one character.
        text = clean_text("".join(self.text_parts))
        if self.text_dropped:
            text += (
                f"\n[{self.text_dropped} more characters of the model's answer were dropped: "
                f"a turn keeps {MAX_TURN_TEXT_CHARS}]"
            )
        return text

    def result(self, *, aborted: bool = False) -> ModelTurn:
        finished = self.finish_reason is not None and not aborted
        calls = [self.calls[i] for i in sorted(self.calls)]
        for call in calls:
            call.name, call.arguments = clean_text(call.name), clean_text(call.arguments)
        if finished and calls and self.finish_reason == "length":
            # The model hit its output limit: the last call's arguments may be cut short.
            for call in calls:
                call.problem = REASON_ARGS_AT_LIMIT if call.index == self._last_index else REASON_TURN_INCOMPLETE
                call.id = call.id or f"call_auto_{call.index + 1}"
            return ModelTurn(self.joined_text(), calls, False, False, self.finish_reason, self.usage)
        for n, call in enumerate(calls):
            if not call.id:
                call.id = f"call_auto_{n + 1}"
            if finished and call.too_long:
                call.problem = REASON_ARGS_TOO_LONG
            elif finished:
                call.problem, call.parsed = _check_arguments(call)
            elif call.index == self._last_index:
                call.problem = REASON_ABORTED_IN_ARGS if aborted else REASON_ARGS_INCOMPLETE
                if aborted and _parses(call.arguments):
                    # The arguments happened to be whole, but the turn was not.
                    call.problem = REASON_ABORTED_TURN
            else:
                call.problem = REASON_ABORTED_TURN if aborted else REASON_TURN_INCOMPLETE
        return ModelTurn(
            text=self.joined_text(),
            calls=calls,
            finished=finished,
            aborted=aborted,
            finish_reason=self.finish_reason,
            usage=self.usage,
        )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting too deep for the decoder
        return False
    return True


def _check_arguments(call: DraftCall) -> tuple[str | None, dict[str, Any] | None]:
    if not call.name:
        return "invalid_call: the model sent a tool call without a name", None
    text = call.arguments.strip() or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"invalid_arguments: not valid JSON ({exc.msg} at char {exc.pos})", None
    except (ValueError, RecursionError) as exc:
        # Valid syntax the decoder still refuses: an integer past Python's digit limit (a plain
        # ValueError, no .msg/.pos) or nesting deeper than the recursion limit.
        return f"invalid_arguments: not decodable JSON ({exc})", None
    if not isinstance(value, dict):
        return f"invalid_arguments: expected a JSON object, got {type(value).__name__}", None
    return None, value


class Provider(Protocol):
    """A model behind a streaming chat API.

    ``stream_turn`` feeds deltas into ``sink`` as they arrive and returns when the stream
    ends (finished or cut: the sink tells which). It raises ``ModelError`` only when the
    request failed before any delta arrived, or when the model reported an error.
    Cancelling it aborts the request at once and closes its connection.
    """

    name: str

    async def stream_turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sink: TurnAssembler
    ) -> None: ...

    async def aclose(self) -> None: ...
