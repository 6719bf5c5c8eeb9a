"""The ``openai`` provider against a server that sends what no chat completion stream is:
each is a ``model_bad_response`` naming what was wrong (it was an internal error, "an
ExceptionGroup"), and a lone surrogate (half a character, as a broken emoji on a page is
escaped in JSON) never reaches the conversation, nor a later request of it.

The real ``openai`` client against a raw HTTP server here, which answers every request
with the given SSE body and records the request bodies.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from subagent.model.openai_provider import OpenAIProvider
from subagent.model.provider import ModelError, TurnAssembler

# The SDK's stream leaves its inner async generators to the garbage collector once it has
# stopped (at [DONE], or at the error): Trio's finalizer warns of them in this process.
# Not what is under test (the runner, in its own process, is not affected).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

OK_END = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def chunk(delta: object, **more: object) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, **more}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@asynccontextmanager
async def raw_server(body: bytes, requests: list[bytes]) -> AsyncIterator[str]:
    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        requests.append(rest)
        head_out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        await stream.send_all(head_out + body)
        await stream.aclose()

    async with trio.open_nursery() as n:
        listeners = await n.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}/v1"
        n.cancel_scope.cancel()


async def turn(
    body: bytes, messages: list[dict[str, object]] | None = None
) -> tuple[TurnAssembler, list[bytes], ModelError | None]:
    """One turn against ``body``: what was assembled, the requests, the model error if any."""
    requests: list[bytes] = []
    sink = TurnAssembler()
    error: ModelError | None = None
    async with raw_server(body, requests) as url:
        provider = OpenAIProvider(model="m", base_url=url, request_timeout_s=10, env={"OPENAI_API_KEY": "sk-test"})
        try:
            with trio.fail_after(20):
                await provider.stream_turn(messages or [{"role": "user", "content": "hi"}], [], sink)
        except ModelError as exc:
            error = exc
        finally:
            await provider.aclose()
    return sink, requests, error


MALFORMED = {
    "not json": b"data: {not json\n\n",
    "not utf-8": b"data: \xff\xfe\x80garbage\n\n",
    "text then broken": chunk({"content": "some text"}) + b"data: {broken\n\n",
    "index null": chunk({"tool_calls": [{"index": None, "id": "a", "function": {"name": "f", "arguments": "{}"}}]}),
    "content an object": chunk({"content": {"a": 1}}),
    "arguments an object": chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": {}}}]}),
    "delta a list": chunk([1, 2]),
}


@pytest.mark.parametrize("body", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_a_malformed_stream_is_a_bad_response_not_an_internal_error(body: bytes) -> None:
    _, _, error = await turn(body + OK_END)
    assert error is not None and error.kind == "model_bad_response", error
    assert error.message.startswith("the model server sent a malformed stream: ")


async def test_usage_of_the_wrong_type_is_ignored_not_an_error() -> None:
    usage = {"prompt_tokens": "lots", "completion_tokens": 3, "total_tokens": 3}
    body = (
        chunk({"content": "hello"})
        + b"data: "
        + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}).encode()
        + b"\n\n"
    )
    sink, _, error = await turn(body + OK_END)
    assert error is None and sink.result().text == "hello"


async def test_a_lone_surrogate_never_reaches_the_conversation_nor_a_later_request() -> None:
    body = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"bad \\ud800 half"},"finish_reason":null}]}\n\n'
    sink, _, error = await turn(body + OK_END)
    text = sink.result().text
    assert error is None
    assert text == "bad \ufffd half"
    text.encode("utf-8")  # can be sent, journaled, printed
    # A history that holds one already (an earlier turn's): the request still goes out, clean.
    poisoned = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x \udfff y"}]
    sink, requests, error = await turn(chunk({"content": "fine"}) + OK_END, poisoned)
    assert error is None and sink.result().text == "fine"
    sent = json.loads(requests[0].decode("utf-8"))
    assert sent["messages"][1]["content"] == "x \ufffd y"


async def test_a_surrogate_pair_split_over_two_deltas_is_one_character() -> None:
    # A server that counts UTF-16 units (a JavaScript proxy) can cut an emoji in two deltas:
    # each half alone is a lone surrogate, the two joined are one character, not two U+FFFD.
    halves = [
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"smile \\ud83d"},"finish_reason":null}]}\n\n',
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"\\ude00 ok"},"finish_reason":null}]}\n\n',
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"k","function":{"name":"f","arguments":"{\\"q\\": \\"\\ud83d"}}]},"finish_reason":null}]}\n\n',
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\ude00 \\udfff\\"}"}}]},"finish_reason":null}]}\n\n',
    ]
    sink, _, error = await turn(b"".join(halves) + OK_END)
    result = sink.result()
    assert error is None
    assert result.text == "smile \U0001f600 ok"
    assert result.calls[0].problem is None
    assert result.calls[0].parsed == {"q": "\U0001f600 \ufffd"}
    json.dumps(result.calls[0].arguments, ensure_ascii=False).encode("utf-8")
