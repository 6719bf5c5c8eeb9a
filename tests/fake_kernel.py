"""An honest fake of the OS edge's ``Kernel``: a process table, signals that act on it.

A process is a ``Proc`` plus an environment and a command line. A signal delivered to it
kills it (state ``Z``) unless it ignores that signal: ``ignores_term`` ignore SIGTERM,
``unkillable`` ignore SIGKILL too (a process stuck in uninterruptible sleep). A pidfd
names the process it was opened on: once that process is reaped and its pid reused, the
pidfd's signal fails with ESRCH, as the kernel's does; it is a real file descriptor (the
read end of a pipe) that turns readable when its process dies, so Trio can wait on it. Every delivery is logged in
``sent`` with the virtual time it happened (``clock``, default ``trio.current_time``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from subagent.osedge import Proc, ProcessId

ME = 50  # the caller's pid, group and session


@dataclass(frozen=True, slots=True)
class Sent:
    at: float
    how: str  # "group", "pid", "cgroup"
    target: int | str
    sig: int


class FakeKernel:
    clock_ticks = 100
    blocking = False

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self.procs: dict[int, Proc] = {}
        self.envs: dict[int, bytes] = {}
        self.cmdlines: dict[int, bytes] = {}
        self.cgroups: dict[Path, set[int]] = {}
        self.ignores_term: set[int] = set()
        self.unkillable: set[int] = set()
        self.sent: list[Sent] = []
        self.reaped: list[int] = []
        self._fds: dict[int, tuple[ProcessId, int]] = {}  # pidfd -> (process, write end)
        self._ticks = itertools.count(100)
        self._clock = clock or trio.current_time

    # -- building the table
    def start(
        self,
        pid: int,
        *,
        ppid: int = 1,
        pgid: int | None = None,
        sid: int | None = None,
        env: dict[str, str] | None = None,
        cmdline: str = "",
        cgroup: Path | None = None,
        state: str = "S",
    ) -> Proc:
        p = Proc(
            pid=pid, ppid=ppid, pgid=pgid or pid, sid=sid or pgid or pid, state=state, start_ticks=next(self._ticks)
        )
        self.procs[pid] = p
        self.envs[pid] = b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items())
        self.cmdlines[pid] = cmdline.replace(" ", "\0").encode()
        if cgroup is not None:
            self.cgroups.setdefault(cgroup, set()).add(pid)
        return p

    def die(self, pid: int) -> None:
        p = self.procs.get(pid)
        if p is not None and not p.dead:
            self.procs[pid] = replace(p, state="Z")
            self.envs.pop(pid, None)  # a zombie has no memory left to read
            for members in self.cgroups.values():
                members.discard(pid)
            for ident, w in self._fds.values():
                if ident == p.ident:
                    os.write(w, b"x")

    def release(self, pid: int) -> None:
        """The zombie is reaped: its pid is free for the next process."""
        self.procs.pop(pid, None)
        self.envs.pop(pid, None)
        self.cmdlines.pop(pid, None)

    def signals(self, sig: int | None = None) -> list[tuple[float, str, int | str]]:
        """Signals sent (``sig``: of one kind); the SIGCONT after each SIGTERM only when asked."""
        return [(s.at, s.how, s.target) for s in self.sent if (s.sig != 18 if sig is None else s.sig == sig)]

    def _deliver(self, pid: int, sig: int) -> None:
        if sig == 0:
            return
        if sig == 9 and pid not in self.unkillable:
            self.die(pid)
        elif sig == 15 and pid not in self.ignores_term and pid not in self.unkillable:
            self.die(pid)

    # -- the Kernel protocol
    def own_ids(self) -> tuple[int, int, int]:
        return ME, ME, ME

    def pids(self) -> list[int]:
        return sorted(self.procs)

    def stat(self, pid: int) -> Proc | None:
        return self.procs.get(pid)

    def environ(self, pid: int) -> bytes | None:
        return self.envs.get(pid)

    def cmdline(self, pid: int) -> bytes:
        return self.cmdlines.get(pid, b"")

    def cgroup(self, pid: int) -> str | None:
        for path, members in self.cgroups.items():
            if pid in members:
                return str(path)
        return None

    def pipe_inodes(self, pid: int) -> set[int] | None:
        return None

    def deleted_files(self, pid: int) -> dict[tuple[int, int], int] | None:
        return None

    def children(self) -> list[int] | None:
        return [p.pid for p in self.procs.values() if p.ppid == ME]

    def uptime_s(self) -> float:
        return 1e6

    def boot_time(self) -> float:
        return 0.0

    def pidfd_open(self, pid: int) -> int:
        p = self.procs.get(pid)
        if p is None:
            raise ProcessLookupError(pid)
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._fds[r] = (p.ident, w)
        if p.dead:
            os.write(w, b"x")
        return r

    def pidfd_send_signal(self, pidfd: int, sig: int) -> None:
        ident = self._fds[pidfd][0]
        p = self.procs.get(ident.pid)
        if p is None or p.start_ticks != ident.start_ticks or p.dead:
            raise ProcessLookupError(ident.pid)
        self.sent.append(Sent(self._clock(), "pid", ident.pid, sig))
        self._deliver(ident.pid, sig)

    def close(self, fd: int) -> None:
        _ident, w = self._fds.pop(fd)
        os.close(w)
        os.close(fd)

    def open_fds(self) -> int:
        return len(self._fds)

    def killpg(self, pgid: int, sig: int) -> None:
        members = [p.pid for p in self.procs.values() if p.pgid == pgid]
        if not members:
            raise ProcessLookupError(pgid)
        if sig:
            self.sent.append(Sent(self._clock(), "group", pgid, sig))
        for pid in members:
            self._deliver(pid, sig)

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.procs:
            raise ProcessLookupError(pid)
        self.sent.append(Sent(self._clock(), "bare pid", pid, sig))
        self._deliver(pid, sig)

    def cgroup_pids(self, path: Path) -> set[int]:
        return set(self.cgroups.get(path, set()))

    def cgroup_kill(self, path: Path) -> None:
        if path not in self.cgroups:
            raise FileNotFoundError(path)
        self.sent.append(Sent(self._clock(), "cgroup", str(path), 9))
        for pid in list(self.cgroups[path]):
            self._deliver(pid, 9)

    def cgroup_populated(self, path: Path) -> bool | None:
        members = self.cgroups.get(path)
        return None if members is None else bool(members)

    def cgroup2_mount(self) -> tuple[Path, str] | None:
        return None

    def reap(self, pid: int) -> bool:
        p = self.procs.get(pid)
        if p is None or p.ppid != ME or not p.dead:
            return False
        self.release(pid)
        self.reaped.append(pid)
        return True

    def zombie_child_waiting(self) -> bool:
        return any(p.ppid == ME and p.dead for p in self.procs.values())

    def child_exited(self, pid: int) -> bool | None:
        p = self.procs.get(pid)
        return None if p is None or p.ppid != ME else p.dead

    def set_child_subreaper(self, on: bool) -> bool:
        return True
