"""The README's "Using it" commands, read from README.md and run as typed.

Each line of the section's command block is split like a shell would (``shlex``) and run
as its own process: only the program path (``.venv/bin/agentd``, this venv's console
script) and the placeholders ``RUN`` and ``CALL`` are replaced, and the files and variables a line
names (``my-script.json``, ``MY_OPENAI_KEY``) are provided. Every line has an expectation
below (its documented output shape and exit code); a line added to the README without one
fails the walk. The daemon is a real ``agentd serve``; the model key line talks to
``subagent.model.fake_openai`` through ``OPENAI_BASE_URL`` in the daemon's environment.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from subagent.model.fake_openai import FakeOpenAI
from supervisor.control.client import Client

ROOT = Path(__file__).resolve().parents[2]
AGENTD = str(Path(sys.executable).with_name("agentd"))
# Bounds the daemon's start and its exit after SIGTERM, and the whole walk.
DAEMON_S = 30.0
WALK_S = 120.0
EVENT_LINE = re.compile(r"^#\d+ +(\d\d:\d\d:\d\d|--:--:--)  \S")
RUN_ID = re.compile(r"^r-[0-9a-f]{16}$")
# A run whose command waits for a person's OK (the approve and deny lines answer it).
APPROVAL = {
    "task": "write the marker",
    "model": {
        "provider": "scripted",
        "script": {
            "turns": [
                {
                    "text": "Writing.",
                    "tool_calls": [
                        {"name": "run_command", "id": "call_w", "arguments": {"command": "echo marker > marker"}}
                    ],
                }
            ],
            "final": "The tool said: {{last_output}}",
        },
    },
    "approval": {"commands": ["echo marker*"]},
}
# Waits in a shell command until a file "go" appears in the run's directory.
GATE = {
    "turns": [
        {
            "text": "At the gate.",
            "tool_calls": [{"name": "run_command", "arguments": {"command": "while [ ! -f go ]; do sleep 0.05; done"}}],
        }
    ],
    "final": "Through the gate.",
}


def readme_commands() -> list[list[str]]:
    """The command block of README.md's "Using it" section, each line split like a shell."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Using it\n", 1)[1]
    block: list[str] = []
    for line in section.splitlines():
        if line.startswith("    "):
            block.append(line.strip())
        elif block:
            break
    return [shlex.split(line, comments=True) for line in block]


class Agentd:
    """``agentd`` commands as separate processes, in a working directory, as a user runs them."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = env

    async def __call__(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
        r = await trio.run_process(
            [AGENTD if argv[0] in (".venv/bin/agentd", "agentd") else argv[0], *argv[1:]],
            cwd=self.cwd,
            env={**self.env, **(env or {})},
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return r.returncode, r.stdout.decode(), r.stderr.decode()


@asynccontextmanager
async def serve(argv: list[str], cwd: Path, env: dict[str, str], log: list[bytes]) -> AsyncIterator[trio.Process]:
    """``agentd serve`` in the background (the README's ``&``), until SIGTERM at the end."""
    assert argv[-1] == "&"
    proc = await trio.lowlevel.open_process([AGENTD, *argv[1:-1]], cwd=cwd, env=env, stderr=-1, start_new_session=True)
    try:
        assert proc.stderr is not None
        with trio.fail_after(DAEMON_S):
            while b"agentd listening on" not in b"".join(log):
                chunk = await proc.stderr.receive_some()
                assert chunk, f"agentd serve exited early: {b''.join(log).decode(errors='replace')}"
                log.append(chunk)
        async with trio.open_nursery() as n:
            n.start_soon(_drain, proc.stderr, log)
            yield proc
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(DAEMON_S):
                await proc.wait()
        assert proc.returncode == 0, b"".join(log).decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _drain(stream: trio.abc.ReceiveStream, log: list[bytes]) -> None:
    async for chunk in stream:
        log.append(chunk)


def _wait_for(state_dir: Path, run_id: str, ready: Callable[[dict[str, Any]], bool]) -> None:
    client = Client(state_dir=state_dir)
    try:
        for ev in client.follow(run_id):
            if ready(ev):
                return
    finally:
        client.close()
    raise AssertionError(f"run {run_id} ended before it was ready")


def _gate_running(ev: dict[str, Any]) -> bool:
    return ev["kind"] == "tool_call" and ev["data"]["record"]["state"] == "running"


def _awaiting(ev: dict[str, Any]) -> bool:
    return ev["kind"] == "state" and ev["data"]["state"] == "awaiting_approval"


async def test_every_using_it_command_runs_as_typed_with_its_documented_output_and_exit_code(tmp_path: Path) -> None:
    commands = readme_commands()
    assert len(commands) >= 9 and commands[0][1] == "serve", commands
    state, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    (work / "my-script.json").write_text(json.dumps({"final": "Nothing to browse today."}))
    (work / "gate.json").write_text(json.dumps(GATE))
    (work / "approval.json").write_text(json.dumps(APPROVAL))
    key = "sk-readme-" + secrets.token_hex(16)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    base |= {"AGENTD_STATE_DIR": str(state), "AGENTD_GRACE_S": "2"}
    agentd = Agentd(work, base)
    fake = FakeOpenAI({"final": "The README, summarised."})
    log: list[bytes] = []
    runs: dict[str, str] = {}
    checked: list[str] = []

    async def spawn_gated() -> str:
        code, out, err = await agentd(["agentd", "spawn", "gated", "--script", "gate.json"])
        assert code == 0, err
        run_id = out.strip()
        await trio.to_thread.run_sync(_wait_for, state, run_id, _gate_running)
        return run_id

    async def spawn_awaiting() -> str:
        code, out, err = await agentd(["agentd", "spawn", "--spec", "approval.json"])
        assert code == 0, err
        run_id = out.strip()
        await trio.to_thread.run_sync(_wait_for, state, run_id, _awaiting)
        return run_id

    async def run_line(argv: list[str]) -> None:
        command = argv[1]
        if command == "spawn" and "--wait" in argv:
            code, out, err = await agentd(argv)
            assert code == 0, err
            lines = out.splitlines()
            assert RUN_ID.match(lines[0]) and lines[-1] == f"run {lines[0]} completed", out
            assert all(EVENT_LINE.match(line) for line in lines[1:-1]) and "state: running" in out, out
            runs["count"] = lines[0]
        elif command == "spawn" and "--browser" in argv:
            code, out, err = await agentd(argv)
            assert code == 0, err
            assert RUN_ID.match(out.strip()) and out.count("\n") == 1, out
            runs["browse"] = out.strip()
        elif command == "spawn" and "--model-key-env" in argv:
            env_var = argv[argv.index("--model-key-env") + 1]
            code, out, err = await agentd(argv, env={env_var: key})
            assert code == 0, err
            run_id = out.strip()
            assert RUN_ID.match(run_id), out
            code, out, err = await agentd([".venv/bin/agentd", "watch", run_id])
            assert code == 0, out + err
            chat = fake.chat_requests
            assert chat and chat[0].headers["authorization"] == f"Bearer {key}"
            assert chat[0].body["model"] == argv[argv.index("--model") + 1]
            code, out, err = await agentd([".venv/bin/agentd", "status", run_id])
            rows = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
            assert rows["model"] == "openai gpt-4o-mini" and rows["state"] == "completed", out
            runs["keyed"] = run_id
        elif command == "spawn" and "--session" in argv:
            code, out, err = await agentd(argv)
            assert code == 0, err
            assert RUN_ID.match(out.strip()), out
            runs.setdefault("turns", []).append(out.strip())
            if "--interrupt" in argv:  # the next turn: the first was stopped or had ended; this one ends
                code, out, err = await agentd([".venv/bin/agentd", "watch", out.strip()])
                assert code == 0, out + err
        elif command == "history":
            code, out, err = await agentd(argv)
            assert code == 0, err
            lines = out.splitlines()
            assert (
                lines[0].startswith(f"turn 1  {runs['turns'][0]}  ")
                and f"turn {len(runs['turns'])}  {runs['turns'][-1]}" in out
            ), out
            assert "  user: list the logs" in lines and "  user: now only the errors" in lines, out
            code, out, err = await agentd([*argv, "--json"])
            assert [t["run_id"] for t in json.loads(out)["turns"]] == runs["turns"]
        elif command == "sessions":
            code, out, err = await agentd(argv)
            assert code == 0, err
            lines = out.splitlines()
            assert lines[0].split() == ["SESSION", "TURNS", "LAST", "STATE", "LIVE", "PROFILE", "CLOSED"], out
            assert lines[1].split()[:2] == ["chat-1", str(len(runs["turns"]))], out
        elif command in ("approve", "deny"):
            run_id = await spawn_awaiting()
            code, out, err = await agentd([argv[0], command, run_id, "call_w", *argv[4:]])
            assert code == 0, err
            assert out == f"{run_id}: call call_w {command}d\n".replace("denyd", "denied")
            code, out, err = await agentd([".venv/bin/agentd", "watch", run_id])
            assert code == 0, out + err
            status = json.loads((await agentd([".venv/bin/agentd", "--json", "status", run_id]))[1])
            (call,) = status["tool_calls"]
            if command == "approve":
                assert call["state"] == "succeeded" and status["result"]["final_text"].startswith(
                    "The tool said: [exit code 0]"
                )
            else:
                assert call["state"] == "rejected"
                assert status["result"]["final_text"] == "The tool said: denied by the user: not on prod"
        elif command == "session":
            code, out, err = await agentd(argv)
            assert code == 0, err
            assert out == "session chat-1 closed\n", out
            code, out, err = await agentd(["agentd", "spawn", "one more", "--session", "chat-1"])
            assert code == 5 and "was closed" in err, err
        elif command == "list":
            code, out, err = await agentd(argv)
            assert code == 0, err
            lines = out.splitlines()
            assert lines[0].split() == ["RUN", "STATE", "SESSION", "CREATED", "TASK"]
            assert {runs["count"], runs["browse"]} <= {line.split()[0] for line in lines[1:]}
        elif command == "watch":
            code, out, err = await agentd([*argv[:-1], runs["browse"]])
            assert code == 0, err
            lines = out.splitlines()
            assert lines[-1] == f"run {runs['browse']} completed" and all(EVENT_LINE.match(x) for x in lines[:-1]), out
        elif command == "cancel":
            run_id = await spawn_gated()
            code, out, err = await agentd([*argv[:-1], run_id])
            assert code == 7, out + err  # the README: cancel exits 7 for a run that ends cancelled
            assert out == f"{run_id}: stop sent (was active); cancelled\n"
        elif command == "status":
            code, out, err = await agentd([argv[0], "status", runs["count"], *argv[3:]])
            assert code == 0, err
            status = json.loads(out)
            assert status["state"] == "completed" and status["spec"]["model"]["provider"] == "scripted"
            assert status["result"]["final_text"].startswith("Scripted run finished")
        elif command == "logs":
            code, out, err = await agentd([*argv[:-1], runs["count"]])
            assert code == 0, err
            assert all(EVENT_LINE.match(line) for line in out.splitlines()) and "state: completed" in out, out
            runs["logs_output"] = out
        elif command == "steer":
            run_id = await spawn_gated()
            code, out, err = await agentd([argv[0], "steer", run_id, *argv[3:]])
            assert code == 0, err
            assert out == f"{run_id}: queued for the next step\n"
            status = json.loads((await agentd([argv[0], "--json", "status", run_id]))[1])
            (Path(status["run_dir"]) / "go").touch()
            code, out, err = await agentd([argv[0], "watch", run_id])
            assert code == 0 and "steering applied: mind the logs" in out, out + err
        else:
            raise AssertionError(f"README line without an expectation in this test: {shlex.join(argv)}")
        checked.append(shlex.join(argv))

    with trio.fail_after(WALK_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(fake.serve)
            daemon_env = {**base, "OPENAI_BASE_URL": fake.base_url}
            async with serve(commands[0], work, daemon_env, log):
                checked.append(shlex.join(commands[0]))
                for argv in commands[1:]:
                    await run_line(argv)
            nursery.cancel_scope.cancel()
        # The journal is a file: logs needs no daemon.
        code, out, err = await agentd([".venv/bin/agentd", "logs", runs["count"]])
    assert code == 0 and out == runs["logs_output"], err
    assert checked == [shlex.join(c) for c in commands]
    # The run's own key reached its runner (above) and nothing else that was written.
    leaks = [str(p) for p in state.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaks == []
    assert key.encode() not in b"".join(log)


async def test_a_model_asked_for_without_a_key_is_refused_naming_where_the_key_goes(tmp_path: Path) -> None:
    state, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")} | {"AGENTD_STATE_DIR": str(state)}
    agentd = Agentd(work, env)
    code, out, err = await agentd(["agentd", "status"])
    assert code == 3 and "agentd serve" in err and err.count("\n") == 1
    log: list[bytes] = []
    with trio.fail_after(WALK_S):
        async with serve(["agentd", "serve", "&"], work, env, log):
            code, out, err = await agentd(["agentd", "spawn", "summarise", "--model", "gpt-4o-mini"])
            listed = json.loads((await agentd(["agentd", "list", "--json"]))[1])["runs"]
            usage = await agentd(["agentd", "status", "--jsn"])
    assert code == 5 and out == "" and err.count("\n") == 1, err
    assert err.startswith(
        "error: the daemon refused the spec: invalid run spec: model: model 'gpt-4o-mini' needs an API key"
    )
    for where in (
        "OPENAI_API_KEY",
        "the daemon's environment",
        "/etc/agentd/agentd.env",
        "systemd/agentd.env.example",
        "--model-key-env",
    ):
        assert where in err, where
    assert listed == []  # refused, not run with the scripted model
    assert (
        usage[0] == 2
        and usage[2] == "error: no such option '--jsn'. Did you mean '--json'? (try 'agentd status --help')\n"
    )
