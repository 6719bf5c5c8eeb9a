"""The kernel as the OS edge sees it: one ``Protocol``, one Linux implementation.

Every fact the daemon and the runner read about processes (``/proc/<pid>/stat``,
``environ``, ``cmdline``, ``cgroup``, ``fd``), every signal they send (pidfd, ``killpg``,
``cgroup.kill``) and every reap goes through a ``Kernel``. Tests inject a fake one once
(a table of processes and a log of signals) instead of patching private functions.
``LinuxKernel`` holds no state: it is the kernel's own.

Identity. Pids wrap at 32768 here, so a pid alone names nobody: a ``Proc`` carries its
start time in clock ticks (field 22 of ``stat``), and ``ProcessId`` (pid + start ticks) is
what callers keep. Measured kernel facts the rest relies on: a zombie keeps its stat line
(pgid, sid, state ``Z``) and its ``cgroup`` file but has no readable ``environ``, and is
no longer listed in ``cgroup.procs``; an environment reads empty for an instant around
``exec``; a pidfd turns readable when its process exits, whoever its parent is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat as stat_
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, final

__all__ = ["Proc", "ProcessId", "parse_stat", "Kernel", "LinuxKernel", "LINUX"]

_PR_SET_CHILD_SUBREAPER: Final = 36


@dataclass(frozen=True, slots=True)
class ProcessId:
    """One process, for as long as it exists: its pid and its start time in clock ticks."""

    pid: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class Proc:
    """One line of the process table, as read from ``/proc/<pid>/stat``."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # "R", "S", "T" (stopped), "Z" (zombie), ...
    start_ticks: int  # start time since boot in clock ticks: with pid, the identity

    @property
    def dead(self) -> bool:
        """A zombie is dead: it runs no code and holds no resources but its pid."""
        return self.state in ("Z", "X", "x")

    @property
    def ident(self) -> ProcessId:
        return ProcessId(self.pid, self.start_ticks)


def parse_stat(pid: int, raw: bytes) -> Proc | None:
    """Parse a ``/proc/<pid>/stat`` line; None if it is not one."""
    # The command name may contain spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return Proc(
            pid=pid,
            state=rest[0].decode(),
            ppid=int(rest[1]),
            pgid=int(rest[2]),
            sid=int(rest[3]),
            start_ticks=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


class Kernel(Protocol):
    """What the OS edge asks of the kernel. Reads never raise for a process that is gone
    (they return None or empty); signals raise as the syscalls do (``ProcessLookupError``,
    ``PermissionError``, ``OSError``)."""

    clock_ticks: int  # clock ticks per second (``SC_CLK_TCK``)
    blocking: bool  # reads may take long (a walk of /proc): callers run them off the event loop

    # -- who is asking
    def own_ids(self) -> tuple[int, int, int]:
        """(pid, pgid, sid) of the calling process."""
        ...

    # -- the process table
    def pids(self) -> list[int]:
        """Every pid in the table (raises ``OSError`` when ``/proc`` cannot be listed)."""
        ...

    def stat(self, pid: int) -> Proc | None: ...

    def environ(self, pid: int) -> bytes | None:
        """The NUL-separated environment (b"": empty); None when gone, a zombie, or not
        ours to read."""
        ...

    def cmdline(self, pid: int) -> bytes: ...

    def cgroup(self, pid: int) -> str | None:
        """The cgroup v2 path (``0::/path``) of ``pid``, zombies included."""
        ...

    def pipe_inodes(self, pid: int) -> set[int] | None:
        """Inode numbers of the pipes ``pid`` holds open; None when unreadable."""
        ...

    def deleted_files(self, pid: int) -> dict[tuple[int, int], int] | None:
        """The regular files ``pid`` holds open or mapped that no path leads to any more
        (unlinked, their last link gone: their space comes back only when they are closed
        and unmapped), by (``st_dev``, ``st_ino``): their allocated bytes. None when
        unreadable."""
        ...

    def children(self) -> list[int] | None:
        """The calling process's children; None when the kernel cannot list them
        (raises ``OSError`` when it could but failed, e.g. out of fds)."""
        ...

    def uptime_s(self) -> float: ...

    def boot_time(self) -> float:
        """The wall-clock time of boot (``btime`` of ``/proc/stat``): start ticks to a date."""
        ...

    # -- signals
    def pidfd_open(self, pid: int) -> int:
        """A pidfd for ``pid``: ``ProcessLookupError`` when gone, ``OSError`` otherwise."""
        ...

    def pidfd_send_signal(self, pidfd: int, sig: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def killpg(self, pgid: int, sig: int) -> None: ...

    def kill(self, pid: int, sig: int) -> None: ...

    # -- cgroups
    def cgroup_pids(self, path: Path) -> set[int]:
        """Pids in the cgroup ``path`` and every cgroup below it."""
        ...

    def cgroup_kill(self, path: Path) -> None:
        """Write ``cgroup.kill``: ``FileNotFoundError`` when absent (kernel < 5.14 or gone)."""
        ...

    def cgroup_populated(self, path: Path) -> bool | None:
        """``populated`` of ``cgroup.events``; None when unreadable (gone)."""
        ...

    def cgroup2_mount(self) -> tuple[Path, str] | None:
        """(mount point, root inside the hierarchy) of the cgroup2 filesystem."""
        ...

    # -- children of the calling process
    def reap(self, pid: int) -> bool:
        """``waitpid(pid, WNOHANG)``: True if it was reaped now."""
        ...

    def zombie_child_waiting(self) -> bool:
        """Is some child of ours a zombie? (a peek that reaps nothing)"""
        ...

    def child_exited(self, pid: int) -> bool | None:
        """Has this child of ours exited (a zombie, not reaped: a peek that reaps
        nothing)? None: no child of ours. Needs no ``/proc`` entry (a zombie of a
        non-dumpable process is not listed in a ``hidepid=invisible`` /proc)."""
        ...

    def set_child_subreaper(self, on: bool) -> bool: ...


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _deleted_mapped(pid: int) -> dict[tuple[int, int], int]:
    """The deleted files ``pid`` maps (``deleted_files``): a mapping holds its whole file
    after its descriptor is closed, which ``/proc/PID/fd`` then no longer shows. Each is
    stat'ed through ``/proc/PID/map_files`` (the kernel asks CAP_SYS_ADMIN or
    CAP_CHECKPOINT_RESTORE for that: a normal user's daemon gets none of them)."""
    found: dict[tuple[int, int], int] = {}
    for line in _read(f"/proc/{pid}/maps").splitlines():
        if not line.endswith(b" (deleted)"):
            continue
        start, _, end = line.split(b" ", 1)[0].partition(b"-")
        try:
            st = os.stat(f"/proc/{pid}/map_files/{int(start, 16):x}-{int(end, 16):x}")
        except (OSError, ValueError):
            continue
        if stat_.S_ISREG(st.st_mode) and st.st_nlink == 0:
            found[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return found


@final
class LinuxKernel:
    """The real kernel, through ``/proc``, cgroupfs and syscalls. Stateless."""

    def __init__(self) -> None:
        self.clock_ticks: int = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.blocking = True

    def own_ids(self) -> tuple[int, int, int]:
        return os.getpid(), os.getpgrp(), os.getsid(0)

    def pids(self) -> list[int]:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]

    def stat(self, pid: int) -> Proc | None:
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except OSError:
            return None
        try:
            raw = os.read(fd, 4096)
        except OSError:
            return None
        finally:
            os.close(fd)
        return parse_stat(pid, raw)

    def environ(self, pid: int) -> bytes | None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f.read()
        except OSError:  # gone, a zombie (no memory left), or not ours to read
            return None

    def cmdline(self, pid: int) -> bytes:
        return _read(f"/proc/{pid}/cmdline")

    def cgroup(self, pid: int) -> str | None:
        for line in _read(f"/proc/{pid}/cgroup").decode(errors="replace").splitlines():
            if line.startswith("0::"):
                return line[3:]
        return None

    def pipe_inodes(self, pid: int) -> set[int] | None:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return None  # gone, not ours to read, or out of fds
        found: set[int] = set()
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("pipe:[") and target.endswith("]"):
                try:
                    found.add(int(target[6:-1]))
                except ValueError:
                    continue
        return found

    def deleted_files(self, pid: int) -> dict[tuple[int, int], int] | None:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return None  # gone, not ours to read, or out of fds
        found: dict[tuple[int, int], int] = {}
        for name in names:
            link = f"/proc/{pid}/fd/{name}"
            try:
                if not os.readlink(link).endswith(" (deleted)"):
                    continue
                st = os.stat(link)  # the open file itself, through its descriptor
            except OSError:
                continue
            if stat_.S_ISREG(st.st_mode) and st.st_nlink == 0:
                found[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        found.update(_deleted_mapped(pid))
        return found

    def children(self) -> list[int] | None:
        # Needs CONFIG_PROC_CHILDREN; every thread lists the children it forked. An error
        # other than a missing file (out of fds) raises, as ``pids`` does.
        if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
            return None
        out: list[int] = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children", "rb") as f:
                    out.extend(int(x) for x in f.read().split())
            except FileNotFoundError:
                continue  # that thread has exited
        return out

    def uptime_s(self) -> float:
        try:
            return float(_read("/proc/uptime").split()[0])
        except (ValueError, IndexError):
            return 0.0

    def boot_time(self) -> float:
        for line in _read("/proc/stat").splitlines():
            if line.startswith(b"btime "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    break
        return 0.0

    def pidfd_open(self, pid: int) -> int:
        if not hasattr(os, "pidfd_open"):
            raise OSError("pidfd_open is not available")
        return os.pidfd_open(pid)

    def pidfd_send_signal(self, pidfd: int, sig: int) -> None:
        signal.pidfd_send_signal(pidfd, sig)

    def close(self, fd: int) -> None:
        os.close(fd)

    def killpg(self, pgid: int, sig: int) -> None:
        os.killpg(pgid, sig)

    def kill(self, pid: int, sig: int) -> None:
        os.kill(pid, sig)

    def cgroup_pids(self, path: Path) -> set[int]:
        found: set[int] = set()
        for dirpath, _dirs, _files in os.walk(path):
            try:
                with open(os.path.join(dirpath, "cgroup.procs"), "rb") as f:
                    found.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
        return found

    def cgroup_kill(self, path: Path) -> None:
        fd = os.open(path / "cgroup.kill", os.O_WRONLY)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)

    def cgroup_populated(self, path: Path) -> bool | None:
        for line in _read(str(path / "cgroup.events")).splitlines():
            if line.startswith(b"populated "):
                return line.split()[1] != b"0"
        return None

    def cgroup2_mount(self) -> tuple[Path, str] | None:
        for line in _read("/proc/self/mountinfo").decode(errors="replace").splitlines():
            left, sep, right = line.partition(" - ")
            if sep and right.split(" ", 1)[0] == "cgroup2":
                fields = left.split()
                return Path(fields[4]), fields[3]
        return None

    def reap(self, pid: int) -> bool:
        try:
            got, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return got == pid

    def child_exited(self, pid: int) -> bool | None:
        try:
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return None

    def zombie_child_waiting(self) -> bool:
        try:
            return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return False
        except OSError:
            return True  # cannot tell: look

    def set_child_subreaper(self, on: bool) -> bool:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1 if on else 0), 0, 0, 0)
        except (OSError, AttributeError):
            return False
        return bool(rc == 0)


# The kernel has no state of its own to keep here: one instance serves every caller.
LINUX: Final = LinuxKernel()
