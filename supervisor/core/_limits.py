"""A run's per-run limits in its receipt, read once its tree is dead: ``pids`` (its pids
group, ``supervisor/trees/_pidslimit.py``) and ``memory`` (its memory group,
``supervisor/trees/_memlimit.py``); a run that hit one is named in the log."""

from __future__ import annotations

import logging
from typing import Any

from supervisor.core._run import Run
from supervisor.trees.containment import Containment

__all__ = ["add_pids", "add_memory"]

logger = logging.getLogger("supervisor.core._lifecycle")


def add_pids(containment: Containment, run: Run, receipt: dict[str, Any]) -> None:
    """The run's per-run pids limit in its receipt (``pids``: max, peak, hit), read
    once its tree is dead; a run whose forks hit it says so in the log too."""
    if run.tree is None:
        return
    try:
        pids = containment.pids_report(run.tree)
    except OSError:
        return
    if pids is None:
        return
    receipt["pids"] = pids
    if pids["hit"]:
        logger.warning(
            "run %s: hit its pids limit (%d tasks): %d forks failed with EAGAIN",
            run.run_id,
            pids["max"],
            pids["hit"],
        )


def add_memory(containment: Containment, run: Run, receipt: dict[str, Any]) -> dict[str, Any] | None:
    """The run's per-run memory limit in its receipt (``memory``: max, peak, failcnt,
    oom_kills, in bytes), read once its tree is dead; a run whose group saw an OOM kill
    says so in the log too. Returns what it added (None: no group)."""
    if run.tree is None:
        return None
    try:
        memory = containment.memory_report(run.tree)
    except OSError:
        return None
    if memory is None:
        return None
    receipt["memory"] = memory
    if memory["oom_kills"]:
        logger.warning(
            "run %s: hit its memory limit (%d MiB): the kernel's OOM killer killed %d of its processes",
            run.run_id,
            memory["max"] >> 20,
            memory["oom_kills"],
        )
    elif memory["failcnt"]:
        logger.info(
            "run %s: reached its memory limit (%d MiB) %d times", run.run_id, memory["max"] >> 20, memory["failcnt"]
        )
    return memory
