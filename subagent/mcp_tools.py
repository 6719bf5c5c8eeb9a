"""MCP servers over stdio through the official SDK: start, list tools, call, and end them.

Invariants: each server's pid (== its pgid: the SDK starts it with start_new_session)
is reported through ``on_group`` the moment it is spawned, before the handshake, via the
SDK's seam ``mcp.client.stdio._create_platform_compatible_process``; a server's stderr
goes to a file (never the runner's stderr); on close the SDK's own shutdown runs (shielded, every
wait bounded by the SDK: about 6 s at worst; no scope of ours may wrap it, as it exits
a task group entered earlier), then the whole group and any marked escaper are ended, and only then is the
group reported gone. A non-JSON line on a server's stdout is a protocol break: the SDK
skips the line (and hands it to the session's message handler); we record it on the
server (``protocol_errors``) so the loop can end the run with ``TOOL_PROTOCOL``.
This module imports ``mcp``; the runner imports it only when the spec has MCP servers.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import mcp.client.stdio as _stdio
import trio
from mcp import ClientSession, StdioServerParameters

from subagent.commands import SUBTREE_VAR
from subagent.groups import sweep_marked, terminate_group
from subagent.spec import McpServerSpec

__all__ = ["McpServer", "McpSetupError", "start_server", "ToolResultText"]

logger = logging.getLogger(__name__)

# Bounds the handshake and the first tools/list of one server (seconds).
MCP_START_TIMEOUT_S: Final = 30.0
# Between SIGTERM and SIGKILL for a server's group (seconds).
MCP_KILL_GRACE_S: Final = 2.0
# How much of a server's stderr an error message quotes (bytes).
STDERR_TAIL_BYTES: Final = 2000

_on_spawn: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("_on_spawn", default=None)
_sdk_spawn = _stdio._create_platform_compatible_process


async def _spawn_and_report(*args: Any, **kwargs: Any) -> Any:
    process = await _sdk_spawn(*args, **kwargs)
    report = _on_spawn.get()
    if report is not None:
        report(process.pid)
    return process


# The SDK's documented test seam; wrapping it is how we learn each server's pgid.
_stdio._create_platform_compatible_process = _spawn_and_report


class McpSetupError(Exception):
    def __init__(self, server: str, message: str, *, protocol: bool = False) -> None:
        super().__init__(f"mcp server {server!r}: {message}")
        self.server = server
        self.message = message
        self.protocol = protocol


@dataclass
class McpServer:
    name: str
    pgid: int | None = None
    session: ClientSession | None = None
    tools: list[Any] = field(default_factory=list)
    stderr_path: Path | None = None
    protocol_errors: list[str] = field(default_factory=list)
    closed: bool = False

    def stderr_tail(self) -> str:
        if self.stderr_path is None:
            return ""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - STDERR_TAIL_BYTES))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    async def call(self, tool: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        """Call a tool; returns (is_error, text). Raises on transport or protocol failure."""
        assert self.session is not None
        result = await self.session.call_tool(tool, arguments)
        return bool(getattr(result, "is_error", False)), ToolResultText(result)


def ToolResultText(result: Any) -> str:
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


def server_env(spec: McpServerSpec, marker: str) -> dict[str, str]:
    """What we add to the SDK's default env: AGENTD_*, TMPDIR, the spec's env, our marker."""
    ours = {k: v for k, v in os.environ.items() if k.startswith("AGENTD_")}
    env = dict(ours)
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    env.update(spec.env)
    env.update(ours)  # containment markers cannot be overridden by a spec
    env[SUBTREE_VAR] = marker
    return env


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe_exc(e) for e in exc.exceptions)
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if str(exc) else text


async def start_server(
    name: str,
    spec: McpServerSpec,
    stack: AsyncExitStack,
    *,
    run_dir: Path | None,
    on_group: Callable[[int, bool], None],
    abortable: Callable[[str], AbstractContextManager[trio.CancelScope]],
) -> McpServer:
    """Start one server inside ``stack`` (which closes it) and list its tools.

    Raises:
        McpSetupError: it could not be spawned, broke the handshake, or died.
    """
    server = McpServer(name=name)
    marker = f"{os.getpid()}-mcp-{name}"
    errlog: IO[bytes] | None = None
    if run_dir is not None:
        try:
            errlog = open(run_dir / f"mcp-{name}.stderr.log", "ab")
            server.stderr_path = run_dir / f"mcp-{name}.stderr.log"
        except OSError as exc:
            logger.warning("cannot write mcp server %r stderr into the run dir: %s", name, exc)
    if errlog is None:
        errlog = tempfile.NamedTemporaryFile(prefix=f"mcp-{name}-", suffix=".stderr.log", delete=False)
        server.stderr_path = Path(errlog.name)
    stack.callback(errlog.close)

    async def finish() -> None:
        # Runs after the SDK's own close: the group and escapers go, whatever happened.
        server.closed = True
        if server.pgid is not None:
            await terminate_group(server.pgid, grace_s=MCP_KILL_GRACE_S, what=f"mcp server {name!r} group")
        await sweep_marked(SUBTREE_VAR, marker)
        if server.pgid is not None:
            on_group(server.pgid, False)

    stack.push_async_callback(finish)

    def spawned(pid: int) -> None:
        server.pgid = pid
        on_group(pid, True)

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):
            line = _bad_line_text(message)
            server.protocol_errors.append(line)
            logger.error("mcp server %r wrote a non-JSON-RPC line on stdout: %s", name, line)

    params = StdioServerParameters(
        command=spec.command,
        args=list(spec.args),
        env=server_env(spec, marker),
        cwd=spec.cwd,
    )
    token = _on_spawn.set(spawned)
    try:
        # The contexts outlive this call, so no cancel scope of ours may wrap their entry.
        read, write = await stack.enter_async_context(_stdio.stdio_client(params, errlog=errlog))
        session = await stack.enter_async_context(ClientSession(read, write, message_handler=on_message))
        with abortable("setup") as abort:
            with trio.fail_after(MCP_START_TIMEOUT_S):
                await session.initialize()
                listed = await session.list_tools()
        if abort.cancelled_caught:
            raise McpSetupError(name, "startup aborted by a stop")
    except trio.TooSlowError:
        raise McpSetupError(name, f"did not answer the handshake within {MCP_START_TIMEOUT_S:g} s{_tail(server)}") from None
    except OSError as exc:
        raise McpSetupError(name, f"cannot start {spec.command!r}: {exc.strerror or exc}{_tail(server)}") from None
    except Exception as exc:
        raise McpSetupError(name, f"failed during startup: {_describe_exc(exc)}{_tail(server)}") from None
    finally:
        _on_spawn.reset(token)
    if server.protocol_errors:
        raise McpSetupError(name, f"wrote non-JSON on stdout during startup: {server.protocol_errors[0]}", protocol=True)
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
        except Exception:
            pass
    return repr(str(exc)[:200])


def tool_specs(servers: Mapping[str, McpServer]) -> list[tuple[str, str, Any]]:
    """(server, tool name, tool) for every tool of every server."""
    return [(s.name, t.name, t) for s in servers.values() for t in s.tools]
