"""Spawning a runner's tree: a new session, pipes, the marker, the tree's cgroup.

``spawn_tree`` starts ``argv`` as the leader of a new tree (re-exported by
``supervisor.trees.process``, whose stop routines end what it starts). The child joins its
cgroup (and its v1 pids group, where the per-run pids limit lives in one: ``_pidslimit``,
and its v1 memory group, the per-run memory limit: ``_memlimit``) in a preexec hook, before it runs a single instruction of ``argv``, so before it can fork;
its start time is read at once (its pid cannot be reused before Trio reaps it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import trio

from subagent.osedge import ProcessTable
from supervisor.errors import SpawnError
from supervisor.trees._handles import HOST_VAR, MARKER_VAR, Tree
from supervisor.trees.containment import CGROUP, GROUP, Containment

__all__ = ["spawn_tree"]

logger = logging.getLogger(__name__)

_POSIX: Final = os.name == "posix"
_HAVE_PROC: Final = os.path.exists("/proc/self/stat")


async def spawn_tree(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    tree_id: str,
    containment: Containment | None,
    pass_fds: Sequence[int] = (),
) -> Tree:
    """Start ``argv`` as the leader of a new tree: new session, pipes, marker, cgroup.

    The child gets stdin/stdout/stderr pipes, ``env`` (None: this process's environment)
    plus ``AGENTD_TREE=<tree_id>``, ``pass_fds`` (at their numbers), and joins the tree's cgroup before it runs a single
    instruction of ``argv`` (so before it can fork). There is no checkpoint after the child
    exists: put its cleanup in place before your next ``await``.

    Raises:
        SpawnError: the child could not be started (the cause is chained).
    """
    if not argv:
        raise SpawnError("expected a command to run, got an empty argv")
    if not tree_id or "\0" in tree_id or "/" in tree_id:
        raise SpawnError(f"expected a tree id without '/' or NUL, got {tree_id!r}")
    child_env = dict(os.environ if env is None else env)
    child_env[MARKER_VAR] = tree_id
    child_env.pop(HOST_VAR, None)  # what the daemon forks besides trees carries it; trees not
    cgroup = containment.prepare(tree_id) if containment is not None else None
    pids_group, pids_join = containment.prepare_pids(tree_id, cgroup) if containment is not None else (None, None)
    memory_group, memory_join = containment.prepare_memory(tree_id, cgroup) if containment is not None else (None, None)
    v1_joins = [g for g in (pids_join, memory_join) if g is not None]
    try:
        proc: trio.Process | None = None
        try:
            proc = await _open_leader(argv, child_env, cwd, cgroup, v1_joins, pass_fds)
        except subprocess.SubprocessError:
            # Only the preexec hook raises this: the child could not join its cgroup (or
            # its v1 pids or memory group) and never ran argv, so starting it again
            # without is safe.
            if v1_joins:
                logger.warning("tree %s: could not join v1 groups %s; continuing without them", tree_id, v1_joins)
                for g in v1_joins:
                    _rmdir_quietly(g)
                v1_joins = []
                if pids_join is not None:
                    pids_group = pids_join = None
                if memory_join is not None:
                    memory_group = memory_join = None
                with contextlib.suppress(subprocess.SubprocessError):
                    proc = await _open_leader(argv, child_env, cwd, cgroup, [], pass_fds)
            if proc is None:
                logger.warning("tree %s: could not join cgroup %s; continuing without it", tree_id, cgroup)
                if containment is not None and cgroup is not None:
                    _rmdir_quietly(cgroup)
                cgroup = pids_group = memory_group = None
                proc = await _open_leader(argv, child_env, cwd, None, [], pass_fds)
    except BaseException as exc:  # OSError, or a cancel before the child existed
        for g in v1_joins:
            _rmdir_quietly(g)
        if cgroup is not None:
            _rmdir_quietly(cgroup)
        if containment is not None:
            containment.discard(tree_id)
        if isinstance(exc, OSError):
            raise SpawnError(f"cannot start {argv[0]!r}: {exc}") from exc
        raise
    # No await from here on: the caller must own the child before the next checkpoint.
    table = containment.table if containment is not None else ProcessTable()
    leader = table.read(proc.pid) if _HAVE_PROC else None
    start_time = table.wall_start(leader) if leader is not None else time.time()
    if containment is not None:
        label = containment.label(cgroup)
    else:
        label = CGROUP if cgroup is not None else GROUP
    tree = Tree(
        tree_id=tree_id,
        pid=proc.pid,
        pgid=proc.pid,
        start_time=start_time,
        cgroup=cgroup,
        containment=label,
        process=proc,
        leader_ticks=leader.start_ticks if leader is not None else None,
        pids_group=pids_group,
        memory_group=memory_group,
        table=table,
    )
    tree.groups[tree.pgid] = tree.leader_ticks
    tree.pipes = _pipe_inodes(proc)
    if containment is not None:
        containment.track(tree)
    logger.debug("tree %s: spawned pid %d (%s) containment %s", tree_id, proc.pid, argv[0], label)
    return tree


async def _open_leader(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str | os.PathLike[str] | None,
    cgroup: Path | None,
    v1_joins: Sequence[Path],
    pass_fds: Sequence[int] = (),
) -> trio.Process:
    options: dict[str, Any] = {"pass_fds": tuple(pass_fds)} if pass_fds else {}
    if _POSIX:
        options["start_new_session"] = True
        joins = [os.fsencode(g / "cgroup.procs") for g in (cgroup, *v1_joins) if g is not None]
        if joins:
            options["preexec_fn"] = _joiner(*joins)
    else:
        options["creationflags"] = getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)
    return await trio.lowlevel.open_process(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        **options,
    )


def _joiner(*procs_files: bytes) -> Callable[[], None]:
    # Runs in the forked child before exec: raw syscalls only, nothing that takes a lock.
    def join_cgroup() -> None:
        for procs_file in procs_files:
            fd = os.open(procs_file, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)

    return join_cgroup


def _pipe_inodes(proc: trio.Process) -> frozenset[int]:
    inodes: set[int] = set()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        fileno = getattr(stream, "fileno", None)
        if fileno is None:
            continue
        try:
            inodes.add(os.fstat(fileno()).st_ino)
        except (OSError, ValueError):
            continue
    return frozenset(inodes)


def _rmdir_quietly(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
