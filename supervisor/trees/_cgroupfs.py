"""cgroup v2 subtrees: whose ``agentd-*`` subtree is whose, and their life.

``own_cgroup_dir`` (where this daemon's cgroup is), and the life of a daemon's subtree:
``make_subtree`` at start (after ``remove_stale_subtrees``), ``claim_subtree`` again if it
vanished, ``rmdir_tree`` at the end. Reads of ``/proc`` and ``cgroup.procs`` go through the
OS edge's ``Kernel`` (``subagent.osedge``). Sends no signal.

Ownership. A pid says nothing across PID namespaces (two daemons can both be pid 1, and a
live daemon's pid may not exist in ours), so a subtree is named ``agentd-<pid>-<random>``
and its owner holds an exclusive flock on its directory for as long as it lives. The lock
is on the cgroupfs inode, the same in every namespace, and the kernel drops it when the
owner dies. A subtree whose lock can be taken and that holds no process is stale; one
whose lock is held is never touched, whatever its name says.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import posixpath
from pathlib import Path
from typing import Final

from subagent.osedge import LINUX, Kernel

__all__ = [
    "LEAF",
    "base_of",
    "read_text",
    "write_value",
    "remove_v1_group",
    "release_v1_subtree",
    "own_cgroup_dir",
    "rmdir_tree",
    "make_subtree",
    "claim_subtree",
    "lock_dir",
    "delegated",
    "remove_stale_subtrees",
    "v1_controller_dir",
    "own_v1_dir",
    "claim_v1_subtree",
]

logger = logging.getLogger(__name__)


def own_cgroup_dir(kernel: Kernel = LINUX) -> Path | None:
    """This process's cgroup v2 directory, or None without a usable cgroup2 mount."""
    mount = kernel.cgroup2_mount()
    own = kernel.cgroup(kernel.own_ids()[0])
    if mount is None or own is None:
        return None
    point, root = mount
    if root != "/" and own.startswith(root):
        own = own[len(root) :]
    return point / own.lstrip("/")


def rmdir_tree(path: Path) -> bool:
    """rmdir a cgroup and the cgroups below it, deepest first; True if all went."""
    ok = True
    for dirpath, _dirs, _files in os.walk(path, topdown=False):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError as exc:
            ok = False
            logger.debug("cgroup %s not removed: %s", dirpath, exc)
    return ok


# The daemon's own leaf beside its runs' subtree in a delegated cgroup v2 (``_placement``:
# the name systemd's delegation notes suggest for a manager beside its payloads).
LEAF: Final = "supervisor"


def base_of(own: Path) -> Path:
    """The delegated cgroup whose subtrees are the daemon's: ``own``, or its parent where
    ``own`` is the daemon's leaf (``LEAF``: a daemon started in it, or moved there)."""
    parent = own.parent
    if own.name == LEAF and (parent / "cgroup.procs").exists() and delegated(parent):
        return parent
    return own


def make_subtree(instance: str, *, kernel: Kernel = LINUX) -> tuple[Path, int] | None:
    """Create and lock ``<base>/agentd-<instance>``; None (logged) when not possible.

    ``base`` is the daemon's own cgroup, or its parent where the daemon was started in
    its leaf (``base_of``). The daemon may stay in ``base`` beside its subtree
    while no domain controller is enabled there (measured: a process in a non-root
    cgroup whose child holds another works while ``cgroup.subtree_control`` is empty, or
    holds only threaded controllers); for a per-run memory limit it moves into its leaf
    first (``_placement.move_into_leaf``, by ``Containment.setup``).
    """
    own = own_cgroup_dir(kernel)
    if own is None:
        logger.info("no cgroup2 mount: trees are contained by subreaper and sweep")
        return None
    own = base_of(own)
    if not delegated(own):
        logger.warning("cgroup %s belongs to systemd and is not delegated (Delegate=yes missing?): no cgroups", own)
        return None
    remove_stale_subtrees(own, kernel=kernel)
    made = claim_subtree(own, instance)
    if made is not None and not (made[0] / "cgroup.kill").exists():
        logger.info("cgroup.kill missing (kernel < 5.14): the final kill walks cgroup.procs")
    return made


def claim_subtree(own: Path, instance: str) -> tuple[Path, int] | None:
    """mkdir ``own/agentd-<instance>`` and hold its lock; None (logged) if that fails."""
    root = own / f"agentd-{instance}"
    for _ in range(3):
        try:
            root.mkdir(exist_ok=True)
        except OSError as exc:
            logger.info("cannot create cgroup %s (%s): trees are contained by subreaper and sweep", root, exc)
            return None
        fd = lock_dir(root)
        if fd is None:
            logger.warning("cgroup %s is locked by another process: not using it", root)
            return None
        # Another daemon's clean-up may have removed it between the mkdir and the lock
        # (it was empty and unlocked then): the lock must be on what the name now names.
        try:
            if os.stat(root).st_ino == os.fstat(fd).st_ino:
                return root, fd
        except OSError:
            pass
        os.close(fd)
    logger.warning("cgroup %s keeps vanishing: trees are contained by subreaper and sweep", root)
    return None


def lock_dir(path: Path) -> int | None:
    """An fd holding an exclusive flock on the directory ``path``; None if it is held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def delegated(own: Path) -> bool:
    """May we create cgroups below ``own``? Not in a systemd unit's cgroup without Delegate=."""
    if not any(part.endswith((".service", ".scope")) for part in own.parts):
        return True  # not a systemd unit: the root of a container or of this host
    for name in ("trusted.delegate", "user.delegate"):  # set by systemd >= 251 on delegation
        try:
            if os.getxattr(own, name) == b"1":
                return True
        except OSError:
            continue
    return False


def remove_stale_subtrees(own: Path, *, kernel: Kernel = LINUX) -> None:
    """rmdir empty ``agentd-*`` subtrees no live daemon owns (nobody holds their lock).

    A subtree that still holds processes stays: a restarted daemon re-adopts or sweeps them.
    """
    try:
        names = [d.name for d in own.iterdir() if d.is_dir() and d.name.startswith("agentd-")]
    except OSError:
        return
    for name in names:
        path = own / name
        fd = lock_dir(path)
        if fd is None:
            continue  # a live daemon's, in this PID namespace or another
        try:
            if not kernel.cgroup_pids(path):
                rmdir_tree(path)
        finally:
            os.close(fd)


def own_v1_dir(controller: str, given: Path | None | bool = True) -> Path | None:
    """This process's group in the cgroup v1 hierarchy of ``controller``
    (``v1_controller_dir`` of ``/proc/self``) when ``given`` is True, else ``given`` (a
    directory a test names, or None for none)."""
    if given is not True:
        return given if isinstance(given, Path) else None
    return v1_controller_dir(controller, read_text(Path("/proc/self/cgroup")), read_text(Path("/proc/self/mountinfo")))


def v1_controller_dir(controller: str, cgroup_text: str, mountinfo_text: str) -> Path | None:
    """The directory of a process's group in the cgroup v1 hierarchy of ``controller``
    (``pids``, ``memory``): from its ``/proc/<pid>/cgroup`` (the ``N:<controller>:/path``
    line) and ``/proc/<pid>/mountinfo`` (a ``cgroup`` mount whose options name it); None
    without that v1 hierarchy, or when it is not mounted in this namespace at or above
    the group."""
    own: str | None = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] != "0" and controller in parts[1].split(","):
            own = parts[2]
            break
    if own is None:
        return None
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        if controller not in tail[2].split(","):
            continue
        root, point = fields[3], fields[4]
        if own != root and not own.startswith(root.rstrip("/") + "/"):
            return None  # mounted below our group: not ours to see
        rel = posixpath.relpath(own, root)
        return Path(point) if rel == "." else Path(point) / rel
    return None


def claim_v1_subtree(own: Path, instance: str, *, kernel: Kernel = LINUX) -> tuple[Path, int] | None:
    """The daemon's ``own/agentd-<instance>`` in a v1 hierarchy (``own``: its group
    there), made and locked after the stale ones are removed, as ``make_subtree`` does in
    v2; None where ``own`` is not writable or the subtree cannot be made."""
    if not os.access(own, os.W_OK):
        return None
    remove_stale_subtrees(own, kernel=kernel)
    return claim_subtree(own, instance)


def remove_v1_group(group: Path, own_root: Path | None) -> bool:
    """rmdir a tree's group in a v1 subtree (the per-run limits'); True if nothing is left.
    A re-adopted tree's group sits in an earlier daemon's subtree: that goes too once
    empty and unlocked (never ``own_root``, this daemon's, which lives on)."""
    ok = rmdir_tree(group)
    parent = group.parent
    if ok and parent != own_root and parent.name.startswith("agentd-"):
        fd = lock_dir(parent)
        if fd is not None:
            try:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # refused while other groups are in it
            finally:
                os.close(fd)
    return ok


def release_v1_subtree(root: Path | None, lock: int | None, what: str) -> None:
    """Remove this daemon's (empty) v1 subtree ``root`` and drop its ``lock``."""
    if root is not None and not rmdir_tree(root):
        logger.warning("%s subtree %s not removed: processes are still in it", what, root)
    if lock is not None:
        os.close(lock)


def read_text(path: str | os.PathLike[str]) -> str:
    """A cgroup (or /proc) file's text; "" when it cannot be read (gone, say)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def write_value(path: str | os.PathLike[str], data: bytes) -> None:
    """One write to a cgroup file (its kernel handler takes it whole). Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
