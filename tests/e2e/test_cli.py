"""Acceptance 1 of the daemon issue, end to end through the real CLI.

A real ``agentd serve`` process on a temp state dir, the real runner with the embedded
scripted model, and the ``agentd`` console script run as separate processes, as a user
would run them.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from supervisor.control.client import Client

AGENTD = str(Path(sys.executable).with_name("agentd"))


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    state = tmp_path / "state"
    monkeypatch.setenv("AGENTD_STATE_DIR", str(state))
    monkeypatch.setenv("AGENTD_GRACE_S", "2")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    proc = await trio.lowlevel.open_process([AGENTD, "serve"], stderr=-1, start_new_session=True)
    try:
        assert proc.stderr is not None
        log = b""
        with trio.fail_after(20):
            while b"agentd listening on" not in log:
                chunk = await proc.stderr.receive_some()
                assert chunk, f"agentd serve exited early: {log.decode(errors='replace')}"
                log += chunk
        async with trio.open_nursery() as n:
            n.start_soon(_drain, proc.stderr)
            yield state
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                await proc.wait()
            assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    async for _ in stream:
        pass


async def agentd(*args: str) -> tuple[int, str, str]:
    r = await trio.run_process([AGENTD, *args], capture_stdout=True, capture_stderr=True, check=False)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


async def test_spawn_runs_to_completed_through_the_cli(served: Path) -> None:
    with trio.fail_after(60):
        code, out, err = await agentd("spawn", "look around", "--wait")
        assert code == 0, err
        assert "completed" in out
        run_id = out.splitlines()[0].strip()
        code, out, err = await agentd("--json", "status", run_id)
    assert code == 0, err
    status = json.loads(out)
    assert status["state"] == "completed"
    assert status["result"]["final_text"].startswith("Scripted run finished")
    assert [c["state"] for c in status["tool_calls"]] == ["succeeded", "succeeded"]
    events = [json.loads(line) for line in (await agentd("--json", "logs", run_id))[1].splitlines()]
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert states == ["queued", "starting", "running", "completed"]


async def test_cancel_through_the_cli_stops_a_running_command_and_keeps_progress(served: Path, tmp_path: Path) -> None:
    script = tmp_path / "slow.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    {
                        "text": "First a quick look.",
                        "tool_calls": [{"name": "run_command", "arguments": {"command": "echo hello"}}],
                    },
                    {
                        "text": "Now the long part.",
                        "tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 60"}}],
                    },
                ],
                "final": "never reached",
            }
        )
    )
    with trio.fail_after(60):
        code, out, err = await agentd("spawn", "slow job", "--script", str(script))
        assert code == 0, err
        run_id = out.strip()
        await trio.to_thread.run_sync(_wait_for_sleep_running, served, run_id)
        code, out, err = await agentd("--json", "cancel", run_id)
        assert code == 7, err  # the run ended cancelled
        reply = json.loads(out.splitlines()[0])
        assert reply["was_active"] is True
        code, out, err = await agentd("--json", "status", run_id)
        status = json.loads(out)
    assert status["state"] == "cancelled"
    assert status["reason"] == "user"
    calls = {c["arguments"]: c for c in status["tool_calls"]}
    assert calls['{"command":"echo hello"}']["state"] == "succeeded"
    assert calls['{"command":"sleep 60"}']["state"] in ("cancelled", "unknown")
    assert "First a quick look." in json.dumps(status["result"])
    code, out, _ = await agentd("--json", "cancel", run_id)
    assert json.loads(out.splitlines()[0])["was_active"] is False


def _wait_for_sleep_running(state_dir: Path, run_id: str) -> None:
    client = Client(state_dir=state_dir)
    try:
        for ev in client.follow(run_id):
            rec = ev["data"].get("record") if ev["kind"] == "tool_call" else None
            if rec and "sleep" in rec["arguments"] and rec["state"] == "running":
                return
    finally:
        client.close()
    raise AssertionError(f"run {run_id} ended before its sleep command ran")


async def test_cli_errors_are_one_line_with_distinct_codes(served: Path, tmp_path: Path) -> None:
    code, out, err = await agentd("status", "r-does-not-exist")
    assert code == 4
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1
    code, out, err = await agentd("--state-dir", str(tmp_path / "nowhere"), "status")
    assert code == 3
    assert "agentd serve" in err


async def test_steer_through_the_cli_reaches_a_running_run_and_is_refused_after_it(
    served: Path, tmp_path: Path
) -> None:
    wait = "while [ ! -f go ]; do sleep 0.02; done"
    script = tmp_path / "gate.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    {"text": "At the gate.", "tool_calls": [{"name": "run_command", "arguments": {"command": wait}}]}
                ],
                "final": "Finished.",
            }
        )
    )
    with trio.fail_after(60):
        run_id = (await agentd("spawn", "gated", "--script", str(script)))[1].strip()
        await trio.to_thread.run_sync(_wait_for_gate, served, run_id)
        code, out, err = await agentd("--json", "steer", run_id, "mind the logs")
        assert code == 0, err
        assert json.loads(out)["accepted"] is True
        status = json.loads((await agentd("--json", "status", run_id))[1])
        (Path(status["run_dir"]) / "go").touch()
        code, out, err = await agentd("watch", run_id)
        assert code == 0, err
        code, out, err = await agentd("steer", run_id, "too late")
    assert code == 5
    assert "not accepted" in err and err.startswith("error: ") and not out
    events = [json.loads(line) for line in (await agentd("--json", "logs", run_id))[1].splitlines()]
    assert [e["data"]["state"] for e in events if e["kind"] == "steering"] == ["queued", "applied"]


def _wait_for_gate(state_dir: Path, run_id: str) -> None:
    client = Client(state_dir=state_dir)
    try:
        for ev in client.follow(run_id):
            if ev["kind"] == "tool_call" and ev["data"]["record"]["state"] == "running":
                return
    finally:
        client.close()
    raise AssertionError(f"run {run_id} ended before its gate")
