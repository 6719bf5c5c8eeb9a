"""A per-run process limit: each tree in a pids group of its own, ``pids.max`` = the limit.

A run that forks without end (a fork bomb a prompt-injected command started) then fails
its own forks (EAGAIN, counted in its group's ``pids.events``) at ``config.run_pids_max``
tasks (threads count), and the other runs and the daemon can still fork. Every process of
the tree is in the group, whatever it does: a process leaves a pids group only by exiting
or by a write to ``cgroup.procs`` the run's sandbox cannot make (its calls' own v2 cgroups,
``subagent/callgroups.py``, are below the tree's v2 cgroup, and moves in the v2 hierarchy
leave the v1 one alone).

Where the group is, best first (chosen once, at start, and logged once):

- ``v2``: the tree's own cgroup v2 (``containment``), where the daemon's v2 subtree offers
  the pids controller (a systemd unit with ``Delegate=yes``). ``+pids`` is enabled in the
  daemon's delegated cgroup and in its subtree: pids is a threaded controller, so the
  kernel would let the daemon stay beside its subtree (the no-internal-process rule binds
  domain controllers only), though with limits on it has moved into its leaf anyway for
  the memory limit (``_placement``); where the kernel refuses (EBUSY), the next is tried.
  A tree's limit is one write (``pids.max``) before its runner is born in that cgroup. The
  subtree as a whole gets ``pids.max`` = the service's task bound (``TasksMax=``) less a
  reserve for the daemon (``_placement.reserve_tasks``): runs at their limits together
  cannot take the daemon's last tasks.
- ``v1``: a hybrid host whose v1 pids hierarchy is mounted: a group
  ``<the daemon's v1 pids cgroup>/agentd-<instance>/<tree id>``, a subtree the daemon owns
  as it owns its v2 one (``_cgroupfs``: same name, a flock held for its life, stale
  subtrees of dead daemons removed at start only when their lock can be taken and they hold
  no process). The runner joins it before it runs a single instruction of its run (the cold
  spawn's preexec hook, the zygote's fork: ``pids_procs``). Cost: a mkdir and a write at
  the spawn, and the join, a write to ``cgroup.procs`` (a v1 move waits for an RCU grace
  period when cgroups were quiet: measured 20-30 ms here, 4 ms back to back; a spare
  runner makes it ahead, off the spawn's path).
- none: no limit (logged once); a spawn never fails for want of one.

Sends no signal: a v1 pids group has no ``cgroup.kill``; the tree's v2 cgroup, groups and
marker end its processes (``process.py``), forkers included.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

from subagent.osedge import LINUX, Kernel
from supervisor.trees import _cgroupfs, _placement

__all__ = ["V1", "V2", "PidsLimit", "v1_pids_dir"]

logger = logging.getLogger(__name__)

V2: Final = "v2"
V1: Final = "v1"


def v1_pids_dir(cgroup_text: str, mountinfo_text: str) -> Path | None:
    """The directory of a process's cgroup v1 pids group: from its ``/proc/<pid>/cgroup``
    (the ``N:pids:/path`` line) and ``/proc/<pid>/mountinfo`` (a ``cgroup`` mount whose
    options name ``pids``); None without a v1 pids hierarchy, or when it is not mounted in
    this namespace at or above the group."""
    return _cgroupfs.v1_controller_dir("pids", cgroup_text, mountinfo_text)


@final
@dataclass(eq=False)
class PidsLimit:
    """The daemon's per-tree pids groups (see the module docstring).

    Attributes:
        limit: ``pids.max`` of each tree's group; 0: no limit.
        mode: ``"v2"``, ``"v1"`` or None (no limit).
        root: the v1 subtree (``.../agentd-<instance>``) in mode ``"v1"``, else None.
    """

    limit: int
    mode: str | None = None
    root: Path | None = None
    # ``pids.max`` of the whole v2 subtree (the service's task bound less the daemon's
    # reserve: ``_placement.reserve_tasks``), or None (no bound above it).
    runs_max: int | None = None
    _lock: int | None = None
    _warned: bool = False

    @classmethod
    def setup(
        cls,
        limit: int,
        *,
        v2_root: Path | None,
        instance: str,
        kernel: Kernel = LINUX,
        v1_own: Path | None | bool = True,
    ) -> PidsLimit:
        """Choose where trees' limits live and make the v1 subtree when that is where.
        Blocking. Never raises: no limit then, said in one log line.

        Args:
            limit: ``config.run_pids_max`` (0: off, nothing made).
            v2_root: the daemon's v2 subtree (``Containment.root``), or None.
            instance: the subtree's name is ``agentd-<instance>`` (the v2 one's).
            v1_own: the daemon's v1 pids cgroup directory; True: found from
                ``/proc/self`` (tests pass a directory, or None for none).
        """
        self = cls(limit=max(0, limit))
        if self.limit == 0:
            return self
        if v2_root is not None and _placement.enable("pids", v2_root.parent, v2_root):
            self.mode = V2
            logger.info("per-run pids limit %d: pids.max of each run's cgroup v2", self.limit)
            mount = kernel.cgroup2_mount()
            self.runs_max = _placement.reserve_tasks(v2_root.parent, v2_root, mount=mount[0] if mount else None)
            return self
        own = _cgroupfs.own_v1_dir("pids", v1_own)
        if isinstance(own, Path):
            made = _cgroupfs.claim_v1_subtree(own, instance, kernel=kernel)
            if made is not None:
                self.root, self._lock = made
                self.mode = V1
                logger.info("per-run pids limit %d: a cgroup v1 pids group per run under %s", self.limit, self.root)
                return self
        logger.warning(
            "no per-run pids limit (run_pids_max %d): neither the cgroup v2 subtree offers the pids "
            "controller nor is a cgroup v1 pids hierarchy writable; a run that forks without end can "
            "starve the others",
            self.limit,
        )
        return self

    def restore(self, v2_root: Path) -> None:
        """The v2 limit again in a subtree made again (``Containment.check_subtree``):
        ``+pids`` and its tasks bound, which a fresh cgroup lacks. Blocking; logged."""
        if self.mode == V2 and not _placement.enable("pids", v2_root.parent, v2_root):
            self._warn(f"pids controller not enabled again in {v2_root}")
        elif self.mode == V2 and self.runs_max is not None:
            self.runs_max = _placement.reserve_tasks(v2_root.parent, v2_root)

    def prepare(self, tree_id: str, cgroup: Path | None) -> tuple[Path | None, Path | None]:
        """The limit of a new tree, made before its runner exists: (the directory whose
        ``pids.*`` files are the tree's, the v1 group its runner must join). Blocking:
        a mkdir and a write. (None, None): no limit for this tree (logged once)."""
        if self.mode == V2 and cgroup is not None:
            try:
                _cgroupfs.write_value(cgroup / "pids.max", str(self.limit).encode())
                return cgroup, None
            except OSError as exc:
                self._warn(f"cannot set {cgroup}/pids.max ({exc})")
                return None, None
        if self.mode == V1 and self.root is not None:
            path = self.root / tree_id
            try:
                with contextlib.suppress(FileExistsError):
                    path.mkdir()
                _cgroupfs.write_value(path / "pids.max", str(self.limit).encode())
                return path, path
            except OSError as exc:
                self._warn(f"cannot make pids group {path} ({exc})")
                with contextlib.suppress(OSError):
                    path.rmdir()
        return None, None

    def describe(self) -> dict[str, Any]:
        """For ``status``: ``{"max", "mode", "subtree", "runs_max"}`` (``mode`` None: no
        limit; ``runs_max``: all runs' tasks together, v2, where the service is bounded)."""
        return {
            "max": self.limit,
            "mode": self.mode,
            "subtree": str(self.root) if self.root is not None else None,
            "runs_max": self.runs_max,
        }

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("per-run pids limit: %s; such runs have none (said once)", what)

    def group_of(self, tree_id: str, cgroup: Path | None) -> Path | None:
        """Where a re-adopted tree's limit is, by the names its daemon gave it (the v1
        subtree of the daemon whose v2 subtree holds ``cgroup``); None if none is there."""
        if cgroup is None:
            return None
        if self.mode == V2:
            return cgroup if (cgroup / "pids.max").exists() else None
        if self.mode == V1 and self.root is not None and cgroup.parent.name.startswith("agentd-"):
            path = self.root.parent / cgroup.parent.name / tree_id
            return path if path.is_dir() else None
        return None

    def report(self, pids_dir: Path | None) -> dict[str, Any] | None:
        """The tree's ``{"max", "peak", "hit"}`` (``hit``: forks refused at its limit,
        ``pids.events``), read once its processes are gone; None without a group."""
        if pids_dir is None:
            return None
        hit: int | None = None
        for line in _cgroupfs.read_text(str(pids_dir / "pids.events")).splitlines():
            key, _, value = line.partition(" ")
            if key == "max" and value.strip().isdigit():
                hit = int(value)
        peak = _cgroupfs.read_text(str(pids_dir / "pids.peak")).strip()
        limit = _cgroupfs.read_text(str(pids_dir / "pids.max")).strip()
        if hit is None and not limit:
            return None  # gone already
        return {
            "max": int(limit) if limit.isdigit() else self.limit,
            "peak": int(peak) if peak.isdigit() else None,
            "hit": hit or 0,
        }

    def remove(self, pids_dir: Path | None, cgroup: Path | None) -> bool:
        """rmdir a tree's v1 group (a v2 one goes with its cgroup); True if nothing is left.
        A re-adopted tree's group sits in an earlier daemon's subtree: that goes too once
        empty and unlocked."""
        if pids_dir is None or pids_dir == cgroup:
            return True
        return _cgroupfs.remove_v1_group(pids_dir, self.root)

    def close(self) -> None:
        """Remove the (empty) v1 subtree and drop its lock. Idempotent."""
        _cgroupfs.release_v1_subtree(self.root, self._lock, "pids")
        self._lock = None
