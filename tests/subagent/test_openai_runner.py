"""The ``openai`` provider end to end: a real runner against the fake OpenAI SSE server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from subagent.events import EventKind, ExitCode
from subagent.model.fake_openai import FakeOpenAI
from tests.subagent.harness import runner_env, start_runner

TWO_COMMANDS = {
    "chunk_size": 5,
    "turns": [
        {"text": "first", "tool_calls": [{"name": "run_command", "arguments": {"command": "echo one"}}]},
        {
            "text": "second",
            "tool_calls": [{"name": "run_command", "arguments": {"command": "echo two"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3},
        },
    ],
    "final": "answer: {{last_output}}",
}


def openai_spec(server: FakeOpenAI, **limits: Any) -> dict[str, Any]:
    return {
        "task": "do it",
        "run_id": "run-openai",
        "model": {"provider": "openai", "name": "fake-model", "base_url": server.base_url, "request_timeout_s": 30},
        "limits": limits or {"max_steps": 10},
    }


@asynccontextmanager
async def fake_server(script: dict[str, Any], **options: Any) -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(FakeOpenAI(script, **options).serve)
        yield server
        nursery.cancel_scope.cancel()


def env_with_key(tmp_path: Path) -> dict[str, str]:
    return runner_env(tmp_path / "run", run_id="run-openai", OPENAI_API_KEY="sk-test")


async def test_openai_provider_runs_the_same_conversation_with_streamed_tool_arguments(tmp_path: Path) -> None:
    async with fake_server(TWO_COMMANDS) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    assert result["provider"] == "openai"
    assert [t["state"] for t in result["tool_calls"]] == ["succeeded", "succeeded"]
    assert result["tool_calls"][0]["arguments"] == '{"command":"echo one"}'
    assert result["final_text"] == "answer: [exit code 0]\ntwo\n"
    assert result["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    reqs = server.chat_requests
    assert [q.turn_index for q in reqs] == [0, 1, 2]
    assert all(q.body["stream"] is True and q.body["tools"][0]["function"]["name"] == "run_command" for q in reqs)
    assert reqs[0].headers["authorization"] == "Bearer sk-test"
    # The second request carried the first call's result, paired by id.
    tool_msg = next(m for m in reqs[1].body["messages"] if m["role"] == "tool")
    assert tool_msg["tool_call_id"] == "call_1_1" and "one" in tool_msg["content"]
    assert not any(q.client_closed for q in reqs)
    assert not r.of(EventKind.LOG), [e.data for e in r.of(EventKind.LOG)]


async def _sigterm_mid_stream(
    tmp_path: Path, turn: dict[str, Any], ready: Callable[[FakeOpenAI], bool]
) -> tuple[FakeOpenAI, Any, dict[str, Any], float]:
    async with fake_server({"turns": [turn]}) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            with trio.fail_after(15):
                await server.wait_for(ready)
            t0 = trio.current_time()
            r.signal()
            rc, result = await r.finish()
            elapsed = trio.current_time() - t0
            with trio.fail_after(5):
                await server.wait_for(lambda s: s.chat_requests[-1].client_closed)
    assert rc == ExitCode.CANCELLED
    return server, r, result, elapsed


async def test_sigterm_while_the_model_streams_closes_the_connection_within_a_second(tmp_path: Path) -> None:
    turn = {"text": "a long answer that never ends", "chunk_size": 4, "hang": True}
    server, r, result, elapsed = await _sigterm_mid_stream(
        tmp_path, turn, lambda s: bool(s.chat_requests) and s.chat_requests[0].hanging
    )
    assert elapsed < 1.0
    # What arrived before the stop is kept (the signal may win the race with the last bytes).
    assert "a long answer that never ends".startswith(result["progress"])
    assert result["status"] == "cancelled" and result["reason"] == "signal"
    assert r.of(EventKind.STOP_REQUESTED)[0].data["during"] == "model"
    assert len(server.chat_requests) == 1


async def test_sigterm_inside_streamed_tool_arguments_never_runs_the_call(tmp_path: Path) -> None:
    turn = {
        "tool_calls": [{"name": "run_command", "arguments": {"command": "touch ran"}, "hang_after": 15}],
        "chunk_size": 3,
    }
    server, r, result, elapsed = await _sigterm_mid_stream(
        tmp_path, turn, lambda s: bool(s.chat_requests) and s.chat_requests[0].hanging
    )
    assert elapsed < 1.0
    # The runner may not have read the last fragments when the signal won the race; the
    # scripted twin of this test (test_runner.py) pins the exact record.
    assert len(result["tool_calls"]) <= 1
    for rec in result["tool_calls"]:
        assert rec["state"] == "not_started" and rec["reason"].startswith("arguments_incomplete")
    assert not (r.run_dir / "ran").exists()
    assert not [g for g in r.of(EventKind.PROCESS_GROUP)]  # nothing was ever started


async def test_a_stream_cut_inside_tool_arguments_never_runs_and_the_model_is_asked_again(tmp_path: Path) -> None:
    script = {
        "turns": [
            {
                "text": "trying",
                "tool_calls": [{"name": "run_command", "arguments": {"command": "touch ran"}, "cut_after": 14}],
                "chunk_size": 4,
            }
        ],
        "final": "after the cut: {{last_output}}",
    }
    async with fake_server(script) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    (rec,) = result["tool_calls"]
    assert rec["state"] == "not_started"
    assert rec["reason"] == "arguments_incomplete: the stream was cut inside this call's arguments"
    assert rec["arguments"] == '{"command":"to'
    assert not (r.run_dir / "ran").exists()
    assert server.chat_requests[0].cut and len(server.chat_requests) == 2
    assert "not executed" in result["final_text"]


async def test_a_model_server_error_is_a_model_error(tmp_path: Path) -> None:
    async with fake_server({"turns": [{"text": "x", "error": "overloaded"}]}) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR
    assert "overloaded" in result["error"]["message"]


async def test_no_reachable_model_server_is_a_model_error(tmp_path: Path) -> None:
    spec = {"task": "t", "model": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "request_timeout_s": 5}}
    async with start_runner(spec, tmp_path, env=env_with_key(tmp_path)) as r:
        rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.MODEL_ERROR
    assert result["error"]["code"] == "model_connection"


async def test_openai_without_key_or_base_url_fails_clearly(tmp_path: Path) -> None:
    async with start_runner({"task": "t", "model": {"provider": "openai"}}, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR
    assert "OPENAI_API_KEY" in result["error"]["message"]


async def test_an_empty_stream_is_a_model_error(tmp_path: Path) -> None:
    async with fake_server({"turns": [{"cut": True}]}) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR, result
    assert len(server.chat_requests) == 1


async def test_a_stop_during_retry_backoff_ends_at_once_without_another_request(tmp_path: Path) -> None:
    async with fake_server({"turns": [{"http_status": 503, "error": "busy"}]}) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            with trio.fail_after(15):
                await server.wait_for(lambda s: any(q.response_complete for q in s.chat_requests))
            t0 = time.monotonic()  # the clock of LoggedRequest.started_at
            r.signal()
            rc, result = await r.finish()
            elapsed = time.monotonic() - t0
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled"
    assert elapsed < 1.0
    # The SDK's next retry (after a backoff of ~0.4 s or more) never happened.
    assert all(q.started_at < t0 for q in server.chat_requests)


async def test_persistent_server_errors_end_as_a_model_error_after_the_retries(tmp_path: Path) -> None:
    async with fake_server({"turns": [{"http_status": 500, "error": "down"}]}) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.MODEL_ERROR
    assert result["error"]["code"] == "model_http" and "500" in result["error"]["message"]
    assert len(server.chat_requests) == 3  # the first try and MAX_RETRIES=2


async def test_a_server_that_rejects_stream_options_still_works(tmp_path: Path) -> None:
    async with fake_server(TWO_COMMANDS, reject_stream_options=True) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    assert result["usage"] is None  # unknown, not invented
    bodies = [q.body for q in server.chat_requests]
    assert "stream_options" in bodies[0] and all("stream_options" not in b for b in bodies[1:])
    assert len(bodies) == 4  # the rejected one, then three turns


async def test_a_stream_cut_turn_after_turn_fails_the_run_as_the_streams_not_as_max_steps(tmp_path: Path) -> None:
    # Each cut turn was asked again (and billed) until max_steps, whose failure named no cut.
    script = {"turns": [{"text": f"part {n}", "cut": True} for n in range(5)], "final": "never"}
    async with fake_server(script) as server:
        async with start_runner(openai_spec(server), tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish()
    assert rc == ExitCode.MODEL_ERROR, result
    assert result["error"]["code"] == "model_stream" and "3 times in a row" in result["error"]["message"]
    assert len(server.chat_requests) == 3
    assert "part 0" in result["progress"]  # what was said is kept


async def test_a_server_that_goes_quiet_mid_stream_is_a_model_timeout(tmp_path: Path) -> None:
    # The read timeout mid-stream was taken for a cut: asked again, then max_steps.
    async with fake_server({"turns": [{"text": "thinking", "hang": True}]}) as server:
        spec = openai_spec(server, max_steps=5)
        spec["model"]["request_timeout_s"] = 1
        async with start_runner(spec, tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.MODEL_ERROR, result
    assert result["error"]["code"] == "model_timeout", result["error"]
    assert len(server.chat_requests) == 1
    assert "thinking" in result["progress"]


async def test_an_answer_cut_at_the_output_limit_completes_and_says_so(tmp_path: Path) -> None:
    for finish in ("length", "content_filter"):
        async with fake_server({"turns": [{"text": "The answer is trunc", "finish_reason": finish}]}) as server:
            async with start_runner(openai_spec(server), tmp_path / finish, env=env_with_key(tmp_path / finish)) as r:
                rc, result = await r.finish()
        assert rc == ExitCode.COMPLETED, result
        assert result["final_text"] == "The answer is trunc"
        assert result["reason"].startswith(f"answer_{finish}: "), result["reason"]


async def test_request_timeout_s_bounds_a_whole_request_even_a_trickling_one(tmp_path: Path) -> None:
    # A byte at a time, each within the SDK's read timeout: the request went on until the
    # run's deadline (or for ever without one).
    script = {"turns": [{"text": "slowly " * 40, "chunk_size": 1, "chunk_delay_s": 0.1}], "final": "x"}
    async with fake_server(script) as server:
        spec = openai_spec(server, max_steps=5)
        spec["model"]["request_timeout_s"] = 1.5
        async with start_runner(spec, tmp_path, env=env_with_key(tmp_path)) as r:
            rc, result = await r.finish(timeout_s=30)
    assert rc == ExitCode.MODEL_ERROR, result
    assert result["error"]["code"] == "model_timeout" and "longer than 1.5 s" in result["error"]["message"]
    assert len(server.chat_requests) == 1
    assert result["progress"].startswith("slowly")
