"""Windows tree kills: ``taskkill`` command lines, and path A and B with them.

``/T`` ends the process and every process it started; ``/F`` forces it (a soft
``taskkill`` asks windowed processes to close and console ones may ignore it). The
command builders are pure; ``fire`` (path A) and ``terminate`` (path B) run them for
``supervisor.trees.process``.
"""

from __future__ import annotations

import logging
import subprocess

import trio

from supervisor.trees._handles import AnyTree, SignalSent, StopReceipt, Tree

__all__ = ["soft_kill_command", "hard_kill_command", "fire", "terminate"]

logger = logging.getLogger(__name__)


def _check_pid(pid: int) -> str:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"expected a positive process id, got {pid!r}")
    return str(pid)


def soft_kill_command(pid: int) -> list[str]:
    """Path A: ask the tree rooted at ``pid`` to end (``taskkill /T /PID n``)."""
    return ["taskkill", "/T", "/PID", _check_pid(pid)]


def hard_kill_command(pid: int) -> list[str]:
    """Path B's escalation: force the whole tree down (``taskkill /F /T /PID n``)."""
    return ["taskkill", "/F", "/T", "/PID", _check_pid(pid)]


_fired: list[subprocess.Popen[bytes]] = []  # fire-and-forget taskkills, kept until done


def fire(cmd: list[str]) -> str:
    """Start ``cmd`` and do not wait for it (path A); keep its handle until it is done."""
    _fired[:] = [p for p in _fired if p.poll() is None]
    try:
        _fired.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    except OSError as exc:
        return f"{' '.join(cmd)}: {exc}"
    return f"{' '.join(cmd)}: sent"


async def terminate(tree: AnyTree, grace_s: float, r: StopReceipt, *, kill_wait_s: float) -> None:
    """Path B on Windows: ``taskkill /T``, the grace, ``taskkill /F /T``, a bounded wait."""

    def at() -> float:
        return round(trio.current_time() - r.started_at, 4)

    async def run(cmd: list[str], name: str) -> None:
        try:
            done = await trio.run_process(cmd, check=False, capture_stdout=True, capture_stderr=True)
            result = "sent" if done.returncode == 0 else f"exit {done.returncode}"
        except OSError as exc:
            result = f"error: {exc}"
        r.signals.append(SignalSent(name, "tree", str(tree.pid), at(), result))

    if not isinstance(tree, Tree):  # no handle on a re-adopted tree's exit: force it
        await run(hard_kill_command(tree.pid), "taskkill /F")
        return
    if tree.process.returncode is None:
        await run(soft_kill_command(tree.pid), "taskkill")
        with trio.move_on_after(grace_s):
            await tree.process.wait()
        r.waited_s = at()
    r.leader = "exited" if tree.process.returncode is not None else "killed"
    r.escalated = tree.process.returncode is None
    if r.escalated:
        logger.warning("tree %s: pid %d ignored taskkill for %.1f s; forcing", tree.tree_id, tree.pid, r.waited_s)
    await run(hard_kill_command(tree.pid), "taskkill /F")
    with trio.move_on_after(kill_wait_s):
        await tree.process.wait()
    if tree.process.returncode is not None:
        r.tree_dead_at = trio.current_time()
        r.tree_dead_after_s = at()
    else:
        r.survivors = [{"pid": tree.pid, "cmdline": "", "state": "?"}]
