"""The CLI's conversation and approval commands, through CliRunner, against a fake backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import ExitCode
from supervisor.control.client import Client, ConnectionLost
from supervisor.core.sessions import SessionNotFound
from supervisor.errors import ControlProtocolError
from tests.supervisor.control_thread import ServerThread
from tests.supervisor.test_cli import run

HISTORY = {
    "session_id": "chat-1",
    "closed_at": None,
    "live_run": None,
    "turns": [
        {
            "run_id": "r-1",
            "state": "cancelled",
            "reason": "user",
            "created_at": 1.0,
            "messages": [
                {"role": "user", "content": "count the lines"},
                {
                    "role": "assistant",
                    "content": "Counting.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "run_command", "arguments": '{"command":"wc -l x"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": "interrupted by the stop; output known before the interruption:\n12 x",
                },
                {"role": "system", "content": "[The user stopped this turn before it finished.]"},
            ],
        }
    ],
    "messages": [],
}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(tmp_path / "state") as srv:
        calls: list[tuple[str, Any]] = []
        srv.calls = calls  # type: ignore[attr-defined]

        async def approve(run_id: str, call_id: str) -> dict[str, Any]:
            calls.append(("approve", (run_id, call_id)))
            if call_id == "nope":
                raise ControlProtocolError("refused", f"call {call_id!r} of run {run_id!r} is not awaiting approval")
            return {"run_id": run_id, "call_id": call_id, "decision": "approved", "state": "awaiting_approval"}

        async def deny(run_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
            calls.append(("deny", (run_id, call_id, reason)))
            return {"run_id": run_id, "call_id": call_id, "decision": "denied", "state": "awaiting_approval"}

        async def history(session_id: str) -> dict[str, Any]:
            if session_id != "chat-1":
                raise SessionNotFound(session_id)
            return HISTORY

        async def list_sessions(*, limit: int) -> dict[str, Any]:
            return {
                "sessions": [
                    {
                        "session_id": "chat-1",
                        "turns": 1,
                        "last_at": 1.0,
                        "last_state": "cancelled",
                        "live_run": None,
                        "closed_at": None,
                        "profile": {"path": "/p", "used_at": 1.0},
                    }
                ]
            }

        async def close_session(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "was_open": True, "stopped": ["r-2"], "profile_removed": True}

        for fn in (approve, deny, history, list_sessions, close_session):
            setattr(srv.backend, fn.__name__, fn)
        yield srv


def test_approve_and_deny_send_the_call_and_a_reason(server: ServerThread) -> None:
    res = run(server, "approve", "r-1", "c1")
    assert res.exit_code == 0 and res.output == "r-1: call c1 approved\n"
    res = run(server, "deny", "r-1", "c2", "--reason", "not on prod", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["decision"] == "denied"
    assert server.calls == [("approve", ("r-1", "c1")), ("deny", ("r-1", "c2", "not on prod"))]  # type: ignore[attr-defined]
    res = run(server, "approve", "r-1", "nope")
    assert res.exit_code == ExitCode.REFUSED and res.output.count("\n") == 1 and "not awaiting approval" in res.output


def test_history_prints_each_turn_and_what_each_call_really_did(server: ServerThread) -> None:
    res = run(server, "history", "chat-1")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert lines[0].startswith("turn 1  r-1  cancelled (user)  ")
    assert lines[1:] == [
        "  user: count the lines",
        "  assistant: Counting.",
        '  -> c1: run_command {"command":"wc -l x"}',
        "  <- c1: interrupted by the stop; output known before the interruption: 12 x",
        "  note: [The user stopped this turn before it finished.]",
    ]
    assert json.loads(run(server, "history", "chat-1", "--json").output) == HISTORY
    res = run(server, "history", "nobody")
    assert res.exit_code == ExitCode.NOT_FOUND and "no session with id 'nobody'" in res.output


def test_sessions_and_session_close(server: ServerThread) -> None:
    res = run(server, "sessions")
    assert res.exit_code == 0
    header, row = res.output.splitlines()
    assert header.split() == ["SESSION", "TURNS", "LAST", "STATE", "LIVE", "PROFILE", "CLOSED"]
    assert row.split()[:2] == ["chat-1", "1"] and row.split()[-4:] == ["cancelled", "-", "yes", "-"]
    res = run(server, "session", "close", "chat-1")
    assert res.exit_code == 0 and res.output == "session chat-1 closed; stopped r-2; browser profile removed\n"


def test_global_options_may_sit_between_session_and_close(server: ServerThread) -> None:
    """`agentd session --json close S`: the options work wherever a user puts them."""
    from tests.supervisor.test_cli import run_bare

    sd = str(server.config.state_dir)
    for args in (
        ["--json", "session", "close", "chat-1", "--state-dir", sd],
        ["session", "--json", "--state-dir", sd, "close", "chat-1"],
        ["session", "--state-dir", sd, "close", "chat-1", "--json"],
    ):
        res = run_bare(*args)
        assert res.exit_code == 0, (args, res.output)
        assert json.loads(res.stdout)["was_open"] is True, args


def test_interrupt_without_a_session_is_a_usage_error(server: ServerThread) -> None:
    res = run(server, "spawn", "x", "--interrupt")
    assert (
        res.exit_code == ExitCode.USAGE
        and res.output == "error: --interrupt needs --session: it stops that session's live turn\n"
    )


@pytest.mark.parametrize(
    ("args", "method", "said"),
    [
        (["session", "close", "chat-1"], "close_session", "the close was sent and may have been done"),
        (["spawn", "t", "--session", "chat-1", "--interrupt"], "spawn", "the spec was sent and may have started"),
    ],
)
def test_a_request_lost_after_it_was_sent_says_the_daemon_may_have_done_it(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, args: list[str], method: str, said: str
) -> None:
    def lost(self: Client, *a: Any, **kw: Any) -> dict[str, Any]:
        exc = ConnectionLost("no reply to 'x' within 45 s")
        exc.sent = True
        raise exc

    monkeypatch.setattr(Client, method, lost)
    res = run(server, *args)
    assert res.exit_code == ExitCode.DISCONNECTED
    assert res.output.startswith("error: no reply to 'x' within 45 s; ") and said in res.output
