"""The zygote's spare runner: forked ahead, it becomes exactly what a forked or cold runner
is; it takes no step before the daemon's ``go`` (sent once the run's start is journaled)
and exits having done nothing when the daemon hangs up first; a spare that dies, or a
zygote that dies, never loses a spawn; a spare never outlives its zygote.

Real daemons (``serve``) and a real zygote process, the real runner with the scripted
model; the protocol tests speak the zygote's wire protocol themselves, as the daemon does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.emit import record_paths
from subagent.osedge import LINUX
from subagent.sandbox import SANDBOX_ENV, Settings
from subagent.zygote import ENV_ROOM, ENV_ROOM_VAR, PLACEHOLDER_MARKER, decode, encode
from supervisor.protocol import Secret
from supervisor.trees import zygote as zygote_mod
from tests import conftest
from tests.supervisor.test_zygote import (
    PER_RUN,
    _memory_holds,
    daemon,
    gated,
    observe_gated_run,
    spawn_at_once,
    wait_running_tool,
    zygote_state,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")

ROOT = Path(__file__).resolve().parents[2]


async def spare_ready(m: Any, timeout_s: float = 60.0, *, other_than: int | None = None) -> int:
    """The pid of a spare the zygote keeps ready (one other than ``other_than``)."""
    with trio.fail_after(timeout_s):
        while True:
            pids = (await m.summary())["zygote"]["spares"]["pids"]
            if pids and pids[0] != other_than:
                return int(pids[0])
            await trio.sleep(0.01)


async def test_a_spare_born_runner_is_what_a_cold_runner_is(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with daemon(tmp_path / "cold", zygote="off") as m:
            cold, cold_env, cold_st = await observe_gated_run(m)
        async with daemon(tmp_path / "spare", zygote_spares=1) as m:
            await zygote_state(m)
            spare_pid = await spare_ready(m)
            forked, forked_env, forked_st = await observe_gated_run(m, zygote_fds=True)
            z = (await m.summary())["zygote"]
            pid = forked_st["pid"]
    assert pid == spare_pid  # the spare, not a fork at the spawn
    assert z["spares"]["used"] == 1 and z["spawned"] == 1 and z["cold_fallbacks"] == 0
    if None in (forked["cgroup_is_tree"], cold["cgroup_is_tree"]):
        forked.pop("cgroup_is_tree")  # containment degraded: not the zygote's business
        cold.pop("cgroup_is_tree")
    assert forked["cgroup_is_tree"] is not False
    assert forked.pop("sandbox") == cold.pop("sandbox")
    assert forked == cold, f"spare {forked}\ncold  {cold}"
    assert {k: v for k, v in forked_env.items() if k not in PER_RUN} == {
        k: v for k, v in cold_env.items() if k not in PER_RUN
    }
    for st in (cold_st, forked_st):
        assert st["state"] == "completed" and "gate open" in st["tool_calls"][0]["output"]
        assert st["receipt"]["exit_code"] == 0 and st["receipt"]["path_b"]["survivors"] == []


async def test_a_spare_keeps_a_specs_paths_under_its_private_tmp_as_a_cold_runner_does(tmp_path: Path) -> None:
    """The spare made its private /tmp before it knew its spec: the spec's paths there (a
    script, a write grant) are bound back when it gets them, as a cold runner keeps them."""
    assert str(tmp_path).startswith(("/tmp/", "/var/tmp/")) or pytest.skip("tmp_path is not under a private dir")
    reports = {}
    for name, settings in (("cold", {"zygote": "off"}), ("spare", {"zygote_spares": 1})):
        work = tmp_path / f"work-{name}"
        shared = work / "shared"
        shared.mkdir(parents=True)
        script = {
            "turns": [
                {"tool_calls": [{"name": "run_command", "arguments": {"command": f"echo {name} > {shared}/out"}}]}
            ],
            "final": "done",
        }
        (work / "script.json").write_text(json.dumps(script))
        spec = {
            "task": "t",
            "model": {"provider": "scripted", "script_path": str(work / "script.json")},
            "sandbox": {"write": [str(shared)]},
        }
        with trio.fail_after(90):
            async with daemon(tmp_path / name, **settings) as m:
                await zygote_state(m, "off" if name == "cold" else "ready")
                if name == "spare":
                    spare_pid = await spare_ready(m)
                r = await m.spawn(spec)
                st = await m.wait_terminal(r["run_id"])
        assert st["state"] == "completed", st
        assert (shared / "out").read_text().strip() == name
        if name == "spare":
            assert st["pid"] == spare_pid
        report = st["receipt"]["sandbox"] if "sandbox" in st.get("receipt", {}) else st["result"]["sandbox"]
        reports[name] = json.loads(
            json.dumps(report).replace(f"work-{name}", "work").replace(str(tmp_path / name), "<d>")
        )
    for report in reports.values():
        assert report["mode"] == "landlock" and not report.get("problems"), report
        assert any(p.endswith("/work/shared") for p in report["private"])
        assert any(p.endswith("/work/script.json") for p in report["private"])
    cold, spare = reports["cold"], reports["spare"]
    for key in ("private", "read", "write"):
        cold[key] = sorted(x for x in cold[key] if "/runs/t-" not in x)
        spare[key] = sorted(x for x in spare[key] if "/runs/t-" not in x)
    cold.pop("setup_ms", None)
    spare.pop("setup_ms", None)
    assert spare == cold


async def test_a_grant_holding_the_run_directory_is_the_hosts_dir_for_a_spare_as_for_a_cold_runner(
    tmp_path: Path,
) -> None:
    """A write grant that holds the daemon's state dir (so the run's own directory, which a
    spare bound before it had a run) is bound whole, as a cold runner binds it: a file made
    from outside while the run's command waits is seen there. (A spare once left the grant
    as the empty skeleton of its run dir's bind: the command waited forever.)"""
    for name, settings in (("cold", {"zygote": "off"}), ("spare", {"zygote_spares": 1})):
        grant = tmp_path / name
        grant.mkdir()
        command = f"while [ ! -f {grant}/gate ]; do sleep 0.02; done; echo gate seen by {name}"
        spec = {
            "task": "t",
            "model": {
                "provider": "scripted",
                "script": {
                    "turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}],
                    "final": "done",
                },
            },
            "sandbox": {"write": [str(grant)]},
        }
        with trio.fail_after(90):
            async with daemon(grant, **settings) as m:
                await zygote_state(m, "off" if name == "cold" else "ready")
                spare_pid = await spare_ready(m) if name == "spare" else None
                r = await m.spawn(spec)
                await wait_running_tool(m, r["run_id"])
                (grant / "gate").write_text("go\n")
                st = await m.wait_terminal(r["run_id"])
        assert st["state"] == "completed", st
        [call] = st["tool_calls"]
        assert call["state"] == "succeeded" and f"gate seen by {name}" in call["output"], call
        if spare_pid is not None:
            assert st["pid"] == spare_pid


async def test_a_runs_secret_reaches_its_spare_and_never_the_zygote(tmp_path: Path) -> None:
    key = "sk-spare-" + os.urandom(12).hex()
    with trio.fail_after(90):
        async with daemon(tmp_path, zygote_spares=1) as m:
            z = await zygote_state(m)
            spare_pid = await spare_ready(m)
            r = await m.spawn(gated(), model_key=Secret(key))
            await wait_running_tool(m, r["run_id"])
            row = await m.status(r["run_id"])
            assert row["pid"] == spare_pid
            environ = Path(f"/proc/{row['pid']}/environ").read_bytes().split(b"\0")
            assert f"OPENAI_API_KEY={key}".encode() in environ
            try:
                in_zygote: bool | None = _memory_holds(z["pid"], key.encode())
            except PermissionError:
                in_zygote = None
            conftest.require(in_zygote is not None, "reading another process's memory (root, or ptrace_scope 0)")
            assert not in_zygote
            # The next spare (forked after this one was taken) never saw it either.
            next_pid = await spare_ready(m, other_than=spare_pid)
            assert not _memory_holds(next_pid, key.encode())
            (Path(row["run_dir"]) / "go").touch()
            st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "completed"


async def test_a_spare_that_dies_does_not_lose_a_spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1) as m:
            await zygote_state(m)
            # Dead while parked: the spawn forks instead.
            dead = await spare_ready(m)
            os.kill(dead, signal.SIGKILL)
            r = await m.spawn(gated("echo after a dead spare"))
            st = await m.wait_terminal(r["run_id"])
            assert st["state"] == "completed" and "after a dead spare" in st["tool_calls"][0]["output"]
            assert st["pid"] != dead
            # Dead once it has its run, before `go` (the daemon's journal write meanwhile).
            victim = await spare_ready(m, other_than=dead)
            real_go = zygote_mod.Spare.go

            async def go_after_its_death(spare: zygote_mod.Spare, *args: Any, **kwargs: Any) -> Any:
                os.kill(spare.pid, signal.SIGKILL)
                with trio.fail_after(10):
                    while spare.process.returncode is None:
                        await trio.sleep(0.01)
                return await real_go(spare, *args, **kwargs)

            monkeypatch.setattr(zygote_mod.Spare, "go", go_after_its_death)
            r2 = await m.spawn(gated("echo after a dying spare"))
            st2 = await m.wait_terminal(r2["run_id"])
            monkeypatch.setattr(zygote_mod.Spare, "go", real_go)
            assert st2["state"] == "completed" and "after a dying spare" in st2["tool_calls"][0]["output"]
            assert st2["pid"] != victim
            # And the next one is served by a new spare again.
            fresh = await spare_ready(m, other_than=victim)
            r3 = await m.spawn(gated("echo by a spare"))
            st3 = await m.wait_terminal(r3["run_id"])
            z = (await m.summary())["zygote"]
    assert st3["state"] == "completed" and st3["pid"] == fresh
    assert z["spares"]["lost"] >= 2 and z["spares"]["used"] == 1 and z["cold_fallbacks"] == 0
    for pid in (dead, victim):
        assert LINUX.stat(pid) is None  # reaped, not left a zombie


async def test_a_zygote_that_dies_takes_its_spare_with_it_and_spawns_go_on(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1) as m:
            z = await zygote_state(m)
            spare_pid = await spare_ready(m)
            spare_dir = next(p for p in (tmp_path / "state" / "runs").iterdir() if p.is_dir())
            os.kill(z["pid"], signal.SIGKILL)
            r = await m.spawn(gated("echo while restarting"))  # cold, or forked once it is back
            st = await m.wait_terminal(r["run_id"])
            with trio.fail_after(10):
                while LINUX.stat(spare_pid) is not None or spare_dir.exists():
                    await trio.sleep(0.01)  # dead, reaped, and its tree removed
            z2 = await zygote_state(m)
            fresh = await spare_ready(m)
            r2 = await m.spawn(gated("echo by the new zygote's spare"))
            st2 = await m.wait_terminal(r2["run_id"])
    assert st["state"] == "completed" and "while restarting" in st["tool_calls"][0]["output"]
    assert z2["pid"] != z["pid"]
    assert st2["state"] == "completed" and st2["pid"] == fresh


async def test_a_burst_takes_the_spare_once_and_forks_the_rest(tmp_path: Path) -> None:
    n = 6
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1, max_concurrent=n) as m:
            await zygote_state(m)
            spare_pid = await spare_ready(m)
            results = await spawn_at_once(m, n)
            z = (await m.summary())["zygote"]
    assert all(r["state"] == "completed" and r["receipt"]["exit_code"] == 0 for r in results)
    assert sum(r["pid"] == spare_pid for r in results) == 1
    assert z["spares"]["used"] == 1 and z["spawned"] == n and z["cold_fallbacks"] == 0


async def test_a_sessions_next_turn_is_a_spares_with_its_history(tmp_path: Path) -> None:
    """A turn's spec (the history of the turns before it) is made before its creation, so
    a spare takes it as it takes any run; the ``session`` event still precedes its steps."""

    def turn(task: str, answer: str) -> dict[str, Any]:
        return {"task": task, "model": {"provider": "scripted", "script": {"final": answer}}}

    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1) as m:
            await zygote_state(m)
            # The first turn a spare's too (``used`` counts both): waited for, as the second
            # is (a spare's v1 joins, made ahead, can leave it not yet ready at the spawn).
            first_spare = await spare_ready(m)
            first = await m.spawn(turn("first question", "first answer"), session_id="chat")
            one = await m.wait_terminal(first["run_id"])
            spare_pid = await spare_ready(m, other_than=one["pid"])
            second = await m.spawn(turn("second question", "second answer"), session_id="chat")
            two = await m.wait_terminal(second["run_id"])
            z = (await m.summary())["zygote"]
            events = [e["kind"] for e in await m.journal.events_after(second["run_id"])]
    assert one["state"] == two["state"] == "completed", (one, two)
    assert one["pid"] == first_spare
    assert two["pid"] == spare_pid and z["spares"]["used"] == 2 and z["cold_fallbacks"] == 0
    given = [(msg["role"], msg["content"]) for msg in two["result"]["messages"][1:4]]
    assert given == [("user", "first question"), ("assistant", "first answer"), ("user", "second question")]
    assert events.index("session") < events.index("step_started"), events


# ----------------------------------------------------------------------------- spares grow to a burst


def test_spares_stay_at_the_floor_for_spawns_one_at_a_time() -> None:
    d = zygote_mod.SpareDemand(floor=1, cap=64, keep_s=600.0)
    assert d.target(0.0) == 1
    for i in range(20):
        d.taken(i * 1.5)  # farther apart than the burst window
        assert d.target(i * 1.5) == 1
    assert d.expires_at == float("inf")


def test_spares_grow_to_a_bursts_size_at_most_the_cap_and_go_back_after_keep_s() -> None:
    d = zygote_mod.SpareDemand(floor=1, cap=8, keep_s=60.0)
    for i in range(5):
        d.taken(100.0 + i * 0.01)
    assert d.target(100.1) == 5
    for i in range(20):
        d.taken(101.5 + i * 0.01)  # a larger burst: capped
    assert d.target(101.8) == 8 and d.peak == 20
    assert d.expires_at == 101.5 + 19 * 0.01 + 60.0
    assert d.target(161.6) == 8  # kept until keep_s after the last burst that large
    assert d.target(161.7) == 1  # then back to the floor
    assert d.expires_at == float("inf")


def test_a_burst_as_large_again_keeps_the_spares_and_a_smaller_one_does_not() -> None:
    d = zygote_mod.SpareDemand(floor=1, cap=64, keep_s=10.0)
    for i in range(4):
        d.taken(0.0 + i * 0.01)
    for i in range(4):
        d.taken(8.0 + i * 0.01)  # as large: kept 10 s from here
    assert d.target(17.0) == 4
    for i in range(2):
        d.taken(17.5 + i * 0.01)  # smaller: does not extend it
    assert d.target(18.1) == 1
    for i in range(2):
        d.taken(20.0 + i * 0.01)  # after the expiry, a smaller burst is the new peak
    assert d.target(20.1) == 2


def test_spares_with_no_room_to_grow_are_a_fixed_number() -> None:
    fixed = zygote_mod.SpareDemand(floor=3, cap=2, keep_s=10.0)  # cap below the floor: the floor
    for i in range(10):
        fixed.taken(i * 0.01)
    assert fixed.target(0.5) == 3 and fixed.cap == 3
    off = zygote_mod.SpareDemand(floor=0, cap=0, keep_s=10.0)
    off.taken(0.0)
    assert off.target(0.0) == 0


def test_the_spares_growth_settings_load_from_the_environment_and_refuse_a_negative(tmp_path: Path) -> None:
    from supervisor.config import Config
    from supervisor.errors import ConfigError

    default = Config.load(state_dir=tmp_path, environ={})
    assert (default.zygote_spares, default.zygote_spares_max, default.zygote_spares_keep_s) == (1, 64, 600.0)
    env = {"AGENTD_ZYGOTE_SPARES_MAX": "8", "AGENTD_ZYGOTE_SPARES_KEEP_S": "30"}
    c = Config.load(state_dir=tmp_path, environ=env)
    assert (c.zygote_spares_max, c.zygote_spares_keep_s) == (8, 30.0)
    for name in ("zygote_spares_max", "zygote_spares_keep_s"):
        with pytest.raises(ConfigError, match=name):
            Config.load(state_dir=tmp_path, environ={"AGENTD_" + name.upper(): "-1"})


async def test_a_burst_grows_the_spares_to_serve_the_next_burst_whole_then_they_are_let_go(tmp_path: Path) -> None:
    n = 4
    keep_s = 3.0

    async def spares_ready(m: Any, want: int) -> list[tuple[int, Path]]:
        with trio.fail_after(30):
            while len(m._zygote._spares) < want:
                await trio.sleep(0.01)
        return [(spare.pid, spare.run_dir) for spare in m._zygote._spares]

    with trio.fail_after(120):
        async with daemon(
            tmp_path, zygote_spares=1, zygote_spares_max=3 * n, zygote_spares_keep_s=keep_s, max_concurrent=3 * n
        ) as m:
            await zygote_state(m)
            await spare_ready(m)
            first = await spawn_at_once(m, n)
            z1 = (await m.summary())["zygote"]
            grown = await spares_ready(m, n)
            grown_info = (await m.summary())["zygote"]["spares"]
            second = await spawn_at_once(m, n)
            z2 = (await m.summary())["zygote"]
            refilled = await spares_ready(m, n)  # the burst recurred: kept keep_s from it
            with trio.fail_after(keep_s + 30):
                while (left := (await m.summary())["zygote"]["spares"])["released"] < n - 1:
                    await trio.sleep(0.02)
            let_go = [(pid, run_dir) for pid, run_dir in refilled if pid not in left["pids"]]
            with trio.fail_after(10):
                while any(run_dir.exists() for _, run_dir in let_go):
                    await trio.sleep(0.01)  # each released spare exited, then its tree went
            gone = [LINUX.stat(pid) is None for pid, _ in let_go]
    assert all(r["state"] == "completed" for r in first + second)
    # The first burst: its one spare (and, on a slow machine, a spare the refill made
    # between its spawns' starts), forks for the rest.
    assert 1 <= z1["spares"]["used"] < n and z1["spawned"] == n
    # The burst's size exactly (each spawn counted once, though those that found no spare
    # at their spawn ask again at their start), under the cap.
    assert grown_info["target"] == n and grown_info["floor"] == 1 and grown_info["max"] == 3 * n
    assert sorted(r["pid"] for r in second) == sorted(pid for pid, _ in grown)  # the next: all spares'
    assert z2["spares"]["used"] - z1["spares"]["used"] == n and z2["spawned"] == 2 * n
    assert z2["cold_fallbacks"] == 0
    assert left["target"] == 1 and len(left["pids"]) == 1 and left["lost"] == 0
    # At least the n - 1 extra spares were let go (a loaded CI machine once also replaced
    # the one kept by a fresh one); each let go is dead and its tree removed.
    assert len(let_go) >= n - 1 and left["released"] >= n - 1 and all(gone)


# ----------------------------------------------------------------------------- the wire protocol


class ZygoteProc:
    """A real ``python -m subagent.zygote`` this test speaks to as the daemon does."""

    def __init__(self, tmp: Path, stderr: int | None = None) -> None:
        self.tmp = tmp
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTHONPATH=str(ROOT), AGENTD_TREE=PLACEHOLDER_MARKER)
        env[ENV_ROOM_VAR] = "." * ENV_ROOM
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "subagent.zygote"],
            stdin=theirs.fileno(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            cwd=tmp,
        )
        theirs.close()
        self.sock.settimeout(60)
        hello = decode(self.sock.recv(1 << 20))
        assert hello is not None and hello["ready"] is True, hello
        self.exits: dict[int, int] = {}

    def recv(self) -> dict[str, Any]:
        msg = decode(self.sock.recv(1 << 20))
        assert msg is not None
        if "exit" in msg:
            self.exits[msg["exit"]] = msg["code"]
        return msg

    def spare(self, n: int) -> tuple[int, socket.socket, Path]:
        run_dir = self.tmp / f"t-spare{n}"
        (run_dir / "tmp").mkdir(parents=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return self.ask_spare(n, run_dir, theirs), ours, run_dir

    def ask_spare(self, n: int, run_dir: Path, theirs: socket.socket) -> int:
        """Ask for spare ``n`` parked in ``run_dir`` on our socket's other end (sent, then
        closed here); its pid."""
        req = {
            "id": n,
            "spare": True,
            "cwd": str(run_dir),
            "tree_id": run_dir.name,
            "cgroup_procs": None,
            "sandbox": Settings(mode="auto").to_env(),
            "answers": None,
        }
        socket.send_fds(self.sock, [encode(req)], [theirs.fileno()])
        theirs.close()
        while "pid" not in (reply := self.recv()):
            assert "error" not in reply, reply
        return int(reply["pid"])

    def wait_exit(self, pid: int) -> int:
        while pid not in self.exits:
            self.recv()
        return self.exits[pid]

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=30)


def assign(chan: socket.socket, run_dir: Path, command: str) -> tuple[int, int, int]:
    """Send the spare a run (its spec in stdin already); returns our stdin, stdout and
    stderr ends."""
    spec = gated(command)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    env_r, env_w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k.startswith(("PATH", "HOME", "LANG", "AGENTD_TEST"))}
    env.update(AGENTD_RUN_DIR=str(run_dir), TMPDIR=str(run_dir / "tmp"), AGENTD_TREE=run_dir.name)
    env[SANDBOX_ENV] = Settings(mode="auto").to_env()
    os.write(env_w, json.dumps(env).encode())
    os.close(env_w)
    os.write(stdin_w, (json.dumps(spec) + "\n").encode())
    socket.send_fds(chan, [encode({"args": [], "cwd": str(run_dir)})], [stdin_r, stdout_w, stderr_w, env_r])
    for fd in (stdin_r, stdout_w, stderr_w, env_r):
        os.close(fd)
    return stdin_w, stdout_r, stderr_r


def read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    os.close(fd)
    return out


def status_field(pid: int, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == name:
                return value.strip()
    except OSError:
        return None
    return None


def wait_at_the_gate(pid: int) -> None:
    """Until the spare has applied its sandbox (``NoNewPrivs`` comes with Landlock, the
    last thing before the gate) and sleeps: waiting for ``go``."""
    fd = os.pidfd_open(pid)
    try:
        for _ in range(6000):
            state = status_field(pid, "State") or ""
            if status_field(pid, "NoNewPrivs") == "1" and state.startswith("S"):
                return
            assert state and not state.startswith("Z"), "the spare exited before its gate"
            select.select([fd], [], [], 0.005)  # a bounded wait that ends at once if it exits
        raise AssertionError("the spare never reached its gate")
    finally:
        os.close(fd)


def test_a_spare_does_nothing_of_a_run_before_go_and_exits_when_the_daemon_hangs_up(tmp_path: Path) -> None:
    z = ZygoteProc(tmp_path)
    try:
        # Hang-up while parked: it exits at once, nothing written.
        pid, chan, run_dir = z.spare(1)
        chan.close()
        assert z.wait_exit(pid) == 0
        assert sorted(p.name for p in run_dir.iterdir()) == ["tmp"]

        # Hang-up after its run was assigned, before `go`: its command never runs, no result.
        pid, chan, run_dir = z.spare(2)
        stdin_w, stdout_r, stderr_r = assign(chan, run_dir, "touch ran")
        ack = decode(chan.recv(1024))
        assert ack == {"assigned": pid}
        wait_at_the_gate(pid)
        assert not (run_dir / "ran").exists()
        chan.close()  # the daemon died, or gave up, before the journal held the start
        assert z.wait_exit(pid) == 0
        assert read_all(stdout_r) == b""  # no result: the run never started here
        assert not (run_dir / "ran").exists()
        assert not record_paths(run_dir)[1].read_bytes()  # its result file: made, never written
        assert b"tool_call" not in read_all(stderr_r)  # nor any event of a step
        os.close(stdin_w)

        # With `go`, the same run runs (the gate was what held it).
        pid, chan, run_dir = z.spare(3)
        stdin_w, stdout_r, stderr_r = assign(chan, run_dir, "touch ran")
        assert decode(chan.recv(1024)) == {"assigned": pid}
        wait_at_the_gate(pid)
        chan.send(b"go")
        chan.close()
        result = json.loads(read_all(stdout_r))
        assert b"tool_call" in read_all(stderr_r)
        os.close(stdin_w)
        assert z.wait_exit(pid) == 0
        assert result["status"] == "completed" and (run_dir / "ran").exists()
    finally:
        z.close()


def test_a_spare_given_up_while_parking_exits_quietly_and_one_still_wanted_says_why(tmp_path: Path) -> None:
    """The daemon gives up a spare whose request it could not finish (stopping, say): it
    closes the spare's socket, then removes its run directory, maybe before the spare has
    reached it. That spare exits 0 without a word; one whose daemon still holds its socket
    and cannot park reports the error (exit 70)."""
    log = tmp_path / "zygote.err"
    with open(log, "wb") as err:
        z = ZygoteProc(tmp_path, stderr=err.fileno())
    try:
        codes = {}
        for n, hang_up in ((1, True), (2, False)):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            if hang_up:
                ours.close()  # before the request is even sent: it finds EOF whenever it looks
            # Its run directory never made, as if removed already.
            codes[n] = z.wait_exit(z.ask_spare(n, tmp_path / f"t-gone{n}", theirs))
            if not hang_up:
                ours.close()
    finally:
        z.close()
    said = log.read_text()
    assert codes == {1: 0, 2: 70}, (codes, said)
    assert said.count("could not start") == 1 and "FileNotFoundError" in said, said


def test_a_parked_spare_dies_with_its_zygote(tmp_path: Path) -> None:
    z = ZygoteProc(tmp_path)
    try:
        pid, chan, _run_dir = z.spare(1)
        fd = os.pidfd_open(pid)
        try:
            z.proc.kill()
            z.proc.wait(timeout=30)
            ready, _, _ = select.select([fd], [], [], 30)  # the pidfd is readable once it exits
            assert ready, "the spare outlived its zygote"
        finally:
            os.close(fd)
            chan.close()
    finally:
        z.close()
