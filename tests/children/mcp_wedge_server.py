"""A small MCP stdio server (raw JSON-RPC, no SDK) that can wedge its client's writer.

Tools (both ``readOnlyHint: true``, so a stop abandons a call of either that was sent):

- ``swallow``: called with a request line longer than ``WEDGE_AFTER`` bytes, the server
  answers it from the line's first part and never reads its stdin again: the client's
  transport stays busy writing the rest of that line, so no later request of the client
  can be handed to it (the client's next call waits at its hand-off, never sent). Until
  its stdin is closed (the client hangs up): then it exits.
- ``hold``: never answers.

Each request it reads and each ``notifications/cancelled`` is logged, one line each, to
``$MCP_WEDGE_LOG`` (``call NAME ID``, ``wedged swallow ID``, ``cancelled ID``).
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
from typing import Any

WEDGE_AFTER = 16 * 1024
_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')
READ_ONLY = {"readOnlyHint": True}
TOOLS = [
    {
        "name": "swallow",
        "description": "Takes a long text.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
        "annotations": READ_ONLY,
    },
    {"name": "hold", "description": "Never answers.", "inputSchema": {"type": "object"}, "annotations": READ_ONLY},
]


def log(line: str) -> None:
    path = os.environ.get("MCP_WEDGE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def send(obj: dict[str, Any]) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def answer(rid: Any, result: dict[str, Any]) -> None:
    send({"jsonrpc": "2.0", "id": rid, "result": result})


def handle(msg: dict[str, Any]) -> None:
    method, rid, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
    if method == "initialize":
        answer(
            rid,
            {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "wedge", "version": "1"},
            },
        )
    elif method == "tools/list":
        answer(rid, {"tools": TOOLS})
    elif method == "tools/call":
        log(f"call {params.get('name')} {json.dumps(rid)}")
        if params.get("name") != "hold":
            answer(rid, {"content": [{"type": "text", "text": "ok"}]})
    elif method == "notifications/cancelled":
        log(f"cancelled {json.dumps(params.get('requestId'))}")
    elif rid is not None:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}})


def wedge(rid: bytes) -> None:
    """Answer the long call from its start; read nothing more; exit when the client hangs up."""
    log(f"wedged swallow {rid.decode()}")
    answer(json.loads(rid), {"content": [{"type": "text", "text": "swallowed the start"}]})
    poller = select.poll()
    poller.register(0, select.POLLHUP)  # a pipe's read end: POLLHUP once no writer is left
    while True:
        for _fd, ev in poller.poll():
            if ev & (select.POLLHUP | select.POLLERR):
                sys.exit(0)


def main() -> None:
    buf = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                handle(json.loads(line))
        if len(buf) > WEDGE_AFTER and b'"tools/call"' in buf[:4096] and b'"swallow"' in buf[:4096]:
            found = _ID.search(buf[:4096])
            if found is not None:
                wedge(found.group(1))


if __name__ == "__main__":
    main()
