"""Identity decisions on fakes: /proc parsing and which known groups may still be signalled."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from supervisor import process
from supervisor.containment import Containment, Proc, parse_stat
from supervisor.process import AdoptedTree
from tests import conftest

STAT = b"4242 (a) b (c) d) S 1 4200 4200 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 123456 0 0"


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


def tree_with(groups: dict[int, int | None]) -> AdoptedTree:
    t = AdoptedTree(tree_id="t", pid=100, pgid=100, start_time=0.0, cgroup=None, containment="group")
    t.groups.update(groups)
    return t


def test_only_groups_that_are_provably_the_trees_are_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {
        200: Proc(pid=200, ppid=1, pgid=200, sid=200, state="S", start_ticks=5),  # same leader
        300: Proc(pid=300, ppid=1, pgid=300, sid=300, state="S", start_ticks=9),  # a new leader
        400: Proc(pid=400, ppid=1, pgid=77, sid=77, state="S", start_ticks=5),  # reused, not a leader
        600: Proc(pid=600, ppid=1, pgid=600, sid=600, state="Z", start_ticks=6),  # our zombie leader
    }
    monkeypatch.setattr(process, "read_proc", table.get)
    tree = tree_with({200: 5, 300: 5, 400: 5, 500: 5, 600: 6, 700: None})
    # 500 and 700: no process has the number, so if the group exists it is still ours.
    assert process._live_groups(tree) == [200, 500, 600, 700]
    # A group learned with its leader already gone is never trusted to a new leader.
    assert process._live_groups(tree_with({300: None})) == []


def test_no_signal_ever_goes_to_group_0_1_or_our_own() -> None:
    import signal

    for pgid in (0, 1, -5, os.getpgrp()):
        assert process._killpg(pgid, signal.SIGTERM) == "refused"
    assert process._live_groups(tree_with({0: None, 1: None})) == []
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


def test_a_marker_is_remembered_but_not_an_empty_or_a_pre_exec_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor import containment as cm

    envs: dict[int, bytes] = {}
    monkeypatch.setattr(cm, "_read_environ", lambda pid: envs.get(pid, b""))
    monkeypatch.setattr(cm, "_markers", {})
    stranger = Proc(pid=900001, ppid=1, pgid=900001, sid=900001, state="S", start_ticks=1)
    child = Proc(pid=900002, ppid=os.getpid(), pgid=900002, sid=900002, state="S", start_ticks=1)

    assert cm.marker_of(stranger) is None  # mid-exec: nothing readable, nothing remembered
    envs[stranger.pid] = b"A=1\0AGENTD_TREE=t-1\0"
    assert cm.marker_of(stranger) == "t-1"
    envs[stranger.pid] = b"A=1\0"  # an exec that drops it: still the tree's
    assert cm.marker_of(stranger) == "t-1"

    envs[child.pid] = b"A=1\0"  # our child between fork and exec: the daemon's environment
    assert cm.marker_of(child) is None
    envs[child.pid] = b"AGENTD_TREE=t-2\0"  # after exec
    assert cm.marker_of(child) == "t-2"
