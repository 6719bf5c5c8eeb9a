"""A cgroup per tool call: what a command starts ends with its call, however it escapes.

The daemon contains a runner's tree in ``.../agentd-<instance>/<tree id>``. A command
(``run_command``, a background command) runs in a cgroup of its own below it,
``<tree>/calls/<n>``, into which the runner moves the command's shell while the shell is
held at its gate, before it has run anything (``move``): every process it starts
is born there, and none can leave on its own. So when the call ends, its cgroup is its
whole set, including an escaper that left the group (``setsid``), was re-parented (a
double fork) and emptied its environment (``env -i``), which the marker alone cannot find.

The run itself may write nothing in cgroupfs: with a write to a ``cgroup.procs`` of its
own, a process may move in any process whose cgroup shares an ancestor it can write (for
a root daemon's run, every process of the host, the daemon too), then kill it with its
call. So the runner makes a few such cgroups (``open_pool``) while it still may, before
its sandbox is applied, and keeps each one's ``cgroup.procs`` open (and ``cgroup.kill``,
for the call's end): the runner writes its held shell's pid to that descriptor, which needs no path (Landlock checks paths as
they are opened). A cgroup is used again once its call has left nothing in it. A call
that finds none free (more than ``POOL_SIZE`` at once), or a runner with no tree cgroup,
runs as before: its group and its marker variable find what it started.

A stdlib-only leaf (``subagent.osedge`` only). Sends no signal.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from subagent.osedge import LINUX, Kernel

__all__ = [
    "TREE_VAR",
    "CALLS",
    "POOL_SIZE",
    "Slot",
    "own_tree_cgroup",
    "find_tree_cgroup",
    "open_pool",
    "take",
    "give",
    "joiner",
    "move",
]

logger = logging.getLogger(__name__)

# Every process of a runner's tree carries its tree id here (the daemon's marker), and a
# tree the daemon contains in a cgroup lives in ``.../agentd-<instance>/<tree id>``.
TREE_VAR: Final = "AGENTD_TREE"
# The cgroup below a tree that holds its calls' cgroups.
CALLS: Final = "calls"
# How many calls at once get a cgroup of their own (made when a runner that runs commands
# starts): the rest are found by group and marker.
POOL_SIZE: Final = 4

_own_cgroup: tuple[int, Path | None] | None = None  # (pid, cgroup): a forked child looks again


def own_tree_cgroup(kernel: Kernel = LINUX) -> Path | None:
    """This runner's tree cgroup, when the daemon contains its tree in one; else None.

    Everything a command starts stays in it (a process cannot leave its cgroup on its
    own), so a command's group and escapers are looked for among its few processes, not
    in the whole process table: with a thousand runs stopping at once, a thousand walks
    of a table of thousands of processes were most of the stop's cost.
    """
    global _own_cgroup
    pid = os.getpid()
    if _own_cgroup is None or _own_cgroup[0] != pid:
        _own_cgroup = (pid, find_tree_cgroup(kernel, pid, os.environ.get(TREE_VAR)))
    return _own_cgroup[1]


def find_tree_cgroup(kernel: Kernel, pid: int, tree_id: str | None) -> Path | None:
    """The cgroup of tree ``tree_id`` if ``pid`` is in it (a runner is, never below it)."""
    try:
        own = kernel.cgroup(pid)
        mount = kernel.cgroup2_mount()
    except OSError:
        return None
    if not tree_id or not own or mount is None:
        return None
    point, root = mount
    if own != root and not own.startswith(root.rstrip("/") + "/"):
        return None
    path = point / posixpath.relpath(own, root)
    if path.name != tree_id or not path.parent.name.startswith("agentd-"):
        return None
    try:
        if kernel.cgroup_populated(path) is None:
            return None
    except OSError:
        return None
    return path


@dataclass
class Slot:
    """One call cgroup of the pool, with its ``cgroup.procs`` and ``cgroup.kill`` open for
    writing (``kill_fd`` None: a kernel without ``cgroup.kill``)."""

    path: Path
    procs_fd: int
    kill_fd: int | None = None


_pool: tuple[int, list[Slot]] | None = None  # (pid, free slots): a forked child has none


def open_pool(tree: Path | None = None, size: int = POOL_SIZE) -> Path | None:
    """Make ``<tree>/calls/0..size-1`` (default: this runner's tree) and keep them for its
    calls; returns ``calls``, or None where they cannot be had. Before the sandbox."""
    global _pool
    tree = own_tree_cgroup() if tree is None else tree
    if tree is None:
        return None
    calls = tree / CALLS
    slots: list[Slot] = []
    try:
        os.makedirs(calls, exist_ok=True)
        for i in range(size):
            path = calls / str(i)
            os.makedirs(path, exist_ok=True)
            slot = Slot(path, os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
            slots.append(slot)
            try:
                slot.kill_fd = os.open(path / "cgroup.kill", os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # a kernel before 5.14: each process by pidfd
                pass
    except OSError as exc:
        logger.debug("cgroups for the run's calls: %s (%d made)", exc, len(slots))
    if not slots:
        return None
    _pool = (os.getpid(), slots)
    return calls


def take() -> Slot | None:
    """A free call cgroup of this runner's pool, or None (none made, or all in use: that
    is said in the run's log, since such a call's escapers may outlive it)."""
    if _pool is None or _pool[0] != os.getpid():
        return None
    if not _pool[1]:
        logger.warning(
            "all %d cgroups for the run's commands are in use: this command runs without one "
            "(what it starts is found by its group and marker; an escaper that also empties its "
            "environment lives on until the run ends)",
            POOL_SIZE,
        )
        return None
    return _pool[1].pop()


def give(slot: Slot) -> None:
    """Back to the pool: its call left nothing in it (else it is not given back)."""
    if _pool is not None and _pool[0] == os.getpid():
        _pool[1].append(slot)


def move(slot: Slot, pid: int) -> None:
    """Move the runner's child ``pid`` (forked, not yet reaped) into ``slot``.

    For a child that starts nothing before it is moved: a command's shell held at its gate
    (``subagent.tools.commands``). Moving it from the runner, rather than having the child
    join in a ``preexec_fn``, lets the spawn use ``vfork``: a ``preexec_fn`` makes
    subprocess ``fork`` the whole runner, ~10 ms of page tables for a runner forked from
    the zygote (its ~110 MiB mapped), copy-on-write faults after it, and its teardown at
    the exec. The write may wait for an RCU grace period (a cgroup move, when cgroups were
    quiet): call it from a thread where one can be had.

    Raises:
        OSError: the move was refused (the child stays in the tree's cgroup).
    """
    os.write(slot.procs_fd, str(pid).encode())


def joiner(slot: Slot) -> Callable[[], None]:
    """A ``preexec_fn`` that moves the forked child into ``slot`` before it execs.

    A raw write to a descriptor the child holds until its exec, nothing that takes a lock.
    A refused join raises (the command does not start: ``subprocess.SubprocessError`` in
    the parent, which starts it again without the cgroup)."""
    fd = slot.procs_fd

    def join() -> None:
        os.write(fd, b"0")  # "0": the writing process itself

    return join
