"""A per-run memory limit: each tree's processes in a memory cgroup of their own.

A run that allocates without end (a prompt-injected command, a runaway browser tab) meets
``config.run_memory_max_mib`` in its own cgroup: the kernel reclaims there, then its OOM
killer kills a process of that cgroup (the largest: usually the allocator), never the
daemon or another run. Every process of the tree is in it (as in its pids group,
``_pidslimit``: a cgroup is left only by exiting or by a write the run's sandbox cannot
make). What it counted goes into the run's receipt (``memory``: max, peak, failcnt,
oom_kills); a runner the OOM killer killed ends its run ``failed``, ``memory_limit``.

Where, best first (chosen once, at start, and logged once):

- ``v2``: the tree's own cgroup v2 (``containment``), ``memory.max`` = the limit and
  ``memory.swap.max`` 0 (where swap is accounted: a run must not page its excess out
  instead), written before its runner is born in it. Memory is a domain controller: the
  daemon's delegated cgroup (a systemd unit with ``Delegate=yes``) must offer it, and
  ``+memory`` goes into that cgroup's and the subtree's ``cgroup.subtree_control`` once
  the daemon has moved itself out into its leaf (``_placement``: the no-internal-process
  rule). ``memory.oom.group`` stays 0, as in v1: the OOM killer kills the largest process,
  so a command that allocates without end dies and its run goes on (the model sees the
  command killed); a run is ended whole only when its runner is the one killed. The
  receipt reads ``memory.max``, ``memory.peak`` (kernel >= 5.19) and ``memory.events``
  (``max``: charges its limit refused, ``oom_kill``), hierarchical, so the run's call
  cgroups (``subagent/callgroups.py``) count too.
- ``v1``: ``<the daemon's v1 memory cgroup>/agentd-<instance>/<tree id>`` on a hybrid host,
  a subtree the daemon owns as it owns its v1 pids one (``_cgroupfs.claim_v1_subtree``:
  same name, a flock held for its life, stale subtrees of dead daemons removed at start
  only when their lock can be taken and they hold no process). Below the daemon's own
  group, never at the hierarchy's root: a run's memory still counts against whatever
  limit the host put on the daemon (``memory.use_hierarchy``). The runner joins it before
  it runs a single instruction of its run, with its v1 pids group (the cold spawn's
  preexec hook, the zygote's child: ``memory_procs``). ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap is accounted) = the limit.
- none: no limit (logged once); a spawn never fails for want of one.

Pages a zygote-forked runner shares with the zygote stay charged to the zygote's cgroup
(in both versions a page is charged to the cgroup that first touched it); what the run
allocates is charged to the run.

Sends no signal: the kernel's OOM killer does, inside the cgroup.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

from subagent.osedge import LINUX, Kernel
from supervisor.trees import _cgroupfs, _placement

__all__ = ["V1", "V2", "MemoryLimit", "v1_memory_dir"]

logger = logging.getLogger(__name__)

V1: Final = "v1"
V2: Final = "v2"
MIB: Final = 1 << 20


def v1_memory_dir(cgroup_text: str, mountinfo_text: str) -> Path | None:
    """The directory of a process's cgroup v1 memory group (``_cgroupfs.v1_controller_dir``)."""
    return _cgroupfs.v1_controller_dir("memory", cgroup_text, mountinfo_text)


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


@final
@dataclass(eq=False)
class MemoryLimit:
    """The daemon's per-tree memory cgroups (see the module docstring).

    Attributes:
        limit_mib: each tree's ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) in
            MiB; 0: no limit.
        mode: ``"v2"``, ``"v1"`` or None (no limit).
        root: the v1 subtree (``.../agentd-<instance>``) in mode ``"v1"``, else None.
    """

    limit_mib: int
    mode: str | None = None
    root: Path | None = None
    _lock: int | None = None
    _warned: bool = False

    @property
    def limit_bytes(self) -> int:
        return self.limit_mib * MIB

    @classmethod
    def setup(
        cls,
        limit_mib: int,
        *,
        instance: str,
        kernel: Kernel = LINUX,
        v1_own: Path | None | bool = True,
        v2_root: Path | None = None,
    ) -> MemoryLimit:
        """Choose where trees' limits live: ``+memory`` in the v2 subtree where offered
        and accepted, else the v1 subtree where the v1 memory hierarchy is writable.
        Blocking. Never raises: no limit then, said in one log line.

        Args:
            limit_mib: ``config.run_memory_max_mib`` (0: off, nothing made).
            instance: the subtree's name is ``agentd-<instance>`` (the v2 one's).
            v2_root: the daemon's v2 subtree (``Containment.root``), or None; the daemon
                must have left its parent for the kernel to accept ``+memory`` there.
            v1_own: the daemon's v1 memory cgroup directory; True: found from
                ``/proc/self`` (tests pass a directory, or None for none).
        """
        self = cls(limit_mib=max(0, limit_mib))
        if self.limit_mib == 0:
            return self
        if v2_root is not None and _placement.enable("memory", v2_root.parent, v2_root):
            self.mode = V2
            logger.info("per-run memory limit %d MiB: memory.max of each run's cgroup v2", self.limit_mib)
            return self
        own = _cgroupfs.own_v1_dir("memory", v1_own)
        if isinstance(own, Path):
            made = _cgroupfs.claim_v1_subtree(own, instance, kernel=kernel)
            if made is not None:
                self.root, self._lock = made
                with contextlib.suppress(OSError):  # the default on cgroup v1 >= 5.x anyway
                    if _cgroupfs.read_text(own / "memory.use_hierarchy").strip() == "0":
                        _cgroupfs.write_value(self.root / "memory.use_hierarchy", b"1")
                self.mode = V1
                logger.info(
                    "per-run memory limit %d MiB: a cgroup v1 memory group per run under %s", self.limit_mib, self.root
                )
                return self
        logger.warning(
            "no per-run memory limit (run_memory_max_mib %d): the daemon's cgroup v2 subtree has no memory "
            "controller (not offered, or the daemon is not alone in its delegated cgroup: docs/dev/PROCESS.md) "
            "and no cgroup v1 memory hierarchy is writable; a run that allocates without end meets only the "
            "host's limit",
            self.limit_mib,
        )
        return self

    def restore(self, v2_root: Path) -> None:
        """``+memory`` again in a v2 subtree made again (``Containment.check_subtree``)."""
        if self.mode == V2 and not _placement.enable("memory", v2_root.parent, v2_root):
            self._warn(f"memory controller not enabled again in {v2_root}")

    def prepare(self, tree_id: str, cgroup: Path | None = None) -> tuple[Path | None, Path | None]:
        """A new tree's limit, made before its runner exists: (the directory whose
        ``memory.*`` files are the tree's, the v1 group its runner must join). v2: writes
        in the tree's cgroup ``cgroup``; v1: a mkdir and a write (two where swap is
        accounted). (None, None): no limit for this tree (logged once)."""
        if self.mode == V2 and cgroup is not None:
            try:
                _cgroupfs.write_value(cgroup / "memory.max", str(self.limit_bytes).encode())
                with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to bound
                    _cgroupfs.write_value(cgroup / "memory.swap.max", b"0")
                return cgroup, None
            except OSError as exc:
                self._warn(f"cannot set {cgroup}/memory.max ({exc})")
                return None, None
        if self.mode != V1 or self.root is None:
            return None, None
        path = self.root / tree_id
        try:
            with contextlib.suppress(FileExistsError):
                path.mkdir()
            limit = str(self.limit_bytes).encode()
            _cgroupfs.write_value(path / "memory.limit_in_bytes", limit)
            memsw = path / "memory.memsw.limit_in_bytes"
            with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to bound
                _cgroupfs.write_value(memsw, limit)  # swap too: a run must not page its excess out instead
            return path, path
        except OSError as exc:
            self._warn(f"cannot make memory group {path} ({exc})")
            with contextlib.suppress(OSError):
                path.rmdir()
        return None, None

    def describe(self) -> dict[str, Any]:
        """For ``status``: ``{"max_mib", "mode", "subtree"}`` (``mode`` None: no limit)."""
        return {
            "max_mib": self.limit_mib,
            "mode": self.mode,
            "subtree": str(self.root) if self.root is not None else None,
        }

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("per-run memory limit: %s; such runs have none (said once)", what)

    def group_of(self, tree_id: str, cgroup: Path | None) -> Path | None:
        """Where a re-adopted tree's group is, by the names its daemon gave it (the v1
        subtree named as the daemon's v2 subtree that holds ``cgroup``); None if none."""
        if cgroup is None:
            return None
        if self.mode == V2:
            return cgroup if (cgroup / "memory.max").exists() else None
        if self.mode != V1 or self.root is None:
            return None
        if not cgroup.parent.name.startswith("agentd-"):
            return None
        path = self.root.parent / cgroup.parent.name / tree_id
        return path if path.is_dir() else None

    def report(self, group: Path | None) -> dict[str, Any] | None:
        """The tree's ``{"max", "peak", "failcnt", "oom_kills"}`` (bytes; ``failcnt``:
        charges its limit refused, each then reclaimed or OOM-killed for; ``oom_kills``:
        processes the kernel's OOM killer killed in it, None where the kernel does not
        count them), read once its processes are gone; None without a group."""
        if group is None:
            return None
        if (group / "memory.max").exists():
            return _report_v2(group, self.limit_bytes)
        limit = _int(_cgroupfs.read_text(group / "memory.limit_in_bytes"))
        if limit is None:
            return None  # gone already
        oom_kills: int | None = None
        for line in _cgroupfs.read_text(group / "memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                oom_kills = _int(value)
        return {
            "max": limit,
            "peak": _int(_cgroupfs.read_text(group / "memory.max_usage_in_bytes")),
            "failcnt": _int(_cgroupfs.read_text(group / "memory.failcnt")) or 0,
            "oom_kills": oom_kills,
        }

    def remove(self, group: Path | None, cgroup: Path | None = None) -> bool:
        """rmdir a tree's v1 group (a v2 one is its cgroup, which goes with the tree); True
        if nothing is left. A re-adopted tree's group sits in an earlier daemon's subtree:
        that goes too once empty and unlocked."""
        if group is None or group == cgroup:
            return True
        return _cgroupfs.remove_v1_group(group, self.root)

    def close(self) -> None:
        """Remove the (empty) v1 subtree and drop its lock. Idempotent."""
        _cgroupfs.release_v1_subtree(self.root, self._lock, "memory")
        self._lock = None


def _report_v2(cgroup: Path, limit_bytes: int) -> dict[str, Any] | None:
    """A v2 tree's ``{"max", "peak", "failcnt", "oom_kills"}`` (see ``MemoryLimit.report``):
    ``memory.max``, ``memory.peak`` (None before kernel 5.19) and ``memory.events``
    (``max``, ``oom_kill``; hierarchical: its call cgroups count)."""
    text = _cgroupfs.read_text(cgroup / "memory.max").strip()
    if not text:
        return None  # gone already
    events: dict[str, int] = {}
    for line in _cgroupfs.read_text(cgroup / "memory.events").splitlines():
        key, _, value = line.partition(" ")
        number = _int(value)
        if number is not None:
            events[key] = number
    return {
        "max": _int(text) or limit_bytes,
        "peak": _int(_cgroupfs.read_text(cgroup / "memory.peak")),
        "failcnt": events.get("max", 0),
        "oom_kills": events.get("oom_kill"),
    }
