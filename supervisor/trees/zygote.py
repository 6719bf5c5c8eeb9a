"""The runner zygote, daemon side: start it, keep it alive, spawn runner trees through it.

The zygote (``python -m subagent.zygote``) has imported everything a runner needs and
forks one runner per spawn, in a few milliseconds, sharing the imported code with every
runner copy-on-write. A spawn sends it the run's environment, working directory, tree id
and cgroup, and the child ends of three fresh pipes (SCM_RIGHTS over a unix socket); the
reply names the runner (pid and start ticks) once it leads its own session in its
cgroup. So a forked tree is the same ``Tree`` a cold spawn makes, and every stop routine
treats both alike; only its ``process`` differs (``ForkedProcess``, Trio's surface).

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
import fcntl
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import trio

from subagent.osedge import ProcessId, open_pidfd
from subagent.zygote import ENV_ROOM, ENV_ROOM_VAR, MAX_MESSAGE, PLACEHOLDER_MARKER, decode, encode
from supervisor.config import Config
from supervisor.trees._handles import HOST_VAR, MARKER_VAR, Tree
from supervisor.trees.containment import Containment

__all__ = ["ForkedProcess", "Zygote", "usable"]

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

    def __init__(self, config: Config, containment: Containment) -> None:
        self.config = config
        self.containment = containment
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
        }

    # ------------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a zygote running until cancelled; restart one that dies (with a back-off).

        A zygote that fails ``MAX_FAILED_STARTS`` times in a row before it was ever ready
        (an import that cannot work here) is given up: state ``failed``, runners cold.
        """
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
        argv = [self.config.runner_python, "-m", "subagent.zygote"]
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
        finally:
            self._sock = None
            if self.state == "ready":
                self.state = "restarting"
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
            self._proc = None

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
            }
            with trio.CancelScope(shield=True):  # a child may exist once the request is out
                reply = await self._request(req, theirs)
        except BaseException as exc:
            for fd in ours:
                _close_quietly(fd)
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
        if cgroup is not None and not reply.get("cgroup"):
            logger.warning("tree %s: could not join cgroup %s; continuing without it", tree_id, cgroup)
            _rmdir_quietly(cgroup)
            cgroup = None
        proc = ForkedProcess(
            pid,
            pidfd if pidfd is not None else -1,
            exit,
            args=[self.config.runner_python, "-m", "subagent.runner", *args],
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
