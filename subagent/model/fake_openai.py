"""A fake OpenAI-compatible chat server: real HTTP/1.1 (``h11``) + SSE, playing a model script.

It speaks just enough of the Chat Completions API for the ``openai`` SDK:
``POST .../chat/completions`` with ``stream: true`` answers ``chat.completion.chunk``
events (text deltas, tool-call deltas with argument fragments, finish, usage, ``[DONE]``)
in chunked transfer encoding; ``stream: false`` answers one ``chat.completion``;
``GET .../models`` lists the model. The script format and the choice of turn are
``subagent.model.script``'s, so this server and the ``scripted`` provider play the same thing.

Like the real API, a request whose history has a tool call without a result (or a tool
result that answers no call just before it) is refused with a 400 that says which
(``check_history``, on by default).

Invariants: every request is logged (``requests``) with whether the client closed the
connection before the response was complete (``client_closed``: the proof that a stop
aborted the stream); a ``cut`` closes the connection mid-body without the terminating
chunk; state changes wake both trio waiters (``wait_for``) and thread waiters
(``wait_for_sync``). Run it with ``nursery.start(server.serve)``, ``server.start_in_thread()``,
or ``python -m subagent.model.fake_openai --script FILE`` (prints the base URL on stdout).

Size: one server for one API: the HTTP side (``h11``, chunked SSE), the API's answers
(streamed and whole) and its history check belong together, and tests read them as one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import h11
import trio

from subagent.model.script import DEFAULT_SCRIPT, Script, history_position, plan

__all__ = ["FakeOpenAI", "LoggedRequest", "history_problem"]

# Bounds how long the server waits for a request's head and body (seconds).
REQUEST_READ_TIMEOUT_S: Final = 10.0
MAX_HEAD_BYTES: Final = 64 * 1024
RECV_BYTES: Final = 65536
MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# Bounds closing one client connection (seconds).
CLOSE_TIMEOUT_S: Final = 1.0
# How long start_in_thread() waits for the listener (seconds).
THREAD_START_TIMEOUT_S: Final = 10.0


@dataclass
class LoggedRequest:
    """One HTTP request the server received, and what became of its response.

    ``started_at`` and ``closed_at`` are ``time.monotonic()`` values.
    """

    n: int
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    turn_index: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    response_complete: bool = False
    client_closed: bool = False  # the client closed the connection before the response ended
    closed_at: float | None = None
    cut: bool = False  # the script cut the stream (server side)
    hanging: bool = False  # everything before a "hang" was sent; the stream is now silent
    rejected: str | None = None  # why the request was refused with a 400 (a broken history)


class _ClientGone(Exception):
    pass


# What ends a connection's handler quietly: the client went away, or spoke nonsense.
_GONE: Final = (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError, ValueError, _ClientGone)


class FakeOpenAI:
    """A scripted OpenAI-compatible server. One instance serves one script."""

    def __init__(
        self,
        script: Script | dict[str, Any] | None = None,
        *,
        model: str = "fake-model",
        host: str = "127.0.0.1",
        reject_stream_options: bool = False,
        check_history: bool = True,
    ) -> None:
        self.reject_stream_options = reject_stream_options  # play an older compatible server
        self.check_history = check_history
        if script is None:
            script = DEFAULT_SCRIPT
        self.script = script if isinstance(script, Script) else Script.from_dict(script)
        self.model = model
        self.host = host
        self.port: int | None = None
        self.requests: list[LoggedRequest] = []
        self._counter = itertools.count(1)
        self._changed = trio.Event()
        self._cond = threading.Condition()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not listening yet")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def chat_requests(self) -> list[LoggedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    # --- waiting -------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        with self._cond:
            self._cond.notify_all()

    async def wait_for(self, predicate: Callable[[FakeOpenAI], bool]) -> None:
        """Wait (in the server's trio run) until ``predicate(self)`` holds. Bound it with fail_after."""
        while not predicate(self):
            await self._changed.wait()

    def wait_for_sync(self, predicate: Callable[[FakeOpenAI], bool], timeout_s: float) -> bool:
        """Wait from another thread; returns whether the predicate held in time."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout=timeout_s)

    # --- serving -------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[FakeOpenAI] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        self._trio_token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._cancel = scope
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    def start_in_thread(self) -> FakeOpenAI:
        """Serve from a daemon thread (for code that is not under trio). Stop with ``stop()``."""
        ready = threading.Event()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.serve)
                ready.set()

        self._thread = threading.Thread(target=trio.run, args=(main,), name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(THREAD_START_TIMEOUT_S):
            raise RuntimeError("the fake OpenAI server did not start")
        return self

    def stop(self) -> None:
        """Stop a server started with ``start_in_thread`` (idempotent)."""
        if self._thread is None or self._trio_token is None or self._cancel is None:
            return
        scope = self._cancel
        try:
            trio.from_thread.run_sync(scope.cancel, trio_token=self._trio_token)
        except trio.RunFinishedError:
            pass
        self._thread.join(THREAD_START_TIMEOUT_S)
        self._thread = None

    async def _handle(self, stream: trio.SocketStream) -> None:
        # One h11 connection per socket: keep-alive and pipelined requests included.
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            while True:
                parsed: tuple[h11.Request, bytes] | None = None
                with trio.move_on_after(REQUEST_READ_TIMEOUT_S):
                    parsed = await _read_request(stream, conn)
                if parsed is None:
                    return
                head, body_bytes = parsed
                try:
                    body: Any = json.loads(body_bytes) if body_bytes else None
                except ValueError:
                    body = body_bytes.decode("utf-8", "replace")
                headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in head.headers}
                req = LoggedRequest(
                    next(self._counter), head.method.decode("ascii"), head.target.decode("latin-1"), headers, body
                )
                self.requests.append(req)
                self._notify()
                try:
                    keep = await self._respond(stream, conn, req)
                finally:
                    self._notify()
                if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # a bad request gets its 400
                # (To a client that may be gone: a request cut short by its sender's death.)
                with trio.move_on_after(CLOSE_TIMEOUT_S), contextlib.suppress(*_GONE):
                    await _send_json(
                        stream,
                        conn,
                        exc.error_status_hint,
                        {"error": {"message": str(exc), "type": "invalid_request_error"}},
                    )
        except _GONE:
            return
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await stream.aclose()

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, req: LoggedRequest) -> bool:
        """Answer one request. Returns whether the connection stays usable."""
        if req.method == "GET" and req.path.rstrip("/").endswith("/models"):
            await _send_json(
                stream,
                conn,
                200,
                {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]},
            )
            req.response_complete = True
            return True
        if (
            req.method != "POST"
            or not req.path.rstrip("/").endswith("/chat/completions")
            or not isinstance(req.body, dict)
        ):
            await _send_json(
                stream,
                conn,
                404,
                {"error": {"message": f"no route for {req.method} {req.path}", "type": "invalid_request_error"}},
            )
            req.response_complete = True
            return True
        if self.reject_stream_options and "stream_options" in req.body:
            await _send_json(
                stream,
                conn,
                400,
                {"error": {"message": "unknown field: stream_options", "type": "invalid_request_error"}},
            )
            req.response_complete = True
            return True
        messages = req.body.get("messages") or []
        problem = history_problem(messages) if self.check_history else None
        if problem is not None:
            req.rejected = problem
            await _send_json(
                stream,
                conn,
                400,
                {"error": {"message": problem, "type": "invalid_request_error", "param": "messages", "code": None}},
            )
            req.response_complete = True
            return True
        turn_index, last_output = history_position(messages)
        req.turn_index = turn_index
        pieces = plan(self.script, turn_index, last_output)
        if pieces and pieces[-1].kind == "http_error":
            for p in pieces[:-1]:
                await trio.sleep(p.seconds)
            err = pieces[-1]
            await _send_json(
                stream, conn, err.index, {"error": {"message": err.text, "type": "server_error", "code": None}}
            )
            req.response_complete = True
            return True
        if not req.body.get("stream"):
            await _send_json(stream, conn, 200, self._whole_completion(pieces))
            req.response_complete = True
            return True
        include_usage = bool((req.body.get("stream_options") or {}).get("include_usage"))

        gone = trio.Event()

        async def watch(cancel: trio.CancelScope) -> None:
            # The client sends nothing more while it reads a stream: bytes here are a
            # pipelined request (h11 keeps them for the next cycle), EOF is the client
            # closing the connection.
            while True:
                try:
                    data = await stream.receive_some(RECV_BYTES)
                except trio.ClosedResourceError:
                    return  # we closed it ourselves (a scripted cut)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    gone.set()
                    cancel.cancel()
                    return
                conn.receive_data(data)

        completed = False
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as writer_scope:
                nursery.start_soon(watch, writer_scope)
                try:
                    completed = await self._stream(stream, conn, req, pieces, include_usage)
                except _ClientGone:
                    gone.set()
            nursery.cancel_scope.cancel()
        if gone.is_set() and not req.response_complete and not req.cut:
            req.client_closed = True
            req.closed_at = time.monotonic()
            return False
        return completed

    async def _stream(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        req: LoggedRequest,
        pieces: list[Any],
        include_usage: bool,
    ) -> bool:
        cid = f"chatcmpl-fake-{req.n}"
        created = int(time.time())
        head = h11.Response(
            status_code=200,
            headers=[
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
                ("transfer-encoding", "chunked"),
            ],
        )
        await _send(stream, conn, head)
        first = True

        async def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
            nonlocal first
            if first:
                delta = {"role": "assistant", **delta}
                first = False
            obj = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            await _send_event(stream, conn, obj)

        for p in pieces:
            if p.kind == "delay":
                await trio.sleep(p.seconds)
            elif p.kind == "text":
                await chunk({"content": p.text})
            elif p.kind == "tool_start":
                await chunk(
                    {
                        "tool_calls": [
                            {
                                "index": p.index,
                                "id": p.id,
                                "type": "function",
                                "function": {"name": p.name, "arguments": ""},
                            }
                        ]
                    }
                )
            elif p.kind == "tool_args":
                await chunk({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
            elif p.kind == "cut":
                req.cut = True
                # No terminating chunk: the client sees the body end mid-message.
                await stream.aclose()
                return False
            elif p.kind == "error":
                await _send_event(stream, conn, {"error": {"message": p.text, "type": "server_error", "code": None}})
                await _send(stream, conn, h11.EndOfMessage())
                req.response_complete = True
                return True
            elif p.kind == "hang":
                req.hanging = True
                self._notify()
                await trio.sleep_forever()
            elif p.kind == "finish":
                await chunk({}, finish=p.text)
                if include_usage:
                    usage = dict(p.usage or {"prompt_tokens": 0, "completion_tokens": 0})
                    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
                    await _send_event(
                        stream,
                        conn,
                        {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": self.model,
                            "choices": [],
                            "usage": usage,
                        },
                    )
                await _send(stream, conn, h11.Data(data=b"data: [DONE]\n\n"))
                await _send(stream, conn, h11.EndOfMessage())
                req.response_complete = True
                return True
        return False

    def _whole_completion(self, pieces: list[Any]) -> dict[str, Any]:
        text, calls, finish = "", {}, "stop"
        for p in pieces:
            if p.kind == "text":
                text += p.text
            elif p.kind == "tool_start":
                calls[p.index] = {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}}
            elif p.kind == "tool_args":
                calls[p.index]["function"]["arguments"] += p.text
            elif p.kind == "finish":
                finish = p.text
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }


def history_problem(messages: Any) -> str | None:
    """Why the real API would refuse this message list (the tool-call pairing), or None.

    Every assistant message with ``tool_calls`` must be followed, before any other kind of
    message, by one ``tool`` message per call id; a ``tool`` message must answer a call of
    the assistant message just before it. The wording is the API's own.
    """
    if not isinstance(messages, list):
        return "Invalid type for 'messages': expected an array"
    pending: list[str] = []
    answerable: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in answerable:
                return (
                    f"Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                    f"with 'tool_calls' (messages.[{i}], tool_call_id {cid!r})."
                )
            if cid in pending:
                pending.remove(cid)
            continue
        if pending:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}"
            )
        answerable = set()
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            ids = [c.get("id") for c in m["tool_calls"] if isinstance(c, dict)]
            pending = [c for c in ids if isinstance(c, str)]
            answerable = set(pending)
    if pending:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}"
        )
    return None


async def _read_request(stream: Any, conn: h11.Connection) -> tuple[h11.Request, bytes] | None:
    """The next request and its body; None when the client closed the connection first."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(RECV_BYTES))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise ValueError("request body too large")
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return head, bytes(body)
        else:  # ConnectionClosed (or PAUSED, which a new cycle never starts with)
            return None


async def _send(stream: Any, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if not data:
        return
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise _ClientGone() from None


async def _send_event(stream: Any, conn: h11.Connection, obj: dict[str, Any]) -> None:
    await _send(stream, conn, h11.Data(data=b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"))


async def _send_json(stream: Any, conn: h11.Connection, status: int, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    await _send(stream, conn, h11.Response(status_code=status, headers=headers))
    await _send(stream, conn, h11.Data(data=body))
    await _send(stream, conn, h11.EndOfMessage())


def main(argv: list[str] | None = None) -> None:
    """``python -m subagent.model.fake_openai [--script FILE]``: serve until killed; print the base URL."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", help="a model script (JSON); default: the built-in script")
    ap.add_argument("--model", default="fake-model")
    args = ap.parse_args(argv)
    script = Script.load(args.script) if args.script else None

    async def run() -> None:
        server = FakeOpenAI(script, model=args.model)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            print(server.base_url, flush=True)

    trio.run(run)


if __name__ == "__main__":  # pragma: no cover
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
