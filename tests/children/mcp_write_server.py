"""A small MCP stdio server with one destructive tool, for the dashboard's Stop tests.

``commit_write(path, gate)`` is annotated destructive and not idempotent (MCP's own
hints: a write a stop must let finish): it creates ``path + ".started"``, waits until the
file ``gate`` exists, then writes ``path`` and answers. The test decides when it finishes.
"""

from __future__ import annotations

import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("writer")


@server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False, read_only_hint=False))
def commit_write(path: str, gate: str) -> str:
    """Write a record (destructive): waits for the gate file, then writes."""
    with open(path + ".started", "w") as f:
        f.write("started\n")
    while not os.path.exists(gate):
        time.sleep(0.02)
    with open(path, "w") as f:
        f.write("written\n")
    return f"wrote {path}"


if __name__ == "__main__":
    server.run()
