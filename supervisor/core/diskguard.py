"""The disk guard: a run that fills the disk is stopped; the daemon and the other runs go on.

A run's writable space (its run dir with its ``TMPDIR``; its runner's events and result
files beside it; a session turn's browser profile) lies on the state dir's filesystem, or
the runs dir's, with no quota. A run that writes until the disk is full would make the
journal unwritable (the daemon degraded, every spawn refused) and leave the other runs no
room for their own files. ``DiskGuard`` stops that run instead:

- *when it looks*: a ``statvfs`` of each watched filesystem (the state dir's, the runs
  dir's) when the daemon is awake anyway: a journal write or a spawn (``poke``, at most
  once per ``POKE_S``), a journal write that fails (``journal_failed``: ENOSPC is one
  cause), and every ``TICK_S`` while runs are live (a command writing with ``dd`` makes no
  event). No run live: no timer, nothing to do on an idle daemon.
- *what it measures*: only when a filesystem has less free space than its low-water mark
  (``Config.min_free_bytes``: the larger of ``disk_min_free_mib`` and
  ``disk_min_free_percent`` of its size), or fewer free inodes than the same share of
  its inodes (``min_free_inodes``: a run that makes empty files without end takes no
  space, yet once the inodes are gone no run dir, no file of another run's can be made),
  each live run's space and inodes on it (``usage_held``: a walk of its files in a worker
  thread, links not followed, other filesystems not entered), and the files on it that
  the run's processes deleted but keep open or mapped (``deleted_held``: ``dd of=f & rm
  f`` takes the space from ``df`` and from any walk; it comes back only when the file is
  closed; a one-page mapping of it, its descriptor closed, holds it whole), each inode
  once.
- *whom it stops*: ``choose_run``: the run holding the most (bytes, or inodes when the
  inodes ran low), if it holds at least ``1/BLAME_DIVISOR`` of the mark (and
  ``BLAME_MIN_BYTES``, ``BLAME_MIN_INODES``). Less, and the space went
  elsewhere (the host's own files): stopping a run would not bring it back, so nobody is
  stopped and the daemon says so in its log. One stop at a time: the next check that may
  stop a run comes once the stopped run's directory is gone (its space back), or its
  removal was tried and failed, or was not tried ``REMOVAL_WAIT_S`` after the run's end
  (said in the log: its space did not come back, and a run that still fills the disk must
  not go unstopped for it). A run being
  stopped already for another reason (a user's stop, a timeout: it may write on through
  its grace) is measured too: if it holds the most, the guard waits for its end as for
  its own stop's, and blames nobody else meanwhile.
- *how*: a ``disk_full`` event on the run says what was measured; then the manager's
  normal cancel with reason ``disk_full`` (both paths, its intent journaled, its partial
  result kept: that lives in the journal and the daemon's memory, not in the run dir), and
  the measurement goes into its receipt (``stop_detail``). Its run dir is removed when it
  ends, as every run's is; a session turn's browser profile is removed then too if the
  profile itself holds enough to be blamed (a stop never removes a profile otherwise:
  here the space would not come back).

Not seen: a deleted file whose descriptor is in flight in a unix socket's queue (sent
with ``SCM_RIGHTS``, never received: in no process's table); space held open by a
process whose descriptors are not the daemon's to read
(a normal user's daemon cannot read those of its runner itself, which is not dumpable;
the commands and servers it starts are readable), and paths a spec's ``sandbox`` grants.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from subagent.emit import record_paths
from supervisor.config import Config
from supervisor.core._diskusage import (
    BLAME_DIVISOR,
    BLAME_MIN_BYTES,
    BLAME_MIN_INODES,
    Held,
    choose_run,
    deleted_held,
    held_by_run,
    min_free_inodes,
    space_held,
    usage_held,
)
from supervisor.core._run import Run

__all__ = [
    "DiskGuard",
    "DISK_FULL_REASON",
    "BLAME_DIVISOR",
    "BLAME_MIN_BYTES",
    "BLAME_MIN_INODES",
    "choose_run",
    "min_free_inodes",
    "space_held",
    "usage_held",
    "deleted_held",
]

logger = logging.getLogger(__name__)

DISK_FULL_REASON: Final = "disk_full"
# How often a journal write or a spawn may lead to a statvfs (seconds).
POKE_S: Final = 1.0
# How often the free space is looked at while runs are live, between pokes (seconds).
TICK_S: Final = 5.0
# After a measurement that found no run to blame, the next one waits this long (seconds),
# or URGENT_REMEASURE_S when a journal write failed meanwhile.
REMEASURE_S: Final = 30.0
URGENT_REMEASURE_S: Final = 5.0
# A run the guard stopped has ended: how long it waits at most for its run dir's removal
# to be tried (seconds; ``Run.removal_tried``, normally at once) before it blames others.
REMOVAL_WAIT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class _Low:
    path: Path  # the watched directory
    dev: int
    free: int
    total: int
    min_free: int
    # Its inodes (0, 0, 0: a filesystem without a fixed number of them).
    free_inodes: int = 0
    total_inodes: int = 0
    min_free_inodes: int = 0

    @property
    def low_bytes(self) -> bool:
        return self.free < self.min_free

    @property
    def low_inodes(self) -> bool:
        return self.free_inodes < self.min_free_inodes


class DiskGuard:
    """Watches the free space under the state dir and the runs dir (see the module).

    Args:
        live: the live runs by id (the run book's).
        record: journals an event of a run's (``RunBook.record``).
        cancel: the manager's cancel (``run_id``, ``reason``).
        profile_of: a session turn's browser profile directory, or None.
        evict_profile: removes a session's profile once its turn has ended.
    """

    def __init__(
        self,
        config: Config,
        live: Mapping[str, Run],
        *,
        record: Callable[[Run, str, dict[str, Any]], Awaitable[object]],
        cancel: Callable[[str, str], Awaitable[object]],
        profile_of: Callable[[Run], Path | None],
        evict_profile: Callable[[str, str], Awaitable[object]],
    ) -> None:
        self.config = config
        self._live = live
        self._record = record
        self._cancel = cancel
        self._profile_of = profile_of
        self._evict_profile = evict_profile
        self._wake = trio.Event()
        self._urgent = False  # a journal write failed since the last check
        self._ticking = False  # runs are live: the loop wakes every TICK_S anyway
        self._checked_at = -float("inf")
        self._measured_at = -float("inf")
        # One disk_full stop at a time: the run, its run dir, set once its profile is dealt with.
        self._stopping: tuple[Run, Path | None, trio.Event] | None = None
        self._ended_at: float | None = None  # when the guard first saw that run ended (trio clock)
        self._nursery: trio.Nursery | None = None
        self._low_said = False
        self.stopped = 0  # runs stopped for a full disk, in all
        self.last: dict[str, Any] | None = None  # the last stop's measurement

    @property
    def on(self) -> bool:
        return self.config.disk_min_free_mib > 0 or self.config.disk_min_free_percent > 0

    def describe(self) -> dict[str, Any]:
        """For ``status``: the watched filesystems' free space, and the stops made."""
        watched: list[dict[str, Any]] = []
        for path in self._watched():
            try:
                vfs = os.statvfs(path)
            except OSError as exc:
                watched.append({"path": str(path), "error": str(exc)})
                continue
            total = vfs.f_blocks * vfs.f_frsize
            fs: dict[str, Any] = {
                "path": str(path),
                "free_bytes": vfs.f_bavail * vfs.f_frsize,
                "total_bytes": total,
                "min_free_bytes": self.config.min_free_bytes(total),
            }
            if vfs.f_files > 0:
                fs["free_inodes"] = vfs.f_favail
                fs["total_inodes"] = vfs.f_files
                fs["min_free_inodes"] = min_free_inodes(self.config, total, vfs.f_files)
            watched.append(fs)
        return {"on": self.on, "watched": watched, "runs_stopped": self.stopped, "last_stop": self.last}

    # ------------------------------------------------------------------ wake-ups

    def poke(self) -> None:
        """The daemon is awake anyway (a journal write, a spawn): look soon, cheaply."""
        if not self._ticking or trio.current_time() - self._checked_at >= POKE_S:
            self._wake.set()

    def journal_failed(self) -> None:
        """A journal write failed (ENOSPC, or another cause the free space tells apart)."""
        self._urgent = True
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check on every wake-up, and every ``TICK_S`` while runs are live (a service)."""
        if not self.on:
            task_status.started()
            return
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self._ticking = bool(self._live)
                if self._ticking:
                    with trio.move_on_after(TICK_S):
                        await self._wake.wait()
                else:
                    await self._wake.wait()
                self._wake = trio.Event()
                try:
                    await self.check()
                except Exception:  # a task root: a failed check must not take the daemon down
                    logger.exception("disk guard: a check failed")

    # ------------------------------------------------------------------ the check

    def _watched(self) -> list[Path]:
        paths = [self.config.state_dir]
        if self.config.run_root != self.config.state_dir:
            paths.append(self.config.run_root)
        return paths

    def _low(self) -> list[_Low]:
        """The watched filesystems below their mark (of bytes or of inodes), each once."""
        low: dict[int, _Low] = {}
        for path in self._watched():
            try:
                dev = os.stat(path).st_dev
                vfs = os.statvfs(path)
            except OSError:
                continue
            total = vfs.f_blocks * vfs.f_frsize
            fs = _Low(
                path,
                dev,
                free=vfs.f_bavail * vfs.f_frsize,
                total=total,
                min_free=self.config.min_free_bytes(total),
                free_inodes=vfs.f_favail,
                total_inodes=vfs.f_files,
                min_free_inodes=min_free_inodes(self.config, total, vfs.f_files),
            )
            if (fs.low_bytes or fs.low_inodes) and dev not in low:
                low[dev] = fs
        return list(low.values())

    async def check(self) -> None:
        """Look at the free space; below a mark, find the run to blame and stop it."""
        urgent, self._urgent = self._urgent, False
        self._checked_at = trio.current_time()
        if self._stopping is not None:
            run, run_dir, settled = self._stopping
            if not self._stop_over(run, run_dir, settled):
                return  # its space is not back yet: nobody else is blamed meanwhile
            self._stopping = None
            self._ended_at = None
            self._measured_at = -float("inf")  # still low: another run may be filling it too
        low = self._low()
        if not low:
            if self._low_said:
                logger.warning("disk guard: free space is above the low-water mark again")
            self._low_said = False
            return
        if trio.current_time() - self._measured_at < (URGENT_REMEASURE_S if urgent else REMEASURE_S):
            return
        # Runs being stopped already (a user's stop, a timeout) are measured too: one that
        # holds the most gets its space back when it ends, and no other run is blamed for it.
        runs = [r for r in self._live.values() if r.run_dir is not None]
        if not runs:
            self._say_low(low[0], "no live run holds space there")
            return
        self._measured_at = trio.current_time()
        paths = {r.run_id: self._paths(r) for r in runs}
        trees = {r.run_id: r.tree for r in runs}
        for fs in low:
            held = await trio.to_thread.run_sync(held_by_run, paths, trees, fs.dev)
            worst = choose_run(held.bytes, fs.min_free) if fs.low_bytes else None
            inodes = worst is None and fs.low_inodes
            if inodes:
                worst = choose_run(held.inodes, fs.min_free_inodes, least=BLAME_MIN_INODES)
            if worst is None:
                top = max(held.bytes.values(), default=0)
                most = f"the most: {top} bytes" + (
                    f", {max(held.inodes.values(), default=0)} inodes" if fs.low_inodes else ""
                )
                self._say_low(fs, f"no run holds enough of it to blame ({most})")
                continue
            target = self._live.get(worst)
            if target is None:  # it ended meanwhile: its space comes back
                return
            if target.token.cancelled:
                self._wait_for(target, fs, held, inodes)
            else:
                await self._stop(target, fs, held, inodes)
            return

    def _stop_over(self, run: Run, run_dir: Path | None, settled: trio.Event) -> bool:
        """Whether the run being stopped is done with: ended, its profile dealt with, and
        its run dir gone, or its removal tried (and failed: a file it cannot remove), or
        not tried ``REMOVAL_WAIT_S`` after its end. Waiting for the dir alone, a removal
        that failed kept every other run from being stopped for good."""
        if not run.done.is_set() or not settled.is_set():
            return False
        if run_dir is None or not run_dir.exists():
            return True
        now = trio.current_time()
        if self._ended_at is None:
            self._ended_at = now
            if self._nursery is not None:  # look again once the wait is over
                self._nursery.start_soon(self._wake_after, REMOVAL_WAIT_S)
        if run.removal_tried.is_set():
            why = "its removal failed"
        elif now - self._ended_at >= REMOVAL_WAIT_S:
            why = f"its removal was not tried within {REMOVAL_WAIT_S:g} s of its end"
        else:
            return False
        logger.warning(
            "disk guard: run %s ended but its directory %s is still there (%s): its space did not come back; "
            "the guard goes on",
            run.run_id,
            run_dir,
            why,
        )
        return True

    async def _wake_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self._wake.set()

    def _paths(self, run: Run) -> list[Path]:
        assert run.run_dir is not None
        paths = [run.run_dir, *record_paths(run.run_dir)]
        profile = self._profile_of(run)
        if profile is not None:
            paths.append(profile)
        return paths

    def _say_low(self, fs: _Low, why: str) -> None:
        if not self._low_said:
            logger.warning("disk guard: %s; %s: no run stopped", _below(fs, inodes=not fs.low_bytes), why)
        self._low_said = True

    def _wait_for(self, run: Run, fs: _Low, held: Held, inodes: bool) -> None:
        """The run holding the most is being stopped already, for another reason: its
        space comes back when it ends (its run dir removed), as a ``disk_full`` stop's
        does; nobody else is stopped meanwhile (not its stop: no event, no detail)."""
        logger.warning(
            "disk guard: %s; run %s, which holds the most (%d %s), is being stopped already (%s): waiting for its end",
            _below(fs, inodes=inodes),
            run.run_id,
            (held.inodes if inodes else held.bytes)[run.run_id],
            "inodes" if inodes else "bytes",
            run.token.reason,
        )
        settled = trio.Event()
        settled.set()
        self._stopping = (run, run.run_dir, settled)

    async def _stop(self, run: Run, fs: _Low, held: Held, inodes: bool = False) -> None:
        def next_most(by: Mapping[str, int]) -> int:
            return max((v for k, v in by.items() if k != run.run_id), default=0)

        deleted = held.deleted.get(run.run_id, 0)
        detail: dict[str, Any] = {
            "reason": DISK_FULL_REASON,
            "path": str(fs.path),
            "free_bytes": fs.free,
            "total_bytes": fs.total,
            "min_free_bytes": fs.min_free,
            "held_bytes": held.bytes[run.run_id],
            # (of which in files it deleted but keeps open)
            "held_deleted_bytes": deleted,
            "next_most_bytes": next_most(held.bytes),
        }
        if inodes:  # what it was stopped for: the inodes it holds
            detail.update(
                short_of="inodes",
                free_inodes=fs.free_inodes,
                total_inodes=fs.total_inodes,
                min_free_inodes=fs.min_free_inodes,
                held_inodes=held.inodes[run.run_id],
                next_most_inodes=next_most(held.inodes),
            )
            holds = f"this run held {held.inodes[run.run_id]} inodes there (files and directories)"
        else:
            holds = f"this run held {held.bytes[run.run_id]} bytes there" + (
                f" ({deleted} of them in files it deleted but keeps open)" if deleted else ""
            )
        detail["message"] = f"the filesystem of {_below(fs, inodes=inodes)}; {holds}, the most of the live runs"
        logger.warning("run %s: stopped: %s", run.run_id, detail["message"])
        settled = trio.Event()
        self._stopping = (run, run.run_dir, settled)
        self.stopped += 1
        self.last = {"run_id": run.run_id, "at": time.time(), **detail}
        run.stop_detail = detail
        try:
            # The stop first: its first half (the token, path A) runs before the cancel's
            # first await, so no other stop lands between this choice and it (a user's,
            # during the event's write, made the run 'user' while this said 'disk_full').
            await self._cancel(run.run_id, DISK_FULL_REASON)
            await self._record(run, DISK_FULL_REASON, detail)
        finally:
            if run.session_id is not None and self._profile_of(run) is not None and self._nursery is not None:
                self._nursery.start_soon(self._evict_after, run, fs, settled, inodes)
            else:
                settled.set()

    async def _evict_after(self, run: Run, fs: _Low, settled: trio.Event, inodes: bool = False) -> None:
        """A session turn stopped for a full disk: once the turn has ended, its profile goes
        if the profile itself holds enough of the disk to be blamed (what the turn wrote
        there stays otherwise: a stop never removes a profile but to bring space back);
        its inodes, for a turn stopped for those."""
        assert run.session_id is not None
        try:
            await run.done.wait()
            profile = self._profile_of(run)
            size, count = (0, 0) if profile is None else await trio.to_thread.run_sync(usage_held, [profile], fs.dev)
            if inodes:
                held, what = count, "inodes"
                blamed = choose_run({run.run_id: count}, fs.min_free_inodes, least=BLAME_MIN_INODES)
            else:
                held, what = size, "bytes"
                blamed = choose_run({run.run_id: size}, fs.min_free)
            if blamed is None:
                logger.info("session %s: its browser profile holds %d %s: kept", run.session_id, held, what)
                return
            await self._evict_profile(run.session_id, f"its turn {run.run_id} filled the disk ({held} {what} in it)")
        except Exception:
            logger.exception("session %s: removing the browser profile of a turn that filled the disk", run.session_id)
        finally:
            settled.set()
            self._wake.set()


def _below(fs: _Low, *, inodes: bool) -> str:
    """What a filesystem is short of, in words (bytes, or inodes)."""
    if inodes:
        return (
            f"{fs.path} had {fs.free_inodes} inodes free of {fs.total_inodes}, below its low-water mark of "
            f"{fs.min_free_inodes} (the same share of its inodes as of its bytes)"
        )
    return f"{fs.path} had {fs.free} bytes free, below its low-water mark of {fs.min_free}"
