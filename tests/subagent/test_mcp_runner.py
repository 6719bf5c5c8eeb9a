"""MCP servers under the runner: process trees end with the run, setup and protocol errors."""

from __future__ import annotations

import json
import os
import stat
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from subagent.events import EventKind, ExitCode
from subagent.tools.mcp_spawn import MCP_KILL_GRACE_S
from tests.subagent.harness import CHILDREN, runner_env, spec, start_runner

TREE_SERVER = str(CHILDREN / "mcp_tree_server.py")


def tree_spec(script: dict[str, Any], *server_args: str, **more: Any) -> dict[str, Any]:
    servers = {"tree": {"command": sys.executable, "args": [TREE_SERVER, *server_args]}}
    return spec(script=script, mcpServers=servers, **more)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree_pids(result: dict[str, Any]) -> list[int]:
    rec = next(t for t in result["tool_calls"] if t["name"] == "tree")
    return list(json.loads(rec["output"]).values())


async def test_completed_run_leaves_no_process_of_the_server_tree(tmp_path: Path) -> None:
    script = {"turns": [{"tool_calls": [{"name": "tree", "arguments": {}}]}], "final": "pids {{last_output}}"}
    async with start_runner(tree_spec(script, "--stderr-noise"), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    pids = tree_pids(result)
    assert len(pids) == 3 and not any(alive(p) for p in pids)
    groups = r.of(EventKind.PROCESS_GROUP)
    assert [(g.data["kind"], g.data["alive"]) for g in groups] == [("mcp_server", True), ("mcp_server", False)]
    assert groups[0].data["pgid"] == pids[0]  # the server leads its own group
    # The server's stderr went to a file in the run dir, not to our stderr.
    assert "this goes to stderr" in (r.run_dir / "mcp-tree.stderr.log").read_text()
    assert result["imported"]["mcp"] is True and result["imported"]["openai"] is False
    assert not r.of(EventKind.LOG), [e.data for e in r.of(EventKind.LOG)]  # a clean run is quiet


async def test_sigterm_during_an_mcp_call_lets_it_finish_and_ends_the_tree(tmp_path: Path) -> None:
    flag = tmp_path / "run" / "go"
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree", "arguments": {}}]},
            {"tool_calls": [{"name": "wait_for", "arguments": {"path": str(flag)}}]},
            {"tool_calls": [{"name": "echo", "arguments": {"text": "never"}}]},
        ]
    }
    async with start_runner(tree_spec(script), tmp_path) as r:
        with trio.fail_after(20):
            # Its first "running" record comes just before the call is sent: a stop in
            # between is applied before it (not_started). Wait until it was sent.
            await r.wait_event(
                EventKind.TOOL_CALL,
                lambda e: e.data["record"]["name"] == "wait_for" and e.data["record"].get("sent_at") is not None,
            )
        r.signal()
        with trio.fail_after(10):
            stop = await r.wait_event(EventKind.STOP_REQUESTED)
        flag.touch()  # the running call may finish now
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED and stop.data["during"] == "tool"
    states = {t["name"]: t["state"] for t in result["tool_calls"]}
    assert states == {"tree": "succeeded", "wait_for": "succeeded"}
    assert not any(alive(p) for p in tree_pids(result))
    assert r.of(EventKind.PROCESS_GROUP)[-1].data["alive"] is False


async def test_sigterm_while_the_model_streams_ends_the_server_tree(tmp_path: Path) -> None:
    script = {"turns": [{"tool_calls": [{"name": "tree", "arguments": {}}]}, {"text": "hm", "hang": True}]}
    async with start_runner(tree_spec(script), tmp_path) as r:
        with trio.fail_after(20):
            await r.wait_event(EventKind.STEP_STARTED, lambda e: e.data["step"] == 2)
        r.signal()
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    assert not any(alive(p) for p in tree_pids(result))


async def test_an_escaped_grandchild_is_found_by_its_marker(tmp_path: Path) -> None:
    script = {"turns": [{"tool_calls": [{"name": "tree", "arguments": {}}]}]}
    async with start_runner(tree_spec(script, "--escape"), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    assert not any(alive(p) for p in tree_pids(result))


async def test_a_server_that_cannot_start_is_tool_setup(tmp_path: Path) -> None:
    servers = {"broken": {"command": "/nonexistent/mcp-server", "args": []}}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_SETUP
    assert result["status"] == "failed" and result["reason"] == "tool_setup"
    assert (
        "mcp server 'broken'" in result["error"]["message"] and "/nonexistent/mcp-server" in result["error"]["message"]
    )
    errors = [e for e in r.of(EventKind.LOG) if e.data["level"] == "error"]
    assert errors and errors[-1].data["message"].startswith("error: ")


async def test_a_server_whose_cwd_is_missing_is_tool_setup_naming_its_cwd(tmp_path: Path) -> None:
    # The spawn's chdir failed with ENOENT, which was reported as the command missing.
    servers = {"s": {"command": sys.executable, "args": ["-c", "pass"], "cwd": str(tmp_path / "nowhere")}}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_SETUP
    assert f"its cwd '{tmp_path / 'nowhere'}' is not a directory here" in result["error"]["message"], result["error"]


async def test_a_server_that_dies_at_startup_is_tool_setup_with_its_stderr(tmp_path: Path) -> None:
    code = "import sys; print('missing config file', file=sys.stderr); sys.exit(3)"
    servers = {"dies": {"command": sys.executable, "args": ["-c", code]}}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_SETUP
    assert "missing config file" in result["error"]["message"]
    assert r.of(EventKind.PROCESS_GROUP)[-1].data["alive"] is False


async def test_a_non_json_line_from_a_server_ends_the_run_with_tool_protocol(tmp_path: Path) -> None:
    # The SDK skips the line; the call in flight ends with it (its answer may have been
    # that line), and the run ends after the batch: a server that writes garbage on its
    # protocol channel cannot be trusted.
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree", "arguments": {}}]},
            {"tool_calls": [{"name": "garble", "arguments": {}}]},
            {"tool_calls": [{"name": "echo", "arguments": {"text": "never"}}]},
        ]
    }
    async with start_runner(tree_spec(script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_PROTOCOL
    assert result["status"] == "failed" and result["reason"] == "tool_protocol"
    assert "this is not json-rpc" in result["error"]["message"]
    tree, garble, *rest = result["tool_calls"]
    assert tree["state"] == "succeeded" and not rest
    # garble answers just after its garbage: if both were read at once, the answer may win.
    assert garble["state"] in ("unknown", "succeeded"), garble
    if garble["state"] == "unknown":
        assert garble["reason"].startswith("tool_protocol:"), garble
    assert not any(alive(p) for p in tree_pids(result))


async def test_a_banner_on_stdout_before_the_handshake_is_tool_protocol(tmp_path: Path) -> None:
    async with start_runner(tree_spec({"final": "x"}, "--banner"), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_PROTOCOL
    assert "hello from a server" in result["error"]["message"]


async def test_a_browser_preset_that_cannot_find_chromium_is_tool_setup(tmp_path: Path) -> None:
    bad = {"executable_path": "/nonexistent/chromium"}
    async with start_runner(spec(script={"final": "x"}, browser=bad), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.TOOL_SETUP, result
    assert result["error"]["message"].startswith("error: browser setup failed")


async def test_sigterm_during_a_slow_server_startup_cancels_at_once(tmp_path: Path) -> None:
    async with start_runner(tree_spec({"final": "x"}, "--slow-start"), tmp_path) as r:
        with trio.fail_after(20):
            group = await r.wait_event(EventKind.PROCESS_GROUP)
        r.signal()
        rc, result = await r.finish(timeout_s=15)
    assert rc == ExitCode.CANCELLED and result["reason"] == "signal"
    assert r.of(EventKind.STOP_REQUESTED)[0].data["during"] == "setup"
    assert not alive(group.data["pgid"])
    assert r.of(EventKind.PROCESS_GROUP)[-1].data["alive"] is False


async def test_a_server_that_dies_mid_call_gives_an_unknown_outcome_and_the_run_goes_on(tmp_path: Path) -> None:
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree", "arguments": {}}]},
            {"tool_calls": [{"name": "die", "arguments": {}}]},
        ],
        "final": "after: {{last_output}}",
    }
    async with start_runner(tree_spec(script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    rec = result["tool_calls"][1]
    assert rec["state"] == "unknown" and rec["reason"].startswith("connection_lost")
    assert result["final_text"].startswith("after: outcome unknown")
    assert not any(alive(p) for p in tree_pids(result))  # its orphaned children too


def test_a_missing_browser_preset_module_is_tool_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subagent.tools
    from subagent.run import SetupFailure, _server_specs
    from subagent.spec import RunSpec

    monkeypatch.setitem(sys.modules, "subagent.tools.browser", None)  # import fails
    monkeypatch.delattr(subagent.tools, "browser", raising=False)
    spec_obj = RunSpec.from_dict({"task": "t", "browser": True}, env={})
    with pytest.raises(SetupFailure) as info:
        _server_specs(spec_obj, tmp_path, AsyncExitStack())
    assert info.value.exit_code == ExitCode.TOOL_SETUP
    assert info.value.message.startswith("error: the browser preset is not available")


async def test_a_server_name_from_another_client_works_as_is(tmp_path: Path) -> None:
    servers = {"my tree.v2": {"command": sys.executable, "args": [TREE_SERVER, "--stderr-noise"]}}
    script = {
        "turns": [{"tool_calls": [{"name": "my_tree_v2__echo", "arguments": {"text": "hi"}}]}],
        "final": "{{last_output}}",
    }
    async with start_runner(spec(script=script, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED and result["final_text"] == "hi"
    assert (r.run_dir / "mcp-my_tree.v2.stderr.log").exists()


async def test_a_run_in_python_dev_mode_leaks_nothing(tmp_path: Path) -> None:
    # Dev mode turns unclosed files, sockets and processes into ResourceWarnings, which
    # the runner reports as log events: a clean run has none.
    script = {
        "turns": [
            {
                "tool_calls": [
                    {"name": "tree", "arguments": {}},
                    {"name": "run_command", "arguments": {"command": "echo x"}},
                ]
            },
            {"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 30", "background": True}}]},
        ]
    }
    env = runner_env(tmp_path / "run", PYTHONDEVMODE="1")
    async with start_runner(tree_spec(script), tmp_path, env=env) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    # Nor the last resort's warning for its background command ("outlived its escalation":
    # 1 run in 4 at load ~6, its shell out of the sandboxed runner's sight: test_unseen_leader).
    logs = [e.data["message"] for e in r.of(EventKind.LOG)]
    assert not logs, [m[:300] for m in logs]


async def test_a_server_that_writes_bytes_no_utf8_holds_is_tool_protocol_at_once(tmp_path: Path) -> None:
    # Invalid UTF-8 on the protocol channel is garbage like any other: a clear
    # tool_protocol error, not the SDK's reader dying and the handshake's 30 s timeout.
    code = "import sys, time; sys.stdout.buffer.write(b'\\xff\\xfebad\\n'); sys.stdout.flush(); time.sleep(60)"
    servers = {"junk": {"command": sys.executable, "args": ["-c", code]}}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish(timeout_s=20)
    assert rc == ExitCode.TOOL_PROTOCOL, result
    assert result["reason"] == "tool_protocol" and "junk" in result["error"]["message"]


async def test_a_tool_named_like_another_servers_qualified_name_does_not_capture_its_calls(tmp_path: Path) -> None:
    servers = {
        "tree": {"command": sys.executable, "args": [TREE_SERVER]},
        "x": {"command": sys.executable, "args": [TREE_SERVER, "--impostor", "tree__echo"]},
    }
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree__echo", "arguments": {"text": "from tree"}}]},
            {"tool_calls": [{"name": "x__tree__echo", "arguments": {"text": "?"}}]},
            {"tool_calls": [{"name": "tree__tree", "arguments": {}}, {"name": "x__tree", "arguments": {}}]},
        ],
        "final": "done",
    }
    async with start_runner(spec(script=script, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    echoes, pids = result["tool_calls"][:2], result["tool_calls"][2:]
    assert [(t["name"], t["output"]) for t in echoes] == [("tree__echo", "from tree"), ("x__tree__echo", "impostor")]
    assert len(pids) == 2 and not any(alive(p) for t in pids for p in json.loads(t["output"]).values())


async def test_an_answer_the_sdk_refuses_ends_the_call_at_once_and_the_run_with_tool_protocol(
    tmp_path: Path,
) -> None:
    # The answer is a JSON line with a lone surrogate escape, which the SDK drops as
    # non-JSON: the call must not wait out its 120 s timeout for an answer that was lost.
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree", "arguments": {}}]},
            {"tool_calls": [{"name": "bad_answer", "arguments": {}}, {"name": "echo", "arguments": {"text": "x"}}]},
            {"tool_calls": [{"name": "echo", "arguments": {"text": "never"}}]},
        ]
    }
    async with start_runner(tree_spec(script, limits={"command_timeout_s": 120}), tmp_path) as r:
        rc, result = await r.finish(timeout_s=20)
    assert rc == ExitCode.TOOL_PROTOCOL, result
    assert result["reason"] == "tool_protocol" and "tree" in result["error"]["message"]
    tree, bad, after = result["tool_calls"]
    assert tree["state"] == "succeeded"
    assert bad["state"] == "unknown" and bad["reason"].startswith("tool_protocol:"), bad
    assert "broke the protocol" in bad["error"] and "\\ud83d" in bad["error"]
    assert bad["finished_at"] - bad["started_at"] < 15
    # The next call of the batch is not sent to a server that broke the protocol.
    assert after["state"] == "failed" and after["reason"] == "tool_protocol", after
    assert after["error"].startswith("not sent:")
    assert not any(alive(p) for p in tree_pids(result))


async def test_arguments_no_utf8_holds_are_refused_before_sending_and_the_session_stays_usable(
    tmp_path: Path,
) -> None:
    script = {
        "turns": [
            {"tool_calls": [{"name": "tree", "arguments": {}}]},
            # Raw text, as a model sends it: a lone surrogate escape is valid JSON.
            {"tool_calls": [{"name": "echo", "arguments": '{"text": "\\udfff"}'}]},
            {"tool_calls": [{"name": "echo", "arguments": {"text": "still here"}}]},
        ],
        "final": "{{last_output}}",
    }
    async with start_runner(tree_spec(script), tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED, result
    assert result["final_text"] == "still here"
    bad = result["tool_calls"][1]
    assert bad["state"] == "failed" and bad["reason"] == "invalid_arguments", bad
    assert "cannot be sent as UTF-8 JSON" in bad["error"]
    assert not any(alive(p) for p in tree_pids(result))


async def test_a_server_that_puts_a_fifo_in_place_of_its_stderr_log_cannot_block_the_runner(tmp_path: Path) -> None:
    # Reading the log's tail for the setup error opened the FIFO and waited for a writer
    # forever: the runner's deadline never fired.
    code = (
        "import os, sys; p = os.path.join(os.environ['AGENTD_RUN_DIR'], 'mcp-fifo.stderr.log'); "
        "os.unlink(p); os.mkfifo(p); sys.exit(3)"
    )
    servers = {"fifo": {"command": sys.executable, "args": ["-c", code]}}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        rc, result = await r.finish(timeout_s=20)
    assert rc == ExitCode.TOOL_SETUP, result
    assert "mcp server 'fifo'" in result["error"]["message"]
    assert stat.S_ISFIFO((r.run_dir / "mcp-fifo.stderr.log").lstat().st_mode)  # it was there
    warnings = [e.data["message"] for e in r.of(EventKind.LOG) if "not a regular file" in e.data["message"]]
    assert warnings, [e.data for e in r.of(EventKind.LOG)]
    assert r.of(EventKind.PROCESS_GROUP)[-1].data["alive"] is False


@pytest.mark.parametrize("planted", ["fifo", "link"])
async def test_a_fifo_or_link_planted_as_a_servers_stderr_log_is_not_opened(tmp_path: Path, planted: str) -> None:
    # A FIFO blocked the spawn's open for writing forever; a link had the server's stderr
    # appended to the file it names. Either way the log goes to a temp file instead.
    log = tmp_path / "run" / "mcp-tree.stderr.log"
    log.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("")
    if planted == "fifo":
        os.mkfifo(log)
    else:
        log.symlink_to(elsewhere)
    script = {"turns": [{"tool_calls": [{"name": "tree", "arguments": {}}]}], "final": "done"}
    async with start_runner(tree_spec(script, "--stderr-noise"), tmp_path) as r:
        rc, result = await r.finish(timeout_s=20)
    assert rc == ExitCode.COMPLETED, result
    assert elsewhere.read_text() == ""
    assert any("stderr into the run dir" in e.data["message"] for e in r.of(EventKind.LOG))
    assert not any(alive(p) for p in tree_pids(result))


async def test_a_stop_during_setup_ends_its_servers_at_once_even_those_that_ignore_sigterm(tmp_path: Path) -> None:
    # Servers that never answer the handshake and ignore SIGTERM: their groups were ended
    # one after another, a kill grace (2 s) each, and four outlasted the daemon's grace.
    deaf = {"command": "/bin/sh", "args": ["-c", "trap '' TERM; echo started >&2; sleep 300"]}
    servers = {f"deaf{i}": deaf for i in range(4)}
    async with start_runner(spec(script={"final": "x"}, mcpServers=servers), tmp_path) as r:
        with trio.fail_after(20):  # all four spawned (each says so once running)
            for i in range(4):
                await r.wait_event(EventKind.PROCESS_GROUP, lambda e, i=i: e.data["name"] == f"deaf{i}")
        r.signal()
        started = trio.current_time()
        rc, result = await r.finish(timeout_s=30)
        took = trio.current_time() - started
    assert rc == ExitCode.CANCELLED and result["reason"] == "signal"
    groups = [e.data["pgid"] for e in r.of(EventKind.PROCESS_GROUP) if e.data["alive"]]
    assert len(groups) == 4 and not any(alive(g) for g in groups)
    assert took < 3 * MCP_KILL_GRACE_S, took  # at once: not the SDK's close and a kill grace each


@pytest.mark.parametrize("when", ["before the setup", "while the first server is spawned"])
async def test_no_server_is_started_once_the_stop_came(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    # The runner spawned every server of the spec, whatever the stop: a stop that came as
    # the setup began (a SIGTERM right after a spare's `go`), or while the first of four
    # servers was spawned, still started the rest after it (their `process_group` events
    # came after `stop_requested`), and then imported mcp before ending them.
    from subagent import run as runner_run
    from subagent.spec import McpServerSpec
    from subagent.stop import StopControl
    from subagent.tools import mcp_spawn

    events: list[tuple[str, dict[str, Any]]] = []

    class Emitted:
        def emit(self, kind: EventKind, /, **data: Any) -> None:
            events.append((str(kind), data))

    stop = StopControl(on_first_stop=lambda reason, during: events.append(("stop_requested", {"during": during})))
    real_prespawn = mcp_spawn.prespawn

    async def stopped_while_spawned(name: str, *args: Any, **kwargs: Any) -> Any:
        spawned = await real_prespawn(name, *args, **kwargs)
        stop.request("signal")  # the stop comes while this server is being started
        return spawned

    stop.phase = "setup"
    if when == "before the setup":
        stop.request("signal")
    else:
        monkeypatch.setattr(mcp_spawn, "prespawn", stopped_while_spawned)
    server = McpServerSpec.from_dict({"command": "/bin/sh", "args": ["-c", "sleep 300"]}, "s")
    specs = {f"s{i}": server for i in range(4)}
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            servers = await runner_run._start_servers(specs, stack, tmp_path, stop, Emitted())  # type: ignore[arg-type]
            started = [d for k, d in events if k == str(EventKind.PROCESS_GROUP) and d["alive"]]
    assert servers == {}
    assert [d["name"] for d in started] == ([] if when == "before the setup" else ["s0"]), events
    if started:
        assert not alive(started[0]["pgid"])  # ended with the run's stack
        assert [k for k, _ in events].index("stop_requested") > [k for k, _ in events].index(
            str(EventKind.PROCESS_GROUP)
        )
