"""The daemon's own place in a delegated cgroup v2: a leaf beside its runs' subtree.

A delegated cgroup (a systemd unit with ``Delegate=yes``, or a container's cgroup
namespace root) is the daemon's ``base``. Its runs live in ``<base>/agentd-<instance>/
<tree id>`` (``_cgroupfs``). To give each run's cgroup a *domain* controller's limit
(``memory.max``: ``_memlimit``), ``+memory`` must be written to the ``cgroup.subtree_control``
of ``base`` and of the subtree, and the kernel refuses the first while any process sits in
``base`` itself (EBUSY, the no-internal-process rule; threaded controllers like ``pids``
are exempt, ``_pidslimit``). So, where runs are to get limits, the daemon first moves
itself into the leaf ``<base>/supervisor`` (``LEAF``; the name systemd's delegation notes
suggest for a manager beside its payloads, and what ``DelegateSubgroup=supervisor`` of
systemd >= 254 would start it in). It moves only itself (one write of its pid to
``cgroup.procs`` moves all its threads), at start, before it forks anything (the zygote,
runners): so only when it is alone in ``base`` (under systemd: control processes of a
delegated unit run in ``.control``, never in ``base``), and never out of the hierarchy's
root (which has no ``cgroup.type``: exempt from the rule, and not ours). Otherwise it
stays, and only the limits that need no move are there (logged once).

What relies on the daemon's placement stays true: the runs' subtree is still
``<base>/agentd-<instance>`` (the peer check, ``control/_peer_cgroup.py``, walks it; the
sweeps place processes by it; stale subtrees are found in ``base``), and the daemon's own
processes (it, its zygote) are outside it, in the leaf. A daemon started again (systemd
gives it a fresh ``base``; elsewhere the leaf may still exist, with an earlier daemon's
dying processes in it) starts in ``base`` or, where it was started in a leaf, takes the
leaf's parent for ``base`` (``base_of``): it finds the same subtrees either way. It leaves
the leaf only by exiting (systemd removes the unit's cgroups once it is down).

The service's tasks (``TasksMax=``: ``pids.max`` of ``base``, or of a cgroup above it)
are shared by the daemon and every run: with the pids controller on the runs' subtree,
the subtree gets ``pids.max`` = that bound less ``tasks_reserve`` (``reserve_tasks``), so
runs at their limits together still leave the daemon room to fork and start threads.

Sends no signal; blocking (cgroupfs reads and writes), called from ``Containment.setup``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from subagent.osedge import LINUX, Kernel
from supervisor.trees import _cgroupfs
from supervisor.trees._cgroupfs import LEAF, base_of

__all__ = ["LEAF", "TASKS_RESERVE", "base_of", "enable", "move_into_leaf", "reserve_tasks", "tasks_reserve"]

logger = logging.getLogger(__name__)

# Tasks (processes and threads) kept for the daemon out of the service's bound: its
# threads (Trio's worker threads, ~40 at most), its zygote and whatever it forks besides
# runs; a quarter of the bound where that is smaller.
TASKS_RESERVE: Final = 256


def move_into_leaf(base: Path, *, kernel: Kernel = LINUX) -> Path | None:
    """Move this process into ``<base>/LEAF`` (made if missing); the leaf, or None (said
    in one log line) where the daemon stays: in the hierarchy's root, not alone in
    ``base``, or a write refused. Already there: the leaf, nothing written."""
    leaf = base / LEAF
    me = kernel.own_ids()[0]
    own = _cgroupfs.own_cgroup_dir(kernel)
    if own == leaf:
        return leaf
    if not (base / "cgroup.type").exists():
        logger.info("cgroup %s is the hierarchy's root: the daemon stays in it (no per-run memory limit in v2)", base)
        return None
    procs = _cgroupfs.read_text(base / "cgroup.procs").split()
    others = [p for p in procs if p != str(me)]
    if others:
        logger.warning(
            "cgroup %s holds %d processes besides the daemon: it stays there, so the subtree's runs get no "
            "domain controller (no per-run memory limit in cgroup v2); start it alone in its cgroup "
            "(a systemd unit with Delegate=yes)",
            base,
            len(others),
        )
        return None
    try:
        leaf.mkdir(exist_ok=True)
        _cgroupfs.write_value(leaf / "cgroup.procs", str(me).encode())
    except OSError as exc:
        logger.warning("cannot move the daemon into %s (%s): it stays in %s", leaf, exc, base)
        return None
    logger.info("daemon moved into its leaf cgroup %s (its runs' subtrees beside it)", leaf)
    return leaf


def enable(controller: str, base: Path, root: Path) -> bool:
    """``+controller`` in ``base``'s and ``root``'s ``cgroup.subtree_control`` (where it is
    not yet): each cgroup below ``root`` then has its files. False (nothing changed but
    what the kernel accepted) where ``base`` is not offered it or a write is refused."""
    if controller not in _cgroupfs.read_text(base / "cgroup.controllers").split():
        return False
    for path in (base, root):
        if controller in _cgroupfs.read_text(path / "cgroup.subtree_control").split():
            continue
        try:
            _cgroupfs.write_value(path / "cgroup.subtree_control", f"+{controller}".encode())
        except OSError as exc:
            logger.info("%s controller not enabled in %s (%s)", controller, path, exc)
            return False
    return True


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def tasks_reserve(bound: int) -> int:
    """The daemon's share of a service's task bound (see ``TASKS_RESERVE``)."""
    return min(TASKS_RESERVE, bound // 4)


def reserve_tasks(base: Path, root: Path, *, mount: Path | None = None) -> int | None:
    """``pids.max`` of the runs' subtree ``root`` = the tightest ``pids.max`` of ``base``
    and the cgroups above it (up to ``mount``, the hierarchy's mount point) less
    ``tasks_reserve``; the value written, or None (no bound above, or the write refused:
    the runs then share the service's bound with the daemon, as before)."""
    bound: int | None = None
    path = base
    while True:
        value = _int(_cgroupfs.read_text(path / "pids.max"))
        if value is not None:
            bound = value if bound is None else min(bound, value)
        if path == mount or path.parent == path or not (path.parent / "cgroup.procs").exists():
            break
        path = path.parent
    if bound is None:
        return None
    limit = max(1, bound - tasks_reserve(bound))
    try:
        _cgroupfs.write_value(root / "pids.max", str(limit).encode())
    except OSError as exc:
        logger.info("cannot bound the runs' tasks in %s (%s)", root, exc)
        return None
    logger.info(
        "runs' subtree %s: pids.max %d (the service's %d less %d for the daemon)", root, limit, bound, bound - limit
    )
    return limit
