"""The agentd CLI through click's CliRunner, against a control server with a fake backend."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from subagent.osedge import run_trio
from subagent.spec import RunSpec
from supervisor.cli import ExitCode, build_spec, cli, format_event
from supervisor.control import _wsclient
from supervisor.control import client as client_mod
from tests.supervisor.control_thread import ServerThread

STEPS: list[tuple[str, dict[str, Any]]] = [
    ("runner_started", {"pid": 4242, "provider": "scripted"}),
    ("step_started", {"step": 1}),
    ("tool_call", {"record": {"name": "run_command", "state": "running"}}),
    ("tool_call", {"record": {"name": "run_command", "state": "succeeded"}}),
    ("step_snapshot", {"step": 1, "progress": "listed the files"}),
    ("assistant_text", {"step": 2, "text": "All done."}),
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(tmp_path / "state") as srv:
        srv.backend.autoplay["ok"] = (STEPS, "completed")
        srv.backend.autoplay["fails"] = (STEPS[:2], "failed")
        yield srv


def run(server: ServerThread | Path, *args: str, env: dict[str, str] | None = None) -> Result:
    state_dir = server if isinstance(server, Path) else server.config.state_dir
    return CliRunner(env=env).invoke(
        cli, ["--state-dir", str(state_dir), *args], catch_exceptions=False, prog_name="agentd"
    )


def write_spec(tmp_path: Path, spec: dict[str, Any]) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


# --------------------------------------------------------------------------- light import path


def test_importing_the_cli_imports_no_trio_openai_or_mcp() -> None:
    code = (
        "import sys, supervisor.cli; "
        "print(sorted(m for m in ('trio', 'trio_websocket', 'wsproto', 'openai', 'mcp', 'httpx2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_status_round_trip_in_a_fresh_process_stays_off_the_heavy_imports(server: ServerThread) -> None:
    code = (
        "import sys\n"
        "from supervisor.cli import cli\n"
        f"cli.main(['--state-dir', {str(server.config.state_dir)!r}, '--json', 'status'], standalone_mode=False)\n"
        "print(sorted(m for m in ('trio', 'trio_websocket', 'openai', 'mcp', 'httpx2') if m in sys.modules))\n"
    )
    # The latency itself (~65 ms here, of which python 21 and click 23) is not asserted:
    # wall time on a loaded CI machine says little; the imports are what keep it low.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, last = out.stdout.strip().splitlines()
    assert json.loads(first)["daemon"]["pid"] > 0
    assert last == "[]"


# --------------------------------------------------------------------------- spawn


def test_spawn_prints_the_run_id_and_passes_options_into_the_spec(server: ServerThread, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text("{}")
    res = run(
        server,
        "spawn",
        "list the files",
        "--script",
        str(script),
        "--max-steps",
        "3",
        "--session",
        "s1",
        "--timeout",
        "60",
    )
    assert res.exit_code == 0, res.output
    run_id = res.stdout.strip()
    assert run_id in server.backend.runs
    sent = server.backend.spawns[-1]
    assert sent["session_id"] == "s1" and sent["timeout_s"] == 60.0
    assert sent["spec"] == {
        "task": "list the files",
        "model": {"script_path": str(script.resolve()), "provider": "scripted"},
        "limits": {"max_steps": 3},
    }


def test_spawn_wait_follows_the_run_to_completion_with_progress_lines(server: ServerThread, tmp_path: Path) -> None:
    """The CLI side of acceptance 1: spawn, watch it run, completed, exit 0."""
    res = run(server, "spawn", "--spec", write_spec(tmp_path, {"task": "go", "autoplay": "ok"}), "--wait")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    run_id = lines[0]
    assert run_id.startswith("r-")
    text = res.stdout
    for expected in (
        "state: running",
        "runner started (pid 4242",
        "step 1",
        "tool run_command succeeded",
        "snapshot after step 1: listed the files",
        "assistant: All done.",
        "state: completed",
    ):
        assert expected in text, (expected, text)
    assert lines[-1] == f"run {run_id} completed"


@pytest.mark.parametrize(("autoplay", "code"), [("ok", ExitCode.OK), ("fails", ExitCode.RUN_FAILED)])
def test_spawn_wait_exit_code_reflects_the_outcome(
    server: ServerThread, tmp_path: Path, autoplay: str, code: int
) -> None:
    res = run(server, "spawn", "--spec", write_spec(tmp_path, {"task": "go", "autoplay": autoplay}), "--wait")
    assert res.exit_code == code, res.output


def test_spawn_wait_json_is_one_object_per_line(server: ServerThread, tmp_path: Path) -> None:
    res = run(server, "--json", "spawn", "--spec", write_spec(tmp_path, {"task": "go", "autoplay": "ok"}), "--wait")
    assert res.exit_code == 0, res.output
    objs = [json.loads(line) for line in res.stdout.splitlines()]
    assert objs[0]["state"] == "running" and objs[0]["run_id"].startswith("r-")
    seqs = [o["seq"] for o in objs[1:-1]]
    assert seqs == list(range(1, len(STEPS) + 3))
    assert objs[-1] == {"end": True, "run_id": objs[0]["run_id"], "state": "completed", "last_seq": seqs[-1]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "expected a TASK"),
        (["--spec", "/nonexistent/spec.json"], "cannot read spec file"),
        (["x", "--script", "/nonexistent/script.json"], "does not exist"),
        (["x", "--mcp-config", "/nonexistent/mcp.json"], "cannot read mcp config"),
    ],
)
def test_spawn_user_errors_are_one_line_and_exit_2(server: ServerThread, args: list[str], message: str) -> None:
    res = run(server, "spawn", *args)
    assert res.exit_code == ExitCode.USAGE
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ") and message in res.stderr
    assert not server.backend.spawns


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"task": "x", "limits": {"max_steps": NaN}}', "is not valid json: NaN is not valid json"),
        (b'{"task": "x", "timeout_s": Infinity}', "is not valid json: Infinity is not valid json"),
        (b'{"task": "x", "timeout_s": 1e999}', "expected finite numbers, got 1e999"),
        (b'{"task": "caf\xe9"}', "is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "is not valid json: nested too deeply"),
    ],
)
def test_a_spec_file_the_daemon_could_not_take_is_one_line_and_exit_2(
    server: ServerThread, tmp_path: Path, content: bytes, message: str
) -> None:
    # NaN was sent as null (a limit silently dropped); the others printed a traceback.
    spec = tmp_path / "spec.json"
    spec.write_bytes(content)
    res = run(server, "spawn", "--spec", str(spec))
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: spec file ") and message in res.stderr
    assert not server.backend.spawns


def test_a_spec_file_that_never_ends_is_read_only_up_to_the_daemons_limit(server: ServerThread) -> None:
    from supervisor.cli import JSON_FILE_MAX_BYTES

    res = run(server, "spawn", "--spec", "/dev/zero")  # was read until memory ran out
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr == f"error: spec file '/dev/zero' is larger than {JSON_FILE_MAX_BYTES} bytes\n"


def test_a_spec_read_from_a_pipe_is_taken(server: ServerThread, tmp_path: Path) -> None:
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf '%s' '{{\"task\": \"from a pipe\"}}' > {fifo}"])
    try:
        res = run(server, "spawn", "--spec", str(fifo))
    finally:
        assert writer.wait(timeout=10) == 0
    assert res.exit_code == 0, res.output
    assert server.backend.spawns[0]["spec"]["task"] == "from a pipe"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", ""], "expected 'run_id' to be a non-empty string, got an empty string"),
        (["cancel", " "], "expected 'run_id' to be a non-empty string, got a blank string"),
        (["steer", "r", ""], "expected 'text' to be a non-empty string, got an empty string"),
        (["spawn", "x", "--session", "S" * 300], "expected 'session_id' of at most 256 chars, got 300"),
    ],
)
def test_arguments_the_daemon_finds_bad_are_usage_errors(server: ServerThread, args: list[str], message: str) -> None:
    # They exited 5 ("refused by the daemon"), as a spec it cannot run does; and an empty
    # id was "expected a non-empty string, got a string".
    res = run(server, *args)
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr == f"error: {message} (bad_args)\n"
    assert not server.backend.spawns


def test_a_spec_the_daemon_refuses_exits_5(server: ServerThread, tmp_path: Path) -> None:
    res = run(server, "spawn", "--spec", write_spec(tmp_path, {"task": "x", "model": "gpt"}))
    assert res.exit_code == ExitCode.REFUSED
    assert res.stderr.startswith("error: the daemon refused the spec: model")


def write_specs(tmp_path: Path, specs: list[dict[str, Any]]) -> list[str]:
    paths = []
    for i, spec in enumerate(specs):
        path = tmp_path / f"spec-{i}.json"
        path.write_text(json.dumps(spec))
        paths.append(str(path))
    return paths


def test_spawn_of_several_specs_prints_each_run_id_in_order(server: ServerThread, tmp_path: Path) -> None:
    # More specs than the client keeps unanswered at once: the window refills as replies come.
    n = client_mod.PIPELINE_WINDOW + 8
    paths = write_specs(tmp_path, [{"task": f"task {i}"} for i in range(n)])
    res = run(server, "spawn", "--max-steps", "2", *(a for p in paths for a in ("--spec", p)))
    assert res.exit_code == 0, res.output
    run_ids = res.stdout.split()
    assert len(run_ids) == n == len(set(run_ids))
    for i, run_id in enumerate(run_ids):
        assert server.backend.runs[run_id].spec == {"task": f"task {i}", "limits": {"max_steps": 2}}


def test_spawn_of_several_specs_in_json_is_one_object_per_line(server: ServerThread, tmp_path: Path) -> None:
    paths = write_specs(tmp_path, [{"task": "a"}, {"task": "b"}])
    res = run(server, "--json", "spawn", "--timeout", "30", "--spec", paths[0], "--spec", paths[1])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [server.backend.runs[r["run_id"]].spec["task"] for r in rows] == ["a", "b"]
    assert [server.backend.runs[r["run_id"]].timeout_s for r in rows] == [30.0, 30.0]


def test_a_refused_spec_among_several_names_its_file_and_the_others_start(server: ServerThread, tmp_path: Path) -> None:
    paths = write_specs(tmp_path, [{"task": "a"}, {"task": "b", "model": "gpt"}, {"task": "c"}])
    res = run(server, "spawn", *(a for p in paths for a in ("--spec", p)))
    assert res.exit_code == ExitCode.REFUSED
    assert (
        res.stderr
        == f"error: spec file {paths[1]!r}: the daemon refused the spec: model: expected an object, got str\n"
    )
    started = res.stdout.split()
    assert [server.backend.runs[r].spec["task"] for r in started] == ["a", "c"]


@pytest.mark.parametrize(
    ("option", "message"),
    [(["--wait"], "--wait follows one run"), (["--session", "s1"], "--session takes one --spec")],
)
def test_wait_and_session_take_one_spec(server: ServerThread, tmp_path: Path, option: list[str], message: str) -> None:
    paths = write_specs(tmp_path, [{"task": "a"}, {"task": "b"}])
    res = run(server, "spawn", *option, "--spec", paths[0], "--spec", paths[1])
    assert res.exit_code == ExitCode.USAGE
    assert res.stderr.startswith(f"error: {message}")
    assert not server.backend.spawns


def test_spawn_many_reports_each_request_a_broken_connection_left_unsent(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_mod, "PIPELINE_WINDOW", 1)  # one at a time: the drop falls between two
    real_send = _wsclient.WebSocket.send_text
    sends = {"n": 0}

    def drop_before_the_second_request(self: Any, text: str) -> None:
        sends["n"] += 1
        if sends["n"] == 2:
            self._sock.shutdown(socket.SHUT_RDWR)  # the network drops us mid-burst
        real_send(self, text)

    monkeypatch.setattr(_wsclient.WebSocket, "send_text", drop_before_the_second_request)
    with client_mod.Client(state_dir=server.config.state_dir) as c:
        results = c.spawn_many([{"task": f"t{i}"} for i in range(3)])
    first, *rest = results
    assert isinstance(first, dict) and server.backend.runs[first["run_id"]].spec == {"task": "t0"}, results
    assert all(isinstance(r, client_mod.ConnectionLost) and str(r).startswith("not sent") for r in rest), results
    assert len(server.backend.spawns) == 1


def test_build_spec_reads_claude_desktop_mcp_files_and_merges_options(tmp_path: Path) -> None:
    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"mcpServers": {"fs": {"command": "npx", "args": ["fs"]}}}))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(
        json.dumps({"task": "old", "model": {"provider": "openai", "name": "a"}, "limits": {"deadline_s": 5}})
    )
    spec = build_spec("new", spec_file=spec_file, model="b", mcp_config=mcp, browser=True, max_steps=4)
    assert spec == {
        "task": "new",
        "model": {"provider": "openai", "name": "b"},
        "limits": {"deadline_s": 5, "max_steps": 4},
        "mcpServers": {"fs": {"command": "npx", "args": ["fs"]}},
        "browser": True,
    }


def test_build_spec_refuses_an_mcp_file_without_mcp_servers(tmp_path: Path) -> None:
    from supervisor.cli import CliError

    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"servers": {}}))
    with pytest.raises(CliError) as info:
        build_spec("t", mcp_config=mcp)
    assert info.value.exit_code == ExitCode.USAGE and "mcpServers" in info.value.message


# --------------------------------------------------------------------------- watch and logs


def test_watch_resumes_after_a_dropped_connection_printing_each_event_once(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = server.backend
    run_id = server.call(b.add_run)
    for kind, data in STEPS:
        server.call(b.emit, run_id, kind, data)
    real_recv = _wsclient.WebSocket.recv_text
    seen = {"events": 0}

    def drop_after_the_second_event(self: Any, timeout_s: float | None) -> str:
        msg = real_recv(self, timeout_s)
        if '"op":"event"' in msg:
            seen["events"] += 1
            if seen["events"] == 2:
                self._sock.shutdown(socket.SHUT_RDWR)  # the network drops us mid-stream
                server.call(b.emit, run_id, "log", {"message": "while you were away"})
                server.call(b.finish, run_id, "cancelled")
        return msg

    monkeypatch.setattr(_wsclient.WebSocket, "recv_text", drop_after_the_second_event)
    res = run(server, "watch", run_id)
    assert res.exit_code == ExitCode.RUN_CANCELLED, res.output
    seqs = [int(line.split()[0][1:]) for line in res.stdout.splitlines() if line.startswith("#")]
    assert seqs == list(range(1, len(STEPS) + 4))
    assert "while you were away" in res.stdout
    assert "connection to the daemon dropped; resumed after #" in res.stderr
    assert b.cancels == []


def test_watch_of_a_live_run_ends_at_its_terminal_state(server: ServerThread, tmp_path: Path) -> None:
    spawned = run(server, "spawn", "--spec", write_spec(tmp_path, {"task": "go", "autoplay": "fails"}))
    run_id = spawned.stdout.strip()
    res = run(server, "watch", run_id)
    assert res.exit_code == ExitCode.RUN_FAILED
    assert res.stdout.splitlines()[-1] == f"run {run_id} failed"


def make_journal(state_dir: Path, events: list[tuple[str, dict[str, Any]]], *, final: str | None = None) -> str:
    """A real journal file with one run and its events, written and closed: no daemon."""

    from supervisor.states import RunState
    from supervisor.store.journal import Journal

    async def write() -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        journal = await Journal.open(state_dir / "agentd.sqlite3")
        try:
            await journal.create_run("r-1", session_id=None, spec={"task": "t"}, created_at=time.time(), timeout_s=None)
            for kind, data in events:
                await journal.append_event("r-1", kind, data)
            if final is not None:
                await journal.finish(
                    "r-1", RunState(final), reason=None, result=None, partial=False, error=None, receipt=None
                )
        finally:
            await journal.aclose()

    run_trio(write)
    return "r-1"


def test_logs_reads_the_journal_file_with_no_daemon(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run_id = make_journal(
        state, [("state", {"state": "running"}), ("log", {"level": "warning", "message": "disk almost full"})]
    )
    assert not (state / "daemon.json").exists()  # nothing to connect to
    res = run(state, "logs", run_id)
    assert res.exit_code == 0, res.output
    assert "[warning] disk almost full" in res.stdout and "state: running" in res.stdout
    res = run(state, "logs", run_id, "--after", "1", "--json")
    assert [json.loads(line)["seq"] for line in res.stdout.splitlines()] == [2]
    assert json.loads(res.stdout)["data"] == {"level": "warning", "message": "disk almost full"}


def test_logs_of_an_unknown_run_or_without_a_journal_is_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    res = run(state, "logs", "r-1")
    assert res.exit_code == ExitCode.NO_DAEMON and res.stderr.startswith("error: no journal at")
    assert res.stderr.count("\n") == 1
    make_journal(state, [])
    res = run(state, "logs", "r-nope")
    assert res.exit_code == ExitCode.NOT_FOUND and res.stderr == "error: no run with id 'r-nope'\n"


def test_logs_follow_of_an_ended_run_needs_no_daemon_and_exits_with_its_outcome(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run_id = make_journal(state, [("log", {"message": "x"})], final="failed")
    res = run(state, "logs", "-f", run_id)
    assert res.exit_code == ExitCode.RUN_FAILED, res.output
    assert res.stdout.splitlines()[-1] == f"run {run_id} failed"


def test_logs_follow_continues_through_the_daemon_until_the_end(real_daemon: Path) -> None:
    spawned = run(real_daemon, "spawn", "count the files")
    res = run(real_daemon, "logs", "-f", spawned.stdout.strip())
    assert res.exit_code == 0 and "state: completed" in res.stdout
    assert res.stdout.splitlines()[-1] == f"run {spawned.stdout.strip()} completed"


def test_spawn_with_a_key_twice_prints_one_run(real_daemon: Path) -> None:
    first = run(real_daemon, "spawn", "--key", "job-1", "count the files")
    again = run(real_daemon, "spawn", "--key", "job-1", "count the files")
    assert first.exit_code == again.exit_code == 0 and first.stdout == again.stdout
    # The run id alone would read as a new run: the second one says it is not.
    assert first.stderr == "" and again.stderr.startswith("note: --key 'job-1' was used before: "), again.stderr
    assert "nothing new was started" in again.stderr and "not a turn of any session" in again.stderr
    other = run(real_daemon, "spawn", "--key", "job-1", "--session", "s-other", "count the files")
    assert other.stdout == first.stdout and "not a turn of session 's-other' as asked" in other.stderr, other.stderr
    listed = run(real_daemon, "--json", "list")
    assert listed.exit_code == 0 and len(json.loads(listed.stdout)["runs"]) == 1, listed.stdout


def test_a_spawn_key_on_the_wire_starts_one_run_and_the_fleet_agents_lookup_finds_it(real_daemon: Path) -> None:
    # The daemon end to end (socket, journal) for the fleet's hand-off: a spawn sent again
    # with its key, its answer lost, is the run the first one made; the agent's lookup of
    # a lost answer by key finds exactly that run, and no run for a key never used.
    from types import SimpleNamespace

    from supervisor.config import ENDPOINT_FILE, TOKEN_FILE
    from supervisor.control._statefiles import read_endpoint, read_token
    from supervisor.fleet._agent import _NodeDaemon

    with client_mod.Client(state_dir=real_daemon, timeout_s=10) as c:
        first = c.spawn({"task": "count the files"}, key="f-1")
        again = c.spawn({"task": "count the files"}, key="f-1")
        other = c.spawn({"task": "count the files"})
        assert [r["id"] for r in c.list_runs(key="f-1")] == [first["run_id"]]
        assert len(c.list_runs()) == 2
    assert again["run_id"] == first["run_id"] and again["existing"] is True and "existing" not in first
    endpoint = {
        "url": read_endpoint(real_daemon / ENDPOINT_FILE)["url"],
        "token": read_token(real_daemon / TOKEN_FILE),
    }
    node = _NodeDaemon(SimpleNamespace(state_dir=real_daemon))
    assert node.find(endpoint, "f-1") == first["run_id"] != other["run_id"]
    assert node.find(endpoint, "f-2") is None


@pytest.mark.parametrize(
    ("event", "line"),
    [
        ({"seq": 3, "kind": "state", "data": {"state": "cancelling", "reason": "user"}}, "state: cancelling (user)"),
        (
            {
                "seq": 4,
                "kind": "process_group",
                "data": {"pgid": 77, "kind": "mcp_server", "name": "browser", "alive": False},
            },
            "process group 77 (mcp_server browser) ended",
        ),
        (
            {"seq": 5, "kind": "stop_requested", "data": {"reason": "signal", "during": "tool"}},
            "stop requested (signal, during tool)",
        ),
        ({"seq": 6, "kind": "something_new", "data": {"a": 1}}, 'something_new {"a": 1}'),
        (
            {"seq": 7, "kind": "log", "data": {"level": "error", "message": "error: bad run spec: task"}},
            "[error] bad run spec: task",
        ),
        (
            {"seq": 12, "kind": "tool_call", "data": {"record": {"name": "read", "state": "running", "sent_at": 5.0}}},
            "tool read running: sent to its server",
        ),
        (
            {
                "seq": 13,
                "kind": "tool_call",
                "data": {"record": {"name": "read", "state": "running", "sent_at": 5.0, "stop_requested_at": 6.0}},
            },
            "tool read running: a stop reached it",
        ),
        (
            {"seq": 14, "kind": "tool_call", "data": {"record": {"name": "read", "state": "running"}}},
            "tool read running",
        ),
        ({"seq": 8, "kind": "steer_sent", "data": {"text": "mind the logs"}}, "steering sent: mind the logs"),
        (
            {"seq": 9, "kind": "step_snapshot", "data": {"step": 2, "progress": "listed the files"}},
            "snapshot after step 2: listed the files",
        ),
        (
            {
                "seq": 10,
                "kind": "step_snapshot",
                "data": {
                    "step": 3,
                    "snapshot_n": 5,
                    "progress_at": 16,
                    "progress_added": "\n\nread them",
                    "tool_calls_changed": [{"id": "a"}, {"id": "b"}],
                },
            },
            "snapshot after step 3: +read them (2 tool calls updated)",
        ),
        (
            {
                "seq": 11,
                "kind": "step_snapshot",
                "data": {"step": 3, "snapshot_n": 6, "progress_at": 27, "progress_added": "", "tool_calls_changed": []},
            },
            "snapshot after step 3: no new text",
        ),
    ],
)
def test_format_event_makes_one_readable_line(event: dict[str, Any], line: str) -> None:
    text = format_event({**event, "ts": 0})
    assert text.endswith(line) and text.startswith(f"#{event['seq']}") and "\n" not in text


# --------------------------------------------------------------------------- cancel, status, list


def test_cancel_prints_was_active_and_the_terminal_state(server: ServerThread) -> None:
    run_id = server.call(server.backend.add_run)
    res = run(server, "cancel", run_id)
    assert res.exit_code == ExitCode.RUN_CANCELLED, res.output  # the README: 7 for a run that ends cancelled
    assert res.stdout.strip() == f"{run_id}: stop sent (was active); cancelled"
    res = run(server, "--json", "cancel", run_id)
    assert json.loads(res.stdout) == {"run_id": run_id, "was_active": False, "state": "cancelled"}
    assert res.exit_code == ExitCode.RUN_CANCELLED
    res = run(server, "cancel", run_id)
    assert res.stdout.strip() == f"{run_id}: was not active (state: cancelled)"
    assert server.backend.cancels == [(run_id, "user")] * 3


def test_a_stop_the_journal_could_not_take_and_a_degraded_daemon_are_said_in_plain_output(
    server: ServerThread,
) -> None:
    # Only --json carried them: the human output said "stop sent" and nothing of a stop
    # that a daemon killed then would not know it was asked.
    server.backend.journal_down = "No space left on device"
    run_id = server.call(server.backend.add_run)
    res = run(server, "cancel", run_id)
    assert res.stdout.strip() == f"{run_id}: stop sent (was active); cancelled"
    assert res.stderr == "warning: the journal cannot be written: the stop goes on, but is not durable yet\n"
    res = run(server, "status")
    assert (
        "degraded: the journal cannot be written (No space left on device); 3 writes wait in memory, not durable yet"
        in res.stdout.splitlines()
    ), res.stdout
    server.backend.journal_down = None
    assert "degraded" not in run(server, "status").stdout


def test_status_says_when_the_journal_was_put_back_and_where_the_other_file_is(server: ServerThread) -> None:
    real = server.backend.summary
    kept = "/state/agentd.sqlite3.replaced-20261203T124334Z"
    at = time.time() - 60

    async def restored() -> dict[str, Any]:
        summary = await real()
        journal = {**summary.get("journal", {}), "restored": [{"at": at, "found": "another file", "kept_aside": kept}]}
        return {**summary, "journal": journal}

    assert "journal:" not in run(server, "status").stdout
    server.backend.summary = restored  # type: ignore[method-assign]
    lines = run(server, "status").stdout.splitlines()
    clock = time.strftime("%H:%M:%S", time.localtime(at))
    said = f"journal: its file was replaced under the daemon and put back at {clock}; the file found there is kept as {kept}"
    assert said in lines, lines


def test_status_and_events_say_a_daemon_killed_while_degraded_lost_runs_facts(server: ServerThread) -> None:
    real = server.backend.summary
    runs = [f"r-{i}" for i in range(7)]

    async def lost() -> dict[str, Any]:
        summary = await real()
        note = {"pid": 4242, "since": 1.0, "runs": runs, "more": 3}
        return {**summary, "journal": {**summary.get("journal", {}), "unwritten_before_restart": note}}

    assert "previous daemon" not in run(server, "status").stdout
    server.backend.summary = lost  # type: ignore[method-assign]
    lines = run(server, "status").stdout.splitlines()
    said = (
        "journal: the previous daemon (pid 4242) ended while writes waited in its memory for the journal: "
        "the last facts of 10 runs may be missing (r-0, r-1, r-2, r-3, r-4, ...)"
    )
    assert said in lines, lines
    event = {"seq": 3, "ts": 0, "kind": "journal_gap", "data": {"message": "its last events may be missing"}}
    assert format_event(event).endswith("facts may be missing: its last events may be missing")


def test_status_says_stopping_while_the_daemon_stops_its_runs(server: ServerThread) -> None:
    assert " running: pid " in run(server, "status").stdout.splitlines()[0]
    real = server.backend.summary

    async def stopping() -> dict[str, Any]:
        return {**(await real()), "stopping": True}

    server.backend.summary = stopping  # type: ignore[method-assign]
    assert " stopping: pid " in run(server, "status").stdout.splitlines()[0]


def test_status_says_which_watched_filesystem_is_low_on_space_or_inodes(server: ServerThread) -> None:
    # The disk guard's marks (``summary.disk.watched``): a filesystem below its byte mark
    # or its inode mark is named; one above both, or with no inode count, is not.
    real = server.backend.summary
    watched = [
        {"path": "/full", "free_bytes": 100 * 2**20, "total_bytes": 2**40, "min_free_bytes": 256 * 2**20},
        {
            "path": "/no-inodes",
            "free_bytes": 2**30,
            "total_bytes": 2**40,
            "min_free_bytes": 256 * 2**20,
            "free_inodes": 10,
            "total_inodes": 4000,
            "min_free_inodes": 40,
        },
        {"path": "/fine", "free_bytes": 2**30, "total_bytes": 2**40, "min_free_bytes": 256 * 2**20},
    ]

    async def low() -> dict[str, Any]:
        return {**(await real()), "disk": {"watched": watched}}

    server.backend.summary = low  # type: ignore[method-assign]
    lines = run(server, "status").stdout.splitlines()
    assert "low on disk: /full has 100 MiB free, below its low-water mark of 256 MiB" in lines
    assert "low on inodes: /no-inodes has 10 free, below its low-water mark of 40" in lines
    assert not [line for line in lines if "/fine" in line or "low on disk: /no-inodes" in line]


@pytest.mark.parametrize(
    ("state", "code"), [("completed", ExitCode.OK), ("failed", ExitCode.RUN_FAILED), ("lost", ExitCode.RUN_LOST)]
)
def test_cancel_of_a_run_that_already_ended_exits_with_its_outcome(server: ServerThread, state: str, code: int) -> None:
    run_id = server.call(server.backend.add_run)
    server.call(server.backend.finish, run_id, state)
    res = run(server, "cancel", run_id)
    assert res.exit_code == code, res.output
    assert res.stdout.strip() == f"{run_id}: was not active (state: {state})"


def test_cancel_no_wait_and_cancel_by_session(server: ServerThread) -> None:
    a = server.call(server.backend.add_run, session_id="s9")
    res = run(server, "--json", "cancel", "--session", "s9", "--reason", "stop button")
    assert res.exit_code == ExitCode.RUN_CANCELLED, res.output
    out = json.loads(res.stdout)
    assert out["was_active"] is True and out["final"] == {a: "cancelled"}
    assert server.backend.cancels == [(a, "stop button")]
    res = run(server, "cancel", "--session", "s-mistyped")  # not "no live run", exit 0
    assert res.exit_code == ExitCode.NOT_FOUND and "no session with id 's-mistyped'" in res.stderr, res.output
    res = run(server, "cancel")
    assert res.exit_code == ExitCode.USAGE
    b = server.call(server.backend.add_run)
    res = run(server, "cancel", "--no-wait", b)
    assert res.exit_code == 0 and res.stdout.strip() == f"{b}: stop sent (was active) (state: cancelled)"


def test_cancel_by_session_with_turn_stops_that_turn_or_nothing(server: ServerThread) -> None:
    b = server.backend
    first = server.call(b.add_run, session_id="s9")
    server.call(b.finish, first, "completed")
    second = server.call(b.add_run, session_id="s9")
    # The Stop meant for the first turn, arriving once the second is live: nothing stopped.
    res = run(server, "cancel", "--session", "s9", "--turn", first)
    assert res.exit_code == 0, res.output  # the turn meant completed
    assert res.stdout.splitlines() == [
        f"{first}: was not active (state: completed)",
        f"session s9: turn {first} had ended; its live turn is {second}, not stopped",
    ]
    res = run(server, "--json", "cancel", "--session", "s9", "--turn", first)
    out = json.loads(res.stdout)
    assert (out["was_active"], out["live_run"], out["final"]) == (False, second, {first: "completed"}), out
    assert server.call(lambda: b.runs[second].state) == "running"
    res = run(server, "cancel", "--session", "s9", "--turn", second)
    assert (
        res.exit_code == ExitCode.RUN_CANCELLED and res.stdout.strip() == f"{second}: stop sent (was active); cancelled"
    )
    res = run(server, "cancel", "--turn", first)
    assert res.exit_code == ExitCode.USAGE and "--turn names a turn of a --session" in res.stderr, res.output
    other = server.call(b.add_run, session_id="s-other")
    res = run(server, "cancel", "--session", "s9", "--turn", other)
    assert res.exit_code == ExitCode.USAGE and "is not a turn of session 's9'" in res.stderr, res.output
    assert server.call(lambda: b.runs[other].state) == "running"


def test_status_of_a_run_and_of_the_daemon(server: ServerThread) -> None:
    run_id = server.call(server.backend.add_run, {"task": "summarise the logs"})
    res = run(server, "status", run_id)
    assert res.exit_code == 0
    assert any(line.split() == ["state", "running"] for line in res.stdout.splitlines())
    assert "summarise the logs" in res.stdout
    res = run(server, "status")
    assert res.exit_code == 0
    assert res.stdout.startswith("agentd ") and "1 live run:" in res.stdout and run_id in res.stdout
    res = run(server, "--json", "status", run_id)
    assert json.loads(res.stdout)["state"] == "running"


def test_list_shows_a_table_and_filters(server: ServerThread) -> None:
    b = server.backend
    live = server.call(b.add_run, {"task": "one"}, session_id="s1")
    done = server.call(b.add_run, {"task": "two"})
    server.call(b.finish, done, "completed")
    res = run(server, "list")
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "SESSION", "CREATED", "TASK"]
    assert lines[1].split()[:3] == [done, "completed", "-"] and lines[2].split()[:3] == [live, "running", "s1"]
    res = run(server, "--json", "list", "--state", "running")
    assert [r["run_id"] for r in json.loads(res.stdout)["runs"]] == [live]
    res = run(server, "list", "--session", "nobody")
    assert res.stdout.strip() == "no runs"


def test_a_run_whose_state_may_be_behind_is_marked_in_the_table_and_status(server: ServerThread) -> None:
    b = server.backend
    behind = server.call(b.add_run, {"task": "re-adopted"})
    real_list, real_status = b.list_runs, b.status

    async def list_runs(**kw: Any) -> list[dict[str, Any]]:
        return [{**r, "catching_up": True} if r["id"] == behind else r for r in await real_list(**kw)]

    async def status(run_id: str) -> dict[str, Any]:
        return {**(await real_status(run_id)), "catching_up": True}

    b.list_runs, b.status = list_runs, status  # type: ignore[method-assign]
    row = next(line for line in run(server, "list").stdout.splitlines() if line.startswith(behind))
    assert row.split()[:2] == [behind, "running?"]
    assert "catching up" in run(server, "status", behind).stdout


# --------------------------------------------------------------------------- global options, usage errors


def run_bare(*args: str, env: dict[str, str] | None = None) -> Result:
    """The CLI with exactly these arguments (no --state-dir put in front)."""
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False, prog_name="agentd")


def test_global_options_work_after_the_command_too(server: ServerThread, tmp_path: Path) -> None:
    """The README's `agentd status RUN --json`, and every other command the same way."""
    sd = str(server.config.state_dir)
    run_id = server.call(server.backend.add_run, {"task": "summarise"})
    res = run_bare("status", run_id, "--json", "--state-dir", sd)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["state"] == "running"
    res = run_bare("list", "--state-dir", sd, "--json")
    assert [r["run_id"] for r in json.loads(res.stdout)["runs"]] == [run_id]
    res = run_bare("spawn", "--spec", write_spec(tmp_path, {"task": "go"}), "--json", "--state-dir", sd)
    assert json.loads(res.stdout)["run_id"].startswith("r-")
    res = run_bare("--json", "status", "--state-dir", sd)
    assert json.loads(res.stdout)["daemon"]["pid"] > 0
    res = run_bare("status", "--state-dir", str(tmp_path / "nowhere"))  # after the command: it wins
    assert res.exit_code == ExitCode.NO_DAEMON


def test_a_command_added_later_gets_the_global_options(server: ServerThread) -> None:
    """What `agentd fleet ...` or `agentd dashboard` will rely on: register, and they work."""
    import click

    from supervisor.cli import pass_obj

    @cli.command("test-echo")
    @pass_obj
    def echo_obj(obj: Any) -> None:
        obj.emit({"state_dir": str(obj.state_dir)}, lambda: click.echo(f"state dir {obj.state_dir}"))

    try:
        res = run_bare("test-echo", "--json", "--state-dir", "/x")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout) == {"state_dir": "/x"}
    finally:
        cli.commands.pop("test-echo")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["stauts"], "error: no such command 'stauts'. Did you mean 'status'? (try 'agentd --help')"),
        (["status", "--jsn"], "error: no such option '--jsn'"),
        (["watch"], "error: missing argument 'RUN' (try 'agentd watch --help')"),
        (["list", "--state", "bogus"], "error: invalid value for '--state': 'bogus' is not one of"),
        (["serve", "--port", "99999"], "error: invalid value for '--port': 99999 is not in the range 0<=x<=65535"),
        (["--bogus", "status"], "error: no such option '--bogus'"),
        (["spawn", "x", "--max-steps", "0"], "error: invalid value for '--max-steps'"),
        # click's float range lets these by; they were sent as null (no timeout at all).
        (["spawn", "x", "--timeout", "nan"], "error: invalid value for '--timeout': 'nan' is not a finite number"),
        (["spawn", "x", "--timeout", "inf"], "error: invalid value for '--timeout': 'inf' is not a finite number"),
    ],
)
def test_usage_errors_are_one_error_line_with_a_hint_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    res = run_bare("--state-dir", str(tmp_path), *args) if args[0] != "--bogus" else run_bare(*args)
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr.startswith(message), res.stderr
    assert res.stderr.count("\n") == 1 and "(try 'agentd" in res.stderr and "Usage:" not in res.stderr
    assert res.stdout == ""


def test_serve_refuses_a_port_out_of_range_from_the_environment_too(tmp_path: Path) -> None:
    res = run_bare("--state-dir", str(tmp_path), "serve", env={"AGENTD_PORT": "70000"})
    assert res.exit_code == ExitCode.USAGE
    assert res.stderr == "error: config port: bad value '70000': must be <= 65535\n"


def serve_out(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "--state-dir", str(tmp_path / "state"), "serve", *args],
        capture_output=True,
        text=True,
        timeout=DAEMON_START_S,
        env={**os.environ, **(env or {})},
    )


def test_serve_on_a_busy_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        out = serve_out(tmp_path, "--port", str(port))
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: address already in use "
        "(another program holds it; pick another with --port, or 0 for any free port)"
    )
    assert "Traceback" not in out.stderr and "ExceptionGroup" not in out.stderr


def test_serve_with_the_dashboard_port_busy_names_the_dashboard_not_the_control_port(tmp_path: Path) -> None:
    # It said "cannot listen on 127.0.0.1:0 ... pick another with --port": the control
    # socket's port, which was free.
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        out = serve_out(tmp_path, env={"AGENTD_DASHBOARD_PORT": str(port)})
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"error: cannot listen for the dashboard on 127.0.0.1:{port}: address already in use "
        "(another program holds it; pick another dashboard_port, or 0 for any free port)"
    )
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("nosuch.invalid", "error: cannot listen on nosuch.invalid:0: "),
        ("a" * 70 + ".example", "not a host name"),  # a label IDNA refuses (a UnicodeError)
    ],
)
def test_serve_on_a_host_that_does_not_resolve_is_one_clear_line(tmp_path: Path, host: str, message: str) -> None:
    out = serve_out(tmp_path, "--host", host)  # was a traceback (gaierror, UnicodeError), exit 1
    assert out.returncode == ExitCode.USAGE, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("error: ") and message in last and "check --host" in last, out.stderr
    assert "Traceback" not in out.stderr


def test_serve_on_a_state_dir_it_cannot_use_is_one_clear_line(tmp_path: Path) -> None:
    # (A read-only filesystem is the same: an OSError at its mkdir or lock, a traceback.)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "--state-dir", str(blocker / "state"), "serve"],
        capture_output=True,
        text=True,
        timeout=DAEMON_START_S,
    )
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"error: config state_dir: cannot use state dir '{blocker / 'state'}': Not a directory"
    )


def test_model_key_env_that_is_not_set_is_a_usage_error(server: ServerThread) -> None:
    res = run(server, "spawn", "x", "--model", "gpt-4o-mini", "--model-key-env", "AGENTD_TEST_NO_SUCH_VAR")
    assert res.exit_code == ExitCode.USAGE
    assert (
        res.stderr
        == "error: --model-key-env: environment variable 'AGENTD_TEST_NO_SUCH_VAR' is not set or empty in this shell\n"
    )
    assert not server.backend.spawns


@pytest.mark.parametrize(
    ("model", "shown"),
    [
        ({"provider": "openai", "name": "gpt-4o-mini"}, "openai gpt-4o-mini"),
        ({"provider": "openai"}, "openai (its default model)"),
        ({"provider": "openai", "name": "m", "base_url": "http://h/v1"}, "openai m at http://h/v1"),
        ({"provider": "scripted"}, "scripted (the built-in script)"),
        ({"provider": "scripted", "script_path": "/s.json"}, "scripted (script /s.json)"),
        ({"provider": "scripted", "script": {}}, "scripted (inline script)"),
    ],
)
def test_status_names_the_provider_and_model(model: dict[str, Any], shown: str) -> None:
    from supervisor.cli import _model

    assert _model({"task": "t", "model": model}) == shown


# --------------------------------------------------------------------------- errors


def test_no_daemon_says_how_to_start_one_and_exits_3(tmp_path: Path) -> None:
    res = run(tmp_path, "status")
    assert res.exit_code == ExitCode.NO_DAEMON
    assert res.stderr.startswith("error: no agentd daemon is running") and "agentd serve" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output


def test_the_state_dir_comes_from_the_environment(server: ServerThread) -> None:
    res = CliRunner(env={"AGENTD_STATE_DIR": str(server.config.state_dir)}).invoke(cli, ["status"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("command", [["status", "r-nope"], ["cancel", "r-nope"], ["watch", "r-nope"]])
def test_an_unknown_run_exits_4_with_one_line(server: ServerThread, command: list[str]) -> None:
    res = run(server, *command)
    assert res.exit_code == ExitCode.NOT_FOUND
    assert res.stderr == "error: no run with id 'r-nope'\n"


def test_a_wrong_token_exits_5(tmp_path: Path) -> None:
    with ServerThread(tmp_path, fixed_token="the-servers-token") as srv:
        res = run(srv, "status")  # the CLI presents the token file's, another one
    assert res.exit_code == ExitCode.REFUSED and "refused the connection (http 401" in res.stderr


def test_serve_with_an_unreadable_config_file_exits_2(tmp_path: Path) -> None:
    res = run(tmp_path, "serve", "--config", str(tmp_path / "missing.toml"))
    assert res.exit_code == ExitCode.USAGE and res.stderr.startswith("error: config config_file")


# --------------------------------------------------------------------------- the real daemon

# Bounds the real daemon's start (READY=1) and its exit after SIGTERM.
DAEMON_START_S = 30.0
DAEMON_STOP_S = 30.0


@pytest.fixture
def real_daemon(tmp_path: Path) -> Iterator[Path]:
    """`agentd serve` as a subprocess; ready when it sends READY=1 on $NOTIFY_SOCKET."""
    short = Path(tempfile.mkdtemp(prefix="agentd-n-", dir="/tmp"))  # AF_UNIX paths are short
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short / "notify"))
    notify.settimeout(DAEMON_START_S)
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["NOTIFY_SOCKET"] = str(short / "notify")
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "--state-dir", str(state_dir), "serve", "--grace", "2"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + DAEMON_START_S
        while True:
            notify.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = notify.recv(4096)
            except TimeoutError:
                pytest.fail(f"the daemon did not become ready: {(tmp_path / 'daemon.log').read_text()}")
            if b"READY=1" in msg.split(b"\n"):
                break
        yield state_dir
    finally:
        proc.terminate()
        try:
            proc.wait(DAEMON_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        notify.close()
        shutil.rmtree(short, ignore_errors=True)


def test_spawn_wait_runs_to_completion_on_the_real_daemon_with_the_scripted_model(real_daemon: Path) -> None:
    """Acceptance 1 through the CLI: spawn -> running -> completed, end to end."""
    res = run(real_daemon, "spawn", "count the files", "--wait")
    assert res.exit_code == 0, res.output
    run_id = res.stdout.splitlines()[0]
    for expected in ("state: queued", "state: running", "tool run_command succeeded", "state: completed"):
        assert expected in res.stdout, (expected, res.stdout)
    assert res.stdout.splitlines()[-1] == f"run {run_id} completed"
    status = json.loads(run(real_daemon, "--json", "status", run_id).stdout)
    assert status["state"] == "completed" and status["result"]["status"] == "completed"
    listed = json.loads(run(real_daemon, "--json", "list").stdout)["runs"]
    assert [r.get("run_id") or r.get("id") for r in listed] == [run_id]


def test_cancel_on_the_real_daemon_prints_was_active_and_the_terminal_state(real_daemon: Path, tmp_path: Path) -> None:
    script = tmp_path / "hang.json"
    script.write_text(json.dumps({"turns": [{"text": "thinking", "hang": True}]}))
    run_id = run(real_daemon, "spawn", "wait forever", "--script", str(script)).stdout.strip()
    follow = client_mod.Client(state_dir=real_daemon).follow(run_id)
    for event in follow:
        if event["kind"] == "step_started":
            res = run(real_daemon, "cancel", run_id)
            assert res.exit_code == ExitCode.RUN_CANCELLED, res.output
            assert res.stdout.strip() == f"{run_id}: stop sent (was active); cancelled"
    assert follow.state == "cancelled"
    again = run(real_daemon, "--json", "cancel", run_id)
    assert json.loads(again.stdout) == {"run_id": run_id, "was_active": False, "state": "cancelled"}
    shown = {
        line.split("  ", 1)[0]: line.split("  ", 1)[1].strip()
        for line in run(real_daemon, "status", run_id).stdout.splitlines()
    }
    assert shown["state"] == "cancelled (user)"
    assert "cancel to tree dead" in shown["teardown"] and "no survivors" in shown["teardown"]


def test_a_second_daemon_on_the_same_state_dir_exits_9_with_one_line(real_daemon: Path) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "supervisor", "--state-dir", str(real_daemon), "serve"],
        capture_output=True,
        text=True,
        timeout=DAEMON_START_S,
    )
    assert second.returncode == ExitCode.ALREADY_RUNNING, second.stderr
    assert second.stderr.startswith("error: another agentd daemon") and second.stderr.count("\n") == 1
    assert run(real_daemon, "status").exit_code == 0  # the first one is untouched


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("grace_s", "nan"),
        ("grace_s", "inf"),
        ("grace_s", "-1"),
        ("default_timeout_s", "-5"),
        ("default_timeout_s", "nan"),
        # In bytes past 2**63 they wrapped: a private tmpfs of 2**44 MiB had no bound.
        ("run_tmpfs_max_mib", str(2**44)),
        ("run_memory_max_mib", str(2**41)),
        ("disk_min_free_mib", str(2**41)),
        ("run_pids_max", str(2**23)),
    ],
)
def test_a_setting_that_is_not_a_finite_number_in_range_is_a_config_error(
    tmp_path: Path, name: str, value: str
) -> None:
    # A grace of NaN passed `v < 0` and SIGKILLed every stopping tree at once; a negative
    # default timeout ended every run at once.
    from supervisor.config import Config
    from supervisor.errors import ConfigError

    with pytest.raises(ConfigError, match=name):
        Config.load(state_dir=tmp_path, environ={"AGENTD_" + name.upper(): value})


def test_logs_print_what_a_run_wrote_as_text_never_as_terminal_control(tmp_path: Path) -> None:
    # A lone surrogate (half a character: a broken emoji on a page, as JSON escapes it)
    # raised in click.echo with a traceback, mid-output; on a terminal, an escape sequence
    # from a model or a tool (retitle the window, clear the screen) reached it raw.
    import pty

    state = tmp_path / "state"
    hostile = "half \udfff a char; \x1b]0;owned\x07 title; \x1b[2J clear; \u202eevil\u202c \u200b\u2066; \U0001f468\u200d\U0001f469 done"
    run_id = make_journal(state, [("log", {"level": "info", "message": hostile})])
    argv = [sys.executable, "-m", "supervisor", "--state-dir", str(state), "logs", run_id]
    piped = subprocess.run(argv, capture_output=True, timeout=60)
    assert piped.returncode == 0 and b"Traceback" not in piped.stderr, piped.stderr
    assert b"half ? a char" in piped.stdout and b"done" in piped.stdout
    main, sub = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=sub, stderr=subprocess.PIPE)
        os.close(sub)
        seen = b""
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            seen += data
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
        proc.stderr.close()
    finally:
        os.close(main)
    assert b"\x1b" not in seen and b"\x07" not in seen, seen
    assert b"\\x1b]0;owned\\x07 title; \\x1b[2J clear; " in seen, seen
    # Text that reorders or hides what follows is shown as its code points; joiners stay.
    assert "\\u202eevil\\u202c \\u200b\\u2066; \U0001f468\u200d\U0001f469 done".encode() in seen, seen


# --------------------------------------------------------------------------- the state dir, resolved


def test_a_relative_state_dir_is_made_absolute_wherever_it_is_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relative one reached the daemon as given; the zygote's runners chdir into their run
    # dir and then opened it: FileNotFoundError, every run after the first few seconds.
    from supervisor.config import Config, default_state_dir

    monkeypatch.chdir(tmp_path)
    want = tmp_path / "rel" / "sd"
    assert Config.load(state_dir="rel/sd", environ={}).state_dir == want
    loaded = Config.load(environ={"AGENTD_STATE_DIR": "rel/sd", "AGENTD_RUNS_DIR": "rel/runs"})
    assert loaded.state_dir == want and loaded.run_root == tmp_path / "rel" / "runs"
    monkeypatch.setenv("AGENTD_STATE_DIR", "rel/sd")
    assert default_state_dir() == want
    assert Config.load().state_dir == want

    import click

    from supervisor.cli import pass_obj

    @cli.command("test-echo-sd")
    @pass_obj
    def echo_obj(obj: Any) -> None:
        click.echo(str(obj.state_dir))

    try:
        for args, env in (
            (["--state-dir", "rel/sd", "test-echo-sd"], None),
            (["test-echo-sd", "--state-dir", "rel/sd"], None),
            (["test-echo-sd"], {"AGENTD_STATE_DIR": "rel/sd"}),
        ):
            res = run_bare(*args, env=env)
            assert (res.exit_code, res.stdout) == (0, f"{want}\n"), (args, res.output)
    finally:
        cli.commands.pop("test-echo-sd")


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_empty_state_dir_option_is_a_usage_error(where: str, tmp_path: Path) -> None:
    # It meant "." (the current directory), while an empty AGENTD_STATE_DIR means the default.
    from supervisor.config import Config
    from supervisor.errors import ConfigError

    args = ["--state-dir", "", "status"] if where == "before" else ["status", "--state-dir", ""]
    res = run_bare(*args)
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr.startswith("error: invalid value for '--state-dir': expected a directory, got an empty string")
    assert res.stderr.count("\n") == 1
    with pytest.raises(ConfigError, match="state_dir"):
        Config.load(state_dir="")


@pytest.mark.parametrize("source", ["option", "env", "config file"])
def test_serve_refuses_an_empty_host(tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--host ""` listened on every interface, with a log line alone to say so.
    import supervisor.daemon

    async def no_daemon(config: Any) -> None:
        raise AssertionError(f"the daemon was started on host {config.host!r}")

    monkeypatch.setattr(supervisor.daemon, "serve", no_daemon)  # (never one left behind)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    args, env = ["--state-dir", str(state_dir), "serve"], None
    if source == "option":
        args += ["--host", ""]
    elif source == "env":
        env = {"AGENTD_HOST": ""}
    else:
        (state_dir / "agentd.toml").write_text('host = ""\n')
    res = run_bare(*args, env=env)
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr == "error: config host: bad value '': empty (to listen on every interface, say 0.0.0.0 or ::)\n"
    assert not (state_dir / "daemon.json").exists()


@pytest.mark.parametrize("command", ["logs", "watch"])
def test_an_after_beyond_any_event_number_is_a_usage_error(tmp_path: Path, command: str) -> None:
    # logs passed it to SQLite: an OverflowError and a traceback (watch's daemon refused it).
    make_journal(tmp_path, STEPS[:1], final="completed")
    res = run(tmp_path, command, "r-1", "--after", str(2**63))
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr.startswith(f"error: invalid value for '--after': {2**63} is not in the range 0<=x<={2**62}")
    assert res.stderr.count("\n") == 1


def _unsearchable(monkeypatch: pytest.MonkeyPatch, under: Path, method: str) -> None:
    """Path.<method> raises as it does for a path under a directory this user cannot search."""
    real = getattr(Path, method)

    def denied(self: Path) -> bool:
        if str(self).startswith(str(under) + os.sep):
            raise PermissionError(13, "Permission denied", str(self))
        return bool(real(self))

    monkeypatch.setattr(Path, method, denied)


def test_logs_under_a_directory_it_cannot_search_is_one_line_exit_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_journal(tmp_path / "state", STEPS[:1], final="completed")
    _unsearchable(monkeypatch, tmp_path, "is_file")  # (a uid 0 test cannot be refused by a chmod)
    res = run(tmp_path / "state", "logs", "r-1")
    assert res.exit_code == ExitCode.NO_DAEMON, res.output
    assert res.stderr == f"error: cannot read the journal in {str(tmp_path / 'state')!r}: Permission denied\n"


def test_serve_under_a_directory_it_cannot_search_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import supervisor.daemon

    async def no_daemon(config: Any) -> None:
        raise AssertionError("the daemon was started")

    monkeypatch.setattr(supervisor.daemon, "serve", no_daemon)
    _unsearchable(monkeypatch, tmp_path, "exists")
    res = run(tmp_path / "state", "serve")
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr == (
        f"error: config state_dir: cannot use state dir {str(tmp_path / 'state')!r}: Permission denied\n"
    )


def run_into_a_closed_pipe(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process whose stdout is a pipe nobody reads any more (`... | head -n0`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "supervisor", "--state-dir", str(state_dir), *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", [["watch", "RUN"], ["logs", "-f", "RUN"], ["spawn", "--wait", "go"]])
def test_a_command_whose_exit_is_the_outcome_exits_141_when_its_stdout_is_closed(
    server: ServerThread, command: list[str]
) -> None:
    # `agentd watch RUN | head -n1` exited 0, "the run completed", of a run still running.
    run_id = server.call(server.backend.add_run)
    res = run_into_a_closed_pipe(server.config.state_dir, *(run_id if a == "RUN" else a for a in command))
    assert res.returncode == 141, res.stderr  # 128 + SIGPIPE (ExitCode.BROKEN_PIPE)
    assert "Traceback" not in res.stderr
    assert all(r.state == "running" for r in server.backend.runs.values())


def test_a_command_whose_exit_is_not_an_outcome_still_exits_0_when_its_stdout_is_closed(
    server: ServerThread,
) -> None:
    run_id = server.call(server.backend.add_run)
    res = run_into_a_closed_pipe(server.config.state_dir, "status", run_id)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_cancel_prints_was_active_before_the_wait_and_a_ctrl_c_there_says_the_stop_was_sent(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    # Nothing was printed until the run had ended: a Ctrl-C during the wait lost was_active
    # and said "stop one with `agentd cancel RUN`" of a run already stopping.
    b = server.backend
    run_id = server.call(b.add_run)

    async def cancel_that_takes_time(rid: str, *, reason: str = "user") -> dict[str, Any]:
        b.cancels.append((rid, reason))
        b.emit(rid, "state", {"state": "cancelling", "reason": reason})
        b.runs[rid].state = "cancelling"
        return {"run_id": rid, "was_active": True, "state": "cancelling"}

    monkeypatch.setattr(b, "cancel", cancel_that_takes_time)

    def ctrl_c_while_following(self: Any, rid: str, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(client_mod.Client, "follow", ctrl_c_while_following)
    res = run(server, *(["--json"] if as_json else []), "cancel", run_id)
    assert res.exit_code == ExitCode.INTERRUPTED, res.output
    if as_json:
        assert json.loads(res.stdout) == {"run_id": run_id, "was_active": True, "state": "cancelling"}
    else:
        assert res.stdout == f"{run_id}: stop sent (was active)\n"
    assert res.stderr == (
        f"error: interrupted: the stop was sent and the run {run_id} is stopping (`agentd status` shows when it ends)\n"
    )
    assert b.cancels == [(run_id, "user")]


def test_a_spec_the_daemon_finds_bad_args_in_is_refused_exit_5_alone_or_among_several(
    server: ServerThread, tmp_path: Path
) -> None:
    # It exited 2 (usage), while README says a refused spec exits 5.
    bad = tmp_path / "bad.json"
    bad.write_text('{"task": "caf\\udcff"}')  # a lone surrogate, written as JSON allows
    res = run(server, "spawn", "--spec", str(bad))
    assert res.exit_code == ExitCode.REFUSED, res.output
    assert res.stderr.startswith("error: expected text without lone surrogates") and res.stderr.count("\n") == 1
    good = write_spec(tmp_path, {"task": "fine"})
    res = run(server, "spawn", "--spec", good, "--spec", str(bad))
    assert res.exit_code == ExitCode.REFUSED, res.output
    assert res.stderr.startswith(f"error: spec file {str(bad)!r}: expected text without lone surrogates")
    assert [server.backend.runs[r].spec["task"] for r in res.stdout.split()] == ["fine"]
    # What was typed on the command line stays a usage error.
    assert run(server, "spawn", "--spec", good, "--session", "S" * 300).exit_code == ExitCode.USAGE


def test_specs_sent_before_the_connection_broke_may_have_started_and_say_so(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They said only "lost the connection": the daemon may well have started them.
    monkeypatch.setattr(client_mod, "PIPELINE_WINDOW", 1)  # one at a time: spec 2 sent, 3 not
    real_recv = _wsclient.WebSocket.recv_text
    replies = {"n": 0}

    def drop_after_the_first_reply(self: Any, timeout_s: float | None) -> str:
        replies["n"] += 1
        if replies["n"] == 2:  # waiting for spec 2's reply: the network drops us
            self._sock.shutdown(socket.SHUT_RDWR)
            raise client_mod.ConnectionLost("the daemon closed the connection")
        return real_recv(self, timeout_s)

    monkeypatch.setattr(_wsclient.WebSocket, "recv_text", drop_after_the_first_reply)
    paths = write_specs(tmp_path, [{"task": f"t{i}"} for i in range(3)])
    res = run(server, "spawn", *(a for p in paths for a in ("--spec", p)))
    assert res.exit_code == ExitCode.DISCONNECTED, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and len(res.stdout.split()) == 1, res.output
    assert lines[0].startswith(f"error: spec file {paths[1]!r}: ")
    assert lines[0].endswith("; the spec was sent and may have started (check with `agentd list`)")
    assert lines[1].startswith(f"error: spec file {paths[2]!r}: not sent") and "may have started" not in lines[1]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_refused_steer_is_one_error_line_on_stderr(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    # It printed "R: not accepted (...)" on stdout, exit 5, unlike every other user error.
    reply = {"run_id": "r-1", "accepted": False, "why": "the run has ended", "state": "completed"}
    monkeypatch.setattr(client_mod.Client, "steer", lambda self, run_id, text: dict(reply))
    res = run(server, *(["--json"] if as_json else []), "steer", "r-1", "mind the logs")
    assert res.exit_code == ExitCode.REFUSED, res.output
    if as_json:
        assert json.loads(res.stdout) == reply and res.stderr == ""
    else:
        assert res.stdout == ""
        assert res.stderr == "error: r-1: not accepted (the run has ended; state: completed)\n"


def test_logs_of_a_run_id_too_long_is_refused_as_the_daemon_does_without_echoing_it(tmp_path: Path) -> None:
    from supervisor.cli import MAX_RUN_ID_CHARS
    from supervisor.protocol import MAX_ID_CHARS

    assert MAX_RUN_ID_CHARS == MAX_ID_CHARS
    make_journal(tmp_path, STEPS[:1], final="completed")
    res = run(tmp_path, "logs", "r" * 100_000)  # the whole id was echoed in the error
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr == "error: expected 'run_id' of at most 256 chars, got 100000\n"


def test_fleet_with_no_front_says_to_start_one_with_agentd_fleet_serve(tmp_path: Path) -> None:
    res = run_bare("--fleet", "--state-dir", str(tmp_path), "status")
    assert res.exit_code == ExitCode.NO_DAEMON, res.output
    assert res.stderr.startswith("error: no agentd fleet front is running") and res.stderr.count("\n") == 1
    assert "start one with `agentd fleet serve`" in res.stderr and "systemctl" not in res.stderr


def test_a_relative_script_path_in_a_spec_file_is_taken_from_the_spec_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was sent as written, and the runner, working in its run dir, failed bad_spec.
    (tmp_path / "specs").mkdir()
    spec = tmp_path / "specs" / "spec.json"
    spec.write_text(json.dumps({"task": "t", "model": {"provider": "scripted", "script_path": "s/script.json"}}))
    monkeypatch.chdir("/")
    built = build_spec(None, spec_file=spec)
    assert built["model"] == {"provider": "scripted", "script_path": str(tmp_path / "specs" / "s" / "script.json")}
    spec.write_text(json.dumps({"task": "t", "model": {"script_path": "/abs/script.json"}}))
    assert build_spec(None, spec_file=spec)["model"] == {"script_path": "/abs/script.json"}


def test_a_spec_files_relative_grants_and_server_paths_are_taken_from_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They were sent as written: a relative grant failed the spec's check (absolute paths
    # only), and a server's relative cwd or ./command meant the run dir, where the runner
    # starts its servers.
    here = tmp_path / "specs"
    here.mkdir()
    spec = here / "spec.json"
    servers = {
        "site": {"command": "node", "args": ["srv.js"], "cwd": "site"},
        "local": {"command": "./bin/srv", "args": ["./not-a-path-we-know"]},
        "there": {"command": "./srv", "cwd": "/srv"},
        "onpath": {"command": "npx"},
    }
    spec.write_text(
        json.dumps(
            {
                "task": "t",
                "sandbox": {"read": ["data", "/etc/abs"], "write": ["../out"], "workdir": "work"},
                "mcpServers": servers,
            }
        )
    )
    monkeypatch.chdir("/")
    built = build_spec(None, spec_file=spec)
    assert built["sandbox"] == {
        "read": [str(here / "data"), "/etc/abs"],
        "write": [str(here / ".." / "out")],
        "workdir": str(here / "work"),
    }
    assert built["mcpServers"] == {
        "site": {"command": "node", "args": ["srv.js"], "cwd": str(here / "site")},
        "local": {"command": str(here / "bin" / "srv"), "args": ["./not-a-path-we-know"]},
        "there": {"command": "./srv", "cwd": "/srv"},
        "onpath": {"command": "npx"},
    }
    # The spec takes it (normalised), where it refused the relative grants before.
    parsed = RunSpec.from_dict(built)
    assert parsed.sandbox.write == (str(tmp_path / "out"),)
    # An --mcp-config file's servers are taken from its own directory, not the spec file's.
    (tmp_path / "cfg").mkdir()
    cfg = tmp_path / "cfg" / "mcp.json"
    cfg.write_text(json.dumps({"mcpServers": {"x": {"command": "./x", "cwd": "."}}}))
    built = build_spec("t", mcp_config=cfg)
    assert built["mcpServers"] == {"x": {"command": "./x", "cwd": str(tmp_path / "cfg" / ".")}}
    # What is not a string is left to the spec's checks, as before.
    spec.write_text(json.dumps({"task": "t", "sandbox": {"read": [3]}, "mcpServers": {"y": 5}}))
    assert build_spec(None, spec_file=spec)["sandbox"] == {"read": [3]}


def test_a_spec_read_through_a_descriptor_takes_relative_paths_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--spec /dev/stdin < x.json`, `--spec <(...)`: the file's "directory" was /dev or
    # /dev/fd, so a grant "data" was sent as /dev/data (the run could not read ./data).
    here = tmp_path / "here"
    here.mkdir()
    spec = tmp_path / "elsewhere.json"
    spec.write_text(json.dumps({"task": "t", "sandbox": {"read": ["data"]}, "mcpServers": {"s": {"command": "./srv"}}}))
    monkeypatch.chdir(here)
    want_read, want_srv = [str(here / "data")], {"s": {"command": str(here / "srv")}}
    # A pipe, as bash's <(...) gives one.
    r, w = os.pipe()
    try:
        os.write(w, spec.read_bytes())
        os.close(w)
        built = build_spec(None, spec_file=Path(f"/dev/fd/{r}"))
    finally:
        os.close(r)
    assert (built["sandbox"]["read"], built["mcpServers"]) == (want_read, want_srv)
    # A regular file named through a descriptor.
    fd = os.open(spec, os.O_RDONLY)
    try:
        assert build_spec(None, spec_file=Path(f"/proc/self/fd/{fd}"))["sandbox"]["read"] == want_read
    finally:
        os.close(fd)
    # /dev/stdin redirected from the file (the CLI's own process: stdin is the file).
    code = "from pathlib import Path; from supervisor.cli import build_spec; print(build_spec(None, spec_file=Path('/dev/stdin'))['sandbox']['read'][0])"
    with spec.open("rb") as stdin:
        out = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(here / "data")
    # A file in a directory still takes its own directory's (not the current one).
    assert build_spec(None, spec_file=spec)["sandbox"]["read"] == [str(tmp_path / "data")]


def test_a_spec_files_paths_in_a_home_directory_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # '~/data' was sent as written: the daemon refused the grant (not absolute), and a
    # script_path '~/s.json' was read from the run dir's '~' (refused: in the state dir).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "task": "t",
                "model": {"provider": "scripted", "script_path": "~/s.json"},
                "sandbox": {"read": ["~/data", "/abs/"], "workdir": "~"},
                "mcpServers": {"m": {"command": "~/bin/srv"}},
            }
        )
    )
    built = build_spec(None, spec_file=spec)
    home = tmp_path / "home"
    assert built["model"]["script_path"] == str(home / "s.json")
    assert built["sandbox"] == {"read": [str(home / "data"), "/abs/"], "workdir": str(home)}
    assert built["mcpServers"] == {"m": {"command": str(home / "bin" / "srv")}}
    RunSpec.from_dict(built)  # the spec's checks take them


def test_a_named_pipe_spec_in_a_directory_takes_that_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a descriptor's name (/dev/stdin, /dev/fd/N) says nothing of where a spec was
    # written; a FIFO made in a directory is that directory's, as a file there is.
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    src = tmp_path / "src.json"
    src.write_text(json.dumps({"task": "t", "sandbox": {"read": ["data"]}}))
    monkeypatch.chdir("/")
    writer = subprocess.Popen(["sh", "-c", 'cat "$1" > "$2"', "sh", str(src), str(fifo)])
    try:
        built = build_spec(None, spec_file=fifo)
    finally:
        writer.wait(timeout=30)
    assert built["sandbox"]["read"] == [str(tmp_path / "data")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["spawn", "ab\udcffc"], "error: invalid value for '[TASK]': 'ab\\xffc' is not valid UTF-8 (at character 3)"),
        (["cancel", "r-1", "--reason", "\udce9t\udce9"], "error: invalid value for '--reason': '\\xe9t\\xe9'"),
        (["session", "close", "s\udcff"], "error: invalid value for 'SESSION': 's\\xff' is not valid UTF-8"),
    ],
)
def test_an_argument_that_is_not_utf8_is_a_usage_error_naming_its_bytes(
    args: list[str], message: str, tmp_path: Path
) -> None:
    """`agentd spawn $'ab\\xffc'`: argv's bytes that are not UTF-8 come as lone surrogates,
    which the daemon refused as a spec "with lone surrogates" (exit 5): now a usage error
    that shows the bytes as typed. A path may hold such bytes (its type is not text)."""
    res = run_bare("--state-dir", str(tmp_path), *args)
    assert res.exit_code == ExitCode.USAGE, res.output
    assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
    res = run_bare("--state-dir", str(tmp_path), "spawn", "--spec", str(tmp_path / "s\udcff.json"))
    assert res.exit_code == ExitCode.USAGE and "cannot read spec file" in res.stderr


def test_watch_says_when_a_pending_calls_arguments_are_cut_and_where_to_read_them_whole() -> None:
    """The person deciding read the first 500 characters and a "…", and was not told the
    rest exists, nor where to see it (the dashboard probe)."""
    long_args = '{"command": "echo ' + "x" * 600 + '; touch /tmp/x"}'
    event: dict[str, Any] = {"run_id": "r-1", "seq": 3, "ts": 0.0, "kind": "approval_requested"}
    event["data"] = {"call_id": "c1", "name": "run_command"}
    event["data"]["arguments"] = long_args
    text = format_event(event)
    assert f"[cut: {len(long_args)} characters in all; `agentd status r-1 --json` shows them whole]" in text
    event["data"]["arguments"] = '{"command": "ls"}'
    assert "[cut" not in format_event(event)
