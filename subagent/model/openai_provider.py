"""The ``openai`` provider: Chat Completions over the real ``openai.AsyncOpenAI``, streaming.

Works with OpenAI and any OpenAI-compatible server (vLLM, Ollama, llama.cpp server).
Invariants: deltas go into the ``TurnAssembler`` as they arrive (tool-call argument
fragments included); a cancel of ``stream_turn`` (a stop) closes the response at once,
and with it the HTTP connection, so the server stops generating; a transport failure
after the first delta is a *cut* turn (the assembler sees no finish), before it a
``ModelError``. SDK exceptions never leave this module untranslated. This module is the
only importer of ``openai``; the runner imports it only for provider "openai".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

import openai
import trio

from subagent.model.provider import ModelError, TurnAssembler, clean_text

__all__ = ["OpenAIProvider", "DEFAULT_MODEL"]

DEFAULT_MODEL: Final = "gpt-4o-mini"
# Bounds one whole model request (retries and stream included) when the spec gives no
# request_timeout_s (seconds); the SDK's own timeout, per read, is the same.
DEFAULT_REQUEST_TIMEOUT_S: Final = 600.0
# Bounds connecting to the server (seconds).
CONNECT_TIMEOUT_S: Final = 10.0
# Retries of a failed request (before any delta arrived); the SDK backs off between them.
MAX_RETRIES: Final = 2
# Used when a base_url is given without a key: local servers usually need none.
PLACEHOLDER_KEY: Final = "sk-no-key-required"
# Bounds closing an aborted response (seconds): the socket close itself is immediate.
ABORT_CLOSE_TIMEOUT_S: Final = 1.0


class OpenAIProvider:
    name = "openai"

    def __init__(
        self,
        *,
        model: str | None,
        base_url: str | None,
        request_timeout_s: float | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        key = env.get("OPENAI_API_KEY")
        base_url = base_url or env.get("OPENAI_BASE_URL") or None
        if not key:
            if base_url is None:
                raise ModelError(
                    "provider 'openai' needs OPENAI_API_KEY (or a base_url for a local server)", kind="model_config"
                )
            key = PLACEHOLDER_KEY
        self.model = model or env.get("OPENAI_MODEL") or DEFAULT_MODEL
        self.base_url = base_url
        self._usage_option = True  # stream_options.include_usage, until a server rejects it
        timeout = self._timeout = request_timeout_s or DEFAULT_REQUEST_TIMEOUT_S
        self._client = openai.AsyncOpenAI(
            api_key=key,
            base_url=base_url,
            timeout=openai.Timeout(timeout, connect=min(CONNECT_TIMEOUT_S, timeout)),
            max_retries=MAX_RETRIES,
        )

    async def stream_turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sink: TurnAssembler
    ) -> None:
        # The whole request, its retries and its stream: a server that trickles a byte a
        # second never met the SDK's timeout, which is per read.
        with trio.move_on_after(self._timeout) as whole:
            await self._stream_turn(messages, tools, sink)
        if whole.cancelled_caught:
            raise ModelError(
                f"the model request took longer than {self._timeout:g} s (request_timeout_s)", kind="model_timeout"
            )

    async def _stream_turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sink: TurnAssembler
    ) -> None:
        # A history that holds a lone surrogate (an earlier turn's, from a server before this
        # was cleaned, or a tool's text) could never be encoded: every later turn failed.
        kwargs: dict[str, Any] = {"model": self.model, "messages": _clean_deep(messages), "stream": True}
        if self._usage_option:
            kwargs["stream_options"] = {"include_usage": True}
        if tools:
            kwargs["tools"] = tools
        try:
            try:
                stream = await self._client.chat.completions.create(**kwargs)
            except openai.BadRequestError as exc:
                if "stream_options" not in kwargs or "stream_options" not in str(exc):
                    raise
                # Some OpenAI-compatible servers reject stream_options: ask without it.
                self._usage_option = False
                del kwargs["stream_options"]
                stream = await self._client.chat.completions.create(**kwargs)
        except openai.APIStatusError as exc:
            raise ModelError(
                f"the model server answered {exc.status_code}: {_message(exc)}", kind="model_http"
            ) from None
        except openai.APIError as exc:
            raise ModelError(f"the model request failed: {_message(exc)}", kind="model_connection") from None
        try:
            async for chunk in stream:
                _feed(sink, chunk)
        except ModelError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
            # What the server sent is not a chat completion chunk (not JSON, not UTF-8, a
            # field of the wrong type): its verdict is a bad response, whatever came before.
            raise ModelError(
                f"the model server sent a malformed stream: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS],
                kind="model_bad_response",
            ) from None
        except openai.APIError as exc:
            if isinstance(exc, openai.APITimeoutError):
                # The server went quiet mid-stream for the whole read timeout: its failure,
                # not a cut to ask again (each ask billed, then a run failed as max_steps).
                raise ModelError(
                    f"the model server sent nothing for {self._timeout:g} s (request_timeout_s)", kind="model_timeout"
                ) from None
            if not sink.received_any or isinstance(exc, openai.APIStatusError) or _is_stream_error(exc):
                raise ModelError(f"the model stream failed: {_message(exc)}", kind="model_stream") from None
            # The connection broke mid-turn: a cut. The assembler saw no finish.
            return
        finally:
            # On a stop this runs under the cancelled scope: shield the close, bound it.
            with trio.CancelScope(shield=True):
                with trio.move_on_after(ABORT_CLOSE_TIMEOUT_S):
                    await stream.close()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(ABORT_CLOSE_TIMEOUT_S):
                await self._client.close()


def _is_stream_error(exc: Exception) -> bool:
    # An {"error": ...} event inside the stream is the server's verdict, not a cut.
    return type(exc) is openai.APIError


def _message(exc: Exception) -> str:
    msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and str(cause):
        msg = f"{msg} ({type(cause).__name__}: {cause})"
    return msg


def _feed(sink: TurnAssembler, chunk: Any) -> None:
    """One chunk into the assembler, its fields checked (the SDK builds chunks from the
    server's JSON without checking them): a field of the wrong type is a ``ModelError``."""
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        sink.add_usage(_count(getattr(usage, "prompt_tokens", None)), _count(getattr(usage, "completion_tokens", None)))
    for choice in getattr(chunk, "choices", None) or []:
        if getattr(choice, "index", 0) != 0:
            continue
        delta = choice.delta
        if delta is not None:
            content = _field(delta.content, "content")
            if content:
                sink.text(content)
            for tc in delta.tool_calls or []:
                if not isinstance(tc.index, int) or isinstance(tc.index, bool):
                    raise _bad("tool_calls[].index", tc.index)
                fn = tc.function
                name = None if fn is None else _field(fn.name, "function.name")
                arguments = None if fn is None else _field(fn.arguments, "function.arguments")
                sink.tool_delta(
                    tc.index,
                    id=_field(tc.id, "tool_calls[].id"),
                    name=name,
                    arguments=arguments,
                )
        if choice.finish_reason:
            sink.finish(_field(choice.finish_reason, "finish_reason") or "stop")


# How much of a malformed stream's error is kept (it may quote what the server sent).
MAX_ERROR_CHARS: Final = 500


def _bad(field: str, value: Any) -> ModelError:
    return ModelError(
        f"the model server sent a malformed stream: {field} is {type(value).__name__}, not a string"[:MAX_ERROR_CHARS],
        kind="model_bad_response",
    )


def _field(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _bad(field, value)


def _count(value: Any) -> int | None:
    """A token count, or None for anything that is not one (it is reported, not relied on)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _clean_deep(value: Any) -> Any:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_clean_deep(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean_deep(v) for k, v in value.items()}
    return value
