"""The fake OpenAI-compatible server, through the real ``openai`` SDK."""

from __future__ import annotations

import openai
import pytest
import trio

from subagent.model.fake_openai import FakeOpenAI

# The SDK leaves its inner async generators unexhausted after [DONE]; trio reports them at
# GC as ResourceWarnings. That is the SDK's business, not the server's.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SCRIPT = {
    "turns": [
        {
            "text": "hello",
            "tool_calls": [{"name": "f", "arguments": {"a": 1}}],
            "chunk_size": 2,
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
        },
        {"text": "cut", "tool_calls": [{"name": "f", "arguments": {"a": 1}, "cut_after": 3}]},
        {"text": "forever", "hang": True},
    ]
}


def client(server: FakeOpenAI) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="k", base_url=server.base_url, max_retries=0)


async def test_streams_chunks_with_tool_argument_fragments_and_usage() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI(SCRIPT).serve)
        c = client(server)
        stream = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
        await c.close()
        nursery.cancel_scope.cancel()
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    fragments = [tc.function.arguments for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert fragments[0] == "" and "".join(fragments) == '{"a":1}' and len(fragments) > 2
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert server.requests[0].response_complete and not server.requests[0].client_closed


async def test_a_cut_breaks_the_body_and_is_logged_as_a_cut_not_a_client_close() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI(SCRIPT).serve)
        c = client(server)
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "hello"}]
        stream = await c.chat.completions.create(model="m", messages=messages, stream=True)
        got = []
        try:
            async for ch in stream:
                got.append(ch)
        except openai.APIConnectionError:
            pass
        else:  # pragma: no cover - the body must not end cleanly
            raise AssertionError("the cut stream ended cleanly")
        await c.close()
        nursery.cancel_scope.cancel()
    req = server.requests[0]
    assert req.turn_index == 1 and req.cut and not req.client_closed and not req.response_complete


async def test_a_client_that_closes_mid_stream_is_recorded() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI(SCRIPT).serve)
        c = client(server)
        messages = [{"role": "user", "content": "x"}] + [{"role": "assistant", "content": "a"}] * 2
        stream = await c.chat.completions.create(model="m", messages=messages, stream=True)
        first = await stream.__anext__()
        assert first.choices[0].delta.content
        await stream.close()
        with trio.fail_after(5):
            await server.wait_for(lambda s: s.requests[0].client_closed)
        await c.close()
        nursery.cancel_scope.cancel()


def test_runs_in_a_thread_for_code_outside_trio_and_answers_non_streaming() -> None:
    import httpx2

    server = FakeOpenAI({"final": "plain"}).start_in_thread()
    try:
        r = httpx2.post(
            server.base_url + "/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.json()["choices"][0]["message"]["content"] == "plain"
        assert httpx2.get(server.base_url + "/models").json()["data"][0]["id"] == "fake-model"
        assert httpx2.get(server.base_url + "/nope").status_code == 404
        assert server.wait_for_sync(lambda s: len(s.requests) == 3, timeout_s=5)
    finally:
        server.stop()


async def _exchange(server: FakeOpenAI, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes (or 5 s)."""
    assert server.port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        out = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


async def test_pipelined_requests_on_one_connection_each_get_their_answer() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI({"final": "x"}).serve)
        get = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
        out = await _exchange(server, get + b"GET /v1/nope HTTP/1.1\r\nhost: x\r\n\r\n")
        nursery.cancel_scope.cancel()
    assert out.startswith(b"HTTP/1.1 200 ") and out.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 404 " in out
    assert [r.path for r in server.requests] == ["/v1/models", "/v1/nope"]


async def test_a_malformed_request_gets_a_400_and_the_server_lives_on() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI({"final": "x"}).serve)
        out = await _exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
        again = await _exchange(server, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        nursery.cancel_scope.cancel()
    assert out.startswith(b"HTTP/1.1 400 ")
    assert again.startswith(b"HTTP/1.1 200 ") and b"fake-model" in again


async def test_a_client_gone_before_its_malformed_request_got_its_400_does_not_take_the_server_down() -> None:
    # A runner stopped while it sent its request (an `--interrupt` racing its turn): the
    # request is cut, and the 400 for it met a closed socket. That error escaped the
    # handler and ended the whole server (every later request of the test refused).
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI({"final": "x"}).serve)
        assert server.port is not None
        for _ in range(20):  # each one a chance for the 400 to meet the closed socket
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", server.port))
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n{"
            await sock.send(head)
            sock.close()  # the request cut short: its 400 goes to a closed socket
        again = await _exchange(server, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        nursery.cancel_scope.cancel()
    assert again.startswith(b"HTTP/1.1 200 ") and b"fake-model" in again


async def test_a_history_with_a_tool_call_that_has_no_result_is_refused_as_the_real_api_does() -> None:
    call = {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    broken = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "y"},
    ]
    whole = [*broken[:2], {"role": "tool", "tool_call_id": "call_x", "content": "ok"}, broken[2]]
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI({"final": "fine"}).serve)
        c = client(server)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="m", messages=broken, stream=True)
        stream = await c.chat.completions.create(model="m", messages=whole, stream=True)
        chunks = [ch async for ch in stream]
        await c.close()
        nursery.cancel_scope.cancel()
    assert info.value.status_code == 400
    assert "The following tool_call_ids did not have response messages: call_x" in str(info.value)
    assert server.requests[0].rejected is not None and server.requests[1].rejected is None
    assert chunks and server.requests[1].response_complete
