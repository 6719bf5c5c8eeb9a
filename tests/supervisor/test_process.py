"""Real-process tests of spawn, path A and path B (supervisor/trees/process.py).

Children live in tests/children/tree_*.py and report their pids on stdout; every wait is
bounded by fail_after, and nothing sleeps to synchronise. Each tree is checked by pid and
start time, so a recycled pid cannot pass for a survivor or a corpse.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.osedge import LINUX, Proc
from supervisor.trees import process
from supervisor.trees.containment import CGROUP, GROUP, SUBREAPER_SWEEP, Containment
from supervisor.trees.process import Tree
from tests import conftest

CHILDREN = Path(__file__).resolve().parents[1] / "children"
GRACE_S = 0.5
# Scheduling slack allowed on top of an exact bound, for real processes on a loaded host.
SLACK_S = 1.0

MakeContainment = Callable[[str], Containment]


@pytest.fixture
def make_containment() -> Iterator[MakeContainment]:
    made: list[Containment] = []

    def make(mode: str) -> Containment:
        instance = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if mode == CGROUP:
            c = Containment.setup(cgroups="auto", instance=instance)
            made.append(c)
            conftest.require(c.root is not None, "a writable cgroup2 mount")
        elif mode == SUBREAPER_SWEEP:
            c = Containment.setup(cgroups="off", instance=instance)
            made.append(c)
            conftest.require(c.subreaper, "prctl(PR_SET_CHILD_SUBREAPER)")
        else:
            c = Containment.setup(cgroups="off", subreaper=False, instance=instance)
            made.append(c)
        assert c.mode == mode
        return c

    yield make
    for c in made:
        c.close()


_spawned: list[Tree] = []


@pytest.fixture(autouse=True)
async def close_every_tree() -> AsyncIterator[None]:
    """End each test's trees and close their pipes, so nothing outlives the test.

    Cleanup only: pytest-trio drops exceptions raised in async fixture teardown.
    """
    yield
    trees = list(_spawned)
    _spawned.clear()
    with trio.fail_after(10):
        for tree in trees:
            await process.terminate_and_kill(tree, grace_s=0)
            await close_pipes(tree)


async def close_pipes(tree: Tree) -> None:
    for stream in (tree.process.stdin, tree.process.stdout, tree.process.stderr):
        if stream is not None:
            await stream.aclose()


def new_tree_id() -> str:
    return "t-" + uuid.uuid4().hex[:12]


async def spawn_argv(argv: list[str], containment: Containment | None, **kw: Any) -> Tree:
    kw.setdefault("env", None)
    kw.setdefault("cwd", None)
    kw.setdefault("tree_id", new_tree_id())
    tree = await process.spawn_tree(argv, containment=containment, **kw)
    _spawned.append(tree)
    return tree


async def spawn(script: str, *args: str, containment: Containment | None) -> Tree:
    return await spawn_argv([sys.executable, str(CHILDREN / script), *args], containment)


async def read_line(tree: Tree) -> bytes:
    assert tree.process.stdout is not None
    buf = b""
    with trio.fail_after(10):
        while b"\n" not in buf:
            chunk = await tree.process.stdout.receive_some()
            assert chunk, f"stdout closed before a full line: {buf!r}"
            buf += chunk
    return buf.split(b"\n", 1)[0]


def identities(pids: dict[str, int]) -> dict[str, tuple[int, int]]:
    out = {}
    for kind, pid in pids.items():
        p = LINUX.stat(pid)
        assert p is not None and not p.dead, f"{kind} {pid} not running before the stop"
        out[kind] = (pid, p.start_ticks)
    return out


def running(ident: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The ones still running: same pid and start time, and not a zombie."""
    alive = {}
    for kind, (pid, ticks) in ident.items():
        p = LINUX.stat(pid)
        if p is not None and p.start_ticks == ticks and not p.dead:
            alive[kind] = pid
    return alive


def sigkilled(receipt: process.StopReceipt, before: Proc | None) -> bool:
    """Did path B SIGKILL this process (as read before the stop), by pid, group or session?"""
    assert before is not None
    ids = {str(before.pid), str(before.pgid), str(before.sid)}
    return any(s.signal == "SIGKILL" and s.result == "sent" and s.id in ids for s in receipt.signals)


# ----------------------------------------------------------------------------- path B


async def test_a_child_ignoring_sigterm_is_sigkilled_at_the_grace(
    make_containment: MakeContainment, caplog: pytest.LogCaptureFixture
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"
    caplog.set_level(logging.WARNING, logger="supervisor.trees.process")
    with trio.fail_after(GRACE_S + 5):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert receipt.escalated
    assert receipt.leader == "killed"
    assert receipt.grace_s == GRACE_S
    assert GRACE_S <= receipt.waited_s < GRACE_S + SLACK_S
    first = receipt.signals[0]
    assert (first.signal, first.target, first.id, first.result) == ("SIGTERM", "group", str(tree.pgid), "sent")
    kills = [s for s in receipt.signals if s.signal == "SIGKILL"]
    assert kills and all(s.at_s >= GRACE_S for s in kills)
    assert receipt.tree_dead_after_s is not None
    assert GRACE_S <= receipt.tree_dead_after_s < GRACE_S + process.KILL_WAIT_S
    assert receipt.survivors == []
    assert tree.process.returncode == -signal.SIGKILL
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"pid {tree.pid}" in m and "still running 0.5 s after SIGTERM" in m for m in warnings), warnings
    json.dumps(receipt.to_dict())  # the receipt goes into the journal as JSON


async def test_a_cgroup_tree_whose_runner_ends_its_own_children_is_found_dead_without_a_kill(
    make_containment: MakeContainment,
) -> None:
    # The runner ends its own command on SIGTERM, then exits: its cgroup is empty when
    # path B looks (populated 0), so the tree is dead with no cgroup.kill and no walk.
    c = make_containment(CGROUP)
    code = (
        "import signal, subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "def stop(*_):\n"
        "    child.terminate(); child.wait(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', child.pid, flush=True)\n"
        "signal.pause()\n"
    )
    tree = await spawn_argv([sys.executable, "-c", code], c)
    ready, child = (await read_line(tree)).split()
    assert ready == b"ready" and LINUX.stat(int(child)) is not None
    assert tree.cgroup is not None and LINUX.cgroup_populated(tree.cgroup) is True
    with trio.fail_after(10):
        receipt = await process.terminate_and_kill(tree, grace_s=10)
    assert not receipt.escalated and receipt.leader == "exited" and receipt.survivors == []
    assert receipt.tree_dead_after_s is not None and receipt.tree_dead_after_s < 10
    assert [s.signal for s in receipt.signals if s.signal == "cgroup.kill"] == []  # found empty
    assert LINUX.cgroup_populated(tree.cgroup) is False
    gone = LINUX.stat(int(child))
    assert gone is None or gone.state == "Z"
    assert tree.process.returncode == 0


async def test_a_runner_that_honours_sigterm_exits_in_the_grace_without_escalation(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn_argv([sys.executable, "-c", "import signal, sys; print('ready', flush=True); signal.pause()"], c)
    assert await read_line(tree) == b"ready"
    with trio.fail_after(5):
        receipt = await process.terminate_and_kill(tree, grace_s=10)
    assert not receipt.escalated
    assert process.soft_stop(tree) == [f"SIGTERM group {tree.pgid}: gone"]
    assert receipt.leader == "exited"
    assert receipt.waited_s < 10
    assert tree.process.returncode == -signal.SIGTERM
    assert receipt.survivors == []


@pytest.mark.parametrize("mode", [CGROUP, SUBREAPER_SWEEP, GROUP])
async def test_nothing_of_a_tree_with_escapers_survives_the_stop(mode: str, make_containment: MakeContainment) -> None:
    c = make_containment(mode)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--stop", containment=c)
    pids = json.loads(await read_line(tree))
    assert set(pids) == {"leader", "group", "setsid", "daemon", "stopped"}
    ident = identities(pids)
    now = {kind: LINUX.stat(pid) for kind, pid in pids.items()}
    assert now["stopped"] is not None and now["stopped"].state == "T"
    assert now["setsid"] is not None and now["setsid"].sid == pids["setsid"]
    assert now["daemon"] is not None and now["daemon"].sid not in (tree.pgid, pids["daemon"])
    assert tree.containment == mode
    assert set(process.alive_members(tree)) == set(pids.values())

    with trio.fail_after(GRACE_S + 6):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)

    assert running(ident) == {}
    assert receipt.survivors == []
    assert receipt.escalated
    assert process.alive_members(tree) == []
    if mode == CGROUP:
        assert any(s.signal == "cgroup.kill" and s.result == "sent" for s in receipt.signals)
    if mode != GROUP:  # with the subreaper the escapers were ours: their zombies are reaped
        for kind in ("setsid", "daemon", "stopped"):
            gone = LINUX.stat(pids[kind])
            assert gone is None or gone.start_ticks != ident[kind][1], kind


@pytest.mark.parametrize("mode", [SUBREAPER_SWEEP, GROUP])
async def test_helpers_without_a_marker_are_found_by_the_session_of_their_dead_parent(
    mode: str, make_containment: MakeContainment
) -> None:
    c = make_containment(mode)
    tree = await spawn("tree_hidden_helpers.py", containment=c)
    pids = json.loads(await read_line(tree))
    ident = identities(pids)
    helper = LINUX.stat(pids["helper"])
    assert helper is not None and helper.sid == pids["browser"] and helper.ppid != pids["browser"]
    assert pids["helper"] in process.alive_members(tree)  # by the marked browser's session
    assert pids["browser"] in tree.groups  # ... which the tree now remembers
    # The browser dies first (a crash, or the MCP server's end): now the helper has no
    # marker, no living ancestor in the tree, and a session whose leader is gone.
    os.kill(pids["browser"], signal.SIGKILL)
    fd = os.pidfd_open(pids["browser"])
    try:
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    with trio.fail_after(GRACE_S + 6):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert running(ident) == {}
    assert receipt.survivors == []


async def test_only_a_cgroup_catches_an_escaper_that_scrubs_its_environment(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(CGROUP)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--scrubbed", containment=c)
    pids = json.loads(await read_line(tree))
    ident = identities(pids)
    scrubbed = pids["scrubbed"]
    try:
        assert LINUX.cgroup(scrubbed) == LINUX.cgroup(tree.pid)
        with trio.fail_after(GRACE_S + 6):
            receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
        assert running(ident) == {}
        assert receipt.survivors == []
    finally:  # it carries no test mark: the suite-wide leak check cannot see it
        if running({"s": ident["scrubbed"]}):
            os.kill(scrubbed, signal.SIGKILL)


async def test_leftovers_are_killed_at_once_when_the_runner_has_exited(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--exit-leader", containment=c)
    pids = json.loads(await read_line(tree))
    with trio.fail_after(5):
        assert await tree.process.wait() == 0
    ident = identities({k: v for k, v in pids.items() if k != "leader"})
    before = {k: LINUX.stat(v) for k, v in pids.items()}
    start = trio.current_time()
    with trio.fail_after(5):
        receipt = await process.terminate_and_kill(tree, grace_s=30)
    assert trio.current_time() - start < 5  # no grace (30 s) for orphans
    assert receipt.leader == "gone"
    assert not receipt.escalated
    assert not any(s.signal == "SIGTERM" for s in receipt.signals)
    for kind in ("setsid", "daemon"):
        assert sigkilled(receipt, before[kind]), kind
    assert running(ident) == {}


async def test_what_outlives_a_runner_that_obeyed_sigterm_is_killed_without_more_grace(
    make_containment: MakeContainment, caplog: pytest.LogCaptureFixture
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--leader-honours-term", containment=c)
    pids = json.loads(await read_line(tree))
    ident = identities(pids)
    before = {k: LINUX.stat(v) for k, v in pids.items()}
    with trio.fail_after(5):
        receipt = await process.terminate_and_kill(tree, grace_s=30)
    assert receipt.leader == "exited" and not receipt.escalated
    assert receipt.waited_s < 5  # the runner's exit ended the grace (30 s)
    assert tree.process.returncode == -signal.SIGTERM
    for kind in ("group", "setsid", "daemon"):
        assert sigkilled(receipt, before[kind]), kind
    assert running(ident) == {}
    assert "outlived the runner" in caplog.text


async def test_path_b_runs_to_the_end_under_a_cancelled_scope(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"
    with trio.CancelScope() as outer:
        outer.cancel(reason="the run's scope unwinds")
        with trio.fail_after(GRACE_S + 5):
            receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert receipt.escalated and receipt.survivors == [] and not receipt.timed_out
    assert tree.process.returncode == -signal.SIGKILL


async def test_wait_tree_gone_says_false_while_a_member_lives(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"
    with trio.fail_after(5):
        assert not await process.wait_tree_gone(tree, 0.2)
        process.soft_stop(tree)  # ignored: SIGTERM does nothing here
        assert not await process.wait_tree_gone(tree, 0.2)
        await process.terminate_and_kill(tree, grace_s=0)
        assert await process.wait_tree_gone(tree, 1)
    assert process.alive_members(tree) == []


async def test_path_b_is_safe_to_repeat_on_a_dead_tree(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"
    with trio.fail_after(GRACE_S + 5):
        await process.terminate_and_kill(tree, grace_s=0)
        again = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert again.leader == "gone"
    assert again.killed == [] and again.survivors == []
    assert again.tree_dead_after_s is not None


# ----------------------------------------------------------------------------- path A


async def test_soft_stop_is_idempotent_and_harmless_on_a_dead_tree(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn_argv([sys.executable, "-c", "import signal; print('ready', flush=True); signal.pause()"], c)
    assert await read_line(tree) == b"ready"
    first = process.soft_stop(tree)
    second = process.soft_stop(tree)
    assert first == [f"SIGTERM group {tree.pgid}: sent"]
    assert len(second) == 1  # the group again (or nothing there): never an exception
    with trio.fail_after(5):
        assert await tree.process.wait() == -signal.SIGTERM
    after = process.soft_stop(tree)
    assert all(line.endswith(": gone") for line in after), after
    with trio.fail_after(5):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert receipt.leader == "gone" and receipt.survivors == []


async def test_soft_stop_wakes_a_stopped_runner_to_act_on_its_sigterm(
    make_containment: MakeContainment, tmp_path: Path
) -> None:
    # A runner handles SIGTERM (its stop); stopped (SIGSTOP), it would sit on the signal
    # until path B killed it at the end of the grace, its partial results lost. Path A's
    # SIGCONT after the SIGTERM lets it stop as it should.
    c = make_containment(SUBREAPER_SWEEP)
    acted = tmp_path / "acted"
    code = (
        "import signal, sys\n"
        f"def stop(*a):\n    open({str(acted)!r}, 'w').write('stop')\n    sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "while True: signal.pause()\n"
    )
    tree = await spawn_argv([sys.executable, "-c", code], c)
    assert await read_line(tree) == b"ready"
    os.kill(tree.pid, signal.SIGSTOP)
    with trio.fail_after(10):  # only waits for a stop it was sent; no signal of ours wakes it
        while LINUX.stat(tree.pid).state != "T":  # type: ignore[union-attr]
            await trio.sleep(0.01)
    assert process.soft_stop(tree) == [f"SIGTERM group {tree.pgid}: sent"]
    with trio.fail_after(5):  # not the grace: its own handler ends it
        assert await tree.process.wait() == 7
    assert acted.read_text() == "stop"


async def test_soft_stop_reaches_known_groups_once_the_runner_is_gone(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    # The leader starts a helper in a session of its own (as the mcp SDK does for its
    # servers), prints the helper's pid, and exits.
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
    )
    tree = await spawn_argv([sys.executable, "-c", code], c)
    helper = int(await read_line(tree))
    assert tree.add_group(helper)
    with trio.fail_after(5):
        await tree.process.wait()
    ident = identities({"helper": helper})
    lines = process.soft_stop(tree)
    assert f"SIGTERM group {helper}: sent" in lines
    with trio.fail_after(5):
        assert await process.wait_tree_gone(tree, 4)
    assert running(ident) == {}
    with trio.fail_after(5):
        await process.terminate_and_kill(tree, grace_s=GRACE_S)


async def test_soft_stop_reaches_interruptible_groups_of_a_live_runner_and_spares_the_others(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    # A stuck runner (it ignores SIGTERM) with two tools in sessions of their own: a
    # command the stop interrupts, and one the policy lets finish.
    code = (
        "import signal, subprocess, sys\n"
        "a = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
        "b = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # after the spawns: SIG_IGN is inherited
        "print(a.pid, b.pid, flush=True)\n"
        "signal.pause()\n"
    )
    tree = await spawn_argv([sys.executable, "-c", code], c)
    interrupt, finish = map(int, (await read_line(tree)).split())
    assert tree.add_group(interrupt) and tree.add_group(finish)
    tree.set_interruptible(interrupt, True)
    tree.set_interruptible(finish, False)
    tree.set_interruptible(tree.pgid, True)  # never: the runner's own group is not a tool's
    assert tree.interruptible == {interrupt}
    ident = identities({"interrupt": interrupt, "finish": finish})
    lines = process.soft_stop(tree)
    assert lines == [f"SIGTERM group {tree.pgid}: sent", f"SIGTERM group {interrupt}: sent"]
    with trio.fail_after(5):
        while "interrupt" in running(ident):
            await trio.sleep(0.01)
    assert set(running(ident)) == {"finish"} and tree.process.returncode is None
    with trio.fail_after(GRACE_S + 5):
        receipt = await process.terminate_and_kill(tree, grace_s=0, sigterm_sent=True)
    assert receipt.survivors == [] and running(ident) == {}


async def test_a_reported_group_is_accepted_by_ancestry_without_a_marker(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    code = (
        "import os, subprocess, sys, signal\n"
        "env = {'AGENTD_TEST_MARK': os.environ['AGENTD_TEST_MARK']}\n"  # no AGENTD_TREE
        "p = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'],"
        " start_new_session=True, env=env)\n"
        "print(p.pid, flush=True)\n"
        "signal.pause()\n"
    )
    tree = await spawn_argv([sys.executable, "-c", code], c)
    helper = int(await read_line(tree))
    assert tree.add_group(helper)
    assert helper in tree.groups
    with trio.fail_after(GRACE_S + 5):
        receipt = await process.terminate_and_kill(tree, grace_s=0)
    assert receipt.survivors == []
    assert any(s.signal == "SIGKILL" and s.target == "group" and s.id == str(helper) for s in receipt.signals)


async def test_a_reported_group_that_is_not_the_trees_is_refused(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"
    stranger = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        assert not tree.add_group(stranger.pid)  # no marker, no cgroup: not ours
        assert not tree.add_group(os.getpgrp())  # never the daemon's own group
        assert not tree.add_group(1)
        assert set(tree.groups) == {tree.pgid}
        with trio.fail_after(GRACE_S + 5):
            await process.terminate_and_kill(tree, grace_s=0)
        assert stranger.returncode is None and stranger.poll() is None
    finally:
        assert stranger.stdin is not None
        await stranger.stdin.aclose()
        with trio.fail_after(5):
            await stranger.wait()


# ----------------------------------------------------------------------------- spawn


async def test_the_leader_is_in_its_cgroup_before_it_runs_a_single_instruction(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(CGROUP)
    tree = await spawn_argv(["cat", "/proc/self/cgroup"], c)
    assert tree.cgroup is not None and tree.containment == CGROUP
    assert tree.cgroup.parent == c.root
    out = b""
    assert tree.process.stdout is not None
    with trio.fail_after(5):
        async for chunk in tree.process.stdout:
            out += chunk
        await tree.process.wait()
    assert f"0::/{tree.cgroup.relative_to(c.root.parent)}".encode() in out
    assert c.remove(tree) and not tree.cgroup.exists()


async def test_a_tree_that_cannot_join_its_cgroup_runs_without_one(
    make_containment: MakeContainment, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    c = make_containment(CGROUP)
    assert c.root is not None
    monkeypatch.setattr(c, "prepare", lambda tree_id: c.root / "no-such-parent" / tree_id)
    tree = await spawn("tree_ignore_term.py", containment=c)
    assert await read_line(tree) == b"ready"  # started once more, without the cgroup
    assert tree.cgroup is None and tree.containment == SUBREAPER_SWEEP
    assert "could not join cgroup" in caplog.text
    with trio.fail_after(GRACE_S + 5):
        receipt = await process.terminate_and_kill(tree, grace_s=0)
    assert receipt.survivors == [] and receipt.cgroup is None


async def test_spawn_sets_marker_session_and_identity(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    code = "import os; print(os.environ['AGENTD_TREE'], os.getsid(0), os.getpgid(0), flush=True)"
    tree = await spawn_argv(
        [sys.executable, "-c", code], c, env={**os.environ, "EXTRA": "1"}, cwd="/", tree_id="t-marker"
    )
    assert await read_line(tree) == f"t-marker {tree.pid} {tree.pid}".encode()
    assert tree.pgid == tree.pid and tree.containment == SUBREAPER_SWEEP and tree.cgroup is None
    assert abs(tree.start_time - time.time()) < 60
    with trio.fail_after(5):
        await tree.process.wait()


async def test_a_command_that_cannot_start_is_a_spawn_error(make_containment: MakeContainment) -> None:
    from supervisor.errors import SpawnError

    c = make_containment(SUBREAPER_SWEEP)
    assert c.tracked_trees == 0
    with pytest.raises(SpawnError, match="no/such/program"):
        await process.spawn_tree(["/no/such/program"], env=None, cwd=None, tree_id=new_tree_id(), containment=c)
    with pytest.raises(SpawnError):
        await process.spawn_tree([], env=None, cwd=None, tree_id=new_tree_id(), containment=c)
    assert c.tracked_trees == 0  # a tree that never started is not waited for


# ----------------------------------------------------------------------------- restart


async def test_find_tree_proves_identity_and_kill_orphaned_tree_sweeps_it(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(CGROUP)
    tree = await spawn("tree_escapers.py", "--ignore-term", containment=c)
    pids = json.loads(await read_line(tree))
    ident = identities(pids)
    found = await trio.to_thread.run_sync(
        lambda: process.find_tree(tree.tree_id, pid=tree.pid, start_time=tree.start_time, cgroup=tree.cgroup)
    )
    assert found.leader_alive
    assert set(found.members) == set(pids.values())
    impostor = process.find_tree(tree.tree_id, pid=tree.pid, start_time=tree.start_time - 3600, cgroup=None)
    assert not impostor.leader_alive
    # Never the recorded pid's group on an unproven start time (the escapers' own sessions,
    # found by their marker, are the tree's and may be signalled).
    assert not any(line.startswith(f"SIGTERM group {tree.pid}:") for line in process.soft_stop(impostor.tree))
    with trio.fail_after(10):
        receipt = await process.kill_orphaned_tree(
            tree.tree_id, pid=tree.pid, start_time=tree.start_time, cgroup=tree.cgroup
        )
        await tree.process.wait()
    assert running(ident) == {}
    assert receipt.survivors == []


async def test_kill_orphaned_tree_finds_members_by_marker_without_a_cgroup(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(GROUP)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--exit-leader", containment=c)
    pids = json.loads(await read_line(tree))
    with trio.fail_after(5):
        await tree.process.wait()
    ident = identities({k: v for k, v in pids.items() if k != "leader"})
    found = process.find_tree(tree.tree_id, pid=tree.pid, start_time=tree.start_time, cgroup=None)
    assert not found.leader_alive
    assert set(found.members) == {pid for pid, _ in ident.values()}
    with trio.fail_after(10):
        receipt = await process.kill_orphaned_tree(tree.tree_id, pid=tree.pid, start_time=tree.start_time, cgroup=None)
    assert running(ident) == {}
    assert receipt.leader == "gone" and receipt.survivors == []


# ----------------------------------------------------------------------------- pipes


async def test_a_descendant_holding_stdout_cannot_hang_draining(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_holds_stdout.py", containment=c)
    got = bytearray()

    async def sink(chunk: bytes) -> None:
        got.extend(chunk)

    assert tree.process.stdout is not None
    bound = 0.3
    with trio.fail_after(5):
        eof = await process.drain_bounded(tree.process.stdout, sink, process=tree.process, after_exit_s=bound)
    assert not eof
    assert b"leader done" in got
    holder = int(got.split(b"holder ", 1)[1].split()[0])
    ident = identities({"holder": holder})
    with trio.fail_after(5):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    assert running(ident) == {}
    assert receipt.leader == "gone"


async def test_draining_reads_to_eof_when_nothing_holds_the_pipe(make_containment: MakeContainment) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn_argv([sys.executable, "-c", "import sys; sys.stdout.write('x' * 100000)"], c)
    got = bytearray()

    async def sink(chunk: bytes) -> None:
        got.extend(chunk)

    assert tree.process.stdout is not None
    with trio.fail_after(5):
        assert await process.drain_bounded(tree.process.stdout, sink, process=tree.process)
        await tree.process.wait()  # reaped here: nothing else waits for it
    assert bytes(got) == b"x" * 100000


class FakeStream(trio.abc.ReceiveStream):
    """A pipe whose writer never closes, delivering scripted chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.chunks:
            await trio.sleep(1)
            return self.chunks.pop(0)
        await trio.sleep_forever()
        raise AssertionError

    async def aclose(self) -> None:
        self.closed = True


class FakeProcess:
    def __init__(self, exits_at: float) -> None:
        self.exits_at = exits_at

    async def wait(self) -> int:
        await trio.sleep_until(self.exits_at)
        return 0


async def test_draining_is_cut_exactly_the_bound_after_the_pipe_falls_silent(autojump_clock: Any) -> None:
    start = trio.current_time()
    stream = FakeStream([b"a", b"b", b"c"])
    got: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        got.append(chunk)

    fake: Any = FakeProcess(exits_at=start + 1.5)
    eof = await process.drain_bounded(stream, sink, process=fake, after_exit_s=2.0)
    assert not eof and stream.closed
    # chunks at 1, 2 and 3 s; the runner exited at 1.5 s; silent from 3 s: cut at 5 s
    assert trio.current_time() - start == pytest.approx(5.0)
    assert got == [b"a", b"b", b"c"]


async def test_a_slow_sink_is_never_cut_short(autojump_clock: Any) -> None:
    """Journaling on a loaded machine may take longer than the bound: no event is dropped."""
    start = trio.current_time()
    stream = FakeStream([b"a", b"b", b"c"])
    got: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        await trio.sleep(5)  # longer than the bound, each time
        got.append(chunk)

    fake: Any = FakeProcess(exits_at=start + 0.5)
    eof = await process.drain_bounded(stream, sink, process=fake, after_exit_s=2.0)
    assert not eof
    assert got == [b"a", b"b", b"c"]
    # 3 x (1 s to arrive + 5 s to store), then 2 s of silence
    assert trio.current_time() - start == pytest.approx(20.0)


# ----------------------------------------------------------------------------- strays


async def test_an_untraceable_adopted_orphan_is_killed_once_no_tree_is_left(
    make_containment: MakeContainment,
) -> None:
    c = make_containment(SUBREAPER_SWEEP)
    tree = await spawn("tree_escapers.py", "--ignore-term", "--scrubbed", containment=c)
    pids = json.loads(await read_line(tree))
    ident = identities(pids)
    try:
        with trio.fail_after(GRACE_S + 6):
            await process.terminate_and_kill(tree, grace_s=GRACE_S)
        # No marker, no session or group of the tree, no living ancestor in it: the
        # sweep cannot place it, but the subreaper has it.
        assert running(ident) == {"scrubbed": pids["scrubbed"]}
        assert [p.pid for p in c.strays()] == [pids["scrubbed"]]
        assert await process.kill_strays(c) == []  # a tree is still tracked: hands off
        c.remove(tree)
        with trio.fail_after(5):
            killed = await process.kill_strays(c)
        assert [k["pid"] for k in killed] == [pids["scrubbed"]]
        assert running(ident) == {}
        assert LINUX.stat(pids["scrubbed"]) is None  # and reaped
    finally:  # it carries no test mark: the suite-wide leak check cannot see it
        if running({"s": ident["scrubbed"]}):
            os.kill(pids["scrubbed"], signal.SIGKILL)


async def test_a_failing_sink_propagates_as_itself(autojump_clock: Any) -> None:
    async def sink(chunk: bytes) -> None:
        raise ValueError(f"cannot store {chunk!r}")

    fake: Any = FakeProcess(exits_at=trio.current_time() + 100)
    with pytest.raises(ValueError, match="cannot store b'a'"):
        await process.drain_bounded(FakeStream([b"a"]), sink, process=fake)


# ----------------------------------------------------------------------------- chromium

CHROMIUM = Path("/usr/lib/chromium/chromium")


@pytest.fixture
def short_tmpdir() -> Iterator[str]:
    """A TMPDIR of the test's own, short enough for Chromium's singleton socket path:
    killed, Chromium leaves its org.chromium.Chromium.* dir there (it was left in /tmp)."""
    path = tempfile.mkdtemp(prefix="agentd-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.chromium
@pytest.mark.parametrize("mode", [CGROUP, SUBREAPER_SWEEP])
async def test_a_stopped_chromium_with_its_helper_sessions_is_ended(
    mode: str, make_containment: MakeContainment, tmp_path: Path, short_tmpdir: str
) -> None:
    conftest.require(CHROMIUM.is_file(), "chromium (apt-get install chromium)")
    c = make_containment(mode)
    tree = await spawn_argv(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        c,
        env={**os.environ, "TMPDIR": short_tmpdir},
    )
    assert tree.process.stderr is not None
    err = b""
    with trio.fail_after(30):
        while b"DevTools listening" not in err:
            chunk = await tree.process.stderr.receive_some()
            assert chunk, err
            err += chunk
    members = process.alive_members(tree)
    sessions = {LINUX.stat(pid).sid for pid in members}  # type: ignore[union-attr]
    assert len(members) >= 3 and len(sessions) >= 2  # crashpad lives in sessions of its own
    ident = identities({str(pid): pid for pid in members})
    for pid in members:  # frozen: a SIGTERM alone would wait for a SIGCONT
        os.kill(pid, signal.SIGSTOP)
    with trio.fail_after(GRACE_S + 6):
        receipt = await process.terminate_and_kill(tree, grace_s=GRACE_S)
    # The SIGCONT after the SIGTERM wakes them to act on it (what still runs at the end of
    # the grace is killed).
    assert receipt.survivors == [] and receipt.tree_dead_at is not None
    assert running(ident) == {}
