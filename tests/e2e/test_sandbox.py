"""Acceptance for issue 16: a run cannot reach the daemon's keys, journal or other runs.

The daemon runs in-process on a state dir of its own; runs are real runners (scripted
model) whose tools try, from their own processes, what a prompt-injected model would:
read the token, read and write the journal, list another run's directory, read the
daemon's memory and environment, signal it, print their own environment, connect to the
control socket without the token. Every denial is read from the tool's own output; the
daemon, its journal and the other run go on unharmed. Two state dir places: under /tmp
(a root runner's private /tmp hides it) and under /var/lib (where Landlock alone keeps it
out, as for the systemd unit's /var/lib/agentd).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from subagent import _landlock
from subagent.sandbox import PRIVATE_DIRS
from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from supervisor.errors import SpawnError
from tests import conftest
from tests.supervisor.test_zygote_spare import spare_ready

JUNK = "junk-written-by-a-probe-7f3a"  # what the probes append to the journal they see
CHILDREN = Path(__file__).resolve().parent.parent / "children"
PROBE_SERVER = str(CHILDREN / "mcp_probe_server.py")
MODEL_KEY = "sk-agentd-test-model-key-0123456789"
OTHER_SECRET = "ghp_agentd_test_other_secret_value"
# Bounds one scenario (seconds): a few runs of a scripted model and their commands.
SCENARIO_S = 60.0


@pytest.fixture(autouse=True)
def landlock() -> None:
    """Every test here is about Landlock: required (CI fails without it, a local run skips)."""
    conftest.require(_landlock.abi_version() >= 1, "Landlock in the kernel (5.13+, 'landlock' among its LSMs)")


class Daemon:
    def __init__(self, manager: RunManager, config: Config, info: dict[str, Any]) -> None:
        self.m = manager
        self.config = config
        self.port = int(info["port"])
        self.token = str(info["token"])

    @property
    def state(self) -> Path:
        return self.config.state_dir


@pytest.fixture(params=["tmp", "var_lib"])
def state_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "tmp":
        yield tmp_path / "state"
        return
    conftest.require(os.access("/var/lib", os.W_OK), "a writable /var/lib (root)")
    path = Path("/var/lib") / f"agentd-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    # Secrets the daemon holds in its environment: none may reach a tool.
    monkeypatch.setenv("OPENAI_API_KEY", MODEL_KEY)
    monkeypatch.setenv("GITHUB_TOKEN", OTHER_SECRET)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    config = Config.load(state_dir=state_dir, runner_python=sys.executable, grace_s=3, environ={}, sandbox="required")
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield Daemon(info["manager"], config, info)
        stop.set()


def scripted(turns: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"task": "probe", "model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}}, **more}


def command(cmd: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "run_command", "arguments": {"command": cmd}}]}


async def gated_run(d: Daemon, then: str = "echo gate open") -> tuple[str, Path]:
    """A run that waits at a gate (a file ``go`` in its run dir), then runs ``then``: the other run."""
    r = await d.m.spawn(scripted([command(f"while [ ! -f go ]; do sleep 0.02; done; {then}")]))
    async with d.m.subscribe(r["run_id"]) as live:
        seen = await d.m.events_after(r["run_id"], 0)
        while not any(e["kind"] == "tool_call" and e["data"]["record"]["state"] == "running" for e in seen):
            seen = [await live.receive()]
    st = await d.m.status(r["run_id"])
    return r["run_id"], Path(st["run_dir"])


async def finish_gated(d: Daemon, run_id: str, run_dir: Path) -> dict[str, Any]:
    (run_dir / "go").touch()
    return await d.m.wait_terminal(run_id)


def outputs(status: dict[str, Any]) -> list[str]:
    return [str(t.get("output")) for t in status["result"]["tool_calls"]]


def journal_ok(path: Path) -> str:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return str(con.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        con.close()


def assert_env_clean(env_text: str, d: Daemon) -> None:
    for secret in (MODEL_KEY, OTHER_SECRET, d.token):
        assert secret not in env_text
    assert "OPENAI_API_KEY" not in env_text and "GITHUB_TOKEN" not in env_text
    assert "AGENTD_RUN_SANDBOX" not in env_text and "AGENTD_STATE_DIR" not in env_text


def assert_denied(lines: dict[str, str], key: str) -> None:
    assert key in lines, f"no {key} line: {lines!r}"
    assert lines[key] != "0", f"{key} was not denied: {lines!r}"


PROBE_KEYS = (
    "token", "journal_read", "journal_write", "endpoint", "other_run", "other_run_write",
    "daemon_environ", "daemon_mem", "daemon_fds", "daemon_signal", "runner_environ",
)  # fmt: skip


def shell_probe(state: Path | str, other_dir: Path | str, daemon_pid: int) -> str:
    """A shell script that tries each forbidden thing and prints ``key=<exit code>``."""
    return "\n".join([
        "echo uid=$(id -u)",
        f"cat {state}/token; echo token=$?",
        f"head -c 16 {state}/agentd.sqlite3; echo journal_read=$?",
        f"echo {JUNK} >> {state}/agentd.sqlite3; echo journal_write=$?",
        f"cat {state}/daemon.json; echo endpoint=$?",
        f"ls {other_dir}; echo other_run=$?",
        f"touch {other_dir}/planted; echo other_run_write=$?",
        f"cat /proc/{daemon_pid}/environ; echo daemon_environ=$?",
        f"head -c 1 /proc/{daemon_pid}/mem; echo daemon_mem=$?",
        f"readlink /proc/{daemon_pid}/fd/*; echo daemon_fds=$?",
        f"kill -0 {daemon_pid}; echo daemon_signal=$?",
        "cat /proc/$PPID/environ; echo runner_environ=$?",
        "echo ENV-BEGIN; env; echo ENV-END",
    ])  # fmt: skip


def own_view(state: Path, sandbox: dict[str, Any]) -> bool:
    """The state dir is under one of the run's private tmpfs (/tmp for a root runner): the
    run sees there the directories its run directory's bind left, the run's own to write,
    never the state dir (``journal_untouched`` then shows the host's was not reached)."""
    return any(state.is_relative_to(p) for p in sandbox.get("private", []) if p in PRIVATE_DIRS)


def journal_untouched(journal: Path) -> bool:
    return JUNK.encode() not in journal.read_bytes()


def check_shell_probe(out: str, secrets: list[str], *, own: bool = False) -> dict[str, str]:
    """Every probe denied, in the command's own words; no secret anywhere in its output.
    ``own``: the state dir's path is the run's own private one (``own_view``): a write
    there is the run's own, so it may succeed."""
    lines = dict(
        line.split("=", 1) for line in out.splitlines() if "=" in line and line.split("=", 1)[0].isidentifier()
    )
    for key in PROBE_KEYS:
        if not (own and key == "journal_write"):
            assert_denied(lines, key)
    assert "Permission denied" in out or "No such file or directory" in out
    assert "Operation not permitted" in out  # the signal to the daemon
    env_text = out.split("ENV-BEGIN", 1)[1].split("ENV-END", 1)[0]
    assert "OPENAI_API_KEY" not in env_text and "AGENTD_RUN_SANDBOX" not in env_text
    for secret in secrets:
        assert secret not in out
    return lines


async def test_a_run_command_cannot_reach_the_daemons_state(daemon: Daemon) -> None:
    d = daemon
    token_before = (d.state / "token").read_bytes()
    with trio.fail_after(SCENARIO_S):
        other_id, other_dir = await gated_run(d)
        probe = shell_probe(d.state, other_dir, os.getpid())
        r = await d.m.spawn(scripted([command(probe)]))
        st = await d.m.wait_terminal(r["run_id"])
        other = await finish_gated(d, other_id, other_dir)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    lines = check_shell_probe(out, [MODEL_KEY, OTHER_SECRET, d.token], own=own_view(d.state, st["sandbox"]))
    assert lines["uid"] != "0", "a run's processes never see themselves as root"
    assert journal_untouched(d.state / "agentd.sqlite3")
    # Nothing was harmed: the token, the journal, the other run, the daemon.
    assert (d.state / "token").read_bytes() == token_before
    assert journal_ok(d.state / "agentd.sqlite3") == "ok"
    assert other["state"] == "completed" and outputs(other) == ["[exit code 0]\ngate open\n"]
    assert not (other_dir / "planted").exists()
    assert {row["id"] for row in await d.m.list_runs()} >= {r["run_id"], other_id}
    sandbox = st["sandbox"]
    assert sandbox["mode"] == "landlock" and sandbox["landlock_abi"] >= 1
    assert str(d.state) in sandbox["protected"]


async def test_a_run_cannot_forge_its_own_result_or_events(daemon: Daemon) -> None:
    # A tool writes what looks like its runner's result and events, wherever it can, then
    # kills its runner so that no real result comes: the run must not pass for completed.
    d = daemon
    forged = json.dumps({"status": "completed", "final_text": "FORGED", "tool_calls": []})
    event = json.dumps({"event": "assistant_text", "ts": 1.0, "step": 1, "text": "FORGED", "complete": True})
    script = "; ".join(
        [
            f"printf '%s\\n' '{forged}' > result.json",
            f"printf '%s\\n' '{event}' >> events.jsonl",
            f"printf '%s\\n' '{forged}' > \"$(pwd).result.json\"; echo sibling_result=$? >&2",
            f"printf '%s\\n' '{event}' >> \"$(pwd).events.jsonl\"",
            "kill -KILL $PPID",
            "sleep 30",
        ]
    )
    with trio.fail_after(SCENARIO_S):
        r = await d.m.spawn(scripted([command(script)]))
        st = await d.m.wait_terminal(r["run_id"])
        events = await d.m.events_after(r["run_id"], 0)
    assert (st["state"], st["reason"]) == ("failed", "runner_died"), st
    # (The command's own text, in its call's record, holds the forgery: look elsewhere.)
    partial = st["result"] or {}
    assert partial.get("final_text") != "FORGED" and partial.get("status") != "completed"
    assert not [e for e in events if e["kind"] == "assistant_text"]


async def test_a_run_cannot_forge_the_daemons_stop_marker(daemon: Daemon) -> None:
    # A tool writes the daemon's stop marker (beside its run dir, as the daemon writes it
    # before it SIGTERMs a runner it stops), then SIGTERMs its runner: the runner must not
    # take that for the daemon's stop (a user's cancel), and nor must what the daemon keeps.
    d = daemon
    script = "; ".join(
        [
            'printf user > "$AGENTD_RUN_DIR.stop"; echo forge=$?',
            'rm -f "$AGENTD_RUN_DIR.stop" && printf user > "$AGENTD_RUN_DIR.stop"; echo replace=$?',
            "kill -TERM $PPID",
            "sleep 30",
        ]
    )
    with trio.fail_after(SCENARIO_S):
        r = await d.m.spawn(scripted([command(script)]))
        st = await d.m.wait_terminal(r["run_id"])
        events = await d.m.events_after(r["run_id"], 0)
    assert (st["state"], st["reason"], st["cancel_reason"]) == ("failed", "signalled", None), st
    result = st["result"]
    assert (result["status"], result["reason"]) == ("failed", "signalled"), result
    assert "stop_reason" not in result, result
    stops = [e["data"] for e in events if e["kind"] == "stop_requested"]
    assert [s["reason"] for s in stops] == ["signalled"] and "stop_reason" not in stops[0], stops
    (out,) = outputs(st)
    if not own_view(d.state, st["sandbox"]):
        # Landlock refuses both: the runs dir is protected. (Under a private /tmp the path
        # is the run's own tmpfs, not the marker the runner holds open: the result above.)
        lines = dict(line.split("=", 1) for line in out.splitlines() if line.startswith(("forge=", "replace=")))
        assert_denied(lines, "forge")
        assert_denied(lines, "replace")


async def test_an_mcp_server_process_cannot_reach_the_daemons_state(daemon: Daemon) -> None:
    d = daemon
    with trio.fail_after(SCENARIO_S):
        other_id, other_dir = await gated_run(d)
        calls = [
            ("read", {"path": str(d.state / "token")}),
            ("read", {"path": str(d.state / "agentd.sqlite3")}),
            ("write", {"path": str(d.state / "agentd.sqlite3")}),
            ("listdir", {"path": str(other_dir)}),
            ("read", {"path": f"/proc/{os.getpid()}/environ"}),
            ("environ", {}),
        ]
        turns = [{"tool_calls": [{"name": f"probe__{name}", "arguments": args} for name, args in calls]}]
        servers = {
            "probe": {
                "command": sys.executable,
                "args": [PROBE_SERVER],
                "env": {"SERVER_SETTING": "kept", "LEAK": MODEL_KEY},
            }
        }
        r = await d.m.spawn(scripted(turns, mcpServers=servers))
        st = await d.m.wait_terminal(r["run_id"])
        other = await finish_gated(d, other_id, other_dir)
    assert st["state"] == "completed", st
    *denials, env_out = outputs(st)
    for i, text in enumerate(denials):
        own = i == 2 and own_view(d.state, st["sandbox"])  # the write: to the run's own private copy
        assert text.startswith("denied: ") or (own and text == "ok: written"), denials
    assert b"written by a probe" not in (d.state / "agentd.sqlite3").read_bytes()
    env = json.loads(env_out.removeprefix("ok: "))
    assert env["SERVER_SETTING"] == "kept"  # the server's configured env is passed ...
    assert "LEAK" not in env  # ... but never the model key, whatever name it is given
    assert_env_clean(json.dumps(env), d)
    assert journal_ok(d.state / "agentd.sqlite3") == "ok"
    assert other["state"] == "completed"


GRANDCHILD = r"""
import json, os, sys
state, other, JUNK = sys.argv[1], sys.argv[2], sys.argv[3]
pid = os.fork()
if pid:
    os.waitpid(pid, 0)
    sys.exit(0)
os.setsid()
out = {"left_session": os.getsid(0) != os.getsid(os.getppid())}
for name, fn in [
    ("token", lambda: open(os.path.join(state, "token")).read()),
    ("journal_write", lambda: open(os.path.join(state, "agentd.sqlite3"), "ab").write(JUNK.encode())),
    ("other_run", lambda: os.listdir(other)),
]:
    try:
        fn()
        out[name] = "allowed"
    except OSError as exc:
        out[name] = "denied: " + exc.strerror
out["env"] = dict(os.environ)
print(json.dumps(out), flush=True)
"""


async def test_a_grandchild_that_leaves_the_session_is_still_inside(daemon: Daemon) -> None:
    d = daemon
    with trio.fail_after(SCENARIO_S):
        other_id, other_dir = await gated_run(d)
        cmd = f"{sys.executable} -c '{GRANDCHILD}' {d.state} {other_dir} {JUNK}"
        r = await d.m.spawn(scripted([command(cmd)]))
        st = await d.m.wait_terminal(r["run_id"])
        other = await finish_gated(d, other_id, other_dir)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    report = json.loads(out.splitlines()[-1])
    assert report["left_session"] is True
    own = own_view(d.state, st["sandbox"])
    for key in ("token", "journal_write", "other_run"):
        assert report[key].startswith("denied: ") or (own and key == "journal_write"), report
    assert journal_untouched(d.state / "agentd.sqlite3")
    assert_env_clean(json.dumps(report["env"]), d)
    assert journal_ok(d.state / "agentd.sqlite3") == "ok"
    assert other["state"] == "completed"


CONNECT = r"""
import socket, sys
port = int(sys.argv[1])
for target in ("/", "/?token=guessed"):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall((f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    try:
        answer = s.recv(4096).split(b"\r\n")[0].decode() or "closed"
    except ConnectionResetError:
        answer = "closed"
    print(target, answer, flush=True)
    s.close()
"""


def refused_both(out: str) -> bool:
    """Did ``CONNECT`` get no upgrade for either target? A run's own connection is closed at
    once where the daemon can tell it is a run's (cgroup containment), else it meets the
    token check (401)."""
    answers = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith("/"))
    return set(answers) == {"/", "/?token=guessed"} and all(
        a == "closed" or a.startswith("HTTP/1.1 401") for a in answers.values()
    )


async def test_a_run_without_the_token_cannot_use_the_control_socket(daemon: Daemon) -> None:
    d = daemon
    pid = os.getpid()
    # Everything a run could try for the token, dumped into its own output.
    hunt = "; ".join([
        f"cat /proc/{pid}/cmdline /proc/{pid}/environ",
        f"ls -la /proc/{pid}/fd /proc/{pid}/cwd/",
        f"cat {d.state}/* {d.state}/runs/*/* $AGENTD_RUN_DIR/../../token",
        "cat /proc/$PPID/environ",
        "env",
        "grep -rs . $AGENTD_RUN_DIR $TMPDIR",
    ])  # fmt: skip
    with trio.fail_after(SCENARIO_S):
        r = await d.m.spawn(scripted([command(f"{sys.executable} -c '{CONNECT}' {d.port}"), command(hunt)]))
        st = await d.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st
    connect, hunted = outputs(st)
    assert refused_both(connect), connect
    if st.get("containment") == "cgroup":
        assert connect.count(" closed") == 2, connect  # refused before the handshake
    assert d.token not in hunted and d.token not in json.dumps(st)
    # The daemon is fine and still answers a client that has the token.
    assert (await d.m.summary())["accepting"] is True


async def test_grants_are_explicit_visible_and_never_the_daemons_state(daemon: Daemon, tmp_path: Path) -> None:
    d = daemon
    work = tmp_path / "project"
    work.mkdir()
    (work / "readme").write_text("project file\n")
    with pytest.raises(SpawnError, match="which no run may reach"):
        await d.m.spawn(scripted([], sandbox={"read": [str(d.state)]}))
    with pytest.raises(SpawnError, match="which no run may reach"):
        await d.m.spawn(scripted([], sandbox={"write": [str(d.state / "runs")]}))
    with pytest.raises(SpawnError, match="sandbox.workdir: expected an existing directory"):
        await d.m.spawn(scripted([], sandbox={"workdir": str(tmp_path / "missing")}))
    with trio.fail_after(SCENARIO_S):
        r = await d.m.spawn(scripted([command("pwd; cat readme; echo made > out; ls")], sandbox={"workdir": str(work)}))
        running = await d.m.status(r["run_id"])
        st = await d.m.wait_terminal(r["run_id"])
    assert running["spec"]["sandbox"]["workdir"] == str(work)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    assert out.splitlines()[1:3] == [str(work), "project file"]
    assert (work / "out").read_text() == "made\n"
    assert st["sandbox"]["workdir"] == str(work) and str(work) in st["sandbox"]["write"]


@pytest.mark.chromium
@pytest.mark.parametrize("state_dir", ["tmp"], indirect=True)
async def test_chromium_keeps_its_own_sandbox_in_a_browser_run(daemon: Daemon) -> None:
    from subagent.tools import browser
    from tests import browser_support as bs

    bs.require_browser()
    d = daemon
    with bs.LocalSite() as site:
        slow = {
            "text": "Now the slow page.",
            "tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/slow"}}],
        }
        with trio.fail_after(120):
            r = await d.m.spawn(bs.scripted_browser_spec(site.url + "/", then=[slow]))
            assert await trio.to_thread.run_sync(site.wait_for_request, "/slow", 60)
            st = await d.m.status(r["run_id"])
            found = browser.browser_processes(Path(st["run_dir"]))
            # Sandboxed helpers (zygotes, renderers) need not name the run's paths: they
            # are the browser's descendants.
            procs = set(found)
            for pid in found:
                procs.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            # Helpers rewrite their command line as one string (their process title).
            cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split() for pid in procs}
            seccomp = {pid: bs.status_field(pid, "Seccomp") for pid in procs}
            userns = {pid: os.readlink(f"/proc/{pid}/ns/user") for pid in procs}
            await d.m.cancel(r["run_id"])
            await d.m.wait_terminal(r["run_id"])
    chromium = {pid: c for pid, c in cmdlines.items() if c and c[0].endswith(b"chromium")}
    renderers = [pid for pid, c in chromium.items() if b"--type=renderer" in c]
    main = [pid for pid, c in chromium.items() if not any(a.startswith(b"--type=") for a in c)]
    assert chromium and renderers and main, cmdlines
    assert not any(b"--no-sandbox" in c for c in cmdlines.values()), "chromium runs without its sandbox"
    # Chromium's own sandbox really holds: renderers are under seccomp-bpf, in a user
    # namespace of their own (the browser process made it, inside the run's).
    for pid in renderers:
        assert seccomp[pid] == "2", seccomp
        assert userns[pid] != userns[main[0]]
    assert st["sandbox"]["browser_sandbox"] is True, st["sandbox"]


async def test_a_read_grant_under_a_private_tmp_stays_read_only(daemon: Daemon, tmp_path: Path) -> None:
    # /tmp, /dev/shm and the like are the run's own tmpfs, which it may write; a host path
    # granted for reading is bound back under it, and must not inherit that write.
    d = daemon
    ro = [tmp_path / "ro", Path("/dev/shm") / f"agentd-test-ro-{uuid.uuid4().hex[:8]}"]
    rw = tmp_path / "rw"  # a write grant beside them stays writable
    try:
        for p in ro:
            p.mkdir()
            (p / "file").write_text("host\n")
        rw.mkdir()
        probe = "; ".join(
            [
                f"echo HACKED > {ro[0]}/file; echo w0=$?",
                f"echo HACKED > {ro[1]}/file; echo w1=$?",
                f"touch {ro[1]}/new; echo n1=$?",
                f"cat {ro[0]}/file {ro[1]}/file",
                f"echo ok > {rw}/written; echo rw=$?",
            ]
        )
        spec = scripted([command(probe)], sandbox={"read": [str(p) for p in ro], "write": [str(rw)]})
        with trio.fail_after(SCENARIO_S):
            r = await d.m.spawn(spec)
            st = await d.m.wait_terminal(r["run_id"])
        assert st["state"] == "completed", st
        (out,) = outputs(st)
        lines = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert lines["w0"] != "0" and lines["w1"] != "0" and lines["n1"] != "0", out
        assert lines["rw"] == "0", out  # its write grant
        assert [(p / "file").read_text() for p in ro] == ["host\n", "host\n"]
        assert not (ro[1] / "new").exists() and (rw / "written").read_text() == "ok\n"
    finally:
        shutil.rmtree(ro[1], ignore_errors=True)


async def run_in_a_private_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str, spec: dict[str, Any]
) -> dict[str, Any]:
    """``spec`` run to its end by a daemon whose state is under the private /tmp, by a
    cold runner (``zygote`` "off") or by a spare (waited for: the run is the spare's)."""
    assert str(tmp_path).startswith("/tmp/") or pytest.skip("tmp_path is not under the private /tmp")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    config = Config.load(
        state_dir=tmp_path / "state", runner_python=sys.executable, grace_s=3, environ={}, zygote=zygote
    )
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        m = info["manager"]
        with trio.fail_after(SCENARIO_S):
            spare = await spare_ready(m) if zygote == "auto" else None
            r = await m.spawn(spec)
            st: dict[str, Any] = await m.wait_terminal(r["run_id"])
        stop.set()
    assert spare is None or st["pid"] == spare  # the run was the spare's
    return st


@pytest.mark.parametrize("zygote", ["off", "auto"])  # a cold runner, a spare
async def test_a_write_grant_inside_a_read_grant_under_a_private_tmp_leaves_the_rest_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str
) -> None:
    # The read grant was bound writable whole, so that the write grant inside it stayed
    # writable: the run rewrote a host file it was granted only to read.
    ro = tmp_path / "proj"
    inner = ro / "out"
    inner.mkdir(parents=True)
    (ro / "file").write_text("host\n")
    probe = "; ".join(
        [
            f"echo HACKED > {ro}/file; echo w=$?",
            f"touch {ro}/new; echo n=$?",
            f"echo ok > {inner}/written; echo rw=$?",
            f"cat {ro}/file",
        ]
    )
    spec = scripted([command(probe)], sandbox={"read": [str(ro)], "write": [str(inner)]})
    st = await run_in_a_private_tmp(tmp_path, monkeypatch, zygote, spec)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    lines = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert lines["w"] != "0" and lines["n"] != "0", out
    assert lines["rw"] == "0", out
    assert (ro / "file").read_text() == "host\n" and not (ro / "new").exists()
    assert (inner / "written").read_text() == "ok\n"


@pytest.mark.parametrize("zygote", ["off", "auto"])  # a cold runner, a spare
async def test_a_grant_through_a_link_in_a_middle_component_under_a_private_tmp_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str
) -> None:
    # A spare looks for its grants on the host through the descriptors of what its private
    # /tmp hides; a link (absolute target) in a middle component of a granted path was
    # followed in the private /tmp instead, where nothing is: the grant was dropped.
    real = tmp_path / "real" / "data"
    real.mkdir(parents=True)
    (real / "file").write_text("host data\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lnk").symlink_to(tmp_path / "real")  # absolute
    (tmp_path / "rel").symlink_to("real")  # relative, for the same dir
    granted = [tmp_path / "a" / "lnk" / "data", tmp_path / "rel" / "data"]
    probe = "; ".join(f"cat {p}/file; echo r{i}=$?" for i, p in enumerate(granted))
    st = await run_in_a_private_tmp(
        tmp_path, monkeypatch, zygote, scripted([command(probe)], sandbox={"read": [str(p) for p in granted]})
    )
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    assert out.count("host data") == 2 and "r0=0" in out and "r1=0" in out, (out, st["sandbox"])


@pytest.mark.parametrize("zygote", ["off", "auto"])  # a cold runner, a spare
@pytest.mark.parametrize("grant", ["none", "a read grant holding the state dir"])
async def test_a_run_writes_its_private_tmp_though_the_state_dir_is_under_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str, grant: str
) -> None:
    # The state dir's protection reached the run's own /tmp: the directories its run
    # directory's bind left there were taken for the state dir, so /tmp got no write rule
    # and `mktemp` failed in every run of a daemon whose state is under /tmp.
    state = tmp_path / "state"
    probe = "; ".join(
        [
            "echo x > /tmp/file; echo t=$?",
            "mkdir -p /tmp/a/b && echo x > /tmp/a/b/f; echo d=$?",
            "mktemp -p /var/tmp >/dev/null; echo v=$?",
            f"cat {state}/token; echo tok=$?",
            f"echo x > {state}/planted; echo p=$?",
            f"echo HACKED > {state}/token; echo ow=$?",
        ]
    )
    more: dict[str, Any] = {} if grant == "none" else {"sandbox": {"read": [str(tmp_path)]}}
    st = await run_in_a_private_tmp(tmp_path, monkeypatch, zygote, scripted([command(probe)], **more))
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    lines = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert lines["tok"] != "0" and MODEL_KEY not in out, out
    token = (state / "token").read_text()
    assert token.strip() and token.strip() not in out and "HACKED" not in token
    assert not (state / "planted").exists() and not (Path("/tmp") / "file").exists()
    if grant == "none":  # the whole of its private /tmp is its own (what it wrote there too)
        assert (lines["t"], lines["d"], lines["v"], lines["p"], lines["ow"]) == ("0",) * 5, out
    else:  # what the read grant brings back stays out of reach (Landlock cannot give the rest of /tmp)
        assert lines["p"] != "0" and lines["ow"] != "0", out
    assert lines["v"] == "0", out


@pytest.mark.parametrize("zygote", ["off", "auto"])  # a cold runner, a spare
async def test_an_mcp_server_command_kept_under_a_private_tmp_is_granted_and_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str
) -> None:
    # A spare made its private /tmp before it had its run: it looked for the server's
    # command there, did not find it, granted nothing, and the run failed ("cannot start
    # ...: No such file or directory"). The daemon now gives it the paths it found.
    tools = tmp_path / "tools"
    tools.mkdir()
    real = tools / "probe-server.sh"
    real.write_text(f"#!/bin/sh\nexec {sys.executable} {PROBE_SERVER}\n")
    real.chmod(0o755)
    command = tools / "probe-server"  # started as a link to it
    command.symlink_to(real)
    spec = scripted(
        [{"tool_calls": [{"name": "probe__read", "arguments": {"path": str(command)}}]}],
        mcpServers={"probe": {"command": str(command)}},
    )
    st = await run_in_a_private_tmp(tmp_path, monkeypatch, zygote, spec)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    assert out.startswith("ok: ") and "exec" in out, st["tool_calls"]  # it ran, and may read its command
    assert str(command) in st["sandbox"]["read"], st["sandbox"]


async def test_a_write_grant_over_agentds_own_code_is_refused_at_the_spawn(daemon: Daemon) -> None:
    from subagent.sandbox import CHECKOUT

    for where in (CHECKOUT, str(Path(CHECKOUT).parent)):
        with pytest.raises(SpawnError, match="agentd's own code"):
            await daemon.m.spawn(scripted([], sandbox={"write": [where]}))


async def test_a_spec_cannot_set_the_paths_the_daemon_grants_its_tools(daemon: Daemon) -> None:
    with pytest.raises(SpawnError, match="tool_paths: the daemon sets it"):
        await daemon.m.spawn(scripted([], tool_paths=["/"]))


async def test_paths_a_runs_tools_would_be_granted_are_held_to_the_grants_rules(daemon: Daemon) -> None:
    # An MCP server's cwd or command, a script's path: granted by the runner for its tools,
    # so refused at the spawn as a sandbox grant there would be.
    d = daemon
    token = str(d.state / "token")
    bad = [
        {"mcpServers": {"p": {"command": sys.executable, "args": ["-c", "pass"], "cwd": str(d.state)}}},
        {"model": {"provider": "scripted", "script_path": token}},
    ]
    for more in bad:
        with pytest.raises(SpawnError, match="which no run may reach"):
            await d.m.spawn({"task": "probe", "model": {"provider": "scripted"}, **more})


@pytest.mark.parametrize("state_dir", ["tmp"], indirect=True)
async def test_a_grant_swapped_for_a_link_into_the_state_dir_after_the_spawn_is_refused_at_the_start(
    state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checked at the spawn; then, while the run waits in the queue, its granted directory
    # becomes a link to the daemon's state. The runner checks again as it enters its sandbox.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    config = Config.load(state_dir=state_dir, runner_python=sys.executable, grace_s=3, environ={}, max_concurrent=1)
    data = tmp_path / "proj" / "data"
    data.mkdir(parents=True)
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        d = Daemon(info["manager"], config, info)
        with trio.fail_after(SCENARIO_S):
            blocker, blocker_dir = await gated_run(d)  # holds the one place: the next run queues
            probe = command(f"cat {data}/token; echo tok=$?")
            r = await d.m.spawn(scripted([probe], sandbox={"read": [str(data)]}))
            queued = (await d.m.status(r["run_id"]))["state"]
            data.rmdir()
            data.symlink_to(state_dir)
            await finish_gated(d, blocker, blocker_dir)
            st = await d.m.wait_terminal(r["run_id"])
        stop.set()
    assert queued == "queued"
    assert (st["state"], st["reason"]) == ("failed", "sandbox"), st
    assert "which no run may reach" in st["error"]["message"]
    assert d.token not in json.dumps(st)


@pytest.mark.parametrize("zygote", ["off", "auto"])  # a cold runner, a spare
async def test_a_run_that_fills_its_private_tmp_gets_enospc_and_the_others_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str
) -> None:
    # A run's private /tmp, /var/tmp, /dev/shm and /run were a tmpfs each with the kernel's
    # default size, half the RAM each: one run writing there could take the machine's
    # memory. They are one tmpfs now, of ``run_tmpfs_max_mib`` for them all.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    config = Config.load(
        state_dir=tmp_path / "state", runner_python=sys.executable, grace_s=3, environ={}, zygote=zygote,
        sandbox="required", run_tmpfs_max_mib=8,
    )  # fmt: skip
    fill = "; ".join(
        [
            "dd if=/dev/zero of=/tmp/a bs=1M count=5 2>&1; echo tmp=$?",
            # The budget is shared: 5 MiB in /tmp leave less than 5 for /dev/shm.
            "dd if=/dev/zero of=/dev/shm/b bs=1M count=5 2>&1; echo shm=$?",
            "dd if=/dev/zero of=/run/c bs=1M count=64 2>&1; echo run=$?",
            "df -k /tmp /var/tmp /dev/shm /run",
            "awk '$5 ~ /^\\/(tmp|var\\/tmp|dev\\/shm|run)$/ {print \"mnt\", $5, $6}' /proc/self/mountinfo",
            # Full, it waits at a gate while the other run writes its own.
            "touch filled; while [ ! -f go ]; do sleep 0.02; done",
        ]
    )
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        d = Daemon(info["manager"], config, info)
        with trio.fail_after(SCENARIO_S):
            if zygote == "auto":
                await spare_ready(d.m)
            other_id, other_dir = await gated_run(d, "dd if=/dev/zero of=/dev/shm/x bs=1M count=6 2>&1; echo shm=$?")
            r = await d.m.spawn(scripted([command(fill)]))
            while (filler := (await d.m.status(r["run_id"]))["run_dir"]) is None:
                await trio.sleep(0.02)
            filler_dir = Path(filler)
            while not (filler_dir / "filled").exists():  # (its command's own file, on its clock)
                await trio.sleep(0.02)
            # The other run, live beside the full one, has its own budget whole.
            (other_dir / "go").touch()
            other = await d.m.wait_terminal(other_id)
            (filler_dir / "go").touch()
            st = await d.m.wait_terminal(r["run_id"])
        stop.set()
    assert st["state"] == "completed", st  # a tool's failure; the run ends as it would
    (out,) = outputs(st)
    lines = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and "/" not in line)
    assert lines["tmp"] == "0" and lines["shm"] != "0" and lines["run"] != "0", out
    assert out.count("No space left on device") == 2, out
    sizes = {line.split()[1] for line in out.splitlines() if line.endswith(("/tmp", "/var/tmp", "/dev/shm", "/run"))}
    assert sizes == {"8192"}, out  # one tmpfs of 8 MiB, seen at each of the four
    assert st["sandbox"]["private_max_mib"] == 8, st["sandbox"]
    top = {m[1]: m[2] for m in (line.split() for line in out.splitlines() if line.startswith("mnt "))}
    assert sorted(top) == sorted(PRIVATE_DIRS), out  # (the last line of each: what is on top)
    assert all({"nosuid", "nodev"} <= set(flags.split(",")) for flags in top.values()), top
    assert other["state"] == "completed", other
    assert outputs(other)[0].splitlines()[-1] == "shm=0", outputs(other)
