"""The identity half of a run's sandbox: user and mount namespaces, capabilities, dumpability.

Kernel calls through ``ctypes``, stdlib only, Linux only. Each function does one thing and
raises ``OSError`` (errno set) when the kernel refuses; ``subagent.sandbox`` decides what
to try and reports what held. Everything here must run while the process has one thread
(``unshare(CLONE_NEWUSER)`` refuses a threaded process), before trio starts.

Size: one ``ctypes`` binding to the kernel's namespace, mount and capability calls (the
libc handle, the flags, ``_mount``), shared by every step of the run's isolation; each step
is a small function, and a split would only move the shared binding into a third module.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
from collections.abc import Callable, Iterable
from typing import Final

__all__ = [
    "KERNEL_TUNABLES",
    "enter_user_namespace",
    "private_mounts",
    "private_devpts",
    "private_proc",
    "cover",
    "shared_tmpfs",
    "drop_capabilities",
    "bind_fd",
    "bind_plan",
    "set_dumpable",
    "can_nest_user_namespace",
    "thread_count",
    "effective_capabilities",
    "libc",
    "CAP_SYS_ADMIN",
    "CAP_SETFCAP",
]

_CLONE_NEWNS: Final = 0x00020000
_CLONE_NEWIPC: Final = 0x08000000
_CLONE_NEWUSER: Final = 0x10000000
_CLONE_NEWPID: Final = 0x20000000
_CLONE_NEWNET: Final = 0x40000000
_MS_RDONLY: Final = 1
_MS_NOSUID: Final = 2
_MS_NODEV: Final = 4
_MS_NOEXEC: Final = 8
_MS_REMOUNT: Final = 32
_MS_BIND: Final = 4096
_MS_REC: Final = 16384
_MS_PRIVATE: Final = 1 << 18
_MNT_DETACH: Final = 2
_PR_SET_DUMPABLE: Final = 4
_PR_CAPBSET_DROP: Final = 24
_PR_CAP_AMBIENT: Final = 47
_PR_CAP_AMBIENT_CLEAR_ALL: Final = 4
_LINUX_CAPABILITY_VERSION_3: Final = 0x20080522
CAP_SYS_ADMIN: Final = 21
CAP_SETFCAP: Final = 31

# What systemd's ProtectKernelTunables= makes read-only under /proc: a process that is uid 0
# on the host (even in a user namespace, even without capabilities) may write most of them.
KERNEL_TUNABLES: Final = (
    "/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs", "/proc/acpi",
    "/proc/apm", "/proc/asound", "/proc/latency_stats", "/proc/mtrr", "/proc/scsi", "/proc/timer_list",
    "/proc/timer_stats", "/proc/kcore", "/proc/kallsyms",
)  # fmt: skip


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    """The C library (``use_errno``), loaded once."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


libc = _c


def _check(res: int, what: str) -> None:
    if res != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def effective_capabilities() -> int:
    """This process's effective capability set (``CapEff``), a bit per capability; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except (OSError, ValueError):
        return 0


def enter_user_namespace(inner_id: int) -> None:
    """Move into a new user, mount and IPC namespace, as ``inner_id`` (uid and gid) there.

    The host still sees the old uid (file owners, signals); inside, the process is
    ``inner_id``, and anything it executes has no capability at all. The process keeps
    every capability inside the new namespace until it executes (for ``private_mounts``).

    The IPC namespace: System V shared memory, semaphores and message queues, and POSIX
    message queues, are no files (Landlock does not see them) and are checked by uid
    alone: in the host's namespace a run could attach the segments of its uid (the
    host's, another run's) and leave its own behind, memory that outlived its stop. Its
    own namespace is freed, and everything in it, when the run's last process exits.

    A uid 0 maps itself (writes ``0`` into ``uid_map``) only if it held CAP_SETFCAP when
    it unshared (Linux 5.12+): a root without capabilities (the systemd unit's) gets EPERM
    at that write, so the unit grants CAP_SETFCAP and nothing else.
    """
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWIPC
    _check(_c().unshare(flags), "unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWIPC)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inner_id} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inner_id} {gid} 1")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _check(_c().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target!r}")


def _locked_flags(path: str) -> int:
    # A remount inside a user namespace must keep the flags the host mount has (EPERM otherwise).
    have = os.statvfs(path).f_flag
    flags = _MS_NOSUID | _MS_NODEV
    for st, ms in ((os.ST_NOEXEC, 8), (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21)):
        if have & st:
            flags |= ms
    return flags


# mount_setattr(2) (Linux 5.12): the one call that makes a bind and every mount under it
# read-only (a remount changes the top mount only).
_SYS_MOUNT_SETATTR: Final = 442  # the same number on every architecture since 5.12
_AT_FDCWD: Final = -100
_AT_RECURSIVE: Final = 0x8000
_MOUNT_ATTR_RDONLY: Final = 0x1


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _read_only_tree(path: str) -> None:
    """``path``'s mount and every mount below it read-only: a read grant that holds a
    mount of its own (a tmpfs at ``/run/user/UID`` under a grant of ``/run/user``) was left
    writable there. Falls back to a remount of the top where mount_setattr is missing."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    libc = _c()
    rc = libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EINVAL):
        raise OSError(err, f"mount_setattr {path!r}: {os.strerror(err)}")
    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _locked_flags(path), None)


def private_mounts(
    *,
    tmpfs: Iterable[str],
    read_only: Iterable[str],
    keep: Iterable[str] = (),
    keep_read_only: Iterable[str] = (),
    check: Callable[[str, str], None] | None = None,
    tmpfs_max_mib: int = 0,
) -> list[str]:
    """In this (new) mount namespace: an empty directory of one new tmpfs on each ``tmpfs``
    directory (``shared_tmpfs``: one ``tmpfs_max_mib`` budget for all of them), then
    ``keep`` (files or directories under them that the run needs: its own directory, the
    interpreter, ``/etc/resolv.conf``'s target) bound back at their own paths, those of
    them in ``keep_read_only`` read-only (a write rule on the tmpfs reaches down through
    the mounts under it: a bind's own flag is what keeps it read-only), then
    ``read_only`` bound read-only over themselves. Missing paths are skipped. Returns what
    was mounted, in order (each path once).

    ``check(path, named)``: called for each path kept, with what its open descriptor names
    (the path, a link followed), before that same descriptor is bound; it raises to refuse
    (a grant swapped for a link into the daemon's state since it was checked by name).
    """
    done: list[str] = []
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing propagates back to the host
    try:
        _private_mounts(done, tmpfs, read_only, keep, keep_read_only, check, tmpfs_max_mib)
    except BaseException:
        # Half a view is worse than none (a tmpfs over /tmp without the run dir bound back
        # would hide the run's own files): undo, newest first, and let the caller report.
        for path in reversed(done):
            _c().umount2(os.fsencode(path), _MNT_DETACH)
        raise
    return list(dict.fromkeys(done))


def cover(dirs: Iterable[str], *, keep: Iterable[str] = (), keep_read_only: Iterable[str] = ()) -> list[str]:
    """In this (new) mount namespace: a small empty tmpfs over each of ``dirs`` (the
    daemon's own directories), then what of ``keep`` and ``keep_read_only`` lies under
    them bound back (``bind_plan``: the run's own directory, say), as ``private_mounts``
    does for its tmpfs. Landlock keeps a run from opening what is there, not from
    ``connect()`` to a unix socket there (another run's); out of its sight, there is no
    path to one. Returns what was mounted, in order; undone, newest first, if a step fails.
    """
    dirs = [d for d in dirs if os.path.isdir(d) and not os.path.islink(d)]
    real_ro, real = ([os.path.realpath(k) for k in ks if os.path.exists(k)] for ks in (keep_read_only, keep))
    held: list[tuple[str, bool, int]] = []
    done: list[str] = []
    try:
        for k, ro in bind_plan(real_ro, real, within=dirs):
            held.append((k, ro, os.open(k, os.O_PATH | os.O_CLOEXEC)))
        for d in dirs:
            # Nothing is written here but the mount points of what is bound back (the run
            # may write none of it: no Landlock rule covers these directories).
            _mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0755,size=64k,nr_inodes=1024")
            done.append(d)
        for path, ro, fd in held:
            _bind_fd_at(fd, path, stat.S_ISDIR(os.fstat(fd).st_mode))
            done.append(path)
            if ro:
                _read_only_tree(path)
    except BaseException:
        for path in reversed(done):
            _c().umount2(os.fsencode(path), _MNT_DETACH)
        raise
    finally:
        for _p, _r, fd in held:
            os.close(fd)
    return done


def private_devpts(path: str = "/dev/pts", *, max_ptys: int = 0) -> None:
    """A new devpts instance at ``path``, in this (new) mount namespace: the terminals the
    run opens are its own, and the host's (a person's shell, a terminal of another run)
    are out of its sight. A process that may open one of those may write into it (text
    that person then sees as their own program's) and read what is typed there (a
    password). ``/dev/ptmx`` opens a terminal in the devpts mounted beside it (``pts``,
    Linux 4.7+), so the run's ``openpty`` still works, in this instance. ``max_ptys``: at
    most that many open at once (0: the kernel's ``kernel.pty.max``, less what it keeps
    for the host's instance, shared by every other instance)."""
    most = f",max={max_ptys}" if max_ptys > 0 else ""
    _mount("devpts", path, "devpts", _MS_NOSUID | _MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620" + most)


def _proc_submounts() -> list[str]:
    """What is mounted under /proc in this mount namespace (a container's masks over
    ``/proc/kcore``, ``binfmt_misc``): the topmost of them (a bind of one brings the
    mounts under it), parents first."""
    points: list[str] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point.startswith("/proc/"):
                points.append(point)
    out: list[str] = []
    for p in sorted(set(points), key=len):
        if not any(p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def private_proc() -> None:
    """A mount namespace of this process's own (owned by its user namespace: call it as
    the host's root, before ``enter_user_namespace``, which copies it, locked) with a new
    procfs instance at /proc mounted ``hidepid=invisible`` (Linux 5.8: options per
    instance): a process lists and opens only the ``/proc/<pid>`` of the processes it may
    ptrace-read (its own uid and dumpable, and, under Landlock, inside its own domain),
    never the command line, environment or status of the host's, the daemon's or another
    run's. Only the host's root may mount one: a procfs belongs to the user namespace
    owning the PID namespace. What the host has mounted under /proc (a container's masks,
    read-only tunables) is bound back over the new instance, as it was. Undone if a step
    fails (the host's /proc in sight again, in this new namespace)."""
    _check(_c().unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing propagates back to the host
    subs = _proc_submounts()
    held: list[tuple[str, int]] = []
    mounted = False
    try:
        for sub in subs:
            held.append((sub, os.open(sub, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)))
        # ``gid``: the group that sees every process (root's, 0, by default, which a root
        # runner's processes hold): one no process of ours holds.
        mine = {os.getegid(), os.getgid(), *os.getgroups()}
        gid = next(g for g in range(65534, 0, -1) if g not in mine)
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, f"hidepid=invisible,gid={gid}")
        mounted = True
        for sub, fd in held:
            _mount(f"/proc/self/fd/{fd}", sub, None, _MS_BIND | _MS_REC, None)
    except BaseException:
        if mounted:
            _c().umount2(b"/proc", _MNT_DETACH)
        raise
    finally:
        for _s, fd in held:
            os.close(fd)


# Files the private tmpfs may hold (``shared_tmpfs``): this many per MiB of its bound, at
# least TMPFS_MIN_INODES (1 GiB: 64 Ki files, ~64 MiB of the kernel's memory at most).
TMPFS_INODES_PER_MIB: Final = 64
TMPFS_MIN_INODES: Final = 4096


def shared_tmpfs(dirs: list[str], max_mib: int, done: list[str]) -> None:
    """One new tmpfs (at most ``max_mib`` MiB and ``TMPFS_INODES_PER_MIB`` files a MiB; 0:
    the kernel's defaults, half the RAM),
    mounted at ``dirs[0]``, and a directory of it (mode 1777) bound on each of ``dirs``
    (``dirs[0]``'s over the tmpfs's root, which nothing reaches then). One budget for the
    run, whichever of them it fills: a tmpfs per directory, each bounded, let a run hold
    that bound times their number. What is mounted is appended to ``done``.
    """
    if not dirs:
        return
    # Files are bounded too: an empty file takes no block of the budget but ~1 KiB of the
    # kernel's memory (its inode and dentry, measured: 200k empty files, 0 bytes used, 200
    # MiB of slab), and the kernel's default (half the RAM's pages: 3 million inodes here)
    # let a run hold ~3 GiB beside its 1 GiB bound.
    size = f",size={max_mib}m,nr_inodes={max(TMPFS_MIN_INODES, max_mib * TMPFS_INODES_PER_MIB)}" if max_mib > 0 else ""
    _mount("tmpfs", dirs[0], "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700" + size)
    done.append(dirs[0])
    fds: list[int] = []
    try:
        for i in range(len(dirs)):
            sub = os.path.join(dirs[0], str(i))
            os.mkdir(sub)
            os.chmod(sub, 0o1777)  # (mkdir's mode goes through the umask)
            fds.append(os.open(sub, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY))
        for path, fd in zip(dirs, fds, strict=True):
            # Without flags of its own, a bind keeps the tmpfs's (nosuid, nodev).
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND, None)
            done.append(path)
    finally:
        for fd in fds:
            os.close(fd)


def _private_mounts(
    done: list[str],
    tmpfs: Iterable[str],
    read_only: Iterable[str],
    keep: Iterable[str],
    keep_ro: Iterable[str],
    check: Callable[[str, str], None] | None,
    tmpfs_max_mib: int,
) -> None:
    dirs = [p for p in tmpfs if os.path.isdir(p) and not os.path.islink(p)]
    real_ro, real = ([os.path.realpath(k) for k in ks if os.path.exists(k)] for ks in (keep_ro, keep))
    wanted = bind_plan(real_ro, real, within=dirs)
    held: list[tuple[str, bool, int]] = []
    try:
        for k, ro in wanted:
            fd = os.open(k, os.O_PATH | os.O_CLOEXEC)
            held.append((k, ro, fd))
            if check is not None:
                check(k, os.readlink(f"/proc/self/fd/{fd}"))  # what is bound: this descriptor
        shared_tmpfs(dirs, tmpfs_max_mib, done)
        for path, ro, fd in held:
            _bind_fd_at(fd, path, stat.S_ISDIR(os.fstat(fd).st_mode))
            done.append(path)
            if ro:
                _read_only_tree(path)
    finally:
        for _p, _r, fd in held:
            os.close(fd)
    for path in read_only:
        if not os.path.lexists(path) or os.path.islink(path):
            continue
        _mount(path, path, None, _MS_BIND | _MS_REC, None)
        done.append(path)
        _read_only_tree(path)


def _under(p: str, top: str) -> bool:
    return p == top or p.startswith(top.rstrip("/") + "/")


def bind_plan(read: Iterable[str], write: Iterable[str], *, within: Iterable[str]) -> list[tuple[str, bool]]:
    """What to bind back under the private tmpfs ``within`` for these (normalised) paths:
    ``(path, read_only)``, parents first.

    The topmost paths below ``within`` are bound, read-only unless written (a path is
    written when it or a directory above it is in ``write``: a write rule reaches down, as
    Landlock's does). Below a read-only bind, a written path is bound again, writable, over
    it: a write grant inside a read grant stays writable without making the rest of it so.
    """
    w = {p for p in write if p}
    tops = [d.rstrip("/") + "/" for d in within]
    plan: list[tuple[str, bool]] = []
    for p in sorted({p for p in (*read, *w) if p and p.startswith(tuple(tops))}, key=len):
        written = any(_under(p, q) for q in w)
        above = [(b, ro) for b, ro in plan if _under(p, b)]
        if not above:
            plan.append((p, not written))
        elif written and max(above, key=lambda b: len(b[0]))[1]:
            plan.append((p, False))  # a written path under a read-only bind
    return plan


def bind_fd(fd: int, path: str, *, read_only: bool = False) -> None:
    """Bind what ``fd`` (O_PATH: a descriptor of what a tmpfs covers, say, opened and
    checked by the caller) names at ``path`` in this mount namespace, making ``path`` (a
    directory, or an empty file) first; ``read_only``: the bind and every mount under it
    are (see ``private_mounts``)."""
    _bind_fd_at(fd, path, stat.S_ISDIR(os.fstat(fd).st_mode))
    if read_only:
        _read_only_tree(path)


def _bind_fd_at(fd: int, path: str, is_dir: bool) -> None:
    """Bind what ``fd`` (O_PATH) names at ``path``, made first (a directory, or an empty
    file to mount a file over)."""
    if is_dir:
        os.makedirs(path, exist_ok=True)
    elif not os.path.lexists(path):  # (one inside a read-only bind is there already)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC, None)


def drop_capabilities() -> None:
    """Drop every capability: bounding set (where allowed), ambient, effective, permitted."""
    libc = _c()
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: the set is already what it is
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")


def set_dumpable(on: bool) -> None:
    """Not dumpable: processes without CAP_SYS_PTRACE over us cannot read our memory or
    ``/proc/self/environ`` (our own children included). Reset by execve."""
    _check(_c().prctl(_PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def can_nest_user_namespace() -> bool:
    """Can a child of ours make a user namespace and map itself (what Chromium's sandbox does)?"""
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            # As dumpable as Chromium is after its execve: a non-dumpable process's /proc
            # files belong to root, so a normal user could not write its own uid_map.
            _c().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            uid = os.geteuid()
            # The namespaces Chromium's zygote is cloned into (its namespace sandbox): a
            # service that allows user namespaces but not these (systemd's
            # RestrictNamespaces=) would start a Chromium that cannot sandbox itself.
            if _c().unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET) == 0:
                # O_WRONLY without O_TRUNC, as Chromium does (Landlock handles truncation apart).
                fd = os.open("/proc/self/uid_map", os.O_WRONLY)
                try:
                    os.write(fd, f"{uid} {uid} 1".encode())
                finally:
                    os.close(fd)
                code = 0
        except BaseException:
            code = 1
        os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
