"""Containment set-up, cgroup bookkeeping and adopted-zombie reaping (supervisor/trees/containment.py)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.osedge import LINUX, Proc
from supervisor.trees import _cgroupfs, process
from supervisor.trees import containment as containment_mod
from supervisor.trees.containment import CGROUP, GROUP, SUBREAPER_SWEEP, Containment
from tests import conftest
from tests.fake_kernel import ME, FakeKernel


@pytest.fixture
def made() -> Iterator[list[Containment]]:
    out: list[Containment] = []
    yield out
    for c in out:
        c.close()


def setup(made: list[Containment], **kw: object) -> Containment:
    c = Containment.setup(instance=f"{os.getpid()}-{uuid.uuid4().hex[:8]}", **kw)  # type: ignore[arg-type]
    made.append(c)
    return c


def is_subreaper() -> bool:
    value = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(37, ctypes.byref(value), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return bool(value.value)


async def exited(pid: int, timeout_s: float = 5.0) -> None:
    """Return once ``pid`` has exited (is a zombie or gone), without reaping it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already, reaped by its parent (or init)
    try:
        with trio.fail_after(timeout_s):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def test_without_cgroups_trees_get_subreaper_and_sweep(made: list[Containment]) -> None:
    c = setup(made, cgroups="off")
    assert c.root is None and c.subreaper
    assert c.mode == SUBREAPER_SWEEP
    assert c.prepare("t-1") is None
    assert c.label(None) == SUBREAPER_SWEEP
    assert is_subreaper()


def test_without_subreaper_trees_get_groups_only(made: list[Containment]) -> None:
    c = setup(made, cgroups="off", subreaper=False)
    assert c.mode == GROUP and c.reap_adopted() == [] and c.strays() == []


def test_the_subreaper_flag_is_dropped_when_the_last_containment_closes() -> None:
    a = Containment.setup(cgroups="off")
    b = Containment.setup(cgroups="off")
    assert is_subreaper()
    a.close()
    assert is_subreaper()
    b.close()
    b.close()  # idempotent
    assert not is_subreaper()


def test_cgroups_are_made_per_tree_and_removed(made: list[Containment]) -> None:
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    assert c.root is not None
    assert c.mode == CGROUP and c.root.name.startswith(f"agentd-{os.getpid()}-")
    assert (c.root / "cgroup.procs").exists()
    path = c.prepare("t-abc")
    assert path == c.root / "t-abc" and (path / "cgroup.kill").exists()
    assert c.tracked_trees == 1
    c.close()
    assert not c.root.exists()


def test_a_runner_in_its_tree_cgroup_finds_it(made: list[Containment]) -> None:
    # A runner's command escalation reads its tree's cgroup instead of the whole table.
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    path = c.prepare("t-abc")
    assert path is not None
    code = (
        "import os, sys; open(sys.argv[1], 'w').write('0'); "
        "from subagent.tools.commands import own_tree_cgroup; print(own_tree_cgroup())"
    )
    for tree_id, found in (("t-abc", str(path)), ("t-other", "None")):
        out = subprocess.run(
            [sys.executable, "-c", code, str(path / "cgroup.procs")],
            env={**os.environ, "AGENTD_TREE": tree_id},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert out.stdout.strip() == found, out.stderr


def test_an_unwritable_cgroup_mount_degrades_to_subreaper_and_sweep(
    made: list[Containment], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cgroupfs, "own_cgroup_dir", lambda kernel=None: Path("/proc/self"))
    c = setup(made, cgroups="auto")
    assert c.root is None and c.mode == SUBREAPER_SWEEP


def test_a_systemd_unit_without_delegation_gets_no_cgroups(
    made: list[Containment], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unit = tmp_path / "system.slice" / "agentd.service"
    unit.mkdir(parents=True)
    monkeypatch.setattr(_cgroupfs, "own_cgroup_dir", lambda kernel=None: unit)
    c = setup(made, cgroups="auto")
    assert c.root is None
    assert list(unit.iterdir()) == []


def test_a_systemd_unit_with_delegation_gets_its_subtree(
    made: list[Containment], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Measured under systemd 252 with this repo's unit settings (PrivateUsers=yes, no
    # capabilities): trusted.delegate is unreadable there, user.delegate reads b"1".
    unit = tmp_path / "system.slice" / "agentd.service"
    unit.mkdir(parents=True)
    try:
        os.setxattr(unit, "user.delegate", b"1")
        xattrs = True
    except OSError:
        xattrs = False
    conftest.require(xattrs, f"user xattrs on the filesystem of {tmp_path} (tmpfs: kernel 6.6+)")
    monkeypatch.setattr(_cgroupfs, "own_cgroup_dir", lambda kernel=None: unit)
    c = setup(made, cgroups="auto")
    assert c.root is not None and c.root.parent == unit and c.mode == CGROUP


def test_a_subtree_nobody_holds_and_that_is_empty_is_removed_and_no_other(made: list[Containment]) -> None:
    probe = setup(made, cgroups="auto")
    conftest.require(probe.root is not None, "a writable cgroup2 mount")
    assert probe.root is not None
    own = probe.root.parent
    tag = uuid.uuid4().hex[:8]
    stale = own / f"agentd-99999999-stale{tag}"  # nobody holds it, nothing in it
    held = own / f"agentd-99999999-held{tag}"  # its pid means nothing here, its lock does
    busy = own / f"agentd-99999998-busy{tag}"  # nobody holds it, a process is in it
    for d in (stale / "t-old", held / "t-new", busy / "t-live"):
        d.mkdir(parents=True)
    lock = _cgroupfs.lock_dir(held)  # as a live daemon in another pid namespace does
    assert lock is not None
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (busy / "t-live" / "cgroup.procs").write_text(str(child.pid))
        setup(made, cgroups="auto")
        assert not stale.exists()
        assert (held / "t-new").exists()  # locked: a live daemon's, whatever its name says
        assert (busy / "t-live").exists()  # holds a process: a restarted daemon may re-adopt it
    finally:
        os.close(lock)
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        for d in (busy / "t-live", busy, held / "t-new", held, stale / "t-old", stale):
            if d.exists():
                d.rmdir()


def test_a_live_daemons_subtree_survives_another_daemons_setup_whatever_its_pid(
    made: list[Containment],
) -> None:
    # Named as a daemon that is pid 1 of its own namespace would name it: in ours, pid 1 is
    # init and 99999999 nobody; neither says anything about the owner. Its lock does.
    a = setup(made, cgroups="auto")
    conftest.require(a.root is not None, "a writable cgroup2 mount")
    other = Containment.setup(cgroups="auto", instance=f"99999999-{uuid.uuid4().hex[:8]}")
    made.append(other)
    assert other.root is not None and a.root is not None
    assert a.root.name != other.root.name
    setup(made, cgroups="auto")  # a third daemon's clean-up at start
    assert a.root.is_dir() and other.root.is_dir()
    assert other.prepare("t-x") == other.root / "t-x"


def test_a_subtree_removed_behind_the_daemons_back_is_made_again_or_reported(
    made: list[Containment], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    assert c.root is not None
    root = c.root
    root.rmdir()  # what an old daemon's clean-up did to a live daemon
    path = c.prepare("t-after")
    assert path == root / "t-after" and path.is_dir()
    assert c.mode == CGROUP and c.problem is None
    (root / "t-after").rmdir()
    root.rmdir()
    monkeypatch.setattr(_cgroupfs, "claim_subtree", lambda own, instance: None)
    assert c.prepare("t-later") is None
    assert c.mode == SUBREAPER_SWEEP
    assert c.problem is not None and str(root) in c.problem


ADOPTER = r"""
import os, sys
def orphan(double):
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    if double and os.fork():
        os._exit(0)
    kind = "daemon" if double else "setsid"
    os.write(1, f"{kind} {os.getpid()}\n".encode())  # one write: print() may interleave
    os.read(0, 1)  # exits at EOF on stdin
    os._exit(0)
orphan(False)
os.waitpid(orphan(True), 0)  # the middle of the double fork exits at once
"""


async def adopter_tree(c: Containment) -> tuple[Any, dict[str, int]]:
    """A tree running ADOPTER, its leader exited: its two orphans' pids by kind, waiting
    for EOF on the tree's stdin to exit."""
    tree = await process.spawn_tree(
        [sys.executable, "-c", ADOPTER], env=None, cwd=None, tree_id="t-" + uuid.uuid4().hex, containment=c
    )
    assert tree.process.stdout is not None and tree.process.stdin is not None
    out = b""
    with trio.fail_after(5):
        while out.count(b"\n") < 2:
            out += await tree.process.stdout.receive_some()
        await tree.process.wait()
    return tree, {kind: int(pid) for kind, pid in (line.split() for line in out.decode().splitlines())}


async def test_adopted_zombies_are_reaped_and_trios_children_are_left_alone(made: list[Containment]) -> None:
    c = setup(made, cgroups="off")
    tree, pids = await adopter_tree(c)
    setsid_pid, daemon_pid = pids["setsid"], pids["daemon"]
    for pid in (setsid_pid, daemon_pid):
        p = LINUX.stat(pid)
        assert p is not None and p.ppid == os.getpid()  # adopted by us, not by PID 1
    assert LINUX.stat(setsid_pid).sid == setsid_pid  # type: ignore[union-attr]
    assert c.reap_adopted() == []  # alive: noted (marker), not reaped

    # Trio's own children, exited but not yet waited for: same session and a new one.
    same = await trio.lowlevel.open_process(["sh", "-c", "exit 7"])
    own = await trio.lowlevel.open_process(["sh", "-c", "exit 9"], start_new_session=True)
    await tree.process.stdin.aclose()
    for pid in (same.pid, own.pid, setsid_pid, daemon_pid):
        await exited(pid)

    assert sorted(c.reap_adopted()) == sorted([setsid_pid, daemon_pid])
    with trio.fail_after(5):
        assert await same.wait() == 7
        assert await own.wait() == 9
    assert LINUX.stat(setsid_pid) is None and LINUX.stat(daemon_pid) is None
    for stream in (tree.process.stdout, tree.process.stderr):
        assert stream is not None
        await stream.aclose()


async def test_a_setsid_escaper_never_seen_alive_is_reaped_once_its_trees_cgroup_is_gone(
    made: list[Containment],
) -> None:
    # A setsid escaper the runner killed before the stop's scan saw it: it leads its own
    # session (as Trio's own new-session children do) and was never noted, so it stayed
    # a zombie of the daemon for good (pids leak in a long-lived daemon).
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    tree, pids = await adopter_tree(c)
    own = await trio.lowlevel.open_process(["sh", "-c", "exit 9"], start_new_session=True)  # Trio's
    await tree.process.stdin.aclose()
    for pid in (*pids.values(), own.pid):
        await exited(pid)
    assert c.remove(tree)  # the tree is over: its cgroup goes
    setsid = LINUX.stat(pids["setsid"])
    assert setsid is not None and setsid.dead and setsid.sid == setsid.pid and setsid.ppid == os.getpid()
    assert sorted(c.reap_adopted()) == sorted(pids.values())
    with trio.fail_after(5):
        assert await own.wait() == 9  # Trio's own child is left alone
    for stream in (tree.process.stdout, tree.process.stderr):
        assert stream is not None
        await stream.aclose()


async def test_a_reaping_loop_does_not_steal_trio_run_process_exit_codes(made: list[Containment]) -> None:
    c = setup(made, cgroups="off")
    done = trio.Event()

    async def reap_loop() -> None:
        while not done.is_set():
            c.reap_adopted()
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reap_loop)
        with trio.fail_after(10):
            for code in (3, 5, 0):
                result = await trio.run_process(["sh", "-c", f"exit {code}"], check=False)
                assert result.returncode == code
                result = await trio.run_process(["sh", "-c", f"exit {code}"], check=False, start_new_session=True)
                assert result.returncode == code
        done.set()


async def test_the_reaping_service_reaps_before_it_reports_started(made: list[Containment]) -> None:
    c = setup(made, cgroups="off")
    tree, pids = await adopter_tree(c)
    await tree.process.stdin.aclose()
    for pid in pids.values():
        await exited(pid)
    daemon = LINUX.stat(pids["daemon"])
    assert daemon is not None and daemon.dead and daemon.ppid == os.getpid()
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        assert LINUX.stat(pids["daemon"]) is None  # born in another session: provably adopted
        nursery.cancel_scope.cancel(reason="test over")
    # The setsid() one died before it was ever seen: it leads its own session, has no
    # environment left and no cgroup, exactly like a child Trio started in a new session,
    # so it is left alone (the documented limit of the sweep mode).
    assert c.reap_adopted() == []
    assert os.waitpid(pids["setsid"], 0)[0] == pids["setsid"]
    for stream in (tree.process.stdout, tree.process.stderr):
        assert stream is not None
        await stream.aclose()


def test_removing_a_readopted_tree_removes_the_old_daemons_empty_subtree(made: list[Containment]) -> None:
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    assert c.root is not None
    old = c.root.parent / "agentd-99999997-old"
    (old / "t-gone").mkdir(parents=True)
    found = process.find_tree("t-gone", pid=99999, start_time=0.0, cgroup=old / "t-gone")
    assert not found.leader_alive and found.members == [] and found.tree.cgroup == old / "t-gone"
    assert c.remove(found.tree)
    assert not old.exists()


async def test_a_leader_being_spawned_is_never_reaped_before_trio_knows_it(made: list[Containment]) -> None:
    # The window: the runner exists (and may already have exited) but spawn_tree has not
    # handed it to track() yet. It sits in its tree's cgroup and carries the marker.
    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    tid = "t-" + uuid.uuid4().hex
    cgroup = c.prepare(tid)
    assert cgroup is not None
    procs_file = os.fsencode(cgroup / "cgroup.procs")

    def join() -> None:
        fd = os.open(procs_file, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

    leader = await trio.lowlevel.open_process(
        ["sh", "-c", "exit 5"], start_new_session=True, preexec_fn=join, env={**os.environ, "AGENTD_TREE": tid}
    )
    await exited(leader.pid)
    assert (LINUX.cgroup(leader.pid) or "").endswith(f"/{tid}")
    assert c.reap_adopted() == [] and c.strays() == []
    with trio.fail_after(5):
        assert await leader.wait() == 5
    c.discard(tid)


async def test_a_scrubbed_session_leading_orphan_is_a_stray_and_the_hosts_own_child_is_not(
    made: list[Containment],
) -> None:
    c = setup(made, cgroups="off")
    # The host's own child in a session of its own, as a test or a benchmark starts one.
    own = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True
    )
    script = "env -i setsid sh -c 'echo $$; exec sleep 300' </dev/null &"
    tree = await process.spawn_tree(
        ["sh", "-c", script], env=None, cwd=None, tree_id="t-" + uuid.uuid4().hex, containment=c
    )
    assert tree.process.stdout is not None
    try:
        with trio.fail_after(5):
            out = b""
            while b"\n" not in out:
                out += await tree.process.stdout.receive_some()
            await tree.process.wait()
        orphan = int(out.split()[0])
        p = LINUX.stat(orphan)
        assert p is not None and p.ppid == os.getpid() and p.sid == orphan  # adopted, own session
        c.remove(tree)
        young: list[Proc] = []
        found = [q.pid for q in c.strays(young=young)] + [q.pid for q in young]
        assert orphan in found and own.pid not in found
        gone = os.pidfd_open(orphan)  # this process adopted it, so this process reaps it
        try:
            with trio.fail_after(5):
                killed = await process.kill_strays(c)
                await trio.lowlevel.wait_readable(gone)
        finally:
            os.close(gone)
        os.waitpid(orphan, 0)
        assert [k["pid"] for k in killed] == [orphan]
        assert own.poll() is None
    finally:
        assert own.stdin is not None
        own.stdin.close()
        own.wait()
        for stream in (tree.process.stdout, tree.process.stderr, tree.process.stdin):
            if stream is not None:
                await stream.aclose()


# ----------------------------------------------------------------------------- events, not polls


class CountingKernel(FakeKernel):
    """Counts the reads a reaper makes: a walk of the table, our children, zombie peeks."""

    def __init__(self) -> None:
        super().__init__()
        self.walks = 0
        self.children_reads = 0
        self.peeks = 0

    def pids(self) -> list[int]:
        self.walks += 1
        return super().pids()

    def children(self) -> list[int] | None:
        self.children_reads += 1
        return super().children()

    def zombie_child_waiting(self) -> bool:
        self.peeks += 1
        return super().zombie_child_waiting()


async def test_an_idle_reaper_reads_nothing_but_a_bounded_peek_and_wakes_on_sigchld(
    made: list[Containment], autojump_clock: object
) -> None:
    k = CountingKernel()
    c = setup(made, cgroups="off", kernel=k)
    assert c.mode == SUBREAPER_SWEEP
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        k.walks = k.children_reads = k.peeks = 0
        await trio.sleep(95.0)  # idle, runs healthy: no walk of the table, ever
        assert k.walks == 0
        # The fallback containment reads its own children every NOTE_ADOPTED_S (bounded),
        # and peeks for a zombie at most every REAP_FALLBACK_S without any event.
        assert k.children_reads == 95.0 // containment_mod.NOTE_ADOPTED_S
        assert k.peeks <= 95.0 // containment_mod.REAP_FALLBACK_S + 1
        # An adopted orphan dies: SIGCHLD wakes a pass at once, not at the next timer.
        orphan = k.start(7001, ppid=ME, sid=7000)  # born in another session: provably adopted
        k.die(orphan.pid)
        t0 = trio.current_time()
        os.kill(os.getpid(), signal.SIGCHLD)
        with trio.fail_after(1.0):
            while orphan.pid not in k.reaped:
                await trio.sleep(0.01)
        assert trio.current_time() - t0 < 1.0 and k.walks == 0
        nursery.cancel_scope.cancel(reason="test over")


def test_a_cgroup_turns_its_events_file_readable_when_its_last_process_exits(made: list[Containment]) -> None:
    from subagent.osedge import IN_MODIFY, Watch

    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    leaf = c.prepare("t-" + uuid.uuid4().hex)
    assert leaf is not None
    procs_file = os.fsencode(leaf / "cgroup.procs")

    def join() -> None:
        fd = os.open(procs_file, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, preexec_fn=join
    )
    watch = Watch.open([(leaf / "cgroup.events", IN_MODIFY)])
    assert watch is not None
    try:
        watch.drain()
        assert LINUX.cgroup_populated(leaf) is True
        assert child.stdin is not None
        child.stdin.close()
        # Woken by events until it reads empty. (The kernel may deliver the join's own
        # notification late, up to its rate limit and later under load: it failed 2 runs
        # in ~4 of a long suite when the test asserted no event before the close.)
        deadline = time.monotonic() + 10
        while LINUX.cgroup_populated(leaf):
            remaining = deadline - time.monotonic()
            assert remaining > 0 and select.select([watch.fd], [], [], remaining)[0], "no event when the cgroup emptied"
            watch.drain()
    finally:
        watch.close()
        child.wait()
    leaf.rmdir()


async def test_a_closed_sigchld_receiver_leaves_a_python_handler_for_a_late_sigchld() -> None:
    """A SIGCHLD whose C handler ran just as the receiver closed must still find a Python
    handler (with SIG_DFL put back, CPython reports "Signal 17 ignored due to race
    condition" as an unraisable error: a daemon's test failed on it under load)."""
    import contextlib

    from supervisor.trees._reaping import open_sigchld

    before = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for _ in range(2):  # a second daemon in the same process finds the first one's handler
            with contextlib.ExitStack() as stack:
                assert open_sigchld(stack) is not None
            after = signal.getsignal(signal.SIGCHLD)
            assert callable(after), after
        caught: list[object] = []
        hook, sys.unraisablehook = sys.unraisablehook, caught.append
        try:
            signal.raise_signal(signal.SIGCHLD)  # goes to the handler left in place
        finally:
            sys.unraisablehook = hook
        assert caught == []
    finally:
        if callable(before):  # never SIG_DFL again: that is the window this test is about
            signal.signal(signal.SIGCHLD, before)


@contextlib.contextmanager
def _tree_with_pool(made: list[Containment], size: int = 4) -> Iterator[Path]:
    """A tree cgroup with a runner's call pool (``callgroups.open_pool``) in this process;
    the pool's descriptors closed and the tree removed after."""
    from subagent import callgroups

    c = setup(made, cgroups="auto")
    conftest.require(c.root is not None, "a writable cgroup2 mount")
    tree = c.prepare("t-" + uuid.uuid4().hex)
    assert tree is not None
    assert callgroups.open_pool(tree, size=size) == tree / "calls"
    try:
        yield tree
    finally:
        assert callgroups._pool is not None
        for s in callgroups._pool[1]:
            os.close(s.procs_fd)
            if s.kill_fd is not None:
                os.close(s.kill_fd)
        callgroups._pool = None
    c.discard(tree.name)
    assert _cgroupfs.rmdir_tree(tree) and not tree.exists()  # its calls' cgroups with it


async def test_a_runners_call_pool_joins_and_kills_through_its_descriptors(made: list[Containment]) -> None:
    # ``callgroups.open_pool``: the call cgroups a runner makes before its sandbox, each
    # joined and killed through a descriptor (cgroup.procs, cgroup.kill) opened then.
    from subagent import callgroups

    with _tree_with_pool(made) as tree:
        slot = callgroups.take()
        assert slot is not None and slot.kill_fd is not None
        proc = await trio.lowlevel.open_process(
            ["sh", "-c", "sleep 300 & exec sleep 300"], start_new_session=True, preexec_fn=callgroups.joiner(slot)
        )
        try:
            with trio.fail_after(5):
                while len(LINUX.cgroup_pids(slot.path)) < 2:  # the shell and its child, both born there
                    await trio.sleep(0.01)
            assert (LINUX.cgroup(proc.pid) or "").endswith(f"/{tree.name}/calls/{slot.path.name}")
            os.write(slot.kill_fd, b"1")
            with trio.fail_after(5):
                assert await proc.wait() == -signal.SIGKILL
                while LINUX.cgroup_populated(slot.path):
                    await trio.sleep(0.01)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            callgroups.give(slot)


async def test_a_command_is_spawned_by_vfork_and_moved_into_its_call_cgroup_at_its_gate(
    made: list[Containment], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runner's real path (``start_gated``): the shell is spawned with no preexec_fn (so
    # by vfork: a fork of a zygote-born runner was ~10 ms), moved into its call cgroup
    # while it waits at its gate, and what its command starts is born there.
    from subagent.tools import commands

    spawned: list[dict[str, Any]] = []
    real_open = trio.lowlevel.open_process

    async def recording_open(argv: Any, **options: Any) -> trio.Process:
        spawned.append(options)
        return await real_open(argv, **options)

    monkeypatch.setattr(trio.lowlevel, "open_process", recording_open)
    with _tree_with_pool(made):
        started = await commands.start_gated(
            "sleep 300 & exec sleep 300", "m-" + uuid.uuid4().hex, lambda: False, stdout=subprocess.DEVNULL
        )
        assert started is not None and started.cgroup is not None
        try:
            assert [o.get("preexec_fn") for o in spawned] == [None]
            with trio.fail_after(5):
                while len(LINUX.cgroup_pids(started.cgroup.path)) < 2:  # the shell and its child
                    await trio.sleep(0.01)
            assert (LINUX.cgroup(started.proc.pid) or "").endswith(f"/calls/{started.cgroup.path.name}")
            assert await commands.end_group_and_escapers(
                started.proc.pid, started.ticks, "m", grace_s=0.5, what="test", cgroup=started.cgroup
            )
            with trio.fail_after(5):
                await started.proc.wait()
        finally:
            if started.proc.returncode is None:
                started.proc.kill()
                await started.proc.wait()


async def test_a_refused_move_runs_the_command_without_a_cgroup_and_keeps_the_slot(
    made: list[Containment], caplog: pytest.LogCaptureFixture
) -> None:
    # The move is refused (here: a descriptor that cannot be written): nothing ran yet, so
    # the command runs as a call beyond the pool does, said in the log, and the slot stays
    # in the pool.
    from subagent import callgroups
    from subagent.tools import commands

    with _tree_with_pool(made, size=1):
        assert callgroups._pool is not None
        slot = callgroups._pool[1][0]
        os.close(slot.procs_fd)
        slot.procs_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        r, w = os.pipe()
        try:
            with caplog.at_level(logging.WARNING, logger="subagent.tools.commands"):
                started = await commands.start_gated("echo ran", "m-" + uuid.uuid4().hex, lambda: False, stdout=w)
            os.close(w)
            w = -1
            assert started is not None and started.cgroup is None
            with trio.fail_after(5):
                assert await started.proc.wait() == 0
            assert os.read(r, 100) == b"ran\n"
            assert "runs without one" in caplog.text
            assert callgroups._pool[1] == [slot]
        finally:
            os.close(r)
            if w != -1:
                os.close(w)


def test_a_call_beyond_the_pool_says_it_runs_without_a_cgroup(caplog: pytest.LogCaptureFixture) -> None:
    # More commands at once than the pool holds: the one without a cgroup is said in the
    # run's log (its escapers are found by group and marker only); a runner with no pool
    # (no cgroups here) says nothing.
    from subagent import callgroups

    assert callgroups._pool is None
    with caplog.at_level(logging.WARNING, logger="subagent.callgroups"):
        assert callgroups.take() is None
        assert not caplog.records
        callgroups._pool = (os.getpid(), [])
        try:
            assert callgroups.take() is None
        finally:
            callgroups._pool = None
    assert [r.getMessage() for r in caplog.records] == [
        f"all {callgroups.POOL_SIZE} cgroups for the run's commands are in use: this command runs without one "
        "(what it starts is found by its group and marker; an escaper that also empties its "
        "environment lives on until the run ends)"
    ]
