"""A small MCP stdio server (official SDK) that probes, from its own process, what it can reach.

Tools: ``read`` (a file's bytes, or the error), ``write`` (append a line), ``listdir``,
``environ`` (its own environment as JSON). Each answer is one line starting with ``ok`` or
``denied`` (the OSError's strerror), so a test can read what the kernel said.
"""

from __future__ import annotations

import json
import os


def _denied(exc: OSError) -> str:
    return f"denied: {exc.strerror}"


def main() -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("probe")

    @server.tool()
    def read(path: str) -> str:
        """Read a file."""
        try:
            with open(path, "rb") as f:
                return f"ok: {f.read().decode('utf-8', 'replace')}"
        except OSError as exc:
            return _denied(exc)

    @server.tool()
    def write(path: str) -> str:
        """Append a line to a file."""
        try:
            with open(path, "ab") as f:
                f.write(b"written by a probe\n")
            return "ok: written"
        except OSError as exc:
            return _denied(exc)

    @server.tool()
    def listdir(path: str) -> str:
        """List a directory."""
        try:
            return f"ok: {sorted(os.listdir(path))}"
        except OSError as exc:
            return _denied(exc)

    @server.tool()
    def environ() -> str:
        """This process's environment."""
        return "ok: " + json.dumps(dict(os.environ))

    server.run()


if __name__ == "__main__":
    main()
