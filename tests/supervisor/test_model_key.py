"""A run's own model key (``spawn(..., model_key=Secret)``) and a model the daemon cannot use.

The key goes to the runner's environment and nowhere else: not a warm runner (whose
environment was set before), not the commands the runner starts, not the journal. A model
asked for with no key anywhere is refused at spawn, never played by the scripted model.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from supervisor.errors import SpawnError
from supervisor.protocol import Secret

GATE = "while [ ! -f go ]; do sleep 0.02; done; env | grep -c '^OPENAI_' || true"


@pytest.fixture
async def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    config = Config.load(state_dir=tmp_path / "state", grace_s=5, pool_size=1, environ={})
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            while m._pool is None or m._pool.ready < 1:
                await trio.sleep(0.05)  # the warm runner this run must not take
            yield m
            stop.set()


async def test_a_runs_own_key_reaches_its_runner_cold_and_nothing_else(manager: RunManager, tmp_path: Path) -> None:
    key = "sk-test-" + secrets.token_hex(16)
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": GATE}}]}], "final": "ok"}
    with trio.fail_after(60):
        r = await manager.spawn(
            {"task": "t", "model": {"provider": "scripted", "script": script}}, model_key=Secret(key)
        )
        async with manager.subscribe(r["run_id"]) as live:
            async for e in live:
                if e["kind"] == "tool_call" and e["data"]["record"]["state"] == "running":
                    break
        st = await manager.status(r["run_id"])
        environ = Path(f"/proc/{st['pid']}/environ").read_bytes().split(b"\0")
        assert f"OPENAI_API_KEY={key}".encode() in environ  # the runner has it
        assert manager._pool is not None and manager._pool.ready == 1  # a cold runner, not the warm one
        (Path(st["run_dir"]) / "go").touch()
        st = await manager.wait_terminal(r["run_id"])
    assert st["state"] == "completed"
    assert st["tool_calls"][0]["output"].strip().splitlines()[-1] == "0"  # its commands do not see OPENAI_*
    journal = b"".join(p.read_bytes() for p in (tmp_path / "state").glob("agentd.sqlite3*"))
    assert key.encode() not in journal and b"sk-test-" not in journal


@pytest.mark.parametrize("model", [{"name": "gpt-4o-mini"}, {"provider": "openai"}])
async def test_a_model_that_cannot_be_used_is_refused_never_replaced(
    manager: RunManager, model: dict[str, str]
) -> None:
    with pytest.raises(SpawnError) as info:
        await manager.spawn({"task": "t", "model": model})
    message = str(info.value)
    for where in ("OPENAI_API_KEY", "the daemon's environment", "systemd/agentd.env.example", "--model-key-env"):
        assert where in message
    assert await manager.list_runs() == []


async def test_the_provider_the_daemon_chose_is_written_into_the_spec(manager: RunManager) -> None:
    with trio.fail_after(60):
        scripted = await manager.spawn({"task": "t", "model": {"script": {"final": "x"}}})
        local = await manager.spawn({"task": "t", "model": {"name": "m", "base_url": "http://127.0.0.1:9/v1"}})
        for r in (scripted, local):
            await manager.cancel(r["run_id"])
            await manager.wait_terminal(r["run_id"])
    assert (await manager.status(scripted["run_id"]))["spec"]["model"]["provider"] == "scripted"
    assert (await manager.status(local["run_id"]))["spec"]["model"] == {
        "provider": "openai",
        "name": "m",
        "base_url": "http://127.0.0.1:9/v1",
    }
