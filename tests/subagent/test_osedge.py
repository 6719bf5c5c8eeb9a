"""The OS edge (subagent/osedge): identity, the table, signals and the escalation routine.

Decisions on a fake kernel injected once (tests/fake_kernel.py, virtual clock); OS facts
on real processes: groups, setsid escapers found by their marker, zombies, and pid reuse
forced in a private PID namespace (``ns_last_pid``), where a process that exited and a
new one with its pid are told apart and the new one is never signalled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.osedge import (
    LINUX,
    Delivery,
    Proc,
    ProcessTable,
    Targets,
    escalate,
    kill_cgroup,
    parse_stat,
    signal_group,
    signal_process,
)
from tests import conftest
from tests.fake_kernel import ME, FakeKernel

STAT = b"4242 (a) b (c) d) S 1 4200 4200 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 123456 0 0"


# ----------------------------------------------------------------------------- the table


def test_the_package_imports_only_the_stdlib() -> None:
    code = "import sys, subagent.osedge; print(sorted(m for m in ('trio', 'supervisor', 'psutil', 'anyio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_command_name_with_spaces_and_parentheses_parses() -> None:
    p = parse_stat(4242, STAT)
    assert p == Proc(pid=4242, ppid=1, pgid=4200, sid=4200, state="S", start_ticks=123456)
    assert not p.dead


@pytest.mark.parametrize("state, dead", [("Z", True), ("X", True), ("T", False), ("D", False), ("R", False)])
def test_a_zombie_is_dead_and_a_stopped_process_is_not(state: str, dead: bool) -> None:
    p = parse_stat(1, STAT.replace(b" S ", f" {state} ".encode(), 1))
    assert p is not None and p.dead is dead


def test_garbage_is_not_a_process() -> None:
    assert parse_stat(1, b"") is None
    assert parse_stat(1, b"1 (x) S 1 2") is None


def test_only_groups_that_are_provably_the_sets_count() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    k.procs.update(
        {
            200: Proc(pid=200, ppid=1, pgid=200, sid=200, state="S", start_ticks=5),  # same leader
            300: Proc(pid=300, ppid=1, pgid=300, sid=300, state="S", start_ticks=9),  # a new leader
            400: Proc(pid=400, ppid=1, pgid=77, sid=77, state="S", start_ticks=5),  # reused, not a leader
            600: Proc(pid=600, ppid=1, pgid=600, sid=600, state="Z", start_ticks=6),  # our zombie leader
        }
    )
    table = ProcessTable(k)
    # 500 and 700: no process has the number, so if the group exists it is still ours.
    assert table.live_groups({200: 5, 300: 5, 400: 5, 500: 5, 600: 6, 700: None}) == [200, 500, 600, 700]
    # A group learned with its leader already gone is never trusted to a new leader.
    assert table.live_groups({300: None}) == []
    assert table.live_groups({0: None, 1: None}) == []


def test_a_marker_is_remembered_but_not_an_empty_or_a_pre_exec_read() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    table = ProcessTable(k)
    stranger = k.start(900001)
    child = k.start(900002, ppid=ME)

    assert table.marker_of(stranger, "AGENTD_TREE") is None  # mid-exec: nothing readable, nothing remembered
    k.envs[stranger.pid] = b"A=1\0AGENTD_TREE=t-1\0"
    assert table.marker_of(stranger, "AGENTD_TREE") == "t-1"
    k.envs[stranger.pid] = b"A=1\0"  # an exec that drops it: still the tree's
    assert table.marker_of(stranger, "AGENTD_TREE") == "t-1"

    k.envs[child.pid] = b"A=1\0"  # our child between fork and exec: the caller's environment
    assert table.marker_of(child, "AGENTD_TREE") is None
    k.envs[child.pid] = b"AGENTD_TREE=t-2\0"  # after exec
    assert table.marker_of(child, "AGENTD_TREE") == "t-2"


def test_members_close_over_descendants_and_sessions_and_never_take_the_caller() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    k.start(ME, env={"AGENTD_TREE": "t"})  # the caller itself carries the marker: never a member
    k.start(1, env={"AGENTD_TREE": "t"})
    browser = k.start(100, ppid=ME, env={"AGENTD_TREE": "t"})
    helper = k.start(101, ppid=1, pgid=101, sid=100)  # no environment, in the browser's session
    child = k.start(102, ppid=100, pgid=102, sid=102)  # scrubbed its marker, left the session
    k.start(103, ppid=1)  # a stranger
    table = ProcessTable(k)
    t = Targets(marker=("AGENTD_TREE", "t"), follow=True)
    assert sorted(table.members(t)) == [browser.pid, helper.pid, child.pid]
    assert sorted(table.members(Targets(marker=("AGENTD_TREE", "t")))) == [browser.pid]


def test_a_set_within_a_cgroup_is_looked_for_there_and_not_in_the_whole_table() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    tree = Path("/sys/fs/cgroup/agentd-1-x/t-abc")
    k.start(ME, env={"AGENTD_SUBTREE": "m"}, cgroup=tree)  # the caller (a runner) is in it too
    leader = k.start(300, ppid=ME, env={"AGENTD_SUBTREE": "m"}, cgroup=tree)
    escaper = k.start(310, ppid=1, env={"AGENTD_SUBTREE": "m"}, cgroup=tree)  # setsid + double fork
    k.start(320, ppid=ME, env={"AGENTD_SUBTREE": "other"}, cgroup=tree)  # another command of the run
    k.start(400, ppid=1, env={"AGENTD_SUBTREE": "m"})  # not in the cgroup: not looked at
    scans: list[int] = []
    real_pids = k.pids
    k.pids = lambda: scans.append(1) or real_pids()  # type: ignore[method-assign]
    table = ProcessTable(k)
    t = Targets(groups={300: leader.start_ticks}, marker=("AGENTD_SUBTREE", "m"), within=tree)
    assert sorted(table.members(t)) == [leader.pid, escaper.pid]
    assert scans == []  # no walk of the whole table
    assert table.universe(Targets(marker=("AGENTD_SUBTREE", "m"), within=tree / "gone")) is not None
    assert scans == [1]  # a cgroup that is gone bounds nothing: the whole table is read


def test_a_runner_finds_its_tree_cgroup_only_when_it_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from subagent import callgroups

    class Mounted(FakeKernel):
        def cgroup2_mount(self) -> tuple[Path, str] | None:
            return Path("/sys/fs/cgroup"), "/"

    k = Mounted(clock=lambda: 0.0)
    tree = Path("/sys/fs/cgroup/agentd-1-x/t-abc")
    k.start(ME, cgroup=tree)
    k.cgroup = lambda pid: "/agentd-1-x/t-abc" if pid == ME else None  # type: ignore[method-assign]
    monkeypatch.setenv("AGENTD_TREE", "t-abc")
    assert callgroups.find_tree_cgroup(k, ME, os.environ.get("AGENTD_TREE")) == tree
    monkeypatch.setenv("AGENTD_TREE", "t-other")  # not this tree's cgroup
    assert callgroups.find_tree_cgroup(k, ME, os.environ.get("AGENTD_TREE")) is None
    monkeypatch.delenv("AGENTD_TREE")
    assert callgroups.find_tree_cgroup(k, ME, os.environ.get("AGENTD_TREE")) is None
    monkeypatch.setenv("AGENTD_TREE", "t-abc")
    k.cgroup = lambda pid: "/system.slice/t-abc"  # type: ignore[method-assign]  # not in an agentd subtree
    assert callgroups.find_tree_cgroup(k, ME, os.environ.get("AGENTD_TREE")) is None


# ----------------------------------------------------------------------------- identity


def test_a_process_that_exited_is_never_confused_with_the_next_owner_of_its_pid() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    table = ProcessTable(k)
    old = k.start(4000, ppid=ME)
    k.die(4000)
    k.release(4000)
    new = k.start(4000, ppid=ME)  # the pid is reused
    assert old.ident != new.ident
    assert signal_process(table, old, signal.SIGKILL) == Delivery.GONE
    assert table.running(new.pid, new.start_ticks) and not table.running(old.pid, old.start_ticks)
    assert k.sent == []
    # A group learned with the old leader is not the new leader's.
    assert table.live_groups({4000: old.start_ticks}) == []


def test_no_signal_ever_goes_to_group_0_1_the_callers_or_the_caller() -> None:
    table = ProcessTable(FakeKernel(clock=lambda: 0.0))
    for pgid in (0, 1, -5, ME):
        assert signal_group(table, pgid, signal.SIGTERM) == Delivery.REFUSED
    assert signal_process(table, Proc(ME, 1, ME, ME, "S", 1), signal.SIGKILL) == Delivery.REFUSED
    real = ProcessTable()
    assert signal_group(real, os.getpgrp(), signal.SIGTERM) == Delivery.REFUSED


# ----------------------------------------------------------------------------- escalate (fake)


async def test_a_group_that_obeys_sigterm_is_never_sigkilled(autojump_clock: Any) -> None:
    k = FakeKernel()
    leader = k.start(300, ppid=ME)
    k.start(301, ppid=300, pgid=300)
    r = await escalate(Targets.group(300, leader.start_ticks), grace_s=5.0, kill_wait_s=2.0, table=ProcessTable(k))
    assert k.signals() == [(0.0, "group", 300)]
    assert r.settled and not r.escalated and r.dead and r.dead_after_s == 0.0


def _counting_cgroup_reads(k: FakeKernel) -> list[Path]:
    walks: list[Path] = []
    real = k.cgroup_pids
    k.cgroup_pids = lambda path: walks.append(path) or real(path)  # type: ignore[method-assign]
    return walks


@pytest.mark.parametrize("escaper", [False, True])
async def test_a_cgroup_tree_found_empty_after_its_leader_exits_is_dead_with_no_walk_and_no_kill(
    autojump_clock: Any, escaper: bool
) -> None:
    # Path B of a run whose runner ended its own tools: the leader's exit settles the
    # grace; an empty cgroup (populated 0) is the whole set dead. With an escaper left in
    # it, the cgroup is read and killed as before.
    k = FakeKernel()
    tree = Path("/sys/fs/cgroup/agentd-1-x/t-abc")
    leader = k.start(300, ppid=ME, cgroup=tree)
    if escaper:
        k.start(310, ppid=1, pgid=310, cgroup=tree)
        k.ignores_term.add(310)
    walks = _counting_cgroup_reads(k)
    t = Targets(groups={300: leader.start_ticks}, cgroup=tree)

    async def leader_exit() -> None:
        while not k.procs[300].dead:
            await trio.sleep(0.01)

    r = await escalate(
        t, grace_s=5.0, kill_wait_s=2.0, table=ProcessTable(k), term=Targets.group(300, leader.start_ticks),
        settled=leader_exit,
    )  # fmt: skip
    assert r.settled and not r.escalated and r.dead and r.survivors == []
    assert k.signals(15) == [(0.0, "group", 300)]
    # The group's SIGKILL (its unreaped leader still makes it exist) goes out either way.
    if escaper:
        assert k.signals(9) == [(0.0, "cgroup", str(tree)), (0.0, "group", 300)] and walks  # read, cgroup.kill
        assert k.procs[310].dead
    else:
        assert k.signals(9) == [(0.0, "group", 300)] and walks == []  # cgroup.events read, nothing walked
        assert r.dead_after_s == 0.0


async def test_escalation_comes_exactly_at_the_grace_and_reaches_escapers_by_pidfd(autojump_clock: Any) -> None:
    k = FakeKernel()
    leader = k.start(300, ppid=ME, env={"AGENTD_SUBTREE": "m"})
    escaper = k.start(310, ppid=1, env={"AGENTD_SUBTREE": "m"})  # setsid + double fork, kept its marker
    k.ignores_term.update({300, 310})
    t = Targets(groups={300: leader.start_ticks}, marker=("AGENTD_SUBTREE", "m"))
    r = await escalate(t, grace_s=5.0, kill_wait_s=2.0, table=ProcessTable(k))
    assert k.signals(15) == [(0.0, "group", 300), (0.0, "pid", escaper.pid)]
    assert k.signals(9) == [(5.0, "group", 300), (5.0, "pid", escaper.pid)]
    assert r.escalated and r.waited_s == 5.0 and r.dead and r.survivors == []
    assert k.open_fds() == 0


async def test_a_process_that_cannot_die_is_abandoned_loudly_after_the_bound(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    k = FakeKernel()
    stuck = k.start(300, ppid=ME, cmdline="stuck in D")
    k.unkillable.add(300)
    r = await escalate(Targets(pids={300: stuck.start_ticks}), grace_s=1.0, kill_wait_s=3.0, table=ProcessTable(k))
    assert r.escalated and r.dead_at is None and [p.pid for p in r.survivors] == [300]
    assert trio.current_time() == pytest.approx(4.0, abs=0.05)
    assert "still alive 3.0 s after SIGKILL; abandoning: pid 300 (stuck in D)" in caplog.text


async def test_a_sigkill_only_sweep_rereads_until_no_new_helper_appears(autojump_clock: Any) -> None:
    k = FakeKernel()
    k.start(400, cmdline="chromium --user-data-dir=/runs/r1/browser/profile")
    k.start(401, cmdline="chromium --type=renderer /runs/r2/browser/profile")  # another run's
    spawned = False

    class Respawning(FakeKernel):
        pass

    def deliver(pid: int, sig: int) -> None:
        nonlocal spawned
        original(pid, sig)
        if pid == 400 and not spawned:  # a helper forked while the browser dies
            spawned = True
            k.start(402, cmdline="chromium --type=gpu /runs/r1/browser/x")

    original = k._deliver
    k._deliver = deliver  # type: ignore[method-assign]
    r = await escalate(
        Targets(cmdline=("/runs/r1/browser/",)), grace_s=0.0, kill_wait_s=2.0, sigterm=False, table=ProcessTable(k)
    )
    assert [(how, pid) for _, how, pid in k.signals()] == [("pid", 400), ("pid", 402)]
    assert r.dead and not k.procs[401].dead


# ----------------------------------------------------------------------------- escalate (real)

IGNORE_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


async def _start(code: str, *, new_session: bool = True, **kw: Any) -> trio.Process:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=new_session, **kw
    )
    assert proc.stdout is not None
    with trio.fail_after(10):
        assert (await proc.stdout.receive_some(100)).startswith(b"ready")
    return proc


def _group(proc: trio.Process) -> Targets:
    p = LINUX.stat(proc.pid)
    assert p is not None
    return Targets.group(proc.pid, p.start_ticks)


async def test_a_cooperative_group_ends_with_sigterm() -> None:
    proc = await _start("import time; print('ready', flush=True); time.sleep(600)")
    with trio.fail_after(5):
        # The leader is our child: reap it as it dies so it does not linger as a zombie.
        async with trio.open_nursery() as n:
            n.start_soon(proc.wait)
            r = await escalate(_group(proc), grace_s=3, kill_wait_s=2)
    assert r.dead and not r.escalated
    assert proc.returncode == -signal.SIGTERM


async def test_a_group_that_ignores_sigterm_is_sigkilled_after_the_grace() -> None:
    proc = await _start(IGNORE_TERM)
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        t0 = trio.current_time()
        r = await escalate(_group(proc), grace_s=0.3, kill_wait_s=3)
        assert trio.current_time() - t0 >= 0.3
    assert r.dead and r.escalated
    assert proc.returncode == -signal.SIGKILL


async def test_a_zombie_member_does_not_count_as_alive() -> None:
    # The leader exits but is not reaped yet: the group "exists" for killpg, yet is dead.
    proc = await trio.lowlevel.open_process([sys.executable, "-c", "pass"], start_new_session=True)
    fd = os.pidfd_open(proc.pid)
    try:
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    p = LINUX.stat(proc.pid)
    assert p is not None and p.dead
    with trio.fail_after(1):
        r = await escalate(Targets.group(proc.pid, p.start_ticks), grace_s=5, kill_wait_s=2)
    assert r.dead and r.signals == []
    await proc.wait()


async def test_a_setsid_escaper_is_found_by_its_marker_and_ended() -> None:
    value = uuid.uuid4().hex
    env = dict(os.environ, AGENTD_SWEEP_TEST=value)
    code = "import os, time; os.setsid(); print('ready', flush=True); time.sleep(600)"
    proc = await _start(code, new_session=False, env=env)  # it makes its own session
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        with trio.fail_after(10):
            r = await escalate(Targets(marker=("AGENTD_SWEEP_TEST", value)), grace_s=2, kill_wait_s=2)
    assert r.dead and [(s.signal, s.target, s.id) for s in r.signals] == [("SIGTERM", "pid", str(proc.pid))]
    assert proc.returncode == -signal.SIGTERM


async def test_a_marked_process_that_ignores_sigterm_is_killed() -> None:
    value = uuid.uuid4().hex
    proc = await _start(IGNORE_TERM, env=dict(os.environ, AGENTD_SWEEP_TEST=value))
    async with trio.open_nursery() as n:
        n.start_soon(proc.wait)
        with trio.fail_after(10):
            r = await escalate(Targets(marker=("AGENTD_SWEEP_TEST", value)), grace_s=0.2, kill_wait_s=2)
    assert r.dead and r.escalated
    assert proc.returncode == -signal.SIGKILL


# ----------------------------------------------------------------------------- pid reuse (real)

PID_REUSE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import trio
    from subagent.osedge import ProcessTable, Targets, escalate, signal_process, signal_group

    table = ProcessTable()
    hz = os.sysconf("SC_CLK_TCK")

    def child(new_session):
        pid = os.fork()
        if pid == 0:
            if new_session:
                os.setsid()
            signal.pause()
            os._exit(0)
        return pid

    def reuse(pid):
        # Start ticks have a 10 ms resolution: the new process must start in a later tick
        # (a wait on the clock, not a sleep to synchronise), then get the same pid.
        old = table.read(pid)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while time.clock_gettime(time.CLOCK_BOOTTIME) * hz < old.start_ticks + 2:
            pass
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        new = child(True)
        assert new == pid, (new, pid)
        return old, table.read(new)

    out = {}
    old, new = reuse(child(True))
    out["pid_reused"] = new.pid == old.pid and new.start_ticks != old.start_ticks
    out["signal_old"] = str(signal_process(table, old, signal.SIGKILL))
    out["group_old"] = table.live_groups({old.pid: old.start_ticks})
    r = trio.run(lambda: escalate(Targets(groups={old.pid: old.start_ticks}, pids={old.pid: old.start_ticks}),
                                  grace_s=0.1, kill_wait_s=0.2))
    out["escalate_signals"] = [s.signal for s in r.signals]
    out["new_alive"] = table.running(new.pid, new.start_ticks)
    os.kill(new.pid, signal.SIGKILL)
    os.waitpid(new.pid, 0)
    print(json.dumps(out))
    """
)


def test_a_process_that_exited_and_a_new_one_with_its_pid_are_never_confused(tmp_path: Any) -> None:
    unshare = shutil.which("unshare")
    conftest.require(unshare is not None and os.geteuid() == 0, "root and unshare(1) for a private PID namespace")
    assert unshare is not None
    script = tmp_path / "reuse.py"
    script.write_text(PID_REUSE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    conftest.require(done.returncode == 0 or "unshare failed" not in done.stderr, "unshare --pid --mount-proc")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["pid_reused"]
    assert out["signal_old"] == "gone"
    assert out["group_old"] == []
    assert out["escalate_signals"] == []  # neither the old group nor the old pid: nothing sent
    assert out["new_alive"]  # the new owner of the pid was never signalled


RELEASE_PROBE = """
import json, signal, sys, threading, trio
from trio._core import _wakeup_socketpair
from subagent.osedge import run_trio
caught = []
sys.unraisablehook = lambda u: caught.append(repr(u.exc_value))
signal.signal(signal.SIGCHLD, lambda *a: None)   # as a daemon earlier in the process left it

def close(self):  # Trio's own order, with a signal landing in its window
    self.wakeup_sock.close()
    self.write_sock.close()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGCHLD)
    if self.old_wakeup_fd is not None:
        signal.set_wakeup_fd(self.old_wakeup_fd)
_wakeup_socketpair.WakeupSocketpair.close = close

async def main():
    await trio.sleep(0)
(run_trio if sys.argv[1] == "run_trio" else trio.run)(main)
print(json.dumps(caught))
"""


@pytest.mark.parametrize("how, reported", [("trio.run", True), ("run_trio", False)])
def test_a_signal_while_trio_closes_is_never_written_to_its_closed_socket(how: str, reported: bool) -> None:
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE, how], capture_output=True, text=True, timeout=60, check=True
    )
    caught = json.loads(out.stdout)
    assert bool(caught) == reported, (caught, out.stderr)
    if reported:  # the bare run shows the fault this guards against
        assert caught == ["OSError(9, 'Bad file descriptor')"]
    else:
        assert "wakeup fd" not in out.stderr


def test_a_cgroup_killed_through_a_descriptor_opened_earlier_is_not_opened_by_path() -> None:
    # A sandboxed runner may not open a call cgroup's cgroup.kill by its path (EACCES):
    # it writes to the descriptor it opened before its sandbox (``callgroups.Slot``).
    k = FakeKernel()
    call = Path("/sys/fs/cgroup/agentd-1-x/t-abc/calls/0")
    k.start(300, ppid=ME, cgroup=call)
    r, w = os.pipe()
    try:
        assert kill_cgroup(ProcessTable(k), call, fd=w) == Delivery.SENT
        assert os.read(r, 8) == b"1"
        assert [s for s in k.sent if s.how == "cgroup"] == []  # never by path
    finally:
        os.close(r)
        os.close(w)


def test_deleted_files_are_the_open_files_no_path_leads_to(tmp_path: Path) -> None:
    # What the disk guard counts for a run beyond its files: space only a close gives back.
    gone = open(tmp_path / "gone", "wb")  # noqa: SIM115 - held open on purpose
    kept = open(tmp_path / "kept", "wb")  # noqa: SIM115
    linked = open(tmp_path / "linked", "wb")  # noqa: SIM115
    try:
        for f in (gone, kept, linked):
            f.write(os.urandom(1024 * 1024))
            f.flush()
        os.link(tmp_path / "linked", tmp_path / "other-name")
        os.unlink(tmp_path / "gone")
        os.unlink(tmp_path / "linked")  # deleted, but another path still leads to it
        found = LINUX.deleted_files(os.getpid())
        assert found is not None
        st = os.fstat(gone.fileno())
        assert found.get((st.st_dev, st.st_ino), 0) >= 1024 * 1024, found
        others = {(os.fstat(f.fileno()).st_dev, os.fstat(f.fileno()).st_ino) for f in (kept, linked)}
        assert not others & set(found), found
        assert LINUX.deleted_files(2**22 + 1) is None  # no such process
    finally:
        for f in (gone, kept, linked):
            f.close()


async def test_a_read_with_no_thread_to_be_had_runs_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # A runner at its run's pids limit cannot start a thread: the escalation's reads (the
    # runner's stop of its command) ran in one and failed the stop with RuntimeError.
    from subagent.osedge._escalate import TrioRuntime

    async def no_thread(fn: object, *args: object, **kwargs: object) -> object:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    assert await TrioRuntime().run_sync(lambda: 42) == 42

    async def other(fn: object, *args: object, **kwargs: object) -> object:
        raise RuntimeError("something else")

    monkeypatch.setattr(trio.to_thread, "run_sync", other)
    with pytest.raises(RuntimeError, match="something else"):
        await TrioRuntime().run_sync(lambda: 42)
