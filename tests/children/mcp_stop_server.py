"""A small MCP stdio server (official SDK) for stop tests: tools of each nature, and a log.

Tools (their MCP annotations decide what a stop does to them):
  ``read_slowly``   readOnlyHint: true; waits ``seconds`` (default 300), then answers
  ``tidy_up``       destructiveHint: false; waits ``seconds`` (default 300), then answers
  ``write_record``  no hints (MCP's default: destructive); takes ``seconds`` (default 1),
                    then appends ``text`` to the file ``path`` and answers "written"
  ``echo``          no hints; answers at once
Every line the server writes to ``$MCP_STOP_LOG`` (flushed at once):
  ``start <tool> <request id>``, ``end <tool> <request id>``, ``handler-cancelled <tool>
  <request id>``, and ``notifications/cancelled <request id>`` for each such notification
  it *receives* (read off the wire, before the SDK applies it).
"""

from __future__ import annotations

import json
import os
import sys
from types import TracebackType
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.stdio import stdio_server
from mcp_types import JSONRPCNotification, ToolAnnotations

LOG = os.environ.get("MCP_STOP_LOG")


def log(line: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


class TapRead:
    """The server's read stream, logging every notifications/cancelled it receives."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def _see(self, item: Any) -> Any:
        msg = getattr(item, "message", None)
        if isinstance(msg, JSONRPCNotification) and msg.method == "notifications/cancelled":
            log(f"notifications/cancelled {json.dumps((msg.params or {}).get('requestId'))}")
        return item

    async def receive(self) -> Any:
        return self._see(await self._inner.receive())

    def __aiter__(self) -> TapRead:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> TapRead:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


server = MCPServer("stop-test")


async def _wait(tool: str, ctx: Context, seconds: float) -> str:
    rid = json.dumps(ctx.request_context.request_id)
    log(f"start {tool} {rid}")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        log(f"handler-cancelled {tool} {rid}")
        raise
    log(f"end {tool} {rid}")
    return f"{tool} waited {seconds:g} s"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def read_slowly(ctx: Context, seconds: float = 300) -> str:
    """Read something slowly (read-only)."""
    return await _wait("read_slowly", ctx, seconds)


@server.tool(annotations=ToolAnnotations(destructive_hint=False))
async def tidy_up(ctx: Context, seconds: float = 300) -> str:
    """Tidy something up (not destructive)."""
    return await _wait("tidy_up", ctx, seconds)


@server.tool()
async def write_record(ctx: Context, path: str, text: str, seconds: float = 1.0) -> str:
    """Write a record (destructive by MCP's default: no hints)."""
    rid = json.dumps(ctx.request_context.request_id)
    log(f"start write_record {rid}")
    await anyio.sleep(seconds)
    with open(path, "a") as f:
        f.write(text + "\n")
    log(f"end write_record {rid}")
    return "written"


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


async def main() -> None:
    async with stdio_server() as (read, write):
        lowlevel = server._lowlevel_server
        await lowlevel.run(TapRead(read), write, lowlevel.create_initialization_options())


if __name__ == "__main__":
    print("mcp_stop_server: serving", file=sys.stderr, flush=True)
    anyio.run(main)
