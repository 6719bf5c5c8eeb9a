"""A per-run memory limit: a run that allocates without end harms only itself.

Real daemon, real runner and sandbox, scripted model, and the real cgroup v1 memory
controller of a hybrid host: one run's command allocates until the kernel's OOM killer
kills it inside that run, while a second run, started with it, allocates too and
completes; then nothing of either is left, and neither are their memory groups. A run
whose runner itself is OOM-killed is recorded as such (reason ``memory_limit``). The unit
tests below check the v1 subtree's ownership rules on real cgroups: only groups this
daemon made are ever removed.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.trees import process
from supervisor.trees._memlimit import MIB, V1, MemoryLimit, v1_memory_dir
from supervisor.trees.containment import Containment
from tests import conftest
from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_pids_limit import _hold_lock, _read, command_spec
from tests.supervisor.test_sweep_mode import none_left

WAIT_S = 30.0
LIMIT_MIB = 96
ALLOC = Path(__file__).parent.parent / "children" / "allocate.py"


def v1_own(pid: int | str = "self") -> Path | None:
    return v1_memory_dir(_read(f"/proc/{pid}/cgroup"), _read(f"/proc/{pid}/mountinfo"))


def v1_writable() -> bool:
    own = v1_own()
    return own is not None and os.access(own, os.W_OK)


def memory_groups(daemon_pid: int) -> list[Path]:
    """The groups in the daemon's v1 memory subtree(s) (``agentd-<its pid>-*``)."""
    own = v1_own(daemon_pid)
    if own is None:
        return []
    return [g for sub in own.glob(f"agentd-{daemon_pid}-*") for g in sub.iterdir() if g.is_dir()]


async def ended(c: Client, run_id: str) -> dict[str, Any]:
    end = await c.wait_end(run_id, WAIT_S)
    st: dict[str, Any] = await c.ok("status", run_id=run_id)
    st["end_state"] = end["state"]
    return st


async def test_a_run_that_allocates_without_end_is_oom_killed_inside_itself_and_harms_no_other_run(
    tmp_path: Path,
) -> None:
    conftest.require(v1_writable(), "root and a cgroup v1 memory hierarchy")
    shared = tmp_path / "shared"
    shared.mkdir()
    # Up to 384 MiB: without a limit it ends all the same ("allocated 384").
    hog = f"{sys.executable} {ALLOC} 384 --mark 16 {shared}/a-big --pause-at 16 {shared}/b-done"
    polite = f"{sys.executable} {ALLOC} 16 --wait-before {shared}/a-big --mark 16 {shared}/b-done"
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_MEMORY_MAX_MIB": str(LIMIT_MIB)}
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            summary = await c.ok("status")
            assert summary["summary"]["memory_limit"]["mode"] == V1, summary["summary"]
            a = (await c.ok("spawn", spec=command_spec(hog, shared)))["run_id"]
            b = (await c.ok("spawn", spec=command_spec(polite, shared)))["run_id"]
            st_a, st_b = await ended(c, a), await ended(c, b)
            # Both runs completed: the kernel killed A's command (its largest process),
            # inside A, and nothing of B or the daemon.
            assert st_a["end_state"] == "completed" and st_b["end_state"] == "completed", (st_a, st_b)
            out_a = st_a["tool_calls"][0]["output"]
            out_b = st_b["tool_calls"][0]["output"]
            assert "allocated" not in out_a, out_a
            assert "allocated 16" in out_b, out_b
            mem_a, mem_b = st_a["receipt"]["memory"], st_b["receipt"]["memory"]
            assert mem_a["max"] == mem_b["max"] == LIMIT_MIB * MIB, (mem_a, mem_b)
            assert mem_a["oom_kills"] >= 1, mem_a  # (failcnt: 0 on this 6.18 kernel, hit or not)
            assert mem_a["peak"] <= LIMIT_MIB * MIB, mem_a
            assert mem_b["oom_kills"] == 0, mem_b
            assert f"run {a}: hit its memory limit ({LIMIT_MIB} MiB)" in d.log_text()
            assert f"run {b}: hit its memory limit" not in d.log_text()
            await none_left(d.pid, frozenset([summary["summary"]["zygote"].get("pid")]) - {None})
            trees = {st_a["tree_id"], st_b["tree_id"]}
            with trio.fail_after(10):  # their groups go once their clean-up ran
                while trees & {g.name for g in memory_groups(d.pid)}:
                    await trio.sleep(0.05)
            daemon_pid, own = d.pid, v1_own(d.pid)
        assert own is not None and not list(own.glob(f"agentd-{daemon_pid}-*"))  # gone at its exit


# How the run's runner is made: each joins the run's memory group its own way (the cold
# spawn's preexec hook; the zygote's child, forked at the spawn or ahead as a spare).
RUNNERS = {
    "cold": {"AGENTD_ZYGOTE": "off"},
    "forked": {"AGENTD_ZYGOTE_SPARES": "0", "AGENTD_ZYGOTE_SPARES_MAX": "0"},
    "spare": {"AGENTD_ZYGOTE_SPARES": "1"},
}


@pytest.mark.parametrize("how", list(RUNNERS))
async def test_a_runner_the_oom_killer_kills_at_its_limit_is_recorded_as_such(tmp_path: Path, how: str) -> None:
    # The runner made the OOM killer's first choice (oom_score_adj 1000, written by this
    # test, root) while its command allocates past the limit: the kernel kills the runner.
    conftest.require(v1_writable(), "root and a cgroup v1 memory hierarchy")
    shared = tmp_path / "shared"
    shared.mkdir()
    hog = f"{sys.executable} {ALLOC} 384 --wait-before {shared}/go"
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_MEMORY_MAX_MIB": str(LIMIT_MIB), **RUNNERS[how]}
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d, d.connect() as c:
            summary = await c.ok("status")
            spare: int | None = None
            with trio.fail_after(WAIT_S):  # the zygote (and its spare) ready: no cold fallback
                while (
                    how != "cold"
                    and summary["summary"]["zygote"]["state"] != "ready"
                    or (how == "spare" and not summary["summary"]["zygote"]["spares"]["pids"])
                ):
                    await trio.sleep(0.02)
                    summary = await c.ok("status")
            if how == "spare":
                spare = summary["summary"]["zygote"]["spares"]["pids"][0]
            run = (await c.ok("spawn", spec=command_spec(hog, shared)))["run_id"]
            assert (await c.wait_kind(run, "process_group", WAIT_S))["op"] == "event"
            st = await c.ok("status", run_id=run)
            (group,) = [g for g in memory_groups(d.pid) if g.name == st["tree_id"]]
            runner = st["pid"]
            assert spare is None or runner == spare, (runner, spare)
            zygote = (await c.ok("status"))["summary"]["zygote"]
            if how == "cold":
                assert zygote["state"] == "off", zygote
            else:  # forked by the zygote (at the spawn, or its spare): no cold fallback
                assert zygote["spawned"] == 1 and zygote["cold_fallbacks"] == 0, zygote
                assert zygote["spares"]["used"] == (1 if how == "spare" else 0), zygote
            assert str(runner) in (group / "cgroup.procs").read_text().split()  # ours: in its group
            Path(f"/proc/{runner}/oom_score_adj").write_text("1000")
            (shared / "go").write_text("")
            st = await ended(c, run)
            assert st["end_state"] == "failed", st
            assert st["reason"] == "memory_limit", st
            assert st["error"]["code"] == f"signal_{signal.SIGKILL.value}", st["error"]
            assert "OOM killer" in st["error"]["message"] and f"{LIMIT_MIB} MiB" in st["error"]["message"], st
            assert st["receipt"]["memory"]["oom_kills"] >= 1, st["receipt"]
            assert f"run {run}: hit its memory limit" in d.log_text()
            helpers = {summary["summary"]["zygote"].get("pid")}
            if how == "spare":  # the zygote's next spare (its floor is 1): kept, not the run's
                with trio.fail_after(WAIT_S):
                    while not (spares := (await c.ok("status"))["summary"]["zygote"]["spares"]["pids"]):
                        await trio.sleep(0.02)
                assert runner not in spares
                helpers.update(spares)
            await none_left(d.pid, frozenset(helpers) - {None})
            with trio.fail_after(10):
                while group.exists():
                    await trio.sleep(0.05)


async def test_a_readopted_runs_memory_group_is_read_and_removed_by_the_next_daemon(tmp_path: Path) -> None:
    # The first daemon is SIGKILLed while its run's command runs: its v1 memory subtree,
    # unlocked now, still holds the run, so the next daemon keeps it at its start, then
    # reports the group in the run's receipt and removes it (and the subtree) at its end.
    conftest.require(v1_writable(), "root and a cgroup v1 memory hierarchy")
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_RUN_MEMORY_MAX_MIB": str(LIMIT_MIB)}
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "state", env=env) as d1, d1.connect() as c:
            run = (await c.ok("spawn", spec=command_spec("sleep 300", shared)))["run_id"]
            assert (await c.wait_kind(run, "process_group", WAIT_S))["op"] == "event"
            tree_id = (await c.ok("status", run_id=run))["tree_id"]
            (group,) = [g for g in memory_groups(d1.pid) if g.name == tree_id]
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
            assert st["receipt"]["memory"]["max"] == LIMIT_MIB * MIB, st["receipt"]
            await none_left(d2.pid, frozenset([summary["summary"]["zygote"]["pid"]]) - {None})
            with trio.fail_after(10):
                while group.parent.exists():
                    await trio.sleep(0.05)


# --------------------------------------------------------------------------- the v1 subtree


def test_v1_memory_dir_reads_the_memory_line_and_its_mount() -> None:
    mountinfo = (
        "30 24 0:26 / /sys/fs/cgroup/unified rw,relatime shared:6 - cgroup2 cgroup2 rw\n"
        "38 24 0:34 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
        "39 24 0:35 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    )
    cgroup = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n0::/\n"
    assert v1_memory_dir(cgroup, mountinfo) == Path("/sys/fs/cgroup/memory/process_api/abc")
    assert v1_memory_dir("0::/\n", mountinfo) is None  # pure v2: no v1 memory line
    assert v1_memory_dir(cgroup, mountinfo.replace("rw,memory", "rw,cpu")) is None  # not mounted


@pytest.fixture
def v1_parent() -> Iterator[Path]:
    """A scratch v1 memory group of this test's, standing for a daemon's own one."""
    conftest.require(os.geteuid() == 0 and v1_writable(), "root and a cgroup v1 memory hierarchy")
    own = v1_own()
    assert own is not None
    parent = own / f"probe-mem-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    try:
        yield parent
    finally:
        for dirpath, _dirs, _files in os.walk(parent, topdown=False):
            os.rmdir(dirpath)


def _in_group(path: Path) -> subprocess.Popen[bytes]:
    def join() -> None:
        fd = os.open(path / "cgroup.procs", os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

    return subprocess.Popen(["sleep", "60"], preexec_fn=join)


def test_stale_v1_memory_subtrees_are_removed_only_when_unlocked_and_empty(v1_parent: Path) -> None:
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
        mem = MemoryLimit.setup(LIMIT_MIB, instance="9-mine", v1_own=v1_parent)
        assert mem.mode == V1 and mem.root == v1_parent / "agentd-9-mine"
        assert not dead.exists()
        assert (live / "t-2").is_dir() and (busy / "t-3").is_dir() and other.is_dir()
        fd = os.open(mem.root, os.O_RDONLY | os.O_DIRECTORY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        group, join = mem.prepare("t-9")
        assert group == join == mem.root / "t-9"
        assert group is not None
        assert int((group / "memory.limit_in_bytes").read_text()) == LIMIT_MIB * MIB
        assert mem.report(group) == {"max": LIMIT_MIB * MIB, "peak": 0, "failcnt": 0, "oom_kills": 0}
        assert mem.remove(group) and not group.exists()
        mem.close()
        assert not mem.root.exists()  # its own subtree goes at its exit, nothing else
        assert (live / "t-2").is_dir() and (busy / "t-3").is_dir() and other.is_dir()
    finally:
        member.kill()
        member.wait()
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_no_memory_limit_when_off_or_without_a_v1_hierarchy(tmp_path: Path) -> None:
    off = MemoryLimit.setup(0, instance="9-mine", v1_own=tmp_path)
    assert off.describe() == {"max_mib": 0, "mode": None, "subtree": None} and not list(tmp_path.iterdir())
    none = MemoryLimit.setup(LIMIT_MIB, instance="9-mine", v1_own=None)
    assert none.mode is None and none.prepare("t-1") == (None, None) and none.report(None) is None


async def test_a_cold_runner_joins_its_memory_group_in_the_preexec_hook(tmp_path: Path) -> None:
    # process.spawn_tree (no zygote): the leader is in the group before it runs, so what
    # it allocates is charged there and the OOM killer kills it there; the group goes
    # with the tree.
    conftest.require(v1_writable(), "root and a cgroup v1 memory hierarchy")
    c = await trio.to_thread.run_sync(
        lambda: Containment.setup(instance=f"{os.getpid()}-{uuid.uuid4().hex[:8]}", memory_max_mib=32)
    )
    try:
        assert c.memory.mode == V1
        tree = await process.spawn_tree(
            [sys.executable, str(ALLOC), "256"], env=None, cwd=tmp_path, tree_id="t-cold", containment=c
        )
        assert tree.memory_group is not None
        with trio.fail_after(WAIT_S):
            assert tree.process.stdout is not None
            out = b""
            while chunk := await tree.process.stdout.receive_some():
                out += chunk
            await tree.process.wait()
        assert tree.process.returncode == -signal.SIGKILL and b"allocated" not in out, (tree.process.returncode, out)
        report = c.memory_report(tree)
        assert report is not None and report["max"] == 32 * MIB and report["oom_kills"] >= 1, report
        receipt = await process.terminate_and_kill(tree, grace_s=1)
        assert receipt.survivors == []
        assert c.remove(tree) and not tree.memory_group.exists()
    finally:
        c.close()
