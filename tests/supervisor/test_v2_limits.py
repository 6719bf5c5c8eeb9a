"""Per-run memory and pids limits on a pure cgroup v2 host (``trees/_placement.py``).

This host's cgroup v2 hierarchy offers neither memory nor pids (a hybrid host: both are
bound to v1), so these tests run on a stand-in cgroupfs in a temporary directory whose
writes follow the kernel's rules that matter here: a controller can be enabled in a
cgroup's ``cgroup.subtree_control`` only where its ``cgroup.controllers`` offers it, a
domain controller (memory) not while the cgroup holds a process (EBUSY: the
no-internal-process rule), a controller's files exist in a cgroup whose parent enabled it,
and a pid written to ``cgroup.procs`` leaves its old cgroup. The real daemon under a real
systemd is ``tests/systemd/test_limits.py``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.trees import _cgroupfs, _placement
from supervisor.trees._memlimit import MIB, MemoryLimit
from supervisor.trees._pidslimit import PidsLimit
from supervisor.trees.containment import Containment
from tests.fake_kernel import ME, FakeKernel

DOMAIN = {"memory", "io", "cpu"}  # cpu is threaded-capable, but not so in a domain cgroup: as memory here


class CgroupFs(FakeKernel):
    """A FakeKernel whose cgroup v2 hierarchy is the directory ``mount``."""

    def __init__(self, mount: Path) -> None:
        super().__init__(clock=lambda: 0.0)
        self.mount = mount

    def cgroup2_mount(self) -> tuple[Path, str] | None:
        return self.mount, "/"

    def cgroup(self, pid: int) -> str | None:
        found = [p.parent for p in self.mount.rglob("cgroup.procs") if str(pid) in p.read_text().split()]
        if not found:
            return None
        return "/" + str(max(found, key=lambda p: len(p.parts)).relative_to(self.mount)).removeprefix(".")

    def cgroup_pids(self, path: Path) -> set[int]:
        return {int(x) for p in path.rglob("cgroup.procs") for x in p.read_text().split()}


def _controllers(cgroup: Path) -> set[str]:
    own = cgroup / "cgroup.controllers"
    if own.exists():
        return set(own.read_text().split())
    return set(_cgroupfs.read_text(cgroup.parent / "cgroup.subtree_control").split())


def _kernel_write(mount: Path) -> object:
    def write_value(path: str | os.PathLike[str], data: bytes) -> None:
        path = Path(path)
        cgroup, name, text = path.parent, path.name, data.decode()
        if name == "cgroup.subtree_control":
            now = set(_cgroupfs.read_text(path).split())
            for token in text.split():
                c = token[1:]
                if c not in _controllers(cgroup):
                    raise OSError(errno.ENOENT, "not offered", str(path))
                if c in DOMAIN and _cgroupfs.read_text(cgroup / "cgroup.procs").split():
                    raise OSError(errno.EBUSY, "no internal processes", str(path))
                now.add(c)
            path.write_text(" ".join(sorted(now)))
        elif name == "cgroup.procs":
            if not cgroup.is_dir():
                raise OSError(errno.ENOENT, "no such cgroup", str(path))
            for procs in mount.rglob("cgroup.procs"):
                procs.write_text(" ".join(p for p in procs.read_text().split() if p != text))
            path.write_text(f"{_cgroupfs.read_text(path)} {text}".strip())
        else:
            controller = name.split(".", 1)[0]
            if controller not in _cgroupfs.read_text(cgroup.parent / "cgroup.subtree_control").split():
                raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
            path.write_text(text)

    return write_value


@pytest.fixture
def fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CgroupFs]:
    """A delegated cgroup ``box`` (as a container's root, or a unit with Delegate=yes)
    offering memory and pids, the daemon (``ME``) alone in it, and a task bound."""
    mount = tmp_path / "cgroup"
    base = mount / "box"
    base.mkdir(parents=True)
    (mount / "cgroup.procs").write_text("1")
    (mount / "cgroup.subtree_control").write_text("memory pids")
    (base / "cgroup.type").write_text("domain")
    (base / "cgroup.controllers").write_text("cpu memory pids")
    (base / "cgroup.procs").write_text(str(ME))
    (base / "cgroup.subtree_control").write_text("")
    (base / "pids.max").write_text("4915")  # systemd's TasksMax= default for a pid_max of 32768
    monkeypatch.setattr(_cgroupfs, "write_value", _kernel_write(mount))
    yield CgroupFs(mount)


def _setup(fs: CgroupFs, *, instance: str = "9-mine", memory_mib: int = 64, pids: int = 40) -> Containment:
    return Containment.setup(
        subreaper=False, instance=instance, kernel=fs, pids_max=pids, memory_max_mib=memory_mib, cgroups="auto"
    )


def test_the_daemon_alone_in_its_cgroup_moves_into_a_leaf_and_each_run_gets_memory_max_and_pids_max(
    fs: CgroupFs,
) -> None:
    base = fs.mount / "box"
    c = _setup(fs)
    try:
        assert c.root == base / "agentd-9-mine" and c.leaf == base / "supervisor"
        assert (base / "supervisor" / "cgroup.procs").read_text().split() == [str(ME)]
        assert (base / "cgroup.procs").read_text() == ""  # an inner node now: controllers allowed
        for cg in (base, c.root):
            assert set((cg / "cgroup.subtree_control").read_text().split()) == {"memory", "pids"}
        assert c.memory.describe() == {"max_mib": 64, "mode": "v2", "subtree": None}
        # The service's task bound less the daemon's reserve, for all runs together.
        assert (c.root / "pids.max").read_text() == str(4915 - 256)
        assert c.pids.describe()["runs_max"] == 4915 - 256 and c.pids.mode == "v2"
        tree = c.prepare("t-1")
        assert tree == c.root / "t-1"
        assert c.prepare_memory("t-1", tree) == (tree, None)  # nothing to join: born in it
        assert c.prepare_pids("t-1", tree) == (tree, None)
        assert (tree / "memory.max").read_text() == str(64 * MIB)
        assert (tree / "memory.swap.max").read_text() == "0"  # no paging the excess out
        assert (tree / "pids.max").read_text() == "40"
        # What the kernel counted, for the receipt (memory.events is hierarchical).
        (tree / "memory.peak").write_text(str(64 * MIB))
        (tree / "memory.events").write_text("low 0\nhigh 0\nmax 17\noom 2\noom_kill 2\noom_group_kill 0\n")
        assert c.memory.report(tree) == {"max": 64 * MIB, "peak": 64 * MIB, "failcnt": 17, "oom_kills": 2}
        assert c.memory.group_of("t-1", tree) == tree  # a re-adopted tree's limit: its cgroup
        assert c.memory.remove(tree, tree) and tree.is_dir()  # goes with its cgroup, not before
    finally:
        c.close()


def test_a_subtree_made_again_gets_the_runs_controllers_again(fs: CgroupFs) -> None:
    c = _setup(fs)
    try:
        assert c.root is not None
        old = c.root
        _cgroupfs.rmdir_tree(old)  # someone removed it
        assert c.check_subtree() and c.root == old and old.is_dir()
        assert set((old / "cgroup.subtree_control").read_text().split()) == {"memory", "pids"}
        assert (old / "pids.max").read_text() == str(4915 - 256)
        tree = c.prepare("t-2")
        assert c.prepare_memory("t-2", tree)[0] == tree and (tree / "memory.max").exists()
    finally:
        c.close()


def test_a_daemon_started_again_takes_its_leaf_and_finds_the_earlier_subtrees_beside_it(fs: CgroupFs) -> None:
    # An earlier daemon's leaf and subtree are still there (not under systemd, which
    # gives each start a fresh cgroup); the new daemon starts in the leaf (as with
    # DelegateSubgroup=supervisor) or in the base: either way the same base.
    base = fs.mount / "box"
    first = _setup(fs, instance="1-old")
    assert first.root is not None
    run = first.prepare("t-old")
    first.prepare_memory("t-old", run)
    (run / "cgroup.procs").write_text("777")  # a run of it, alive
    assert first._root_lock is not None
    os.close(first._root_lock)  # the earlier daemon died: its lock is gone
    first._root_lock = None
    for leaf_start in (True, False):
        if not leaf_start:  # systemd starts the main process in the unit's own cgroup
            (base / "cgroup.procs").write_text(str(ME))
            (base / "supervisor" / "cgroup.procs").write_text("")
        c = _setup(fs, instance="2-new")
        try:
            assert c.root == base / "agentd-2-new" and c.leaf == base / "supervisor"
            assert (base / "supervisor" / "cgroup.procs").read_text().split() == [str(ME)]
            assert (base / "agentd-1-old" / "t-old").is_dir()  # holds a process: never removed
            assert c.memory.mode == "v2" and c.memory.group_of("t-old", run) == run
            assert c.memory.report(run) is not None and c.memory.report(run)["max"] == 64 * MIB  # type: ignore[index]
        finally:
            c.close()


def test_the_daemon_stays_where_it_is_not_alone_and_only_threaded_pids_are_there(fs: CgroupFs) -> None:
    base = fs.mount / "box"
    (base / "cgroup.procs").write_text(f"{ME} 4242")  # another process shares its cgroup
    root = base / "agentd-9-x"
    root.mkdir()
    assert _placement.move_into_leaf(base, kernel=fs) is None
    assert (base / "cgroup.procs").read_text().split() == [str(ME), "4242"] and not (base / "supervisor").exists()
    # The kernel refuses +memory while processes are in base: no limit, the spawn goes on.
    memory = MemoryLimit.setup(64, instance="9-x", v1_own=None, v2_root=root)
    assert memory.mode is None and memory.prepare("t-1", root / "t-1") == (None, None)
    pids = PidsLimit.setup(40, v2_root=root, instance="9-x", v1_own=None, kernel=fs)
    assert pids.mode == "v2"  # threaded: allowed beside the daemon, as before


def test_the_daemon_never_leaves_the_hierarchys_root(fs: CgroupFs) -> None:
    (fs.mount / "cgroup.procs").write_text(str(ME))
    (fs.mount / "box" / "cgroup.procs").write_text("")
    assert _placement.move_into_leaf(fs.mount, kernel=fs) is None
    assert not (fs.mount / "supervisor").exists()


def test_limits_off_leave_the_daemon_in_place(fs: CgroupFs) -> None:
    base = fs.mount / "box"
    c = _setup(fs, memory_mib=0, pids=0)
    try:
        assert c.leaf is None and not (base / "supervisor").exists()
        assert (base / "cgroup.procs").read_text() == str(ME)
    finally:
        c.close()


def test_the_runs_task_bound_is_the_tightest_above_less_the_daemons_reserve(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    base = mount / "system.slice" / "agentd.service"
    root = base / "agentd-1"
    root.mkdir(parents=True)
    for d in (mount, mount / "system.slice", base, root):
        (d / "cgroup.procs").write_text("")
    assert _placement.reserve_tasks(base, root, mount=mount) is None  # unbounded: nothing written
    assert not (root / "pids.max").exists()
    (root / "pids.max").write_text("max")
    (base / "pids.max").write_text("max")
    (mount / "system.slice" / "pids.max").write_text("1000")
    assert _placement.reserve_tasks(base, root, mount=mount) == 1000 - 250  # a quarter of a small bound
    (base / "pids.max").write_text("4915")
    (mount / "system.slice" / "pids.max").write_text("max")
    assert _placement.reserve_tasks(base, root, mount=mount) == 4915 - 256
    assert (root / "pids.max").read_text() == str(4915 - 256)
    assert _placement.tasks_reserve(4) == 1 and _placement.tasks_reserve(10**6) == 256


def test_base_of_is_the_leafs_parent_only_for_the_leaf_of_a_delegated_cgroup(tmp_path: Path) -> None:
    base = tmp_path / "box"
    (base / "supervisor").mkdir(parents=True)
    (base / "cgroup.procs").write_text("")
    assert _placement.base_of(base / "supervisor") == base
    assert _placement.base_of(base) == base
    unit = tmp_path / "agentd.service"  # a unit's cgroup without Delegate= (no xattr)
    (unit / "supervisor").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("")
    assert _placement.base_of(unit / "supervisor") == unit / "supervisor"


def test_a_v2_memory_report_without_memory_peak_or_a_limit_still_reads(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "memory.max").write_text("max\n")
    (tree / "memory.events").write_text("max 0\noom_kill 0\n")
    mem = MemoryLimit(limit_mib=64, mode="v2")
    assert mem.report(tree) == {"max": 64 * MIB, "peak": None, "failcnt": 0, "oom_kills": 0}
    (tree / "memory.max").unlink()
    assert mem.report(tree) is None  # gone already
    assert MemoryLimit(limit_mib=64, mode="v2").group_of("t", tree) is None
