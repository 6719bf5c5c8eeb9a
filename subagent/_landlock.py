"""Landlock through ``ctypes``: the three system calls, the access bits, and a ruleset builder.

Landlock (Linux 5.13+) lets an unprivileged process restrict itself, and everything it
starts afterwards, to the file hierarchies it lists; the restriction can only be narrowed
later, never lifted. A restricted process can also no longer ptrace (nor read
``/proc/PID/mem`` or ``environ`` of) a process outside its domain, and with ABI 6 it can
no longer signal one or connect to an abstract unix socket one created.

Rules grant, nothing denies: a path is reachable if some granted hierarchy holds it.
``plan_rules`` turns "grant these trees, but never these paths inside them" into grants
Landlock can express, by granting the siblings along the way to each protected path
instead of its ancestor. Stdlib only; Linux only (``available()`` is 0 elsewhere).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LandlockError",
    "Grant",
    "abi_version",
    "handled_fs",
    "plan_rules",
    "restrict_self",
    "Ruleset",
    "FS_READ",
    "FS_WRITE",
    "FS_FILE_ONLY",
    "SCOPE_ABSTRACT_UNIX_SOCKET",
    "SCOPE_SIGNAL",
]

# Same numbers on every architecture (they were added after the tables were unified).
_SYS_CREATE_RULESET: Final = 444
_SYS_ADD_RULE: Final = 445
_SYS_RESTRICT_SELF: Final = 446
_CREATE_RULESET_VERSION: Final = 1
_RULE_PATH_BENEATH: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38

# Filesystem access bits (uapi/linux/landlock.h), with the ABI that introduced them.
EXECUTE: Final = 1 << 0
WRITE_FILE: Final = 1 << 1
READ_FILE: Final = 1 << 2
READ_DIR: Final = 1 << 3
REMOVE_DIR: Final = 1 << 4
REMOVE_FILE: Final = 1 << 5
MAKE_CHAR: Final = 1 << 6
MAKE_DIR: Final = 1 << 7
MAKE_REG: Final = 1 << 8
MAKE_SOCK: Final = 1 << 9
MAKE_FIFO: Final = 1 << 10
MAKE_BLOCK: Final = 1 << 11
MAKE_SYM: Final = 1 << 12
REFER: Final = 1 << 13  # ABI 2: rename/link across directories
TRUNCATE: Final = 1 << 14  # ABI 3
IOCTL_DEV: Final = 1 << 15  # ABI 5

_FS_BY_ABI: Final = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}

# Scopes (ABI 6): no connecting to abstract unix sockets, no signals, outside the domain.
SCOPE_ABSTRACT_UNIX_SOCKET: Final = 1 << 0
SCOPE_SIGNAL: Final = 1 << 1

FS_READ: Final = EXECUTE | READ_FILE | READ_DIR
FS_WRITE: Final = (
    FS_READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_SYM
    | REFER | TRUNCATE
)  # fmt: skip
# The only rights a rule on a file (not a directory) may carry.
FS_FILE_ONLY: Final = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


class LandlockError(OSError):
    """A Landlock system call failed (``errno`` and ``what`` say which and why)."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}")
        self.what = what


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc: ctypes.CDLL | None = None


def _syscall() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = _syscall()
    except OSError:
        return 0
    res = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(res), 0)


def handled_fs(abi: int) -> int:
    """Every filesystem right this ABI knows: all of them are handled (denied unless granted)."""
    if abi <= 0:
        return 0
    return _FS_BY_ABI.get(abi, (1 << 16) - 1)


@dataclass(frozen=True, slots=True)
class Grant:
    path: str
    access: int


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def plan_rules(grants: Iterable[Grant], protect: Sequence[str]) -> list[Grant]:
    """Grants that give ``grants`` except anything at or below a ``protect`` path.

    A grant whose tree holds a protected path is replaced by grants on each entry of its
    directory (recursively along the way), skipping the protected one and symlinks (a rule
    follows a link to its target, which could be the protected path), and other hard links
    to a protected file found in those directories (a rule follows the file, not its path:
    links elsewhere in a granted tree are not looked for, ``_links``). Entries created
    later in such a directory are not covered, nor is listing the directory itself. A grant at or below a protected path is kept
    as it is: it is explicit (a run's own directory inside the state directory). Paths
    that do not exist are dropped. Pure apart from reading directories.
    """
    prot = [os.path.realpath(p) for p in protect]
    linked = _linked(prot)
    out: list[Grant] = []
    for g in grants:
        try:
            path = os.path.realpath(g.path)
            st = os.stat(path)
        except OSError:
            continue
        out.extend(_split(path, g.access, stat.S_ISDIR(st.st_mode), prot, linked))
    return out


def _linked(protect: list[str]) -> set[tuple[int, int]]:
    """(device, inode) of each protected file that has other hard links."""
    out = set()
    for p in protect:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            out.add((st.st_dev, st.st_ino))
    return out


def _is_linked(entry: os.DirEntry[str], linked: set[tuple[int, int]]) -> bool:
    if not any(ino == entry.inode() for _, ino in linked):  # (the entry's inode: no stat call)
        return False
    st = entry.stat(follow_symlinks=False)
    return (st.st_dev, st.st_ino) in linked


def _split(path: str, access: int, is_dir: bool, protect: list[str], linked: set[tuple[int, int]]) -> list[Grant]:
    if not is_dir:
        # A protected file (``/etc/shadow`` in ``/etc``) is skipped as a directory is.
        return [] if path in protect else [Grant(path, access & FS_FILE_ONLY)]
    inside = [p for p in protect if _under(p, path)]
    if not inside:
        return [Grant(path, access)]
    if path in inside:
        return []
    # No right on the directory itself: a rule on a directory reaches everything below it,
    # the protected path included. (Listing it is refused; its entries are granted.)
    out: list[Grant] = []
    try:
        entries = list(os.scandir(path))
    except OSError:
        return out
    for entry in entries:
        try:
            if entry.is_symlink():
                continue
            is_dir = entry.is_dir(follow_symlinks=False)  # the entry's type: no stat call
            if not is_dir and _is_linked(entry, linked):
                continue  # another hard link to a protected file, beside the way to it
        except OSError:
            continue
        out.extend(_split(entry.path, access, is_dir, protect, linked))
    return out


def _open_path(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_CLOEXEC)


def restrict_self(grants: Iterable[Grant], *, abi: int, scoped: int = 0, no_new_privs: bool = True) -> int:
    """Restrict this thread (call it before any other thread exists) to ``grants``.

    Every filesystem right of ``abi`` is handled; ``scoped`` adds ABI 6 scopes. Rights the
    ABI does not know are dropped from grants. Returns the number of rules added.

    Raises:
        LandlockError: Landlock is missing, or a call failed.
    """
    ruleset = Ruleset(abi=abi, scoped=scoped)
    try:
        added = ruleset.add(grants)
        ruleset.restrict(no_new_privs=no_new_privs)
    finally:
        ruleset.close()
    return added


class Ruleset:
    """A Landlock ruleset built in steps: ``add`` grants (some early, say, in a runner
    forked ahead, ``subagent.zygote``), then ``restrict`` this thread to it. What
    ``restrict_self`` does at once.

    Raises:
        LandlockError: Landlock is missing, or a call failed (any method).
    """

    def __init__(self, *, abi: int, scoped: int = 0) -> None:
        if abi <= 0:
            raise LandlockError(errno.EOPNOTSUPP, "landlock is not available")
        self._libc = _syscall()
        self.abi = abi
        self._fs = handled_fs(abi)
        attr = _RulesetAttr(handled_access_fs=self._fs, handled_access_net=0, scoped=scoped if abi >= 6 else 0)
        size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
        fd = int(self._libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)))
        if fd < 0:
            raise LandlockError(ctypes.get_errno(), "landlock_create_ruleset")
        self.fd = fd

    def add(self, grants: Iterable[Grant]) -> int:
        """Add a rule per grant (rights of this ABI only); returns how many were added."""
        libc, fs = self._libc, self._fs
        added = 0
        for g in grants:
            access = g.access & fs
            if not access:
                continue
            try:
                pfd = _open_path(g.path)
            except OSError:
                continue  # gone since it was planned
            try:
                rule = _PathBeneathAttr(allowed_access=access, parent_fd=pfd)
                res = libc.syscall(_SYS_ADD_RULE, self.fd, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
                if res < 0:
                    err = ctypes.get_errno()
                    if err == errno.EINVAL and not os.path.isdir(g.path):
                        # A file with directory rights: keep the file ones.
                        rule.allowed_access = access & FS_FILE_ONLY
                        res = libc.syscall(
                            _SYS_ADD_RULE, self.fd, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)
                        )
                        err = ctypes.get_errno()
                    if res < 0:
                        raise LandlockError(err, f"landlock_add_rule {g.path!r}")
                added += 1
            finally:
                os.close(pfd)
        return added

    def restrict(self, *, no_new_privs: bool = True) -> None:
        """Restrict this thread (and what it starts from now on) to the rules added."""
        libc = self._libc
        if no_new_privs and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise LandlockError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_RESTRICT_SELF, self.fd, ctypes.c_uint32(0)) != 0:
            raise LandlockError(ctypes.get_errno(), "landlock_restrict_self")

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
