"""MCP servers over stdio through the official SDK: handshake, list tools, call.

Invariants: the server process was already spawned by ``subagent.tools.mcp_spawn`` (which
also owns ending its group); it is handed to the SDK through the SDK's seam
``mcp.client.stdio._create_platform_compatible_process``, so the SDK's transport and its
own shutdown (stdin close, bounded wait, group kill: shielded, every wait bounded by the
SDK, about 6 s at worst; no scope of ours may wrap it, as it exits a task group entered
earlier) apply unchanged, right after what of the server's tree is stopped (SIGSTOP by the
run's own command) is resumed (``resume_stopped_server``); only its stdout reaches the SDK a whole line at a time, with
a bound on a line (``subagent.tools._mcp_lines``). A non-JSON line on a server's stdout is a protocol break: the
SDK skips the line and hands it to the session's message handler; we record it on the
server (``protocol_errors``, ``broken``): a call in flight ends at once (its answer may
have been that line) and the loop ends the run with ``TOOL_PROTOCOL``.
A stop reaches a call through MCP's own ``notifications/cancelled``: cancelling the SDK's
request sends it (the SDK's courtesy cancel), and ``cancel_in_flight`` sends it for the
call in flight while still waiting for its answer; the session's write stream is watched
(``_OutboundTap``) to know that request's id and to send each cancel only once, and to
tell the caller the moment a call is handed to the transport (``on_sent``: its record's
``sent_at``; a stop before that leaves it unsent).
This module imports ``mcp``; the runner imports it only when the spec has MCP servers.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import mcp.client.stdio as _stdio
import trio
from mcp import ClientSession, StdioServerParameters

from subagent.osedge import LINUX
from subagent.spec import McpServerSpec
from subagent.tools._mcp_lines import WholeLinesProcess
from subagent.tools.mcp_spawn import Prespawned, resume_stopped_server
from subagent.tools.runfiles import NotRegularFile, open_regular

__all__ = ["McpServer", "McpSetupError", "StoppedBeforeSend", "UnsendableArguments", "start_server", "tool_result_text"]

logger = logging.getLogger(__name__)

# Bounds the handshake and the first tools/list of one server (seconds).
MCP_START_TIMEOUT_S: Final = 30.0
# How much of a server's stderr an error message quotes (bytes).
STDERR_TAIL_BYTES: Final = 2000

_handover: contextvars.ContextVar[Any | None] = contextvars.ContextVar("_handover", default=None)
_sdk_spawn = _stdio._create_platform_compatible_process


async def _spawn_or_hand_over(*args: Any, **kwargs: Any) -> Any:
    process = _handover.get()
    if process is not None:
        # Its stdout a whole line at a time: the SDK's reader is quadratic in a line's
        # length otherwise (``subagent.tools._mcp_lines``).
        return WholeLinesProcess(process)
    return await _sdk_spawn(*args, **kwargs)


# The SDK's documented seam: it is how a process we spawned earlier reaches the SDK.
_stdio._create_platform_compatible_process = _spawn_or_hand_over


class McpSetupError(Exception):
    def __init__(self, server: str, message: str, *, protocol: bool = False) -> None:
        super().__init__(f"mcp server {server!r}: {message}")
        self.server = server
        self.message = message
        self.protocol = protocol


class UnsendableArguments(ValueError):
    """A call's arguments cannot be written as UTF-8 JSON (a lone surrogate from a
    ``\\udXXX`` escape in the model's JSON): refused before the SDK's writer sees them,
    where the serialisation error would end the whole transport."""


def _check_encodable(arguments: dict[str, Any]) -> None:
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise UnsendableArguments(f"the arguments cannot be sent as JSON: {exc}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Not the exception's text: it quotes the lone surrogate, which no event can carry.
        raise UnsendableArguments(
            f"the arguments cannot be sent as UTF-8 JSON: {exc.reason} (character {exc.start} of their JSON; "
            "a \\ud800-\\udfff escape must be one half of a pair)"
        ) from None


class StoppedBeforeSend(Exception):
    """The run was stopped before a call was handed to the server's transport: it was
    never sent."""


# While the transport's writer is busy with an earlier message, how often a call waiting
# to be handed over looks again (and looks for a stop), in seconds.
_HANDOFF_POLL_S: Final = 0.005


class _OutboundTap:
    """The session's write stream, watched: the id of the ``tools/call`` in flight, and
    no second ``notifications/cancelled`` for a request already told (the SDK's courtesy
    cancel follows ours when a cancelled call is then abandoned).

    A call's hand-off to the transport is one step with the check that no stop came
    (``stop``, set for the call): the SDK's path from our check to its write yields to the
    loop, where a stop may arrive; a call a stop reaches before its hand-off is never sent.
    ``on_sent`` (set for the call) is told once, right after the hand-off and never
    without one: what makes the hand-off observable (the record's ``sent_at``).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.in_flight: str | int | None = None
        self.stop: Any = None  # the run's StopControl, for the call being made
        self.on_sent: Callable[[], None] | None = None  # for the call being made
        self._cancelled: set[str | int] = set()

    async def send(self, item: Any, /) -> None:
        from mcp_types import JSONRPCNotification, JSONRPCRequest

        msg = getattr(item, "message", None)
        if isinstance(msg, JSONRPCRequest) and msg.method == "tools/call":
            if self.stop is not None:
                await self._hand_over(item, msg.id, self.stop)
                self._sent()
                return
            self.in_flight = msg.id
            await self._inner.send(item)
            self._sent()
            return
        elif isinstance(msg, JSONRPCNotification) and msg.method == "notifications/cancelled":
            rid = (msg.params or {}).get("requestId")
            if isinstance(rid, (str, int)):
                if rid in self._cancelled:
                    return
                self._cancelled.add(rid)
        await self._inner.send(item)

    async def _hand_over(self, item: Any, rid: str | int, stop: Any) -> None:
        import anyio

        while True:
            # No checkpoint between the check and a hand-off that does not wait.
            if stop.requested:
                raise StoppedBeforeSend
            try:
                self._inner.send_nowait(item)
            except anyio.WouldBlock:
                # The writer is still writing an earlier message. Not a waiting send:
                # cancelled, it may have handed the item over all the same.
                with trio.CancelScope(shield=True):
                    await trio.sleep(_HANDOFF_POLL_S)
                # A timeout or an interrupt ends the wait (it was never sent); a stop is
                # the check above. Yields only when cancelled: none between the two.
                await trio.lowlevel.checkpoint_if_cancelled()
                continue
            self.in_flight = rid
            return

    def _sent(self) -> None:
        on_sent, self.on_sent = self.on_sent, None  # once per call
        if on_sent is None:
            return
        try:
            on_sent()
        except Exception:
            # The request is with the transport all the same: the SDK must not see a failed write.
            logger.exception("mcp: recording a call's hand-off failed")

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _OutboundTap:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


@dataclass
class McpServer:
    name: str
    pgid: int | None = None
    leader_ticks: int | None = None  # the server's start time: ``pgid`` is still it while it matches
    session: ClientSession | None = None
    tools: list[Any] = field(default_factory=list)
    stderr_path: Path | None = None
    protocol_errors: list[str] = field(default_factory=list)
    # Set with the first protocol error: a call in flight ends then (its answer may have
    # been the line the SDK dropped), rather than waiting out its timeout.
    broken: trio.Event = field(default_factory=trio.Event)
    tap: _OutboundTap | None = None

    def stderr_tail(self) -> str:
        """The end of the server's stderr log; "" when it cannot be read.

        Never blocks: the log is in the run dir, where a tool (another server) may have
        put a FIFO in its place, whose plain open would stop the runner for good.
        """
        if self.stderr_path is None:
            return ""
        try:
            with os.fdopen(open_regular(self.stderr_path, os.O_RDONLY), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - STDERR_TAIL_BYTES))
                return f.read().decode("utf-8", "replace").strip()
        except NotRegularFile as exc:
            logger.warning("mcp server %r: its stderr log is unreadable: %s", self.name, exc)
            return ""
        except OSError:
            return ""

    async def call(
        self, tool: str, arguments: dict[str, Any], *, stop: Any = None, on_sent: Callable[[], None] | None = None
    ) -> tuple[bool, str]:
        """Call a tool; returns (is_error, text). Raises on transport or protocol failure.

        Raises ``UnsendableArguments`` (nothing sent) for arguments no UTF-8 JSON holds.
        ``stop``: the run's StopControl; a stop before the call is handed to the transport
        raises ``StoppedBeforeSend`` (it was not sent). ``on_sent()``: called once, at once
        after the request was handed to the transport (never for a call that was not).
        """
        assert self.session is not None
        _check_encodable(arguments)
        if self.tap is not None:
            self.tap.stop = stop
            self.tap.on_sent = on_sent
        try:
            result = await self.session.call_tool(tool, arguments)
        finally:
            if self.tap is not None:
                self.tap.in_flight = None
                self.tap.stop = None
                self.tap.on_sent = None
        return bool(getattr(result, "is_error", False)), tool_result_text(result)

    def stopped(self) -> bool:
        """Whether the server's own process is stopped (SIGSTOP, SIGTSTP: state ``T``), so
        that it can answer nothing until resumed. Only the process spawned, known by its
        start time (a reused pid is not it); False when it cannot be read. Linux only."""
        if self.pgid is None or self.leader_ticks is None:
            return False
        proc = LINUX.stat(self.pgid)
        return proc is not None and proc.start_ticks == self.leader_ticks and proc.state in ("T", "t")

    async def cancel_in_flight(self, reason: str) -> bool:
        """Send ``notifications/cancelled`` for the call in flight; keep waiting for it.

        Returns whether a call was in flight. Fire and forget, like the SDK's own.
        """
        if self.session is None or self.tap is None or self.tap.in_flight is None:
            return False
        from mcp_types import CancelledNotification, CancelledNotificationParams

        params = CancelledNotificationParams(request_id=self.tap.in_flight, reason=reason)
        await self.session.send_notification(CancelledNotification(params=params))
        return True


def tool_result_text(result: Any) -> str:
    """The text a model sees for a CallToolResult: text parts, then structured content."""
    parts: list[str] = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", None)
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(item, 'mime_type', '?')}]")
        elif kind == "resource_link":
            parts.append(f"[resource: {getattr(item, 'uri', '?')}]")
        else:
            parts.append(f"[{kind} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, default=str))
    return "\n".join(parts)


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe_exc(e) for e in exc.exceptions)
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if str(exc) else text


async def start_server(
    spawned: Prespawned,
    spec: McpServerSpec,
    stack: AsyncExitStack,
    *,
    abortable: Callable[[str], AbstractContextManager[trio.CancelScope]],
) -> McpServer:
    """Connect the SDK to a spawned server inside ``stack``, handshake, list its tools.

    Raises:
        McpSetupError: it could not be spawned, broke the handshake, or died.
    """
    name = spawned.name
    server = McpServer(name=name, pgid=spawned.pgid, leader_ticks=spawned.leader_ticks, stderr_path=spawned.stderr_path)
    if spawned.error is not None or spawned.process is None:
        exc = spawned.error
        why = (exc.strerror or str(exc)) if exc is not None else "no process"
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            # The spawn's chdir failed, not the command: ENOENT named the command.
            why = f"its cwd {spec.cwd!r} is not a directory here"
        raise McpSetupError(name, f"cannot start {spec.command!r}: {why}{_tail(server)}")

    starting = trio.CancelScope()  # the handshake: garbage ends it at once

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):
            line = _bad_line_text(message)
            server.protocol_errors.append(line)
            server.broken.set()
            logger.error("mcp server %r wrote a non-JSON-RPC line on stdout: %s", name, line)
            starting.cancel(reason="a non-JSON-RPC line during the server's startup")

    # Bytes no UTF-8 holds become U+FFFD: a line of them is garbage like any other (a
    # protocol error reported as such), not a reader that dies with the handshake.
    params = StdioServerParameters(
        command=spec.command, args=list(spec.args), cwd=spec.cwd, encoding_error_handler="replace"
    )
    token = _handover.set(spawned.process)
    try:
        # The contexts outlive this call, so no cancel scope of ours may wrap their entry.
        # The SDK types errlog TextIO but only hands it to the spawn as stderr (a binary file
        # is a file all the same; here the spawn is a hand-over and does not use it).
        errlog = spawned.errlog
        read, write = await stack.enter_async_context(_stdio.stdio_client(params, errlog=errlog))  # type: ignore[arg-type]
        # Runs right before the SDK's close (LIFO): a server the run stopped acts on none of it.
        stack.callback(resume_stopped_server, spawned)
        server.tap = _OutboundTap(write)
        session = await stack.enter_async_context(ClientSession(read, server.tap, message_handler=on_message))
        with abortable("setup") as abort, starting:
            with trio.fail_after(MCP_START_TIMEOUT_S):
                await session.initialize()
                listed = await session.list_tools()
        if abort.cancelled_caught:
            raise McpSetupError(name, "startup aborted by a stop")
    except trio.TooSlowError:
        raise McpSetupError(
            name, f"did not answer the handshake within {MCP_START_TIMEOUT_S:g} s{_tail(server)}"
        ) from None
    except McpSetupError:
        raise
    except Exception as exc:
        raise McpSetupError(name, f"failed during startup: {_describe_exc(exc)}{_tail(server)}") from None
    finally:
        _handover.reset(token)
    if server.protocol_errors:
        raise McpSetupError(
            name, f"wrote non-JSON on stdout during startup: {server.protocol_errors[0]}", protocol=True
        )
    server.session = session
    server.tools = list(listed.tools)
    return server


def _tail(server: McpServer) -> str:
    tail = server.stderr_tail()
    return f" (its stderr ends: {tail[-500:]!r})" if tail else ""


def _bad_line_text(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            for e in errors():
                if "input" in e:
                    return repr(str(e["input"])[:200])
        except (TypeError, ValueError, AttributeError):
            pass  # not pydantic's shape: fall back to the message
    return repr(str(exc)[:200])
