"""What the live runs hold on a filesystem, and which of them to blame (the disk guard's
measurement: ``supervisor.core.diskguard``).

Blocking walks, run in a worker thread: a run's files (links not followed, other
filesystems not entered), their bytes and inodes, and the files its processes deleted but
keep open (through their ``/proc/<pid>/fd``).
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.config import Config
from supervisor.trees._handles import AnyTree

__all__ = [
    "BLAME_DIVISOR",
    "BLAME_MIN_BYTES",
    "BLAME_MIN_INODES",
    "Held",
    "choose_run",
    "min_free_inodes",
    "space_held",
    "usage_held",
    "deleted_held",
    "held_by_run",
]

logger = logging.getLogger("supervisor.core.diskguard")

# A run is blamed for a full disk only if it holds at least this share of the mark...
BLAME_DIVISOR: Final = 8
# ...and at least this much (or, for a filesystem low on inodes, this many of them).
BLAME_MIN_BYTES: Final = 1024 * 1024
BLAME_MIN_INODES: Final = 1024


def choose_run(held: Mapping[str, int], min_free: int, *, least: int = BLAME_MIN_BYTES) -> str | None:
    """The run to stop for a filesystem below its mark ``min_free`` (bytes, or inodes with
    ``least=BLAME_MIN_INODES``), given what each live run holds on it, or None.

    The run holding the most, if that is at least ``min_free / BLAME_DIVISOR`` and
    ``least``: a run holding less did not fill the disk, and stopping it would not bring
    the space back. On a tie, the run that came first in ``held``.
    """
    floor = max(least, min_free // BLAME_DIVISOR)
    worst: str | None = None
    for run_id, size in held.items():
        if size >= floor and (worst is None or size > held[worst]):
            worst = run_id
    return worst


def min_free_inodes(config: Config, total_bytes: int, total_inodes: int) -> int:
    """The low-water mark of a filesystem's free inodes: the share of its ``total_inodes``
    that its byte mark (``Config.min_free_bytes``) is of its ``total_bytes``. 0 for a
    filesystem that has no fixed number of inodes (btrfs says 0)."""
    if total_inodes <= 0 or total_bytes <= 0:
        return 0
    share = min(1.0, config.min_free_bytes(total_bytes) / total_bytes)
    return math.ceil(total_inodes * share)


def space_held(paths: Iterable[Path], dev: int) -> int:
    """Bytes the files under ``paths`` take on device ``dev`` (``usage_held``'s bytes)."""
    return usage_held(paths, dev)[0]


def usage_held(paths: Iterable[Path], dev: int) -> tuple[int, int]:
    """Bytes the files under ``paths`` take on device ``dev`` (allocated blocks), and the
    inodes they use there (a file with several links once). Blocking.

    Links are not followed and other filesystems are not entered; a path that is gone
    (or goes during the walk) counts nothing."""
    total = 0
    linked: set[int] = set()
    inodes = 0
    stack = [os.fspath(p) for p in paths]
    while stack:
        path = stack.pop()
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_dev != dev:
            continue
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            if st.st_ino in linked:
                continue
            linked.add(st.st_ino)
        inodes += 1
        total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            try:
                with os.scandir(path) as entries:
                    stack.extend(entry.path for entry in entries)
            except OSError:
                pass
    return total, inodes


def deleted_held(tree: AnyTree, dev: int, seen: set[tuple[int, int]]) -> int:
    """Bytes on device ``dev`` that the live processes of ``tree`` hold in files they
    deleted but keep open or mapped (``Kernel.deleted_files``), each inode not in ``seen`` (then
    added to it: how many were added is how many inodes they hold). Blocking (the tree's
    processes: its cgroup, or a scan of the table)."""
    table = tree.table
    total = 0
    try:
        members = table.members(tree.targets())
    except FileNotFoundError:  # its cgroup went with it: the tree ended while measured
        return 0
    except OSError:  # the table could not be read (out of descriptors): the walk still counts
        logger.warning("disk guard: the processes of tree %s could not be listed", tree.tree_id)
        return 0
    for pid, p in members.items():
        if p.dead:
            continue
        for key, size in (table.kernel.deleted_files(pid) or {}).items():
            if key[0] == dev and key not in seen:
                seen.add(key)
                total += size
    return total


@dataclass(frozen=True, slots=True)
class Held:
    """What the live runs hold on one filesystem, by run id."""

    bytes: dict[str, int]  # in all: their files, and what they deleted but keep open
    deleted: dict[str, int]  # of them, bytes in files deleted but kept open
    inodes: dict[str, int]  # in all, the same two parts


def held_by_run(paths: Mapping[str, list[Path]], trees: Mapping[str, AnyTree | None], dev: int) -> Held:
    """What each run holds on ``dev``."""
    seen: set[tuple[int, int]] = set()
    held = Held({}, {}, {})
    for run_id, p in paths.items():
        tree = trees.get(run_id)
        before = len(seen)
        held.deleted[run_id] = deleted_held(tree, dev, seen) if tree is not None else 0
        size, inodes = usage_held(p, dev)
        held.bytes[run_id] = size + held.deleted[run_id]
        held.inodes[run_id] = inodes + len(seen) - before
    return held
