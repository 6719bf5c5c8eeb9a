"""A per-run pids limit: a run that forks without end harms only itself.

Real daemon with cgroups, real runner and sandbox, scripted model, and the real pids
controller (the cgroup v1 pids hierarchy of a hybrid host, or v2 where the daemon's
subtree offers it): one run's command forks until a fork is refused while a second run,
started with it, forks too and completes; then nothing of either is left, and neither
are their pids groups. The unit tests below check the v1 subtree's ownership rules on
real cgroups: only groups this daemon made are ever removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.trees import process
from supervisor.trees._pidslimit import V1, PidsLimit, v1_pids_dir
from supervisor.trees.containment import Containment
from tests import conftest
from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_sweep_mode import none_left

WAIT_S = 30.0
LIMIT = 40
FORKER = Path(__file__).parent.parent / "children" / "fork_until_refused.py"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def v1_own(pid: int | str = "self") -> Path | None:
    return v1_pids_dir(_read(f"/proc/{pid}/cgroup"), _read(f"/proc/{pid}/mountinfo"))


def v1_writable() -> bool:
    own = v1_own()
    return own is not None and os.access(own, os.W_OK)


def pids_controller_here() -> bool:
    """Can a daemon of this test's give each run a pids group: a writable v1 pids
    hierarchy, or ``pids`` offered in its cgroup v2?"""
    own_v2 = _read("/proc/self/cgroup").split("0::", 1)[-1].strip()
    offered = _read(f"/sys/fs/cgroup/unified{own_v2}/cgroup.controllers") + _read(
        f"/sys/fs/cgroup{own_v2}/cgroup.controllers"
    )
    return v1_writable() or "pids" in offered.split()


def command_spec(command: str, shared: Path) -> dict[str, Any]:
    turns = [{"text": "go", "tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}]
    return {
        "task": "fork",
        "model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}},
        "sandbox": {"write": [str(shared)]},
    }


async def run_status(c: Client, run_id: str) -> dict[str, Any]:
    end = await c.wait_end(run_id, WAIT_S)
    st: dict[str, Any] = await c.ok("status", run_id=run_id)
    assert end["state"] == "completed", st
    return st


def pids_groups(daemon_pid: int) -> list[Path]:
    """The groups in the daemon's v1 pids subtree(s) (``agentd-<its pid>-*``)."""
    own = v1_own(daemon_pid)
    if own is None:
        return []
    return [g for sub in own.glob(f"agentd-{daemon_pid}-*") for g in sub.iterdir() if g.is_dir()]


async def test_a_run_that_forks_without_end_stops_at_its_limit_and_harms_no_other_run(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    # Up to 500 children: without a limit it ends all the same.
    bomb = f"{sys.executable} {FORKER} 500 --write {shared}/a-full --wait-after {shared}/b-done"
    polite = f"{sys.executable} {FORKER} 10 --wait-before {shared}/a-full --write {shared}/b-done"
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_PIDS_MAX": str(LIMIT)}
    conftest.require(pids_controller_here(), "a pids controller (cgroup v1 pids, or v2 delegated)")
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            summary = await c.ok("status")
            a = (await c.ok("spawn", spec=command_spec(bomb, shared)))["run_id"]
            b = (await c.ok("spawn", spec=command_spec(polite, shared)))["run_id"]
            st_a, st_b = await run_status(c, a), await run_status(c, b)
            conftest.require(st_a["containment"] == "cgroup", "a writable cgroup2 mount (cgroup containment)")
            pids_a = st_a["receipt"].get("pids")
            out_a = st_a["tool_calls"][0]["output"]
            out_b = st_b["tool_calls"][0]["output"]
            # A's forks were refused (EAGAIN) before its tree had LIMIT tasks (the runner
            # and the shell count too); B forked all it wanted meanwhile.
            made = int(out_a.split("made ")[1].split()[0])
            assert 0 < made < LIMIT and f"errno {errno.EAGAIN}" in out_a, out_a
            assert "made 10 errno None" in out_b, out_b
            assert pids_a["max"] == LIMIT and pids_a["hit"] >= 1, pids_a
            assert pids_a["peak"] is None or pids_a["peak"] <= LIMIT, pids_a
            pids_b = st_b["receipt"]["pids"]
            assert pids_b["max"] == LIMIT and pids_b["hit"] == 0, pids_b
            assert f"run {a}: hit its pids limit ({LIMIT} tasks)" in d.log_text()
            await none_left(d.pid, frozenset([summary["summary"]["zygote"]["pid"]]) - {None})
            trees = {st_a["tree_id"], st_b["tree_id"]}
            with trio.fail_after(10):  # their groups go once their clean-up ran
                while trees & {g.name for g in pids_groups(d.pid)}:
                    await trio.sleep(0.05)
            daemon_pid, own = d.pid, v1_own(d.pid)
        if own is not None:  # the daemon's v1 subtree goes at its exit
            assert not list(own.glob(f"agentd-{daemon_pid}-*"))


async def test_a_fork_bomb_at_its_limit_is_still_ended_whole_by_a_stop(tmp_path: Path) -> None:
    # Its processes ignore SIGTERM and fork all the time (EAGAIN at the limit, then again
    # as soon as a leaf exits): the stop's cgroup.kill (or sweep) still ends every one.
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_PIDS_MAX": str(LIMIT), "AGENTD_GRACE_S": "1"}
    conftest.require(pids_controller_here(), "a pids controller (cgroup v1 pids, or v2 delegated)")
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            summary = await c.ok("status")
            spec = command_spec(f"{sys.executable} {FORKER} --bomb {shared}/refused", shared)
            run = (await c.ok("spawn", spec=spec))["run_id"]
            with trio.fail_after(WAIT_S):  # a file the bomb writes: polled, bounded
                while not (shared / "refused").exists():
                    await trio.sleep(0.02)
            assert (await c.ok("cancel", run_id=run))["was_active"] is True
            end = await c.wait_end(run, WAIT_S)
            st = await c.ok("status", run_id=run)
            assert end["state"] == "cancelled", st
            assert st["receipt"]["pids"]["hit"] >= 1, st["receipt"]
            assert st["receipt"]["path_b"]["survivors"] == [], st["receipt"]
            await none_left(d.pid, frozenset([summary["summary"]["zygote"]["pid"]]) - {None})
            with trio.fail_after(10):
                while st["tree_id"] in {g.name for g in pids_groups(d.pid)}:
                    await trio.sleep(0.05)


async def test_a_readopted_runs_pids_group_is_read_and_removed_by_the_next_daemon(tmp_path: Path) -> None:
    # The first daemon is SIGKILLed while its run's command runs: its v1 pids subtree,
    # unlocked now, still holds the run, so the next daemon keeps it at its start, then
    # reports the group in the run's receipt and removes it (and the subtree) at its end.
    conftest.require(v1_writable(), "root and a cgroup v1 pids hierarchy")
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_PIDS_MAX": str(LIMIT)}
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d1, d1.connect() as c:
            run = (await c.ok("spawn", spec=command_spec("sleep 300", shared)))["run_id"]
            assert (await c.wait_kind(run, "process_group", WAIT_S))["op"] == "event"
            tree_id = (await c.ok("status", run_id=run))["tree_id"]
            (group,) = [g for g in pids_groups(d1.pid) if g.name == tree_id]
            await c.ws.aclose()
            d1.proc.kill()  # SIGKILL: no clean-up at all
            await d1.proc.wait()
        assert (group / "cgroup.procs").read_text().split()  # the run lives on in it
        async with real_daemon(tmp_path / "state", env=env) as d2, d2.connect() as c:
            assert group.is_dir()  # not a stale subtree: it holds a process
            summary = await c.ok("status")
            assert (await c.ok("cancel", run_id=run))["was_active"] is True
            assert (await c.wait_end(run, WAIT_S))["state"] == "cancelled"
            st = await c.ok("status", run_id=run)
            assert st["receipt"]["pids"]["max"] == LIMIT, st["receipt"]
            await none_left(d2.pid, frozenset([summary["summary"]["zygote"]["pid"]]) - {None})
            with trio.fail_after(10):
                while group.parent.exists():
                    await trio.sleep(0.05)


# --------------------------------------------------------------------------- the v1 subtree


def test_v1_pids_dir_reads_the_pids_line_and_its_mount() -> None:
    mountinfo = (
        "30 24 0:26 / /sys/fs/cgroup/unified rw,relatime shared:6 - cgroup2 cgroup2 rw\n"
        "31 24 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "38 24 0:34 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    )
    cgroup = "9:name=systemd:/\n8:pids:/a/b\n4:cpu,cpuacct:/x\n0::/\n"
    assert v1_pids_dir(cgroup, mountinfo) == Path("/sys/fs/cgroup/pids/a/b")
    assert v1_pids_dir("8:pids:/\n0::/\n", mountinfo) == Path("/sys/fs/cgroup/pids")
    # A container that sees its own part of the hierarchy as its mount's root.
    inner = "38 24 0:34 /lxc/c1 /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
    assert v1_pids_dir("8:pids:/lxc/c1/svc\n", inner) == Path("/sys/fs/cgroup/pids/svc")
    assert v1_pids_dir("8:pids:/other\n", inner) is None  # not below what is mounted here
    assert v1_pids_dir("0::/\n", mountinfo) is None  # pure v2: no v1 pids line
    assert v1_pids_dir(cgroup, mountinfo.replace("rw,pids", "rw,memory")) is None  # not mounted


@pytest.fixture
def v1_parent() -> Iterator[Path]:
    """A scratch v1 pids group of this test's, standing for a daemon's own v1 pids group."""
    conftest.require(os.geteuid() == 0 and v1_writable(), "root and a cgroup v1 pids hierarchy")
    own = v1_own()
    assert own is not None
    parent = own / f"probe-pids-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    try:
        yield parent
    finally:
        for dirpath, _dirs, _files in os.walk(parent, topdown=False):
            os.rmdir(dirpath)


def _hold_lock(path: Path) -> subprocess.Popen[bytes]:
    """Another process that holds the flock on ``path`` (a live daemon's), until killed."""
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    return proc


def _in_group(path: Path) -> subprocess.Popen[bytes]:
    """A process in the v1 group ``path`` (it joins before it execs), until killed."""

    def join() -> None:
        fd = os.open(path / "cgroup.procs", os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

    return subprocess.Popen(["sleep", "60"], preexec_fn=join)


def test_stale_v1_subtrees_are_removed_only_when_unlocked_and_empty(v1_parent: Path) -> None:
    dead = v1_parent / "agentd-1-dead"  # a dead daemon's, empty: removed with its groups
    (dead / "t-1").mkdir(parents=True)
    live = v1_parent / "agentd-2-live"  # a live daemon's (its lock held): kept
    (live / "t-2").mkdir(parents=True)
    busy = v1_parent / "agentd-3-busy"  # a dead daemon's that holds a process: kept
    (busy / "t-3").mkdir(parents=True)
    other = v1_parent / "someone-else"  # not ours by name: never touched
    other.mkdir()
    holder = _hold_lock(live)
    member = _in_group(busy / "t-3")
    try:
        pids = PidsLimit.setup(LIMIT, v2_root=None, instance="9-mine", v1_own=v1_parent)
        assert pids.mode == V1 and pids.root == v1_parent / "agentd-9-mine"
        assert not dead.exists()
        assert (live / "t-2").is_dir() and (busy / "t-3").is_dir() and other.is_dir()
        # Ours is locked while it lives: another daemon's clean-up leaves it alone.
        fd = os.open(pids.root, os.O_RDONLY | os.O_DIRECTORY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        group, join = pids.prepare("t-9", None)
        assert group == join == pids.root / "t-9"
        assert (group / "pids.max").read_text().strip() == str(LIMIT)
        pids.close()
        assert not pids.root.exists()  # its own subtree goes at its exit, nothing else
        assert (live / "t-2").is_dir() and (busy / "t-3").is_dir() and other.is_dir()
    finally:
        member.kill()
        member.wait()
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_a_v1_group_counts_the_forks_its_limit_refused_and_goes_when_empty(v1_parent: Path) -> None:
    pids = PidsLimit.setup(5, v2_root=None, instance="9-mine", v1_own=v1_parent)
    group, join = pids.prepare("t-1", None)
    assert group is not None and join is not None
    assert pids.report(group) == {"max": 5, "peak": 0, "hit": 0}

    def enter() -> None:
        fd = os.open(join / "cgroup.procs", os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

    proc = subprocess.run(
        [sys.executable, str(FORKER), "50"], preexec_fn=enter, capture_output=True, text=True, timeout=30
    )
    assert f"errno {errno.EAGAIN}" in proc.stdout, proc
    made = int(proc.stdout.split()[1])
    assert made == 4, proc.stdout  # itself + 4 = 5
    report = pids.report(group)
    assert report is not None and report["max"] == 5 and report["hit"] >= 1 and report["peak"] == 5, report
    assert pids.remove(group, None) and not group.exists()
    pids.close()
    assert not (v1_parent / "agentd-9-mine").exists()


def test_the_v2_pids_controller_is_used_where_offered_and_enabled_else_the_next(tmp_path: Path) -> None:
    # cgroupfs stand-ins (the v2 hierarchy here offers no pids): what is written where.
    own = tmp_path / "agentd.service"
    root = own / "agentd-9-mine"
    (root / "t-1").mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    for d in (own, root):
        (d / "cgroup.subtree_control").write_text("")
    (root / "t-1" / "pids.max").write_text("max\n")
    pids = PidsLimit.setup(LIMIT, v2_root=root, instance="9-mine", v1_own=None)
    assert pids.mode == "v2" and pids.root is None
    assert (own / "cgroup.subtree_control").read_text() == "+pids"
    assert (root / "cgroup.subtree_control").read_text() == "+pids"
    assert pids.prepare("t-1", root / "t-1") == (root / "t-1", None)  # nothing to join
    assert (root / "t-1" / "pids.max").read_text().startswith(str(LIMIT))
    assert pids.remove(root / "t-1", root / "t-1") and (root / "t-1").is_dir()  # goes with its cgroup
    # Not offered, or refused (a write the kernel answers EBUSY): the next place, here none.
    (own / "cgroup.controllers").write_text("cpu memory\n")
    assert PidsLimit.setup(LIMIT, v2_root=root, instance="9-mine", v1_own=None).mode is None
    (own / "cgroup.controllers").write_text("pids\n")
    (own / "cgroup.subtree_control").unlink()
    (own / "cgroup.subtree_control").mkdir()  # any write fails
    none = PidsLimit.setup(LIMIT, v2_root=root, instance="9-mine", v1_own=None)
    assert none.mode is None and none.prepare("t-2", root) == (None, None)
    assert PidsLimit.setup(0, v2_root=root, instance="9-mine", v1_own=None).describe() == {
        "max": 0,
        "mode": None,
        "subtree": None,
        "runs_max": None,
    }


async def test_a_cold_runner_joins_its_pids_group_in_the_preexec_hook(tmp_path: Path) -> None:
    # process.spawn_tree (no zygote): the leader is in the group before it runs, so the
    # forks of what it runs count; the group goes with the tree.
    conftest.require(pids_controller_here(), "a pids controller (cgroup v1 pids, or v2 delegated)")
    c = await trio.to_thread.run_sync(
        lambda: Containment.setup(instance=f"{os.getpid()}-{uuid.uuid4().hex[:8]}", pids_max=8)
    )
    try:
        assert c.pids.mode is not None
        tree = await process.spawn_tree(
            [sys.executable, str(FORKER), "50"], env=None, cwd=tmp_path, tree_id="t-cold", containment=c
        )
        assert tree.pids_group is not None
        with trio.fail_after(WAIT_S):
            assert tree.process.stdout is not None
            out = b""
            while chunk := await tree.process.stdout.receive_some():
                out += chunk
            await tree.process.wait()
        assert out.decode().strip() == f"made 7 errno {errno.EAGAIN}"  # itself + 7 = 8
        report = c.pids_report(tree)
        assert report is not None and report["max"] == 8 and report["hit"] >= 1, report
        receipt = await process.terminate_and_kill(tree, grace_s=1)
        assert receipt.survivors == []
        assert c.remove(tree) and not tree.pids_group.exists()
    finally:
        c.close()


_NO_THREAD_LEFT = r"""
import os, sys, trio
from subagent.tools import commands

group = sys.argv[1]
with open(f"{group}/cgroup.procs", "w") as f:
    f.write("0")
with open(f"{group}/pids.max", "w") as f:  # the run at its limit: not one task more
    f.write(str(len(os.listdir("/proc/self/task"))))

async def main():
    out = await commands.run_command(
        "echo ran", timeout_s=10, max_output_bytes=1000, interrupt=trio.CancelScope(), on_group=lambda *a: None
    )
    print("error:", out.spawn_error, "| output:", out.output.strip())

trio.run(main)
"""


def test_a_runner_at_its_limit_fails_the_command_not_the_run(v1_parent: Path) -> None:
    # A runner whose run used its whole limit (its MCP server's threads, say) could not
    # start the worker thread trio forks a command in: a RuntimeError, and the whole run
    # failed 'internal' (the call 'unknown: runner_failed'). It is the call's EAGAIN now.
    out = subprocess.run(
        [sys.executable, "-c", _NO_THREAD_LEFT, str(v1_parent)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"error: BlockingIOError: [Errno {errno.EAGAIN}]"), out.stdout
    report = PidsLimit(1).report(v1_parent)
    assert report is not None and report["hit"] >= 1, report  # the kernel refused it, not a fake
