"""Issue 16 for a daemon run by a normal user: the same walls as tests/e2e/test_sandbox.py.

A real ``agentd serve`` runs as an unprivileged uid (``nobody``) with the state dir a user
gets by default (``~/.local/state/agentd``), and the model key and another secret in its
environment. Its runs are that same uid, so the uid is no wall: Landlock is, with a user
and mount namespace of the run's own (private /tmp and /run). The probes are those of the
root daemon's test, from a run_command, an MCP server's process and a grandchild that left
the session; the user's own files and sockets are out of reach too; a run without the token
is refused by the control socket; Chromium keeps its own sandbox.

CI runs as root, and this venv's interpreter may live where no other uid can go (pyenv
under a 0700 /root). The harness (``user_daemon``) does not change the host for that: the
daemon gets a mount namespace of its own where every directory on the way to the
interpreter, the venv and this checkout that the uid cannot traverse is replaced by an
empty tmpfs (mode 0755) with the needed entry bound back, then drops to the uid with
``setpriv``. The daemon sees the same files at the same paths, except that those
directories' other entries are gone: a normal user could not read them either.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from subagent import _landlock, _nest, _quotas
from subagent.sandbox import PRIVATE_DIRS, PROC_SHARED
from supervisor.control.client import Client
from tests import conftest
from tests.e2e.test_sandbox import (
    CONNECT,
    GRANDCHILD,
    JUNK,
    MODEL_KEY,
    OTHER_SECRET,
    PROBE_SERVER,
    check_shell_probe,
    command,
    journal_ok,
    journal_untouched,
    own_view,
    scripted,
    shell_probe,
)  # fmt: skip

REPO = Path(__file__).resolve().parent.parent.parent
# The daemon's user: one that exists on any Debian host, owns nothing and logs in nowhere.
USER = "nobody"
# Bounds the daemon's start (imports, journal, listening) and its stop (seconds).
DAEMON_START_S = 30.0
DAEMON_STOP_S = 20.0
# Bounds one scenario (seconds): a few runs of a scripted model and their commands.
SCENARIO_S = 60.0


@pytest.fixture(autouse=True)
def landlock() -> None:
    """Every test here is about Landlock: required (CI fails without it, a local run skips)."""
    conftest.require(_landlock.abi_version() >= 1, "Landlock in the kernel (5.13+, 'landlock' among its LSMs)")


# ----------------------------------------------------------------------------- the view


def _can_traverse(st: os.stat_result, uid: int, gid: int) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def blocked_dirs(paths: Iterable[str], uid: int, gid: int) -> dict[str, set[str]]:
    """Directories on the way to ``paths`` that ``uid``/``gid`` cannot traverse, each with
    the entries under it that must stay reachable, outermost first."""
    out: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(os.path.realpath(path)).parts
        for depth in range(1, len(parts) - 1):
            here = os.path.join(*parts[: depth + 1])
            if not _can_traverse(os.stat(here), uid, gid):
                out.setdefault(here, set()).add(parts[depth + 1])
    return dict(sorted(out.items(), key=lambda kv: kv[0].count("/")))


def view_script(blocked: dict[str, set[str]], saves: Path, uid: int, gid: int) -> str:
    """Shell, run as root in a new mount namespace: the view above, then the drop to ``uid``."""
    q = shlex.quote
    lines = ["set -eu"]
    for i, (where, names) in enumerate(blocked.items()):
        kept = [(os.path.join(where, name), saves / f"{i}-{n}") for n, name in enumerate(sorted(names))]
        for src, save in kept:
            kind = "mkdir" if os.path.isdir(src) else "touch"
            lines += [f"{kind} {q(str(save))}", f"mount --bind {q(src)} {q(str(save))}"]
        lines.append(f"mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs {q(where)}")
        for src, save in kept:
            kind = "mkdir" if os.path.isdir(src) else "touch"
            lines += [f"{kind} {q(src)}", f"mount --bind {q(str(save))} {q(src)}", f"umount {q(str(save))}"]
    lines.append(f'exec setpriv --reuid={uid} --regid={gid} --clear-groups -- "$@"')
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the daemon


@dataclass
class UserDaemon:
    uid: int
    gid: int
    pid: int
    home: Path
    state: Path

    def client(self) -> Client:
        return Client(state_dir=self.state)

    @property
    def token(self) -> str:
        return (self.state / "token").read_text().strip()

    @property
    def port(self) -> int:
        return int(json.loads((self.state / "daemon.json").read_text())["port"])


async def _drain(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    async for chunk in stream:
        into += chunk


@pytest.fixture(params=["home", "tmp"])
def place(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Where the user's home is: under /home (Landlock is what keeps the state dir out of
    a run's reach) or under /tmp (the run's private /tmp hides it too). Removed after."""
    root = Path("/home") if request.param == "home" else Path(tempfile.gettempdir())
    conftest.require(os.access(root, os.W_OK), f"a writable {root} (root)")
    base = Path(tempfile.mkdtemp(prefix="agentd-test-", dir=root))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def user_daemon(place: Path) -> AsyncIterator[UserDaemon]:
    conftest.require(os.geteuid() == 0, "root, to start the daemon as another uid (setpriv)")
    for tool in ("unshare", "setpriv", "mount"):
        conftest.require(shutil.which(tool) is not None, f"{tool} (util-linux)")
    pw = pwd.getpwnam(USER)
    uid, gid = pw.pw_uid, pw.pw_gid
    node = shutil.which("node")
    needs = [sys.executable, sys.prefix, os.path.realpath(sys.base_prefix), str(REPO), *([node] if node else [])]
    path = ":".join(dict.fromkeys([*([os.path.dirname(node)] if node else []), "/usr/local/bin", "/usr/bin", "/bin"]))
    # The user's home: nothing in it but what the daemon makes (its default state dir).
    os.chmod(place, 0o755)
    home = place / "home"
    home.mkdir(mode=0o700)
    os.chown(home, uid, gid)
    saves = place / "saves"
    saves.mkdir(mode=0o700)
    script = view_script(blocked_dirs(needs, uid, gid), saves, uid, gid)
    env = {
        "PATH": path,  # a login's, not root's
        "HOME": str(home),
        "USER": USER,
        "LOGNAME": USER,
        "LANG": "C.UTF-8",
        # This checkout's code (the venv's own install may be another checkout's: a worktree).
        "PYTHONPATH": str(REPO),
        "AGENTD_GRACE_S": "3",
        "AGENTD_SANDBOX": "required",
        "AGENTD_DASHBOARD": "off",
        # Secrets the daemon holds: none may reach a tool.
        "OPENAI_API_KEY": MODEL_KEY,
        "GITHUB_TOKEN": OTHER_SECRET,
        conftest.MARK_VAR: os.environ[conftest.MARK_VAR],
    }
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]
    argv += [sys.executable, "-m", "supervisor", "serve"]
    proc = await trio.lowlevel.open_process(argv, env=env, cwd=str(home), stderr=-1, start_new_session=True)
    log = bytearray()
    try:
        assert proc.stderr is not None
        async with trio.open_nursery() as n:
            with trio.fail_after(DAEMON_START_S):
                while b"agentd listening on" not in log:
                    chunk = await proc.stderr.receive_some()
                    assert chunk, f"agentd serve exited early: {log.decode(errors='replace')}"
                    log += chunk
            n.start_soon(_drain, proc.stderr, log)
            state = home / ".local" / "state" / "agentd"
            yield UserDaemon(uid=uid, gid=gid, pid=proc.pid, home=home, state=state)
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(DAEMON_STOP_S):
                await proc.wait()
        assert proc.returncode == 0, log.decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.move_on_after(DAEMON_STOP_S):
                await proc.wait()


# ----------------------------------------------------------------------------- runs


def _wait_end(d: UserDaemon, run_id: str) -> dict[str, Any]:
    with d.client() as c:
        follow = c.follow(run_id)
        for _event in follow:
            pass
        return c.status(run_id)


def _wait_tool_running(d: UserDaemon, run_id: str) -> dict[str, Any]:
    with d.client() as c:
        for e in c.follow(run_id):
            if e["kind"] == "tool_call" and e["data"]["record"]["state"] == "running":
                return c.status(run_id)
    raise AssertionError(f"run {run_id} ended before its tool ran")


async def spawn(d: UserDaemon, spec: dict[str, Any]) -> str:
    def go() -> str:
        with d.client() as c:
            return str(c.spawn(spec)["run_id"])

    return await trio.to_thread.run_sync(go)


async def wait_end(d: UserDaemon, run_id: str) -> dict[str, Any]:
    return await trio.to_thread.run_sync(_wait_end, d, run_id, abandon_on_cancel=True)


async def gated_run(d: UserDaemon) -> tuple[str, Path]:
    """A run that waits at a gate (a file ``go`` in its run dir): the other run."""
    run_id = await spawn(d, scripted([command("while [ ! -f go ]; do sleep 0.02; done; echo gate open")]))
    st = await trio.to_thread.run_sync(_wait_tool_running, d, run_id, abandon_on_cancel=True)
    return run_id, Path(st["run_dir"])


async def finish_gated(d: UserDaemon, run_id: str, run_dir: Path) -> dict[str, Any]:
    (run_dir / "go").touch()
    return await wait_end(d, run_id)


def outputs(status: dict[str, Any]) -> list[str]:
    return [str(t.get("output")) for t in status["result"]["tool_calls"]]


# ----------------------------------------------------------------------------- tests


async def test_a_users_daemon_runs_as_that_user_and_its_runs_are_sandboxed(user_daemon: UserDaemon) -> None:
    d = user_daemon
    daemon = psutil.Process(d.pid)
    assert daemon.uids().real == d.uid and daemon.uids().effective == d.uid
    assert json.loads((d.state / "daemon.json").read_text())["pid"] == d.pid
    assert d.state.stat().st_uid == d.uid and stat.S_IMODE(d.state.stat().st_mode) == 0o700
    token_before = (d.state / "token").read_bytes()
    # The user's own secret in their home, beside the state dir.
    ssh = d.home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "id_ed25519").write_text(OTHER_SECRET)
    for p in (ssh, ssh / "id_ed25519"):
        os.chown(p, d.uid, d.gid)
    home_probe = f"cat {ssh}/id_ed25519; echo ssh_key=$?; ls {d.home}; echo home=$?"
    with trio.fail_after(SCENARIO_S):
        other_id, other_dir = await gated_run(d)
        run_id = await spawn(d, scripted([command(shell_probe(d.state, other_dir, d.pid)), command(home_probe)]))
        st = await wait_end(d, run_id)
        other = await finish_gated(d, other_id, other_dir)
    assert st["state"] == "completed", st
    out, home_out = outputs(st)
    own = own_view(d.state, st["sandbox"])  # a home under /tmp: what the run sees there is its own
    assert "ssh_key=0" not in home_out and OTHER_SECRET not in home_out, home_out
    assert "home=0" not in home_out or (own and ".ssh" not in home_out.split("ssh_key=", 1)[1]), home_out
    lines = check_shell_probe(out, [MODEL_KEY, OTHER_SECRET, d.token], own=own)
    assert journal_untouched(d.state / "agentd.sqlite3")
    assert lines["uid"] == str(d.uid), "a normal user's runs are that user"
    sandbox = st["sandbox"]
    assert sandbox["mode"] == "landlock" and str(d.state) in sandbox["protected"], sandbox
    assert sandbox["identity"] == f"uid {d.uid} on the host, uid {d.uid} in its own user namespace, no capabilities"
    assert sandbox["proc"] == PROC_SHARED, "a normal user cannot mount a procfs: the host's /proc, and said so"
    assert {p for p in PRIVATE_DIRS if os.path.isdir(p)} <= set(sandbox["private"]), sandbox
    # The user's per-user kernel counts: the run's share capped in its own namespace as a root run's is.
    assert sandbox["quotas"]["max_inotify_instances"] == _quotas.INOTIFY_INSTANCES, sandbox
    assert sandbox["quotas"]["ptys"] == _quotas.PTYS and "keyctl" in sandbox["denied_syscalls"], sandbox
    # All runs together: in the daemon's nest, the user's own namespace (``subagent/_nest.py``).
    assert sandbox["quotas"]["total_max_inotify_instances"] == _nest.INOTIFY_INSTANCES_TOTAL, sandbox
    if not any(d.home.is_relative_to(p) for p in PRIVATE_DIRS):
        assert "Permission denied" in out  # Landlock's word: no private dir hides the state here
    # Nothing was harmed: the token, the journal, the other run, the daemon.
    assert (d.state / "token").read_bytes() == token_before
    assert journal_ok(d.state / "agentd.sqlite3") == "ok"
    assert other["state"] == "completed" and outputs(other) == ["[exit code 0]\ngate open\n"]
    assert not (other_dir / "planted").exists()
    assert daemon.is_running()


@pytest.mark.parametrize("place", ["home"], indirect=True)
async def test_an_mcp_server_and_a_setsid_grandchild_of_a_users_daemon_are_inside(user_daemon: UserDaemon) -> None:
    d = user_daemon
    calls = [
        ("read", {"path": str(d.state / "token")}),
        ("read", {"path": str(d.state / "agentd.sqlite3")}),
        ("write", {"path": str(d.state / "agentd.sqlite3")}),
        ("read", {"path": f"/proc/{d.pid}/environ"}),
        ("environ", {}),
    ]
    with trio.fail_after(SCENARIO_S):
        other_id, other_dir = await gated_run(d)
        turns = [
            {"tool_calls": [{"name": f"probe__{name}", "arguments": args} for name, args in calls]},
            {"tool_calls": [{"name": "probe__listdir", "arguments": {"path": str(other_dir)}}]},
            command(f"{sys.executable} -c '{GRANDCHILD}' {d.state} {other_dir} {JUNK}"),
        ]
        servers = {"probe": {"command": sys.executable, "args": [PROBE_SERVER], "env": {"LEAK": MODEL_KEY}}}
        run_id = await spawn(d, scripted(turns, mcpServers=servers))
        st = await wait_end(d, run_id)
        other = await finish_gated(d, other_id, other_dir)
    assert st["state"] == "completed", st
    *denials, env_out, listed, grandchild = outputs(st)
    assert all(t.startswith("denied: ") for t in [*denials, listed]), [*denials, listed]
    env = json.loads(env_out.removeprefix("ok: "))
    assert "LEAK" not in env and "OPENAI_API_KEY" not in env and "GITHUB_TOKEN" not in env
    report = json.loads(grandchild.splitlines()[-1])
    assert report["left_session"] is True
    assert all(report[k].startswith("denied: ") for k in ("token", "journal_write", "other_run")), report
    for text in (env_out, grandchild):
        for secret in (MODEL_KEY, OTHER_SECRET, d.token):
            assert secret not in text
    assert journal_ok(d.state / "agentd.sqlite3") == "ok"
    assert other["state"] == "completed"


# What ``go build`` leaves under the run's HOME (its module cache, read-only on purpose),
# and a directory the run closed to its own uid.
READ_ONLY_TREE = (
    "m=$HOME/go/pkg/mod/example.com/x@v1.0.0; mkdir -p $m/sub locked/in && echo package x > $m/sub/x.go "
    "&& chmod -R a-w $HOME/go && chmod 0 locked && echo made"
)


@pytest.mark.parametrize("place", ["home"], indirect=True)
async def test_a_read_only_tree_a_run_of_a_users_daemon_leaves_goes_with_its_run_dir(
    user_daemon: UserDaemon,
) -> None:
    # The run's files are the daemon user's, and rmtree cannot empty a directory that
    # user may not write (or read): the run dir stayed for good, a leak at every Go build
    # (and a disk_full stop of such a run waited for ever for its space).
    d = user_daemon
    with trio.fail_after(SCENARIO_S):
        run_id = await spawn(d, scripted([command(READ_ONLY_TREE)]))
        st = await wait_end(d, run_id)
        assert st["state"] == "completed" and outputs(st) == ["[exit code 0]\nmade\n"], st
    run_dir = Path(st["run_dir"])
    with trio.fail_after(10):
        while run_dir.exists():  # removed once the run has ended: polled, bounded
            await trio.sleep(0.05)


@pytest.mark.parametrize("place", ["home"], indirect=True)
async def test_a_run_of_a_users_daemon_without_the_token_is_refused(user_daemon: UserDaemon) -> None:
    d = user_daemon
    # Everything a run could try for the token, dumped into its own output.
    hunt = "; ".join([
        f"cat /proc/{d.pid}/cmdline /proc/{d.pid}/environ",
        f"ls -la /proc/{d.pid}/fd /proc/{d.pid}/cwd/",
        f"cat {d.state}/* {d.state}/runs/*/* $AGENTD_RUN_DIR/../../token",
        "cat /proc/$PPID/environ",
        "env",
        "grep -rs . $AGENTD_RUN_DIR $TMPDIR $HOME",
    ])  # fmt: skip
    with trio.fail_after(SCENARIO_S):
        run_id = await spawn(d, scripted([command(f"{sys.executable} -c '{CONNECT}' {d.port}"), command(hunt)]))
        st = await wait_end(d, run_id)
    assert st["state"] == "completed", st
    connect, hunted = outputs(st)
    assert "/ HTTP/1.1 401" in connect and "/?token=guessed HTTP/1.1 401" in connect, connect
    assert d.token not in hunted and d.token not in json.dumps(st)
    with d.client() as c:
        assert c.ping()  # the daemon still answers a client that has the token


async def wait_request_or_end(d: UserDaemon, site: Any, run_id: str, path: str) -> dict[str, Any] | None:
    """None once the site has served ``path``; the run's status if the run ended first."""
    ended: dict[str, Any] | None = None
    async with trio.open_nursery() as n:

        async def request() -> None:
            await trio.to_thread.run_sync(site.wait_for_request, path, SCENARIO_S, abandon_on_cancel=True)
            n.cancel_scope.cancel(reason=f"the site served {path}")

        async def end() -> None:
            nonlocal ended
            ended = await wait_end(d, run_id)
            n.cancel_scope.cancel(reason="the run ended")

        n.start_soon(request)
        n.start_soon(end)
    return ended


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


def _connects_as(uid: int, gid: int, path: str) -> bool:
    """Whether ``uid`` (outside any run) can connect to the unix socket ``path``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 2
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except BaseException:
            code = 1
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("place", ["home"], indirect=True)
async def test_the_users_own_sockets_are_out_of_a_runs_reach(user_daemon: UserDaemon) -> None:
    # A login's sockets: systemd --user's and the session bus under /run/user/<uid>,
    # ssh-agent's under /tmp. Landlock does not cover connect(); the user could start a
    # unit outside the sandbox through the first. The run's own /run and /tmp hide them.
    d = user_daemon
    dirs = [Path(tempfile.mkdtemp(prefix="agentd-test-", dir=root)) for root in ("/run", tempfile.gettempdir())]
    listeners: list[socket.socket] = []
    try:
        for where in dirs:
            os.chown(where, d.uid, d.gid)
            sock = socket.socket(socket.AF_UNIX)
            listeners.append(sock)
            sock.bind(str(where / "user.sock"))
            sock.listen(8)
            os.chown(where / "user.sock", d.uid, d.gid)
        paths = [str(where / "user.sock") for where in dirs]
        assert all(_connects_as(d.uid, d.gid, p) for p in paths)  # the user's, and reachable
        with trio.fail_after(SCENARIO_S):
            run_id = await spawn(d, scripted([command(f"{sys.executable} -c '{CONNECT_UNIX}' {' '.join(paths)}")]))
            st = await wait_end(d, run_id)
    finally:
        for sock in listeners:
            sock.close()
        for where in dirs:
            shutil.rmtree(where, ignore_errors=True)
    assert st["state"] == "completed", st
    (out,) = outputs(st)
    assert "connected" not in out and out.count("refused:") == 2, out


@pytest.mark.chromium
@pytest.mark.parametrize("place", ["home"], indirect=True)
async def test_chromium_keeps_its_own_sandbox_under_a_users_daemon(user_daemon: UserDaemon) -> None:
    from subagent.tools import browser
    from tests import browser_support as bs

    bs.require_browser()
    d = user_daemon
    with bs.LocalSite() as site:
        slow = {
            "text": "Now the slow page.",
            "tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/slow"}}],
        }
        with trio.fail_after(120):
            run_id = await spawn(d, bs.scripted_browser_spec(site.url + "/", then=[slow]))
            ended = await wait_request_or_end(d, site, run_id, "/slow")
            assert ended is None, f"the run ended before its browser reached /slow: {ended}"
            with d.client() as c:
                st = c.status(run_id)
            found = browser.browser_processes(Path(st["run_dir"]))
            procs = set(found)
            for pid in found:
                procs.update(p.pid for p in psutil.Process(pid).children(recursive=True))
            cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split() for pid in procs}
            uids = {pid: psutil.Process(pid).uids().real for pid in procs}
            seccomp = {pid: bs.status_field(pid, "Seccomp") for pid in procs}
            userns = {pid: os.readlink(f"/proc/{pid}/ns/user") for pid in procs}
            with d.client() as c:
                c.cancel(run_id)
            end = await wait_end(d, run_id)
    assert end["state"] == "cancelled", end
    chromium = {pid: c for pid, c in cmdlines.items() if c and c[0].endswith(b"chromium")}
    renderers = [pid for pid, c in chromium.items() if b"--type=renderer" in c]
    main = [pid for pid, c in chromium.items() if not any(a.startswith(b"--type=") for a in c)]
    assert chromium and renderers and main, cmdlines
    assert not any(b"--no-sandbox" in c for c in cmdlines.values()), (
        f"chromium runs without its sandbox: {st['sandbox']}"
    )
    assert set(uids.values()) == {d.uid}, uids  # the user's browser, no root helper
    for pid in renderers:
        assert seccomp[pid] == "2", seccomp
        assert userns[pid] != userns[main[0]]
    assert st["sandbox"]["browser_sandbox"] is True, st["sandbox"]
