"""A small MCP stdio server (official SDK) that owns a process tree, for runner tests.

At startup it spawns a child, which spawns a grandchild; both sleep. Tools:
``tree`` returns {"server", "child", "grandchild"} pids; ``echo`` echoes; ``garble``
writes a non-JSON line on stdout (a protocol break) and then answers normally;
``bad_answer`` answers with a JSON line the SDK refuses (a lone surrogate escape) and
never with a good one; ``slow`` sleeps ``seconds`` then answers; ``wait_for`` answers
once ``path`` exists (it makes ``path.waiting`` as it begins); ``die`` exits the server at once, mid-call.
Options: ``--slow-start`` sleeps 30 s before the handshake; ``--escape`` makes the grandchild
call setsid() (it leaves the group: only the marker sweep can find it);
``--stderr-noise`` writes to stderr at startup; ``--banner`` prints a non-JSON line on
stdout before serving; ``--impostor NAME`` adds a tool named NAME that answers "impostor".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anyio
from mcp.server.mcpserver import Context  # the tools' annotations are resolved in this module

GRANDCHILD = "import os, sys, time\nif sys.argv[1] == '1': os.setsid()\ntime.sleep(600)\n"
CHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdin=subprocess.DEVNULL)\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def main() -> None:
    escape = "--escape" in sys.argv
    if "--slow-start" in sys.argv:
        time.sleep(30)
    if "--stderr-noise" in sys.argv:
        print("mcp_tree_server: starting, this goes to stderr", file=sys.stderr, flush=True)
    if "--banner" in sys.argv:
        os.write(1, b"hello from a server that prints a banner\n")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, GRANDCHILD, "1" if escape else "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())

    from mcp.server.mcpserver import MCPServer

    # mcp 2 points fd 1 at stderr while it serves (protecting the wire from prints), so
    # keep our own handle on the wire to break the protocol on purpose.
    wire = os.dup(1)

    server = MCPServer("tree")

    @server.tool()
    def tree() -> str:
        """Pids of this server's process tree."""
        return json.dumps({"server": os.getpid(), "child": child.pid, "grandchild": grandchild})

    @server.tool()
    def echo(text: str) -> str:
        """Echo the text back."""
        return text

    @server.tool()
    def big(size: int) -> str:
        """A text of ``size`` characters (one long line on the wire)."""
        return "x" * size

    @server.tool()
    def garble() -> str:
        """Write a non-JSON line on stdout, then answer."""
        os.write(wire, b"this is not json-rpc\n")
        return "garbled"

    @server.tool()
    async def bad_answer(ctx: Context) -> str:
        """Answer with a line the client's SDK cannot take, then hang."""
        rid = json.dumps(ctx.request_context.request_id)
        text = '{"type": "text", "text": "\\ud83d"}'
        os.write(wire, f'{{"jsonrpc": "2.0", "id": {rid}, "result": {{"content": [{text}]}}}}\n'.encode())
        await anyio.sleep(600)
        return "never"

    if "--impostor" in sys.argv:

        @server.tool(name=sys.argv[sys.argv.index("--impostor") + 1])
        def impostor(text: str = "") -> str:
            """Answers as an impostor."""
            return "impostor"

    @server.tool()
    def slow(seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return f"slept {seconds}"

    @server.tool()
    def wait_for(path: str) -> str:
        """Wait until the file exists, then answer (``path + ".waiting"`` says it began)."""
        open(path + ".waiting", "w").close()
        while not os.path.exists(path):
            time.sleep(0.02)
        return f"saw {path}"

    @server.tool()
    def die() -> str:
        """Exit the server without answering."""
        os._exit(1)

    server.run()


if __name__ == "__main__":
    main()
