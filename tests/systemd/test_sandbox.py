"""Issue 16 under the real unit: a run cannot reach the daemon's state, as installed.

The daemon runs as agentd.service (installed by scripts/install-systemd) in a booted
container: uid 0 with no capability but CAP_SETFCAP, which its runners drop once they are
in their own user, mount and IPC namespace (test_sandbox_ns.py); Landlock is what keeps a
run off the daemon's files (its directories are covered in the run's view too). The same probes as
tests/e2e/test_sandbox.py run from a run_command, an MCP server's process and a
grandchild that left the session: each is denied, no secret is in their environment, and
the daemon, its journal and the other run go on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from subagent import _quotas
from tests.e2e.test_sandbox import (
    CONNECT,
    GRANDCHILD,
    JUNK,
    PROBE_SERVER,
    check_shell_probe,
    command,
    refused_both,
    scripted,
    shell_probe,
)
from tests.systemd.agentd_support import (
    STATE_DIR,
    UNIT,
    cli,
    install,
    poll,
    require_daemon,
    stop_and_check,
)
from tests.systemd.container import Container, python_in_container

pytestmark = pytest.mark.systemd

MODEL_KEY = "sk-agentd-unit-test-model-key"
ENV_FILE = "/etc/agentd/agentd.env"
SPEC = "/run/agentd-test/spec.json"


@pytest.fixture(scope="module")
def agentd(container: Container) -> Iterator[Container]:
    require_daemon()
    install(container)
    # A secret in the unit's environment file, as an operator would put it there.
    container.write(ENV_FILE, f"OPENAI_API_KEY={MODEL_KEY}\n", mode="0600")
    container.systemctl("start", UNIT, timeout_s=60)
    yield container
    stop_and_check(container)
    container.systemctl("reset-failed", UNIT, check=False)


def spawn(c: Container, spec: dict[str, Any]) -> str:
    c.write(SPEC, json.dumps(spec))
    return str(cli(c, "spawn", "--spec", SPEC)["run_id"])


def wait_end(c: Container, run_id: str) -> dict[str, Any]:
    return poll(f"run {run_id} to end",
                lambda: (s := cli(c, "status", run_id))["state"] not in {"queued", "starting", "running"} and s,
                timeout_s=60, every_s=0.1)  # fmt: skip


def gated(c: Container) -> tuple[str, str]:
    run_id = spawn(c, scripted([command("while [ ! -f go ]; do sleep 0.02; done; echo gate open")]))
    st = poll("the gated run to wait at its gate",
              lambda: (s := cli(c, "status", run_id)).get("run_dir") and any(
                  t["state"] == "running" for t in s.get("tool_calls") or []) and s,
              timeout_s=60, every_s=0.1)  # fmt: skip
    return run_id, str(st["run_dir"])


def open_gate(c: Container, run_id: str, run_dir: str) -> dict[str, Any]:
    c.run(["touch", f"{run_dir}/go"])
    return wait_end(c, run_id)


def daemon_pid(c: Container) -> int:
    return int(c.show(UNIT, "MainPID")["MainPID"])


def token(c: Container) -> str:
    return c.run(["cat", f"{STATE_DIR}/token"]).stdout.strip()


def journal_ok(c: Container) -> str:
    code = f"import sqlite3; print(sqlite3.connect('file:{STATE_DIR}/agentd.sqlite3?mode=ro', uri=True).execute('PRAGMA integrity_check').fetchone()[0])"
    return c.run([python_in_container(), "-c", code]).stdout.strip()


def outputs(status: dict[str, Any]) -> list[str]:
    return [str(t.get("output")) for t in status["tool_calls"]]


def test_a_run_command_under_the_unit_cannot_reach_the_daemons_state(agentd: Container) -> None:
    c = agentd
    pid, secret = daemon_pid(c), token(c)
    other_id, other_dir = gated(c)
    run_id = spawn(c, scripted([command(shell_probe(STATE_DIR, other_dir, pid))]))
    st = wait_end(c, run_id)
    other = open_gate(c, other_id, other_dir)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    check_shell_probe(out, [MODEL_KEY, secret])
    # Landlock's word (the run's own directory, bound back), or the state dir covered in
    # the run's view (its own mount namespace).
    assert "Permission denied" in out or "No such file or directory" in out
    env_file = c.run(["sh", "-c", f"cat {ENV_FILE}"]).stdout
    assert MODEL_KEY in env_file  # (the file is there, for the daemon)
    sandbox = st["sandbox"]
    assert sandbox["mode"] == "landlock", sandbox
    assert sandbox["identity"] == "uid 0 on the host, uid 65000 in its own user namespace, no capabilities", sandbox
    # The key calls are refused and the rlimits lowered; the user namespace's caps
    # (inotify, namespaces) cannot be written under ProtectKernelTunables (/proc/sys is
    # read-only, locked, in every namespace of the service), and status says so.
    assert "keyctl" in sandbox["denied_syscalls"], sandbox
    assert sandbox["quotas"]["RLIMIT_MSGQUEUE"] == _quotas.MSGQUEUE_BYTES, sandbox
    assert "max_inotify_instances" not in sandbox["quotas"], sandbox
    assert any(p.startswith(_quotas.UNCAPPED) for p in sandbox["problems"]), sandbox
    assert token(c) == secret and journal_ok(c) == "ok"
    assert other["state"] == "completed" and daemon_pid(c) == pid


CONNECT_UNIX = r"""
import socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print(path, "connected")
    except OSError as exc:
        print(path, "refused:", exc.strerror)
"""


def test_the_unit_env_file_and_root_sockets_are_out_of_reach(agentd: Container) -> None:
    c = agentd
    # The sockets are there for the host's own root (the daemon's view is the unit's).
    assert c.run(["test", "-S", "/run/systemd/private"], check=False).returncode == 0
    sockets = "/run/systemd/private /run/dbus/system_bus_socket"
    probe = f"cat {ENV_FILE}; echo env_file=$?; {python_in_container()} -c '{CONNECT_UNIX}' {sockets}; systemctl start nothing.service; echo systemctl=$?"
    run_id = spawn(c, scripted([command(probe)]))
    st = wait_end(c, run_id)
    (out,) = outputs(st)
    # Landlock's word, or (the run's own mount namespace) /etc/agentd and /run not in its view.
    assert "env_file=0" not in out and ("Permission denied" in out or "No such file or directory" in out)
    assert MODEL_KEY not in out
    assert "connected" not in out and out.count("refused:") == 2, out
    assert "systemctl=0" not in out


def test_a_run_under_the_unit_without_the_token_is_refused_by_the_socket(agentd: Container) -> None:
    c = agentd
    port = json.loads(c.run(["cat", f"{STATE_DIR}/daemon.json"]).stdout)["port"]
    run_id = spawn(c, scripted([command(f"{python_in_container()} -c '{CONNECT}' {port}")]))
    st = wait_end(c, run_id)
    (out,) = outputs(st)
    assert refused_both(out), out
    assert token(c) not in json.dumps(st)


def test_an_mcp_server_and_a_setsid_grandchild_under_the_unit(agentd: Container) -> None:
    c = agentd
    pid, secret = daemon_pid(c), token(c)
    other_id, other_dir = gated(c)
    py = python_in_container()
    calls = [
        ("read", {"path": f"{STATE_DIR}/token"}),
        ("write", {"path": f"{STATE_DIR}/agentd.sqlite3"}),
        ("listdir", {"path": other_dir}),
        ("read", {"path": f"/proc/{pid}/environ"}),
        ("environ", {}),
    ]
    turns = [
        {"tool_calls": [{"name": f"probe__{name}", "arguments": args} for name, args in calls]},
        command(f"{py} -c '{GRANDCHILD}' {STATE_DIR} {other_dir} {JUNK}"),
    ]
    servers = {"probe": {"command": py, "args": [PROBE_SERVER]}}
    run_id = spawn(c, scripted(turns, mcpServers=servers))
    st = wait_end(c, run_id)
    other = open_gate(c, other_id, other_dir)
    assert st["state"] == "completed", st
    *denials, env_out, grandchild = outputs(st)
    assert all(t.startswith("denied: ") for t in denials), denials
    for text in (env_out, grandchild):
        assert MODEL_KEY not in text and secret not in text and "OPENAI_API_KEY" not in text
    report = json.loads(grandchild.splitlines()[-1])
    assert report["left_session"] is True
    assert all(report[k].startswith("denied: ") for k in ("token", "journal_write", "other_run")), report
    assert journal_ok(c) == "ok" and other["state"] == "completed"
    # The daemon never stopped answering: a client with the token still gets through.
    assert run_id in json.dumps(cli(c, "list"))
