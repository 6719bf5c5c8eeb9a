"""A cold runner stopped while it imports ``openai`` (~1.2 s here) exits on the stop at once:
the import runs in a worker thread while the loop watches the stop, and is abandoned. On the
loop, the import held the stop until it was done (``tests/subagent/test_mcp_import_stop.py``
is the same for ``mcp``).

A real cold runner (``python -m subagent.runner``) of an ``openai`` run; its ``openai`` is a
stand-in, on its ``PYTHONPATH``, whose import computes for 30 s (and says when it began):
an import that takes long, told apart from a stop that waits for it.
"""

from __future__ import annotations

from pathlib import Path

import trio

from subagent.events import EventKind, ExitCode
from tests.subagent.harness import REPO, runner_env, spec, start_runner
from tests.subagent.test_mcp_import_stop import SLOW_MCP as SLOW_IMPORT


async def test_a_cold_runner_stopped_while_it_imports_openai_exits_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake = run_dir / "slow-imports"
    (fake / "openai").mkdir(parents=True)
    (fake / "openai" / "__init__.py").write_text(SLOW_IMPORT)
    env = runner_env(run_dir, PYTHONPATH=f"{fake}:{REPO}")
    model = {"provider": "openai", "name": "m", "base_url": "http://127.0.0.1:9/v1"}
    async with start_runner(spec(model=model), tmp_path, env=env) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.RUNNER_STARTED)
            while not (fake / "openai" / "importing").exists():  # the import has begun
                await trio.sleep(0.01)
        r.signal()
        sent = trio.current_time()
        rc, result = await r.finish(timeout_s=20)
        took = trio.current_time() - sent
    assert rc == ExitCode.CANCELLED and result["status"] == "cancelled" and result["reason"] == "signal", result
    (stopped,) = r.of(EventKind.STOP_REQUESTED)
    assert stopped.data["during"] == "setup"
    assert took < 5.0, took  # not the import's 30 s
    assert result["imported"]["openai"] is False, result["imported"]  # abandoned half done
