"""A cold runner stopped while it imports ``mcp`` (1.3-1.6 s) exits on the stop at once: the
import runs in a worker thread while the loop watches the stop, and is abandoned. On the
loop, the import held the stop until it was done (a cold runner stopped then exited 1.5-2.5 s
after its SIGTERM, here).

A real cold runner (``python -m subagent.runner``); its ``mcp`` is a stand-in, on its
``PYTHONPATH``, whose import computes for 30 s (and says when it began): an import that
takes long, told apart from a stop that waits for it.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import trio

from subagent.events import EventKind, ExitCode
from tests.subagent.harness import REPO, runner_env, spec, start_runner

# The stand-in's import: says it began (a file beside it), then computes for 30 s.
SLOW_MCP = """\
import os, time
open(os.path.join(os.path.dirname(__file__), "importing"), "w").close()
end = time.monotonic() + 30
while time.monotonic() < end:
    sum(range(1000))
"""


async def test_a_cold_runner_stopped_while_it_imports_mcp_exits_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake = run_dir / "slow-imports"
    (fake / "mcp").mkdir(parents=True)
    (fake / "mcp" / "__init__.py").write_text(SLOW_MCP)
    env = runner_env(run_dir, PYTHONPATH=f"{fake}:{REPO}")
    server = {"command": "/bin/sh", "args": ["-c", "sleep 300"]}
    async with start_runner(spec(script={"final": "x"}, mcpServers={"s": server}), tmp_path, env=env) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.PROCESS_GROUP, lambda e: e.data["alive"])
            while not (fake / "mcp" / "importing").exists():  # the import has begun
                await trio.sleep(0.01)
        r.signal()
        sent = trio.current_time()
        rc, result = await r.finish(timeout_s=20)
        took = trio.current_time() - sent
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled" and result["reason"] == "signal", result
    (stopped,) = r.of(EventKind.STOP_REQUESTED)
    assert stopped.data["during"] == "setup"
    assert took < 5.0, took  # not the import's 30 s
    # Abandoned half done (in sys.modules from its start): not imported, as the result says.
    assert result["imported"]["mcp"] is False, result["imported"]
    (group,) = [e.data["pgid"] for e in r.of(EventKind.PROCESS_GROUP) if e.data["alive"]]
    assert not psutil.pid_exists(group) or psutil.Process(group).status() == psutil.STATUS_ZOMBIE
