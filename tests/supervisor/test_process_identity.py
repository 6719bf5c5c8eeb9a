"""Identity decisions of process.py: which cgroups, groups and pids a tree may signal.

The table itself (parsing, markers, pid reuse) is the OS edge's: tests/subagent/test_osedge.py.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from subagent.osedge import Proc, ProcessTable
from supervisor.trees import process
from supervisor.trees.containment import Containment
from supervisor.trees.process import AdoptedTree
from tests import conftest
from tests.fake_kernel import ME, FakeKernel


def test_soft_stop_signals_only_groups_that_are_provably_the_trees(autojump_clock: object) -> None:
    k = FakeKernel(clock=lambda: 0.0)
    k.procs.update(
        {
            100: Proc(pid=100, ppid=1, pgid=100, sid=100, state="Z", start_ticks=4),  # the runner, dead
            200: Proc(pid=200, ppid=1, pgid=200, sid=200, state="S", start_ticks=5),  # same leader
            300: Proc(pid=300, ppid=1, pgid=300, sid=300, state="S", start_ticks=9),  # a new leader
        }
    )
    tree = AdoptedTree(
        tree_id="t",
        pid=100,
        pgid=100,
        start_time=0.0,
        cgroup=None,
        containment="group",
        leader_ticks=4,
        table=ProcessTable(k),
    )
    tree.groups.update({100: 4, 200: 5, 300: 5})
    assert process.soft_stop(tree) == ["SIGTERM group 100: sent", "SIGTERM group 200: sent"]
    assert [(how, g, sig) for _, how, g, sig in ((s.at, s.how, s.target, s.sig) for s in k.sent)] == [
        ("group", 100, signal.SIGTERM),
        ("group", 100, signal.SIGCONT),  # a stopped process acts on the SIGTERM too
        ("group", 200, signal.SIGTERM),
        ("group", 200, signal.SIGCONT),
    ]


def test_no_signal_ever_goes_to_group_0_1_or_our_own() -> None:
    tree = AdoptedTree(tree_id="t", pid=99999, pgid=99999, start_time=0.0, cgroup=None, containment="group")
    tree.groups.update({0: None, 1: None})
    assert process.soft_stop(tree) == []
    leader = tree.table.read(os.getpgrp())
    tree.groups[os.getpgrp()] = leader.start_ticks if leader is not None else None
    assert process.soft_stop(tree) in ([], [f"SIGTERM group {os.getpgrp()}: refused"])
    with pytest.raises(ValueError, match="expected the recorded runner pid"):
        process.find_tree("t", pid=0, start_time=None, cgroup=None)


def test_a_cgroup_that_is_not_a_trees_is_never_killed_or_swept(tmp_path: Path) -> None:
    assert process._cgroup_kill(tmp_path / "system.slice" / "agentd.service") == "refused"
    found = process.find_tree("t", pid=99999, start_time=None, cgroup=tmp_path)  # not in agentd-*
    assert found.tree.cgroup is None
    c = Containment.setup(cgroups="auto", subreaper=False, instance=f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        conftest.require(c.root is not None, "a writable cgroup2 mount")
        assert c.root is not None
        # A journal naming the daemon's own cgroup or its subtree root: never a tree's.
        assert process._cgroup_kill(c.root.parent) == "refused"
        assert process._cgroup_kill(c.root) == "refused"
        leaf = c.prepare("t-x")
        assert leaf is not None and process._is_tree_cgroup(leaf)
    finally:
        c.close()


def test_a_tree_cgroup_is_one_under_an_agentd_subtree_that_does_not_hold_us_and_an_empty_one_is_not_walked() -> None:
    k = FakeKernel(clock=lambda: 0.0)
    sub = Path("/sys/fs/cgroup/agentd-1-x")
    k.cgroups[sub / "t-empty"] = set()
    k.start(300, cgroup=sub / "t-live")
    k.start(ME, cgroup=sub / "t-ours")
    k.start(301, cgroup=Path("/sys/fs/cgroup/system.slice/t-x"))
    walks: list[Path] = []
    real = k.cgroup_pids
    k.cgroup_pids = lambda path: walks.append(path) or real(path)  # type: ignore[method-assign]
    table = ProcessTable(k)
    assert process._is_tree_cgroup(sub / "t-empty", table) and walks == []  # populated 0: cannot hold us
    assert process._is_tree_cgroup(sub / "t-live", table) and walks == [sub / "t-live"]
    assert not process._is_tree_cgroup(sub / "t-ours", table)  # it holds the daemon: never killed
    assert not process._is_tree_cgroup(Path("/sys/fs/cgroup/system.slice/t-x"), table)  # not agentd's
