"""The one system call a run may not make: ``clone3``, through a seccomp filter.

``clone3(CLONE_INTO_CGROUP)`` starts a child in any cgroup v2 whose directory the caller
can open (``O_PATH``: reading ``/sys`` is enough) and whose ``cgroup.procs`` (and the
common ancestor's) it could write by its file mode. The kernel checks that mode itself
(``inode_permission``, no file is opened), so Landlock, which checks files as they are
opened, never sees it: a process of a root daemon's run (uid 0 on the host, every
``cgroup.procs`` its owner's) started a child in the hierarchy's root, outside its run's
cgroup, its calls' and the per-run limits, and the child outlived the run and its stop.
A normal user's run could do the same anywhere in the cgroups delegated to that user.

Seccomp cannot read ``clone3``'s arguments (a pointer), so the call is refused whole,
with ``ENOSYS``: what a kernel without it says, to which the C library answers with
``clone`` (glibc's ``pthread_create``, ``posix_spawn``; container runtimes refuse it the
same way). ``fork``, ``vfork`` and ``clone`` are untouched; nothing of a run needs
``clone3``. The filter is inherited by everything the process starts, and kept across
``execve``; it needs ``no_new_privs`` (set here, as Landlock sets it).

Stdlib only (``ctypes``), Linux only. One thread: a filter applies to the calling thread
(and what it starts), so install it before any other thread exists.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Final

__all__ = ["DENIED", "SYS_CLONE3", "deny_clone3"]

# The same number in every architecture's table, its compat ones included (added after
# the tables were unified).
SYS_CLONE3: Final = 435
DENIED: Final = ("clone3",)

_PR_SET_NO_NEW_PRIVS: Final = 38
_PR_SET_SECCOMP: Final = 22
_SECCOMP_MODE_FILTER: Final = 2
_SECCOMP_RET_ALLOW: Final = 0x7FFF0000
_SECCOMP_RET_ERRNO: Final = 0x00050000
# x86-64's x32 ABI numbers its calls from this bit on: clone3 there is 435 with it.
_X32_SYSCALL_BIT: Final = 0x40000000

# Classic BPF opcodes (linux/filter.h).
_BPF_LD_W_ABS: Final = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_ALU_AND_K: Final = 0x54  # BPF_ALU | BPF_AND | BPF_K
_BPF_JEQ_K: Final = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_RET_K: Final = 0x06  # BPF_RET | BPF_K
_NR_OFFSET: Final = 0  # offsetof(struct seccomp_data, nr)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _program() -> bytes:
    """nr &= ~x32 bit; nr == clone3 ? ERRNO(ENOSYS) : ALLOW (struct sock_filter each)."""
    insns = [
        (_BPF_LD_W_ABS, 0, 0, _NR_OFFSET),
        (_BPF_ALU_AND_K, 0, 0, ~_X32_SYSCALL_BIT & 0xFFFFFFFF),
        (_BPF_JEQ_K, 0, 1, SYS_CLONE3),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)


def deny_clone3() -> None:
    """From now on ``clone3`` fails with ``ENOSYS`` in this process and everything it
    starts. Sets ``no_new_privs``.

    Raises:
        OSError: the kernel refused the filter (no seccomp in it, say).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    code = _program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
