"""The runner zygote, daemon side: start it, keep it alive, spawn runner trees through it.

The zygote (``python -m subagent.zygote``) has imported everything a runner needs and
forks one runner per spawn, in a few milliseconds, sharing the imported code with every
runner copy-on-write. A spawn sends it the run's environment, working directory, tree id
and cgroup, and the child ends of three fresh pipes (SCM_RIGHTS over a unix socket); the
reply names the runner (pid and start ticks) once it leads its own session in its
cgroup. So a forked tree is the same ``Tree`` a cold spawn makes, and every stop routine
treats both alike; only its ``process`` differs (``ForkedProcess``, Trio's surface).

Spares (``config.zygote_spares``, default 1; grown to a burst's size by ``SpareDemand``,
up to ``zygote_spares_max``, for ``zygote_spares_keep_s``): the zygote keeps that many
runners forked ahead, each born in the cgroup of a tree made for it (id, run directory,
approvals channel, cgroup: what ``pool.new_tree`` makes at a spawn), parked as far along
as a runner goes without its run. A spawn takes one (``take_spare``) and ``assign``s it the run before
the run's first journal write, so the spare reads its spec and finishes its sandbox while
the journal commits; ``go`` is sent once the run's start (``starting``) is durable: a
restarted daemon never finds a run that did something before that. A spare that died,
would not take its run, or whose zygote went, is discarded (it exits, its tree removed)
and the spawn forks as before; the next spares are forked once spawns have gone quiet
(``SPARE_REFILL_DELAY_S``), so a burst never waits for one (the spares serve its first
spawns, forks serve the rest, and the spares grow to serve the whole of the next).

Exits, reaped exactly once. The runner is the zygote's child, not ours: the zygote reaps
it and reports its exit code over the socket; we see the exit through a pidfd and take
the code from that report. Should the zygote die first, its runners are re-parented to
this daemon (a child subreaper) and ``ForkedProcess`` reaps them itself, by pid; the
containment reaper never touches them (tracked leaders), nor before they are tracked
(their tree is still pending).

Used only where that holds: Linux, the daemon a child subreaper, the stock runner (no
``runner_command``), ``zygote = "auto"``. Until the zygote is ready, while it is being
restarted after dying (with a back-off), and when a request fails, runners start cold:
``spawn_tree`` returns None and the caller falls back to ``process.spawn_tree``.

Size: the daemon's end of one wire protocol (``subagent/zygote.py`` is the other): the
zygote's life (start, ready, restart with back-off), a spawn's request with its
descriptors and reply, and ``ForkedProcess``, the tree's process as the reports give it.
"""

from __future__ import annotations

import array
import collections
import fcntl
import itertools
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import trio

from subagent.osedge import ProcessId, open_pidfd
from subagent.sandbox import SANDBOX_ENV
from subagent.zygote import ENV_ROOM, ENV_ROOM_VAR, MAX_MESSAGE, PLACEHOLDER_MARKER, decode, encode
from supervisor.config import Config, module_argv
from supervisor.trees._handles import HOST_VAR, MARKER_VAR, Tree
from supervisor.trees._nest import Nest
from supervisor.trees.containment import Containment

__all__ = ["ForkedProcess", "Spare", "SpareDemand", "Zygote", "usable"]

logger = logging.getLogger(__name__)

# How long the zygote may take to import everything and say it is ready.
READY_TIMEOUT_S: Final = 120.0
# How long one spawn may wait for the zygote's reply before it is declared hung.
REPLY_TIMEOUT_S: Final = 10.0
# Back-off before restarting a zygote that died or failed to start (doubles up to the max).
RESTART_BACKOFF_S: Final = 1.0
RESTART_BACKOFF_MAX_S: Final = 60.0
# Starts in a row that never got ready before the zygote is given up (runners stay cold).
MAX_FAILED_STARTS: Final = 5
# After the zygote died, how long an exited runner may take to be re-parented to us.
REPARENT_WAIT_S: Final = 2.0
# The exit code recorded when a runner's exit code was lost with the zygote.
LOST_STATUS: Final = 255
# After a spare is taken, wait this long before the zygote forks the next one: the taken
# one's first step goes first (both want a CPU).
SPARE_REFILL_DELAY_S: Final = 0.05
# After a spare could not be made, wait this long before trying again.
SPARE_RETRY_S: Final = 1.0
# The refill waits for spawns to go quiet (``SPARE_REFILL_DELAY_S`` without a take), so a
# burst's forks are not queued behind new spares at the zygote; but no longer than this.
SPARE_REFILL_MAX_DELAY_S: Final = 0.5
# Spawns within this long of each other are one burst (what the spares grow to serve).
SPARE_BURST_WINDOW_S: Final = 1.0
# How long a spare may take to acknowledge its run (it is parked on its socket: at once).
SPARE_ACK_TIMEOUT_S: Final = 5.0


def usable(config: Config, containment: Containment) -> bool:
    """Can runners be forked by a zygote here and still be exactly what a cold one is?"""
    return (
        config.zygote == "auto"
        and not config.runner_command
        and containment.subreaper
        and sys.platform.startswith("linux")
        and hasattr(os, "pidfd_open")
        and hasattr(socket, "send_fds")
    )


@final
class SpareDemand:
    """How many spares to keep: ``floor`` (``zygote_spares``), grown to the largest burst
    of spawns seen (spawns less than ``SPARE_BURST_WINDOW_S`` apart), at most ``cap``,
    for ``keep_s`` after the last burst that large; then back to the floor.

    A host whose spawns come one at a time keeps the floor; one that sees a burst of N
    keeps N parked until it has gone ``keep_s`` without one (a spare costs memory, no CPU,
    while parked). Pure: times are given (``trio.current_time()``), so it is tested alone.
    """

    def __init__(self, floor: int, cap: int, keep_s: float, window_s: float = SPARE_BURST_WINDOW_S) -> None:
        self.floor = max(0, floor)
        self.cap = max(self.floor, cap)
        self.keep_s = keep_s
        self.window_s = window_s
        self._recent: collections.deque[float] = collections.deque()  # takes within the window
        self.peak = 0  # the largest burst still kept for
        self.peak_at = -math.inf  # when a burst last reached it
        self.last_take = -math.inf

    def taken(self, now: float, *, count: bool = True) -> None:
        """A spawn asked for a spare (whether or not one was there). ``count=False``: it
        asked before (only when it was, the refill waits on: spawns are still starting)."""
        self.last_take = max(self.last_take, now)
        if not count:
            return
        recent = self._recent
        recent.append(now)
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        if now >= self.expires_at:
            self.peak = 0
        if len(recent) >= self.peak:
            self.peak, self.peak_at = len(recent), now

    @property
    def expires_at(self) -> float:
        """When the kept burst stops counting (``inf``: nothing kept above the floor)."""
        return self.peak_at + self.keep_s if self.peak > self.floor else math.inf

    def target(self, now: float) -> int:
        if now >= self.expires_at:
            self.peak = 0
        return min(self.cap, max(self.floor, self.peak))


class _Exit:
    """Where the zygote's exit report for one runner lands."""

    __slots__ = ("code", "orphaned", "changed")

    def __init__(self) -> None:
        self.code: int | None = None
        self.orphaned = False  # the zygote died: the runner is (about to be) our child
        self.changed = trio.Event()


@final
class ForkedProcess:
    """Trio's ``Process`` surface for a runner the zygote forked.

    ``returncode`` is the zygote's exit report (or, once the zygote is gone, our own reap
    of the re-parented runner); ``wait()`` waits for it. The pidfd sees the exit whoever
    the parent is.
    """

    def __init__(
        self,
        pid: int,
        pidfd: int,
        exit: _Exit,
        *,
        args: Sequence[str],
        stdin: trio.lowlevel.FdStream | None,
        stdout: trio.lowlevel.FdStream | None,
        stderr: trio.lowlevel.FdStream | None,
    ) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd: int | None = pidfd if pidfd >= 0 else None
        self._exit = exit
        self._returncode: int | None = None
        self._wait_lock = trio.Lock()

    def __repr__(self) -> str:
        return f"<ForkedProcess pid {self.pid}: {'running' if self._returncode is None else self._returncode}>"

    @property
    def returncode(self) -> int | None:
        if self._returncode is None:
            if self._exit.code is not None:
                self._returncode = self._exit.code
            elif self._exit.orphaned:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    return None  # not re-parented to us yet (or reaped before the zygote died)
                if pid == self.pid:
                    self._returncode = os.waitstatus_to_exitcode(status)
            if self._returncode is not None:
                self._close_pidfd()
        return self._returncode

    def poll(self) -> int | None:
        return self.returncode

    async def wait(self) -> int:
        async with self._wait_lock:
            while (code := self.returncode) is None:
                if not self._exit.orphaned:
                    await self._exit.changed.wait()  # the zygote's report, or its death
                    continue
                # The zygote died: the runner is re-parented to us; reap it ourselves.
                if self._pidfd is not None:
                    try:
                        await trio.lowlevel.wait_readable(self._pidfd)
                    except trio.ClosedResourceError:
                        pass  # returncode (another task) reaped it and closed the pidfd
                with trio.move_on_after(REPARENT_WAIT_S):
                    while self.returncode is None:
                        await trio.sleep(0.001)
                if self._returncode is None:
                    # Exited and reaped by the zygote, whose report died with it.
                    logger.warning("runner pid %d: exited, but its exit code was lost with the zygote", self.pid)
                    self._returncode = LOST_STATUS
                    self._close_pidfd()
        return code

    def _close_pidfd(self) -> None:
        if self._pidfd is None:
            return
        fd, self._pidfd = self._pidfd, None
        try:
            trio.lowlevel.notify_closing(fd)
        except RuntimeError:  # not in a Trio run: nobody can be waiting on it
            pass
        os.close(fd)


class _Unavailable(Exception):
    pass


@final
class Zygote:
    """The daemon's zygote service: ``nursery.start(z.run)``, then ``await z.spawn_tree(...)``."""

    def __init__(self, config: Config, containment: Containment, nest: Nest | None = None) -> None:
        self.config = config
        self.containment = containment
        self.nest = nest  # given to each zygote it starts: its runners and spares join it
        self.state = "starting"  # "starting", "ready", "restarting", "failed", "stopped"
        self.pid: int | None = None
        self.started = 0  # zygotes started so far (1 + restarts)
        self.spawned = 0  # runners forked
        self.fallbacks = 0  # spawns that went cold because the zygote was not there
        self.import_s: float | None = None
        self._sock: trio.socket.SocketType | None = None
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._exits: dict[int, _Exit] = {}  # runners of the running zygote, by pid
        self._proc: trio.Process | None = None
        self._was_ready = False
        self._spares: collections.deque[Spare] = collections.deque()
        self._spare_taken = trio.Event()
        self._graves: trio.Nursery | None = None  # where discarded spares are waited for
        self.spares_used = 0  # spawns a spare served
        self.spares_lost = 0  # spares discarded (dead, refused, or the zygote went)
        self.spares_released = 0  # spares let go because fewer are wanted again
        cap = min(config.zygote_spares_max, config.max_concurrent)
        self.demand = SpareDemand(config.zygote_spares, cap, config.zygote_spares_keep_s)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self._sock is not None

    def describe(self) -> dict[str, Any]:
        """For ``status``: how spawns are made now."""
        return {
            "state": self.state,
            "pid": self.pid,
            "restarts": max(0, self.started - 1),
            "spawned": self.spawned,
            "cold_fallbacks": self.fallbacks,
            "import_s": self.import_s,
            "spares": {
                "target": self.demand.target(trio.current_time()) if self.config.zygote_spares > 0 else 0,
                "floor": self.config.zygote_spares,
                "max": self.demand.cap if self.config.zygote_spares > 0 else 0,
                "ready": len(self._spares),
                "pids": [spare.pid for spare in self._spares],
                "used": self.spares_used,
                "lost": self.spares_lost,
                "released": self.spares_released,
            },
        }

    # ------------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a zygote running until cancelled; restart one that dies (with a back-off).

        A zygote that fails ``MAX_FAILED_STARTS`` times in a row before it was ever ready
        (an import that cannot work here) is given up: state ``failed``, runners cold.
        """
        async with trio.open_nursery() as graves:
            self._graves = graves
            try:
                await self._run(task_status)
            finally:
                self._graves = None
                graves.cancel_scope.cancel()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        backoff = RESTART_BACKOFF_S
        failed_starts = 0
        try:
            while True:
                t0 = trio.current_time()
                self._was_ready = False
                try:
                    await self._serve_one()
                except (OSError, _Unavailable) as exc:
                    logger.warning("zygote: %s; runners start cold until it is back", exc)
                failed_starts = 0 if self._was_ready else failed_starts + 1
                if failed_starts >= MAX_FAILED_STARTS:
                    logger.error("zygote: failed to start %d times in a row; runners start cold", failed_starts)
                    self.state = "failed"
                    await trio.sleep_forever()
                if trio.current_time() - t0 > RESTART_BACKOFF_MAX_S:
                    backoff = RESTART_BACKOFF_S  # it had been up a while: not a crash loop
                self.state = "restarting"
                await trio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        finally:
            self.state = "stopped"

    async def _serve_one(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE * 2)
        except OSError:
            pass
        env = dict(os.environ)
        for name in ("AGENTD_RUN_ID", "AGENTD_RUN_DIR"):
            env.pop(name, None)
        env[MARKER_VAR] = PLACEHOLDER_MARKER
        env[ENV_ROOM_VAR] = "." * ENV_ROOM  # room for a runner's own environment in /proc
        if self.nest is not None:
            env.update(self.nest.env())  # (held by the zygote, never joined: its runners do)
        argv = module_argv(self.config.runner_python, "subagent.zygote")
        try:
            try:
                proc = await trio.lowlevel.open_process(
                    argv,
                    stdin=theirs.fileno(),
                    stdout=subprocess.DEVNULL,
                    stderr=None,  # the daemon's: a zygote's traceback lands in its log
                    env=env,
                    cwd=str(self.config.run_root),
                    # Its own group (a terminal's Ctrl-C is the daemon's to handle), in the
                    # daemon's session: never taken for a tree's member or an orphan.
                    process_group=0,
                    pass_fds=self.nest.pass_fds() if self.nest is not None else (),
                )
            finally:
                theirs.close()
        except BaseException:
            ours.close()
            raise
        self._proc = proc
        self.pid = proc.pid
        self.started += 1
        sock = trio.socket.from_stdlib_socket(ours)
        try:
            t0 = time.monotonic()
            with trio.move_on_after(READY_TIMEOUT_S) as scope:
                hello = decode(await sock.recv(MAX_MESSAGE))
            if scope.cancelled_caught:
                raise _Unavailable(f"pid {proc.pid} not ready after {READY_TIMEOUT_S:.0f} s")
            if hello is None or not hello.get("ready"):
                why = hello.get("error") if hello else "it exited"
                raise _Unavailable(f"pid {proc.pid} could not start: {why}")
            self.import_s = round(time.monotonic() - t0, 3)
            if not hello.get("proc_view"):
                logger.info("zygote: forked runners cannot show their marker in /proc (found by cgroup and group)")
            self._sock = sock
            self.state = "ready"
            self._was_ready = True
            logger.info("zygote pid %d ready in %.2f s", proc.pid, self.import_s)
            ended: list[BaseException] = []
            async with trio.open_nursery() as nursery:
                if self.config.zygote_spares > 0:
                    nursery.start_soon(self._keep_spares)
                try:
                    await self._read(sock, proc)
                except (OSError, _Unavailable) as exc:
                    ended.append(exc)
                finally:
                    # Nobody reads replies any more: no request (a spare's) waits for one.
                    self._sock = None
                    for event, _box in self._pending.values():
                        event.set()  # an empty box: unavailable
                    self._pending.clear()
                    nursery.cancel_scope.cancel()
            if ended:
                raise ended[0]
        finally:
            self._sock = None
            if self.state == "ready":
                self.state = "restarting"
            spares, self._spares = list(self._spares), collections.deque()
            for spare in spares:
                spare.close()  # EOF: a parked spare exits (and dies with the zygote anyway)
            for event, _box in self._pending.values():
                event.set()  # an empty box: unavailable
            self._pending.clear()
            # Its runners are re-parented to us now: they reap themselves (ForkedProcess).
            for orphan in self._exits.values():
                orphan.orphaned = True
                orphan.changed.set()
            self._exits.clear()
            with trio.CancelScope(shield=True):
                sock.close()  # EOF: an idle zygote exits by itself
                with trio.move_on_after(1.0):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                for spare in spares:
                    await self._bury(spare)
            self._proc = None

    async def _read(self, sock: trio.socket.SocketType, proc: trio.Process) -> None:
        """The zygote's messages: replies (a runner's, a spare's), exit reports."""
        while True:
            data = await sock.recv(MAX_MESSAGE)
            if not data:
                raise _Unavailable(f"pid {proc.pid} exited")
            msg = decode(data)
            if msg is not None and isinstance(msg.get("exit"), int):
                done = self._exits.pop(msg["exit"], None)
                if done is not None:
                    done.code = int(msg.get("code", LOST_STATUS))
                    done.changed.set()
                elif isinstance(msg.get("request"), int) and msg["request"] in self._pending:
                    # It died before it replied: that spawn failed (it starts cold).
                    event, box = self._pending.pop(msg["request"])
                    box.append(
                        {"id": msg["request"], "error": f"the runner exited ({msg.get('code')}) before it replied"}
                    )
                    event.set()
                continue
            if msg is None or not isinstance(msg.get("id"), int):
                logger.warning("zygote: unexpected message %r", data[:200])
                continue
            if isinstance(msg.get("pid"), int):
                # Registered here, in order: its exit report may be the next message.
                msg["_exit"] = self._exits[msg["pid"]] = _Exit()
            waiter = self._pending.pop(msg["id"], None)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()

    # ------------------------------------------------------------------ spares

    async def _keep_spares(self) -> None:
        """Keep as many spares forked ahead as ``demand`` wants while the zygote is ready.

        Never on a spawn's path: after spares are taken, the next ones are forked once the
        takes have gone quiet for ``SPARE_REFILL_DELAY_S`` (the taken ones run first, and
        a burst's forks are not queued behind spares at the zygote), at the latest
        ``SPARE_REFILL_MAX_DELAY_S`` after the first of them. Spares beyond the target
        (a burst's, once it has not recurred for ``zygote_spares_keep_s``) are let go.
        """
        demand = self.demand
        short_since: float | None = None  # when the spares first fell below the target
        while True:
            now = trio.current_time()
            target = demand.target(now)
            while len(self._spares) > target:
                self._spares.pop().discard(released=True)  # the youngest: the oldest serve first
            if len(self._spares) < target:
                if short_since is None:
                    short_since = now
                due = min(demand.last_take + SPARE_REFILL_DELAY_S, short_since + SPARE_REFILL_MAX_DELAY_S)
                if now < due:
                    await trio.sleep_until(due)
                    continue
                spare = await self._make_spare()
                if spare is None:
                    await trio.sleep(SPARE_RETRY_S)
                else:
                    self._spares.append(spare)
                short_since = trio.current_time()  # spawns still coming: one per max delay
                continue
            short_since = None
            self._spare_taken = trio.Event()
            with trio.move_on_at(demand.expires_at):
                await self._spare_taken.wait()

    async def _make_spare(self) -> Spare | None:
        """A spare for a new tree (its id, run directory, approvals channel and cgroup made
        now, as ``pool.new_tree`` makes them for a spawn), or None."""
        from supervisor.trees.pool import _make_run_dir, remove_dir, runner_env

        containment = self.containment
        tree_id = "t-" + uuid.uuid4().hex[:16]
        run_dir = self.config.run_root / tree_id
        cgroup: Path | None = None
        pids_group: Path | None = None
        pids_join: Path | None = None
        memory_group: Path | None = None
        memory_join: Path | None = None
        chan: socket.socket | None = None
        try:
            await trio.to_thread.run_sync(_make_run_dir, run_dir)
            env = runner_env(run_dir, config=self.config)
            from subagent.approvals import ANSWERS_ENV
            from supervisor.core.approvals import make_channel

            env[ANSWERS_ENV] = str(await trio.to_thread.run_sync(make_channel, run_dir))
            env[MARKER_VAR] = tree_id
            env.pop(HOST_VAR, None)
            # Its leaf only: the tree is tracked once it has a run (``Spare.go``).
            cgroup = containment.prepare(tree_id, ahead=True)
            pids_group, pids_join = containment.prepare_pids(tree_id, cgroup)
            memory_group, memory_join = containment.prepare_memory(tree_id, cgroup)
            chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                req = {
                    "id": next(self._ids),
                    "spare": True,
                    "cwd": str(run_dir),
                    "sandbox": env.get(SANDBOX_ENV),  # settings (no secret): its sandbox's first half
                    "answers": env[ANSWERS_ENV],  # its approvals channel (a path)
                    "tree_id": tree_id,
                    "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup is not None else None,
                    "pids_procs": str(pids_join / "cgroup.procs") if pids_join is not None else None,
                    "memory_procs": str(memory_join / "cgroup.procs") if memory_join is not None else None,
                }
                with trio.CancelScope(shield=True):  # a child may exist once the request is out
                    reply = await self._request(req, [theirs.fileno()])
            finally:
                theirs.close()
        except BaseException as exc:
            if chan is not None:
                chan.close()
            if pids_join is not None:
                _rmdir_quietly(pids_join)
            if memory_join is not None:
                _rmdir_quietly(memory_join)
            if cgroup is not None:
                _rmdir_quietly(cgroup)
            containment.discard(tree_id)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(remove_dir, run_dir)
            if isinstance(exc, (OSError, _Unavailable)):
                logger.info("zygote: could not make a spare runner (%s)", exc)
                return None
            raise
        pid: int = reply["pid"]
        ticks: int = reply["ticks"]
        try:
            pidfd = open_pidfd(containment.table, ProcessId(pid, ticks))
        except OSError:
            pidfd = None
        pids_group = _joined_pids(tree_id, reply, pids_group, pids_join)
        memory_group = _joined_memory(tree_id, reply, memory_group, memory_join)
        if cgroup is not None and not reply.get("cgroup"):
            _rmdir_quietly(cgroup)
            cgroup = None
            if pids_join is None:  # v2: the limit was that cgroup's
                pids_group = None
            if memory_join is None:
                memory_group = None
        chan.setblocking(False)
        spare = Spare(
            self, tree_id, run_dir, cgroup, env, chan, pid, ticks, pidfd if pidfd is not None else -1, reply["_exit"]
        )
        spare.pids_group = pids_group
        spare.memory_group = memory_group
        return spare

    def take_spare(self, *, count: bool = True) -> Spare | None:
        """A live spare for the next run, or None (then fork as usual). No checkpoint.

        Each spawn that wanted one is counted once (``demand``; ``count=False``: this run
        asked before): a burst that found too few grows the spares kept for the next."""
        self.demand.taken(trio.current_time(), count=count)
        self._spare_taken.set()
        while self._spares:
            spare = self._spares.popleft()
            if spare.alive:
                return spare
            spare.discard()
        return None

    def _discarded(self, spare: Spare, *, released: bool) -> None:
        if released:
            self.spares_released += 1
        else:
            self.spares_lost += 1
        if self._graves is not None:
            self._graves.start_soon(self._bury, spare)

    async def _bury(self, spare: Spare) -> None:
        """Wait for a discarded spare's exit (EOF on its socket ends it), then remove its
        tree: cgroup, run directory."""
        from supervisor.trees.pool import remove_dir

        spare.close()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(REPLY_TIMEOUT_S):
                await spare.process.wait()
            if spare.process.returncode is None:
                logger.warning("spare runner pid %d did not exit; killing it", spare.pid)
                try:
                    os.kill(spare.pid, 9)
                except OSError:
                    pass
                with trio.move_on_after(REPLY_TIMEOUT_S):
                    await spare.process.wait()
            if spare.pids_group is not None and spare.pids_group != spare.cgroup:
                _rmdir_quietly(spare.pids_group)
            if spare.memory_group is not None and spare.memory_group != spare.cgroup:
                _rmdir_quietly(spare.memory_group)
            if spare.cgroup is not None:
                _rmdir_quietly(spare.cgroup)
            self.containment.discard(spare.tree_id)
            await trio.to_thread.run_sync(remove_dir, spare.run_dir)

    # ------------------------------------------------------------------ spawn

    async def spawn_tree(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        tree_id: str,
    ) -> Tree | None:
        """A runner tree forked by the zygote (``python -m subagent.runner *args``), or None
        when the zygote is not there or failed this request: start it cold then.

        Like ``process.spawn_tree``: the child gets stdin/stdout/stderr pipes, ``env`` plus
        ``AGENTD_TREE=<tree_id>``, a new session, and joins the tree's cgroup before it
        can fork. No checkpoint after the child exists (the wait for the reply is
        shielded and bounded): put its cleanup in place before your next ``await``.
        """
        if not self.ready:
            self.fallbacks += 1
            return None
        containment = self.containment
        cgroup = containment.prepare(tree_id)
        pids_group, pids_join = containment.prepare_pids(tree_id, cgroup)
        memory_group, memory_join = containment.prepare_memory(tree_id, cgroup)
        child_env = dict(env)
        child_env[MARKER_VAR] = tree_id
        child_env.pop(HOST_VAR, None)  # as process.spawn_tree: a tree's processes never carry it
        ours: list[int] = []
        theirs: list[int] = []
        try:
            for _ in range(3):
                r, w = os.pipe2(os.O_CLOEXEC)
                ours.append(r)
                theirs.append(w)
            # stdin: the child reads, we write: swap that pair's ends.
            ours[0], theirs[0] = theirs[0], ours[0]
            theirs.append(_env_pipe(child_env))  # read by the runner alone, never the zygote
            req = {
                "id": next(self._ids),
                "args": list(args),
                "cwd": os.fspath(cwd),
                "tree_id": tree_id,
                "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup is not None else None,
                "pids_procs": str(pids_join / "cgroup.procs") if pids_join is not None else None,
                "memory_procs": str(memory_join / "cgroup.procs") if memory_join is not None else None,
            }
            with trio.CancelScope(shield=True):  # a child may exist once the request is out
                reply = await self._request(req, theirs)
        except BaseException as exc:
            for fd in ours:
                _close_quietly(fd)
            if pids_join is not None:
                _rmdir_quietly(pids_join)
            if memory_join is not None:
                _rmdir_quietly(memory_join)
            if cgroup is not None:
                _rmdir_quietly(cgroup)
            # A request the zygote took before it died may have left a runner: it reads EOF
            # for its spec and exits at once (its zombie is ours until the daemon exits).
            containment.discard(tree_id)
            if isinstance(exc, (OSError, _Unavailable)):
                logger.warning("tree %s: zygote spawn failed (%s); starting it cold", tree_id, exc)
                self.fallbacks += 1
                return None
            raise
        finally:
            for fd in theirs:  # the zygote has its own copies (or never will)
                _close_quietly(fd)
        # No await from here on: the caller must own the child before the next checkpoint.
        pid: int = reply["pid"]
        ticks: int = reply["ticks"]
        exit = reply["_exit"]
        table = containment.table
        try:
            # None: it exited and its pid was reused (a pidfd would name another process).
            pidfd = open_pidfd(table, ProcessId(pid, ticks))
        except OSError:
            pidfd = None
        start_time = table.kernel.boot_time() + ticks / table.kernel.clock_ticks
        pids_group = _joined_pids(tree_id, reply, pids_group, pids_join)
        memory_group = _joined_memory(tree_id, reply, memory_group, memory_join)
        if cgroup is not None and not reply.get("cgroup"):
            logger.warning("tree %s: could not join cgroup %s; continuing without it", tree_id, cgroup)
            _rmdir_quietly(cgroup)
            cgroup = None
            if pids_group is not None and pids_join is None:  # v2: the limit was that cgroup's
                pids_group = None
            if memory_join is None:
                memory_group = None
        proc = ForkedProcess(
            pid,
            pidfd if pidfd is not None else -1,
            exit,
            args=[*module_argv(self.config.runner_python, "subagent.runner"), *args],
            stdin=trio.lowlevel.FdStream(ours[0]),
            stdout=trio.lowlevel.FdStream(ours[1]),
            stderr=trio.lowlevel.FdStream(ours[2]),
        )
        tree = Tree(
            tree_id=tree_id,
            pid=pid,
            pgid=pid,
            start_time=start_time,
            cgroup=cgroup,
            containment=containment.label(cgroup),
            process=proc,
            leader_ticks=ticks,
            pids_group=pids_group,
            memory_group=memory_group,
            table=table,
        )
        tree.groups[tree.pgid] = tree.leader_ticks
        tree.pipes = frozenset(os.fstat(fd).st_ino for fd in ours)  # its stdio, as process.spawn_tree
        containment.track(tree)
        self.spawned += 1
        logger.debug("tree %s: forked pid %d by the zygote, containment %s", tree_id, pid, tree.containment)
        return tree

    async def _request(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        sock = self._sock
        if sock is None:
            raise _Unavailable("not running")
        event = trio.Event()
        box: list[dict[str, Any]] = []
        self._pending[req["id"]] = (event, box)
        try:
            async with self._send_lock:
                await sock.sendmsg([encode(req)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            with trio.move_on_after(REPLY_TIMEOUT_S) as scope:
                await event.wait()
            if scope.cancelled_caught:
                self._restart(f"no reply in {REPLY_TIMEOUT_S:.0f} s")
                raise _Unavailable("no reply")
        finally:
            self._pending.pop(req["id"], None)
        if not box:
            raise _Unavailable("the zygote went away")
        reply = box[0]
        if "error" in reply or not isinstance(reply.get("pid"), int) or not isinstance(reply.get("ticks"), int):
            raise _Unavailable(str(reply.get("error", reply)))
        return reply  # with its exit slot (``_exit``), registered by the reader

    def _restart(self, why: str) -> None:
        """Kill a hung zygote: the service notices, and starts another."""
        logger.warning("zygote pid %s: %s; restarting it", self.pid, why)
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()


@final
class Spare:
    """A runner the zygote forked ahead for a tree of its own (id, run directory, cgroup),
    parked on its socket (``subagent/zygote.py``, ``_Zygote._park``).

    A spawn takes it (``Zygote.take_spare``), ``assign``s it its run (no checkpoint:
    before the run's start is journaled), and once the journal holds that start, ``go``
    lets it take its first step and returns its ``Tree``. Whatever fails on the way, the
    spare is discarded (EOF: it exits having done nothing of a run) and the spawn forks
    as usual.
    """

    def __init__(
        self,
        zygote: Zygote,
        tree_id: str,
        run_dir: Path,
        cgroup: Path | None,
        env: dict[str, str],
        chan: socket.socket,
        pid: int,
        ticks: int,
        pidfd: int,
        exit: _Exit,
    ) -> None:
        self.zygote = zygote
        self.tree_id = tree_id
        self.run_dir = run_dir
        self.cgroup = cgroup
        self.env = env
        self.chan = chan
        self.pid = pid
        self.ticks = ticks
        self.args: list[str] = []
        self.spec_sent = False  # the spec is in its stdin already
        self.pids_group: Path | None = None  # its per-run pids limit (``_pidslimit``), joined
        self.memory_group: Path | None = None  # its per-run memory limit (``_memlimit``), joined
        self._ours: list[int] = []
        argv = module_argv(zygote.config.runner_python, "subagent.runner")
        self.process = ForkedProcess(pid, pidfd, exit, args=argv, stdin=None, stdout=None, stderr=None)
        self._discarded = False

    @property
    def alive(self) -> bool:
        return not self._discarded and self.process.returncode is None and not self.process._exit.orphaned

    def assign(self, args: Sequence[str], extra_env: Mapping[str, str], spec_line: bytes | None) -> bool:
        """Send the spare its run: the child ends of its stdio pipes (``spec_line`` already
        in its stdin, when it fits the pipe) and its environment. No checkpoint. False
        (the spare discarded) when it cannot take it."""
        theirs: list[int] = []
        try:
            for _ in range(3):
                r, w = os.pipe2(os.O_CLOEXEC)
                self._ours.append(r)
                theirs.append(w)
            self._ours[0], theirs[0] = theirs[0], self._ours[0]  # stdin: we write
            if spec_line is not None and len(spec_line) <= 65536:
                view = memoryview(spec_line)
                os.set_blocking(self._ours[0], False)
                try:
                    while view:
                        view = view[os.write(self._ours[0], view) :]
                    self.spec_sent = True
                finally:
                    os.set_blocking(self._ours[0], True)
            env = dict(self.env)
            env.update(extra_env)
            theirs.append(_env_pipe(env))
            self.args = list(args)
            msg = encode({"args": self.args, "cwd": str(self.run_dir)})
            socket.send_fds(self.chan, [msg], theirs)
            return True
        except OSError as exc:
            logger.warning("spare runner pid %d: cannot assign it a run (%s); forking instead", self.pid, exc)
            self.discard()
            return False
        finally:
            for fd in theirs:
                _close_quietly(fd)

    def process_record(self) -> dict[str, Any]:
        """The run's process record as ``go`` will make its tree (journaled before ``go``:
        a daemon that dies in between leaves recovery a spare that exits on the hang-up)."""
        return {
            "pid": self.pid,
            "pid_start_time": self._start_time(),
            "pgid": self.pid,
            "tree_id": self.tree_id,
            "cgroup": str(self.cgroup) if self.cgroup else None,
            "containment": self.zygote.containment.label(self.cgroup),
            "run_dir": str(self.run_dir),
        }

    def _start_time(self) -> float:
        kernel = self.zygote.containment.table.kernel
        return kernel.boot_time() + self.ticks / kernel.clock_ticks

    async def go(self, stopped: Callable[[], bool] | None = None) -> Tree | None:
        """The run's start is journaled: let the spare run. Its tree, or None when it did
        not take the run (it died, or it hung up): it is discarded then; fork instead.

        ``stopped``: whether the run was stopped meanwhile, asked right before ``go`` is
        sent (no checkpoint between): a stopped run's spare is never let go (its wait for
        the spare's acknowledgement is a checkpoint, where a stop may come and be
        acknowledged); it is hung up on instead and exits having done nothing of the run
        (no ``runner_started``, no step). None then too: the caller tells it by its stop."""
        try:
            with trio.move_on_after(SPARE_ACK_TIMEOUT_S):
                await trio.lowlevel.wait_readable(self.chan)
            ack = decode(self.chan.recv(MAX_MESSAGE))
            if ack is None or ack.get("assigned") != self.pid:
                raise OSError(f"no acknowledgement ({ack!r})")
            if stopped is not None and stopped():
                logger.debug("spare runner pid %d: its run was stopped before its go; hung up on", self.pid)
                self.discard(released=True)
                return None
            self.chan.send(b"go")
        except (OSError, trio.ClosedResourceError) as exc:
            logger.warning("spare runner pid %d: did not take its run (%s); forking instead", self.pid, exc)
            self.discard()
            return None
        self._discarded = True  # a runner now: the run's, never discarded as a spare
        self.chan.close()  # the spare closes its end after "go": nothing more to say
        zygote, containment = self.zygote, self.zygote.containment
        ours, self._ours = self._ours, []
        proc = self.process
        proc.args = [*proc.args, *self.args]
        proc.stdin = trio.lowlevel.FdStream(ours[0])
        proc.stdout = trio.lowlevel.FdStream(ours[1])
        proc.stderr = trio.lowlevel.FdStream(ours[2])
        table = containment.table
        tree = Tree(
            tree_id=self.tree_id,
            pid=self.pid,
            pgid=self.pid,
            start_time=self._start_time(),
            cgroup=self.cgroup,
            containment=containment.label(self.cgroup),
            process=proc,
            leader_ticks=self.ticks,
            pids_group=self.pids_group,
            memory_group=self.memory_group,
            table=table,
        )
        tree.groups[tree.pgid] = tree.leader_ticks
        tree.pipes = frozenset(os.fstat(fd).st_ino for fd in ours)
        containment.track(tree)
        zygote.spawned += 1
        zygote.spares_used += 1
        logger.debug("tree %s: spare pid %d took its run, containment %s", self.tree_id, self.pid, tree.containment)
        return tree

    def close(self) -> None:
        """Hang up on the spare (it exits at once if it has no run yet) and drop its pipes."""
        self.chan.close()
        ours, self._ours = self._ours, []
        for fd in ours:
            _close_quietly(fd)

    def discard(self, *, released: bool = False) -> None:
        """Give the spare up (unless it took its run): it exits, and its tree is removed
        once it has. ``released``: it was fine, only no longer wanted."""
        if self._discarded:
            return
        self._discarded = True
        self.close()
        self.zygote._discarded(self, released=released)


def _joined_pids(
    tree_id: str, reply: Mapping[str, Any], pids_group: Path | None, pids_join: Path | None
) -> Path | None:
    """The tree's pids group once the runner replied: a v1 group it could not join is
    removed (the run goes on without a limit, as a cold one would)."""
    if pids_join is not None and not reply.get("pids"):
        logger.warning("tree %s: could not join pids group %s; continuing without it", tree_id, pids_join)
        _rmdir_quietly(pids_join)
        return None
    return pids_group


def _env_pipe(env: Mapping[str, str]) -> int:
    """A pipe holding ``env`` as JSON, closed for writing: its read end, for the runner."""
    data = json.dumps(dict(env)).encode()
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        if len(data) > 65536:  # a pipe holds 64 KiB by default; make room (up to pipe-max-size)
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(data))
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rmdir_quietly(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _joined_memory(
    tree_id: str, reply: Mapping[str, Any], memory_group: Path | None, memory_join: Path | None
) -> Path | None:
    """The tree's memory group once the runner replied: a v1 group it could not join is
    removed (the run goes on without a memory limit, as a cold one would); a v2 one is
    its cgroup, joined at its birth."""
    if memory_join is not None and not reply.get("memory"):
        logger.warning("tree %s: could not join memory group %s; continuing without it", tree_id, memory_join)
        _rmdir_quietly(memory_join)
        return None
    return memory_group
