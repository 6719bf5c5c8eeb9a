"""The runner zygote: a forked runner is what a cold one is; exits are seen and reaped once.

Real daemons (``serve``), the real runner with the scripted model, real processes; the
cold runner of a daemon with ``zygote = "off"`` is the reference every fact is compared
with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.osedge import LINUX, parse_var
from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests import conftest
from tests.supervisor.test_stop_tools import command_alive, wait_event

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")

ROOT = Path(__file__).resolve().parents[2]
GATE = "env > cmd-env.tmp && mv cmd-env.tmp cmd-env.txt; while [ ! -f go ]; do sleep 0.02; done; echo gate open"
# Variables that differ between any two runs (or that a shell sets for itself).
PER_RUN = {
    "AGENTD_RUN_ID",
    "AGENTD_RUN_DIR",
    "AGENTD_TREE",
    "AGENTD_SUBTREE",
    "TMPDIR",
    "HOME",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    # How a runner is told of the daemon's nest (``subagent/_nest.py``): a cold one in the
    # environment it was started with, a forked one by its zygote.
    "AGENTD_RUN_NEST",
}


@asynccontextmanager
async def daemon(tmp: Path, **settings: Any) -> AsyncIterator[RunManager]:
    config = Config.load(state_dir=tmp / "state", grace_s=5, environ={}, **settings)
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        try:
            yield info["manager"]
        finally:
            stop.set()


async def zygote_state(m: RunManager, want: str = "ready", timeout_s: float = 60.0) -> dict[str, Any]:
    with trio.fail_after(timeout_s):
        while True:
            z = (await m.summary())["zygote"]
            if z["state"] == want:
                return z
            await trio.sleep(0.05)


def gated(command: str = GATE) -> dict[str, Any]:
    script = {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}], "final": "done"}
    return {"task": "t", "model": {"provider": "scripted", "script": script}}


async def spawn_at_once(m: RunManager, n: int) -> list[dict[str, Any]]:
    """n runs (``echo run i``) requested at once; their terminal statuses, as they end."""
    results: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        r = await m.spawn(gated(f"echo run {i}"))
        results.append(await m.wait_terminal(r["run_id"]))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


async def wait_running_tool(m: RunManager, run_id: str) -> None:
    """Until the run's command is running: its group alive, past its gate (a stop before
    that leaves it unrun, and its record ``not_started``)."""
    await wait_event(m, run_id, command_alive)


def _status_masks(pid: int) -> dict[str, str]:
    """Blocked, ignored and caught signals 1-31 (glibc catches 32 and 33 for itself once
    a thread has been created, which depends on when we look)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigBlk", "SigIgn", "SigCgt"):
            out[key] = f"{int(value.strip(), 16) & 0x7FFFFFFF:08x}"
    return out


def fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")  # "pipe:[123]", "socket:[45]", a path
        except OSError:
            continue
    return out


def runner_facts(row: dict[str, Any]) -> dict[str, Any]:
    """What a cold runner is, read from the kernel while its command runs."""
    pid = row["pid"]
    p = LINUX.stat(pid)
    assert p is not None and not p.dead
    cgroup = ""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            cgroup = line[3:]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return {
        "leads_session": p.sid == pid,
        "leads_group": p.pgid == pid,
        "parent_is_daemon_or_zygote": p.ppid != 1,
        "cgroup_is_tree": cgroup.rsplit("/", 1)[-1] == row["tree_id"] if row["cgroup"] else None,
        "marker": parse_var(LINUX.environ(pid) or b"", "AGENTD_TREE") == row["tree_id"],
        "cmdline": [a.decode() for a in cmdline[1:4]],
        "cwd": os.readlink(f"/proc/{pid}/cwd") == row["run_dir"],
        "masks": _status_masks(pid),
        "stdio": [fd_targets(pid).get(fd, "").split("[")[0] for fd in (0, 1, 2)],  # three pipes
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        # What /proc shows of its environment: the run's own, as for a cold runner.
        "environ": sorted(
            k
            for k in (
                e.partition(b"=")[0].decode() for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e
            )
            if k not in PER_RUN
        ),
    }


async def command_env(run_dir: str) -> dict[str, str]:
    path = Path(run_dir) / "cmd-env.txt"
    with trio.fail_after(10):
        while not path.exists():  # written whole, then renamed
            await trio.sleep(0.01)
    env = {}
    for line in (Path(run_dir) / "cmd-env.txt").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            env[key] = value
    return env


def sandbox_facts(report: dict[str, Any] | None, daemon_dir: str) -> dict[str, Any] | None:
    """The run's sandbox as its runner reported it, minus what differs per run or daemon."""
    if report is None:
        return None
    report = json.loads(json.dumps(report).replace(daemon_dir, "<daemon>"))
    rid_free = {k: v for k, v in report.items() if k not in ("setup_ms", "workdir")}
    for key in ("read", "write", "private"):  # paths under the run's own dir differ per run
        if isinstance(rid_free.get(key), list):
            rid_free[key] = sorted(x for x in rid_free[key] if "/runs/t-" not in str(x))
    return rid_free


async def observe_gated_run(
    m: RunManager, zygote_fds: bool = False
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    r = await m.spawn(gated())
    rid = r["run_id"]
    await wait_running_tool(m, rid)
    row = await m.status(rid)
    facts = runner_facts(row)
    daemon_dir = str(Path(row["run_dir"]).parents[2])  # <daemon dir>/state/runs/<tree>
    facts["sandbox"] = sandbox_facts(row.get("sandbox"), daemon_dir)  # the same, however born
    if zygote_fds:  # nothing the zygote holds (its socket to us, its wake-up pipe) leaked in
        # Pipes and sockets only: those are shared only by inheritance (a path such as
        # /dev/null may be open in both, separately).
        def anonymous(pid: int) -> set[str]:
            return {t for t in fd_targets(pid).values() if t.startswith(("pipe:", "socket:"))}

        held = anonymous((await m.summary())["zygote"]["pid"])
        assert held and not held & anonymous(row["pid"]), (held, fd_targets(row["pid"]))
    env = await command_env(row["run_dir"])
    assert env["AGENTD_RUN_ID"] == rid and env["AGENTD_TREE"] == row["tree_id"]
    assert env["AGENTD_RUN_DIR"] == row["run_dir"] and env["TMPDIR"] == str(Path(row["run_dir"]) / "tmp")
    (Path(row["run_dir"]) / "go").touch()
    st = await m.wait_terminal(rid)
    return facts, env, st


async def test_a_forked_runner_is_what_a_cold_runner_is(tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with daemon(tmp_path / "cold", zygote="off") as m:
            assert (await m.summary())["zygote"]["state"] == "off"
            cold, cold_env, cold_st = await observe_gated_run(m)
        async with daemon(tmp_path / "forked") as m:
            await zygote_state(m)
            forked, forked_env, forked_st = await observe_gated_run(m, zygote_fds=True)
            z = (await m.summary())["zygote"]
    assert z["spawned"] == 1 and z["cold_fallbacks"] == 0
    assert cold["leads_session"] and cold["leads_group"] and cold["marker"]
    assert cold["cmdline"] == ["-P", "-m", "subagent.runner"] and cold["stdio"] == ["pipe:"] * 3
    if None in (forked["cgroup_is_tree"], cold["cgroup_is_tree"]):
        # A daemon degrades to sweeping when its cgroup subtree cannot be made or vanishes
        # (another daemon on a shared machine may take an unlocked one for stale): that
        # is containment's business, not the zygote's.
        forked.pop("cgroup_is_tree")
        cold.pop("cgroup_is_tree")
    assert forked.pop("sandbox") == cold.pop("sandbox")
    assert forked == cold, f"forked {forked}\ncold    {cold}"
    assert {k: v for k, v in forked_env.items() if k not in PER_RUN} == {
        k: v for k, v in cold_env.items() if k not in PER_RUN
    }
    for st in (cold_st, forked_st):
        assert st["state"] == "completed"
        assert "gate open" in st["tool_calls"][0]["output"]
        assert st["receipt"]["exit_code"] == 0
        assert st["receipt"]["path_b"]["survivors"] == []


async def test_exit_codes_reach_the_run_and_each_runner_is_reaped_once(tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with daemon(tmp_path) as m:
            await zygote_state(m)
            # SIGKILLed runner: a signal exit, no result.
            r = await m.spawn(gated())
            await wait_running_tool(m, r["run_id"])
            row = await m.status(r["run_id"])
            seen = {row["pid"]: LINUX.stat(row["pid"]).start_ticks}
            os.kill(row["pid"], signal.SIGKILL)
            killed = await m.wait_terminal(r["run_id"])
            # Cancelled: the runner's own exit code 3.
            r2 = await m.spawn(gated())
            await wait_running_tool(m, r2["run_id"])
            pid2 = (await m.status(r2["run_id"]))["pid"]
            seen[pid2] = LINUX.stat(pid2).start_ticks
            await m.cancel(r2["run_id"])
            (Path((await m.status(r2["run_id"]))["run_dir"]) / "go").touch()
            cancelled = await m.wait_terminal(r2["run_id"])
            # Reaped (by the zygote, their parent): neither is left, not even as a zombie.
            for pid, ticks in seen.items():
                p = LINUX.stat(pid)
                assert p is None or p.start_ticks != ticks
    assert killed["state"] == "failed" and killed["reason"] == "runner_died"
    assert killed["receipt"]["exit_code"] == -signal.SIGKILL
    assert killed["error"]["code"] == "signal_9"
    assert cancelled["state"] == "cancelled" and cancelled["receipt"]["exit_code"] == 3


async def test_a_zygote_that_dies_is_restarted_and_its_runners_are_ours(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with daemon(tmp_path) as m:
            z = await zygote_state(m)
            r = await m.spawn(gated())
            await wait_running_tool(m, r["run_id"])
            row = await m.status(r["run_id"])
            os.kill(z["pid"], signal.SIGKILL)
            await zygote_state(m, "restarting")
            # The orphaned runner is re-parented to the daemon (a child subreaper).
            with trio.fail_after(10):
                while (p := LINUX.stat(row["pid"])) is not None and p.ppid != os.getpid():
                    await trio.sleep(0.01)
            (Path(row["run_dir"]) / "go").touch()
            st = await m.wait_terminal(r["run_id"])
            assert LINUX.stat(row["pid"]) is None  # reaped by the daemon: no zombie left
            z2 = await zygote_state(m)
            assert z2["pid"] != z["pid"] and z2["restarts"] == 1
            r2 = await m.spawn(gated("echo again"))
            st2 = await m.wait_terminal(r2["run_id"])
            assert (await m.summary())["zygote"]["spawned"] == z2["spawned"] + 1  # the new zygote forked it
    assert st["state"] == "completed" and st["receipt"]["exit_code"] == 0
    assert "gate open" in st["tool_calls"][0]["output"]
    assert st2["state"] == "completed" and "again" in st2["tool_calls"][0]["output"]


async def test_runs_start_cold_until_the_zygote_is_ready_and_when_it_is_off(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with daemon(tmp_path / "a") as m:
            z = (await m.summary())["zygote"]
            if z["state"] == "starting":  # the usual case: imports take a second or more
                r = await m.spawn(gated("echo cold"))
                st = await m.wait_terminal(r["run_id"])
                assert st["state"] == "completed"
                assert (await m.summary())["zygote"]["cold_fallbacks"] >= 1
        async with daemon(tmp_path / "b", runner_command=f"{sys.executable} -m subagent.runner") as m:
            assert (await m.summary())["zygote"]["state"] == "off"  # not the stock runner


async def test_a_burst_of_forked_runs_all_complete(tmp_path: Path) -> None:
    n = 8
    with trio.fail_after(120):
        async with daemon(tmp_path, max_concurrent=n) as m:
            await zygote_state(m)
            results = await spawn_at_once(m, n)
            z = (await m.summary())["zygote"]
    outputs = [r["tool_calls"][0]["output"] for r in results]
    assert all(sum(f"run {i}" in o for o in outputs) == 1 for i in range(n))
    assert all(r["state"] == "completed" and r["receipt"]["exit_code"] == 0 for r in results)
    assert z["spawned"] == n and z["cold_fallbacks"] == 0
    assert len({r["pid"] for r in results}) == n


def test_every_forked_runner_gets_fresh_random_state(tmp_path: Path) -> None:
    """The zygote reseeds every generator its imports made (random's own, trio's, ...)."""
    probe = textwrap.dedent(
        """
        import json, os, random, socket, sys
        from subagent import runner, zygote
        made_at_import = random.Random(1234)   # like a library's private generator
        def fake_start(args):
            os.write(1, json.dumps([random.random(), made_at_import.random()]).encode())
            os._exit(0)
        runner.start = fake_start
        runner.preload = lambda: None
        sys.exit(zygote.main())
        """
    )
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", probe], stdin=b.fileno(), env=env, cwd=tmp_path)
    b.close()
    outputs = []
    try:
        from subagent.zygote import decode, encode

        a.settimeout(30)
        assert decode(a.recv(1 << 20))["ready"] is True
        for i in range(2):
            r0, w0 = os.pipe()
            r1, w1 = os.pipe()
            r2, w2 = os.pipe()
            r3, w3 = os.pipe()
            os.write(w3, json.dumps(dict(os.environ)).encode())
            os.close(w3)
            req = {"id": i, "args": [], "cwd": str(tmp_path), "tree_id": f"t-{i}", "cgroup_procs": None}
            socket.send_fds(a, [encode(req)], [r0, w1, w2, r3])
            for fd in (r0, w1, w2, r3):
                os.close(fd)
            while "pid" not in (reply := decode(a.recv(1 << 20))) and "error" not in reply:
                pass
            assert "pid" in reply, reply
            out = b""
            while chunk := os.read(r1, 4096):
                out += chunk
            outputs.append(json.loads(out))
            for fd in (w0, r1, r2):
                os.close(fd)
    finally:
        a.close()
        proc.wait(timeout=30)
    assert outputs[0][0] != outputs[1][0]
    assert outputs[0][1] != outputs[1][1]
    assert random_made_with_seed_1234() not in (outputs[0][1], outputs[1][1])


def random_made_with_seed_1234() -> float:
    import random

    return random.Random(1234).random()


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Does any readable mapping of ``pid`` hold ``needle``? (root reads another's memory)"""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for entry in maps:
            addr, perms = entry.split()[:2]
            if not perms.startswith("r") or "[vvar" in entry or "[vsyscall" in entry:
                continue
            start, end = (int(x, 16) for x in addr.split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, ValueError, OverflowError):
                continue
    return False


async def test_a_runs_secrets_reach_its_forked_runner_and_never_the_zygote(tmp_path: Path) -> None:
    from supervisor.protocol import Secret

    key = "sk-zygote-" + os.urandom(12).hex()
    with trio.fail_after(90):
        async with daemon(tmp_path) as m:
            z = await zygote_state(m)
            r = await m.spawn(gated(), model_key=Secret(key))  # waits in its command until "go"
            await wait_running_tool(m, r["run_id"])
            row = await m.status(r["run_id"])
            environ = Path(f"/proc/{row['pid']}/environ").read_bytes().split(b"\0")
            assert f"OPENAI_API_KEY={key}".encode() in environ  # the runner has it, as a cold one would
            assert (await m.summary())["zygote"]["spawned"] == 1  # forked, not cold
            try:
                in_zygote: bool | None = _memory_holds(z["pid"], key.encode())
            except PermissionError:
                in_zygote = None
            conftest.require(in_zygote is not None, "reading another process's memory (root, or ptrace_scope 0)")
            assert not in_zygote  # the environment went runner-bound through a pipe
            (Path(row["run_dir"]) / "go").touch()
            st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "completed"


async def test_a_zygote_that_cannot_start_is_given_up_and_runs_stay_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.trees import zygote as zygote_mod

    monkeypatch.setattr(zygote_mod, "RESTART_BACKOFF_S", 0.01)
    not_python = tmp_path / "not-python"
    not_python.write_text("#!/bin/sh\nexit 3\n")
    not_python.chmod(0o755)
    with trio.fail_after(60):
        async with daemon(tmp_path, runner_python=str(not_python)) as m:
            z = await zygote_state(m, "failed")
    assert z["restarts"] == zygote_mod.MAX_FAILED_STARTS - 1 and z["spawned"] == 0


def test_a_zygote_whose_daemon_dies_while_it_imports_ends_at_once_not_after_its_imports() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-m", "subagent.zygote"], stdin=theirs, stderr=subprocess.PIPE)
    theirs.close()
    ours.close()  # the daemon is gone long before the imports (seconds) are done
    _out, err = proc.communicate(timeout=60)
    # Done after its imports, it would find out only at "ready": EPIPE, exit code 1.
    assert proc.returncode == 0 and not err, err.decode()


_HANG_UP_WHILE_PREPARING = """
import os, select, stat, sys
import subagent.zygote as z

def is_socket(fd):
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False

def prepare():  # the daemon hangs up while the zygote prepares its memory (after the imports)
    (sock,) = [fd for fd in range(256) if is_socket(fd)]  # the daemon's
    os.write(int(sys.argv[1]), b"preparing\\n")
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP)
    assert poller.poll(30_000), "the test never hung up"

z._prepare_memory = prepare
sys.exit(z.main())
"""


_SLOW_PREPARATION = """
import os, sys, time
import subagent.zygote as z

def prepare():  # a preparation that takes long (MADV_COLLAPSE on a loaded machine)
    os.write(int(sys.argv[1]), b"preparing\\n")
    time.sleep(120)

z._prepare_memory = prepare
sys.exit(z.main())
"""


def _hang_up_while_preparing(program: str) -> tuple[int | None, bytes]:
    """Run a zygote (``program``) whose preparation says ``preparing``, hang up on it
    then, and return its exit code and stderr (it is killed if still there after 60 s)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    said_r, said_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", program, str(said_w)],
        stdin=theirs,
        stderr=subprocess.PIPE,
        pass_fds=(said_w,),
        cwd=ROOT,
    )
    theirs.close()
    os.close(said_w)
    try:
        with os.fdopen(said_r, "rb") as said:
            if said.readline() != b"preparing\n":
                raise AssertionError(f"it ended before preparing: {proc.communicate(timeout=60)[1].decode()}")
    finally:
        ours.close()
    try:
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_a_zygote_whose_daemon_hangs_up_while_it_prepares_exits_then_not_after() -> None:
    # A daemon stopped just after its start waited for its zygote to finish preparing
    # (its hang-up was watched for during the imports only), then killed it at 1 s.
    code, err = _hang_up_while_preparing(_SLOW_PREPARATION)  # well before its 120 s end
    assert code == 0 and not err, err.decode()


def test_a_zygote_whose_daemon_hangs_up_before_its_ready_exits_quietly() -> None:
    code, err = _hang_up_while_preparing(_HANG_UP_WHILE_PREPARING)
    # Its "ready" meets EPIPE: nobody to tell, so no traceback and no failure.
    assert code == 0 and not err, err.decode()
