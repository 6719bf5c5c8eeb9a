"""The scripted-model file format: parsing, interpolation, and the stream it plays.

One module owns the format so the in-process ``scripted`` provider and the fake
OpenAI-compatible HTTP server (``subagent.model.fake_openai``) play exactly the same thing.
Invariants: stdlib only (the spec validator imports it); playing is pure: ``plan()``
turns (script, turn index, last tool output) into a list of stream pieces and touches
no clock or I/O; the turn index is the number of assistant turns already in the
history, so a player needs no state of its own. Format: ``subagent/SCRIPT_FORMAT.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict, Unpack

__all__ = [
    "ScriptError",
    "ScriptedCall",
    "Turn",
    "Script",
    "Piece",
    "DEFAULT_SCRIPT",
    "plan",
    "render",
    "history_position",
]

DEFAULT_CHUNK_SIZE: Final = 16
DEFAULT_FINAL_TEXT: Final = "Done."


class ScriptError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def _nonneg(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v:
        raise ScriptError(where, f"expected a number >= 0, got {v!r}")
    return float(v)


def _check(d: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ScriptError(where, f"expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ScriptError(where, f"unknown key {unknown[0]!r} (expected one of {sorted(allowed)!r})")
    return d


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    name: str
    arguments: Any  # an object (sent as JSON) or a raw string (sent as is)
    id: str | None = None
    cut_after: int | None = None  # stream only this many characters of arguments, then cut
    hang_after: int | None = None  # stream this many characters of arguments, then go silent

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ScriptedCall:
        d = _check(d, where, {"name", "arguments", "id", "cut_after", "hang_after"})
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ScriptError(f"{where}.name", f"expected a non-empty string, got {name!r}")
        args = d.get("arguments", {})
        if not isinstance(args, (dict, str)):
            raise ScriptError(f"{where}.arguments", f"expected an object or a string, got {type(args).__name__}")
        cut, hang = d.get("cut_after"), d.get("hang_after")
        for key, v in (("cut_after", cut), ("hang_after", hang)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ScriptError(f"{where}.{key}", f"expected an integer >= 0, got {v!r}")
        if cut is not None and hang is not None:
            raise ScriptError(f"{where}.hang_after", "give cut_after or hang_after, not both")
        cid = d.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ScriptError(f"{where}.id", f"expected a string, got {cid!r}")
        return cls(name=name, arguments=args, id=cid, cut_after=cut, hang_after=hang)


@dataclass(frozen=True, slots=True)
class Turn:
    text: str = ""
    tool_calls: tuple[ScriptedCall, ...] = ()
    extract: str | None = None
    delay_s: float = 0.0
    chunk_delay_s: float | None = None
    chunk_size: int | None = None
    error: str | None = None
    hang: bool = False
    cut: bool = False
    http_status: int | None = None
    usage: Mapping[str, int] | None = None
    finish_reason: str | None = None  # default: "tool_calls" with calls, else "stop"

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Turn:
        if isinstance(d, str):
            return cls(text=d)
        d = _check(
            d,
            where,
            {
                "text",
                "tool_calls",
                "extract",
                "delay_s",
                "chunk_delay_s",
                "chunk_size",
                "error",
                "hang",
                "cut",
                "http_status",
                "usage",
                "finish_reason",
            },
        )
        text = d.get("text", "")
        if not isinstance(text, str):
            raise ScriptError(f"{where}.text", f"expected a string, got {type(text).__name__}")
        calls = d.get("tool_calls", [])
        if not isinstance(calls, list):
            raise ScriptError(f"{where}.tool_calls", f"expected a list, got {type(calls).__name__}")
        extract = d.get("extract")
        if extract is not None:
            if not isinstance(extract, str):
                raise ScriptError(f"{where}.extract", f"expected a regex string, got {extract!r}")
            try:
                re.compile(extract)
            except re.error as exc:
                raise ScriptError(f"{where}.extract", f"invalid regex {extract!r}: {exc}") from None
        size = d.get("chunk_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ScriptError(f"{where}.chunk_size", f"expected an integer >= 1, got {size!r}")
        error = d.get("error")
        if error is not None and not isinstance(error, str):
            raise ScriptError(f"{where}.error", f"expected a string, got {error!r}")
        status = d.get("http_status")
        if status is not None and (isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599):
            raise ScriptError(f"{where}.http_status", f"expected an HTTP error status 400..599, got {status!r}")
        usage = d.get("usage")
        if usage is not None:
            usage = _check(usage, f"{where}.usage", {"prompt_tokens", "completion_tokens"})
            for k, v in usage.items():
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ScriptError(f"{where}.usage.{k}", f"expected an integer >= 0, got {v!r}")
        finish = d.get("finish_reason")
        if finish is not None and (not isinstance(finish, str) or not finish):
            raise ScriptError(f"{where}.finish_reason", f"expected a non-empty string, got {finish!r}")
        parsed = tuple(ScriptedCall.from_dict(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls))
        for i, c in enumerate(parsed[:-1]):
            if c.cut_after is not None or c.hang_after is not None:
                key = "cut_after" if c.cut_after is not None else "hang_after"
                raise ScriptError(f"{where}.tool_calls[{i}].{key}", "only the last call of a turn can be cut or hang")
        return cls(
            text=text,
            tool_calls=parsed,
            extract=extract,
            delay_s=_nonneg(d.get("delay_s", 0), f"{where}.delay_s"),
            chunk_delay_s=None
            if d.get("chunk_delay_s") is None
            else _nonneg(d["chunk_delay_s"], f"{where}.chunk_delay_s"),
            chunk_size=size,
            error=error,
            hang=bool(d.get("hang", False)),
            cut=bool(d.get("cut", False)),
            http_status=status,
            usage=usage,
            finish_reason=finish,
        )


@dataclass(frozen=True, slots=True)
class Script:
    turns: tuple[Turn, ...] = ()
    final: str = DEFAULT_FINAL_TEXT
    chunk_size: int = DEFAULT_CHUNK_SIZE
    chunk_delay_s: float = 0.0
    extract: str | None = None  # default for turns that interpolate {{match}}
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Any) -> Script:
        """Raises: ScriptError with a dotted ``field``."""
        d = _check(d, "", {"turns", "final", "chunk_size", "chunk_delay_s", "extract"})
        turns = d.get("turns", [])
        if not isinstance(turns, list):
            raise ScriptError("turns", f"expected a list, got {type(turns).__name__}")
        final = d.get("final", DEFAULT_FINAL_TEXT)
        if not isinstance(final, str):
            raise ScriptError("final", f"expected a string, got {type(final).__name__}")
        size = d.get("chunk_size", DEFAULT_CHUNK_SIZE)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ScriptError("chunk_size", f"expected an integer >= 1, got {size!r}")
        extract = d.get("extract")
        if extract is not None:
            Turn.from_dict({"extract": extract}, "extract")
        return cls(
            turns=tuple(Turn.from_dict(t, f"turns[{i}]") for i, t in enumerate(turns)),
            final=final,
            chunk_size=size,
            chunk_delay_s=_nonneg(d.get("chunk_delay_s", 0), "chunk_delay_s"),
            extract=extract,
            source=d,
        )

    @classmethod
    def load(cls, path: str) -> Script:
        """Raises: ScriptError (unreadable file or bad script)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ScriptError("", f"cannot read script {path!r}: {exc.strerror}") from None
        except ValueError as exc:
            raise ScriptError("", f"script {path!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)


# The embedded default: what a run does with no API key and no script. It proves the
# whole path (model -> run_command -> history -> answer) without any network.
DEFAULT_SCRIPT: Final[dict[str, Any]] = {
    "turns": [
        {
            "text": "I am the built-in scripted model (no OPENAI_API_KEY is set). Let me look around.",
            "tool_calls": [{"name": "run_command", "arguments": {"command": "uname -sr && pwd"}}],
        },
        {
            "text": "Now let me count the files here.",
            "tool_calls": [{"name": "run_command", "arguments": {"command": "ls -A | wc -l"}}],
        },
    ],
    "extract": "(\\d+)\\s*$",
    "final": "Scripted run finished: entries in this directory: {{match}}.",
}

# --- playing --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Piece:
    """One element of a model's stream.

    kind: "delay" (seconds), "text" (text), "tool_start" (index, id, name),
    "tool_args" (index, text), "cut" (the stream breaks here), "error" (text),
    "hang" (the stream stays open, silent), "finish" (text = finish_reason, usage),
    "http_error" (index = status, text = message): the request fails before any stream.
    """

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""
    seconds: float = 0.0
    usage: Mapping[str, int] | None = None


_VAR = re.compile(r"\{\{\s*(last_output|match|step)\s*\}\}")


def _match(pattern: str | None, last_output: str) -> str:
    if pattern is None:
        return ""
    m = re.search(pattern, last_output)
    if m is None:
        return ""
    return m.group(1) if m.re.groups >= 1 and m.group(1) is not None else m.group(0)


class _Vars(TypedDict):
    """The values a template's ``{{ name }}`` placeholders take."""

    last_output: str
    match: str
    step: int


def render(template: str, *, last_output: str, match: str, step: int) -> str:
    values = {"last_output": last_output, "match": match, "step": str(step)}
    return _VAR.sub(lambda m: values[m.group(1)], template)


def _render_args(args: Any, **kw: Unpack[_Vars]) -> Any:
    if isinstance(args, str):
        return render(args, **kw)
    if isinstance(args, dict):
        return {k: _render_args(v, **kw) for k, v in args.items()}
    if isinstance(args, list):
        return [_render_args(v, **kw) for v in args]
    return args


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or []


def plan(script: Script, turn_index: int, last_output: str) -> list[Piece]:
    """The stream of one model turn, as pieces. Past the last turn: the final answer."""
    if turn_index < len(script.turns):
        turn = script.turns[turn_index]
    else:
        turn = Turn(text=script.final)
    size = turn.chunk_size or script.chunk_size
    gap = script.chunk_delay_s if turn.chunk_delay_s is None else turn.chunk_delay_s
    kw: _Vars = {
        "last_output": last_output,
        "match": _match(turn.extract or script.extract, last_output),
        "step": turn_index + 1,
    }
    pieces: list[Piece] = []
    if turn.delay_s:
        pieces.append(Piece("delay", seconds=turn.delay_s))
    if turn.http_status is not None:
        pieces.append(
            Piece("http_error", index=turn.http_status, text=turn.error or f"scripted HTTP {turn.http_status}")
        )
        return pieces

    def chunk(p: Piece) -> None:
        if gap and any(x.kind in ("text", "tool_start", "tool_args") for x in pieces):
            pieces.append(Piece("delay", seconds=gap))
        pieces.append(p)

    for part in _split(render(turn.text, **kw), size):
        chunk(Piece("text", text=part))
    for i, call in enumerate(turn.tool_calls):
        args = _render_args(call.arguments, **kw)
        raw = args if isinstance(args, str) else json.dumps(args, separators=(",", ":"))
        cid = call.id or f"call_{turn_index + 1}_{i + 1}"
        chunk(Piece("tool_start", index=i, id=cid, name=call.name))
        stop_at = call.cut_after if call.cut_after is not None else call.hang_after
        if stop_at is not None:
            for part in _split(raw[:stop_at], size):
                chunk(Piece("tool_args", index=i, text=part))
            pieces.append(Piece("cut" if call.cut_after is not None else "hang"))
            return pieces
        for part in _split(raw, size):
            chunk(Piece("tool_args", index=i, text=part))
    if turn.error is not None:
        pieces.append(Piece("error", text=turn.error))
        return pieces
    if turn.cut:
        pieces.append(Piece("cut"))
        return pieces
    if turn.hang:
        pieces.append(Piece("hang"))
        return pieces
    finish = turn.finish_reason or ("tool_calls" if turn.tool_calls else "stop")
    pieces.append(Piece("finish", text=finish, usage=turn.usage))
    return pieces


def history_position(messages: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """(turn index, last tool output) from an OpenAI-shaped message list."""
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    last = ""
    for m in reversed(messages):
        if m.get("role") == "tool":
            content = m.get("content")
            last = content if isinstance(content, str) else json.dumps(content)
            break
    return turn, last
