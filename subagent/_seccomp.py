"""The system calls a run may not make: ``clone3``, the new mount API, ``io_uring`` and the key calls, through a seccomp filter.

``clone3(CLONE_INTO_CGROUP)`` starts a child in any cgroup v2 whose directory the caller
can open (``O_PATH``: reading ``/sys`` is enough) and whose ``cgroup.procs`` (and the
common ancestor's) it could write by its file mode. The kernel checks that mode itself
(``inode_permission``, no file is opened), so Landlock, which checks files as they are
opened, never sees it: a process of a root daemon's run (uid 0 on the host, every
``cgroup.procs`` its owner's) started a child in the hierarchy's root, outside its run's
cgroup, its calls' and the per-run limits, and the child outlived the run and its stop.
A normal user's run could do the same anywhere in the cgroups delegated to that user.
Seccomp cannot read ``clone3``'s arguments (a pointer), so the call is refused whole.

``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``: a file registered with a
ring is held by the ring alone, out of ``/proc/PID/fd`` and ``maps`` (measured: 8 MiB
written to a tmpfs, registered, closed and unlinked stayed taken, with nothing in either
listing but ``anon_inode:[io_uring]``), so a run could fill the state dir's filesystem
out of the disk guard's sight; and the interface is a large attack surface. Docker's
default profile refuses them too; libuv (node) falls back to its thread pool on
``ENOSYS``; Chromium and Python do not use them.

``add_key``, ``request_key``, ``keyctl``: the kernel's key quota is per uid on the host,
whatever the user namespace (``kernel.keys.root_maxkeys``/``root_maxbytes`` for uid 0):
a root daemon's run filled the host's root's, and reached the keyrings it inherits (the
daemon's session keyring). Docker's default profile refuses them too. Nothing of a run
needs them (Chromium, node, Python do not use keys).

Refused with ``ENOSYS``: what a kernel without the call says (no clone3 before 5.3, no
keys without ``CONFIG_KEYS``), which callers handle: the C library then uses ``clone``
(glibc's ``pthread_create``, ``posix_spawn``; container runtimes refuse clone3 the same
way), keyutils' users fall back (a Kerberos cache in a file). ``EPERM`` reads as "not
allowed here" and makes some give up. ``fork``, ``vfork`` and ``clone`` are untouched.
The filter is inherited by everything the process starts, and kept across ``execve``;
it needs ``no_new_privs`` (set here, as Landlock sets it).

Stdlib only (``ctypes``), Linux only. One thread: a filter applies to the calling thread
(and what it starts), so install it before any other thread exists.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Final

__all__ = ["DENIED", "IO_URING_CALLS", "KEY_CALLS", "NEW_MOUNT_CALLS", "SYS_CLONE3", "deny_syscalls"]

# The same number in every architecture's table, its compat ones included (added after
# the tables were unified).
SYS_CLONE3: Final = 435
# The mount API of Linux 5.2+ (and ``mount_setattr``, 5.12): numbered alike in every table,
# as ``clone3``. Landlock refuses a sandboxed process every mount, but not ``fsopen`` +
# ``fsconfig(FSCONFIG_CMD_CREATE)``: a run inside a user and mount namespace of its own
# made a new superblock per call (devpts, tmpfs), kept by a descriptor, 4-9 KiB of kernel
# memory each mostly outside its memory limit, bounded only by its open files. Nothing of
# a run mounts (the runner's own mounts are made before the filter).
NEW_MOUNT_CALLS: Final = {
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
# io_uring (Linux 5.1+), numbered alike in every table too.
IO_URING_CALLS: Final = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
KEY_CALLS: Final = ("add_key", "request_key", "keyctl")
# Their numbers differ by architecture, keyed here by the AUDIT_ARCH_* value the kernel
# gives the filter: a 32-bit process on a 64-bit kernel calls through its own table (x86's
# ``int 0x80``: 288 is keyctl there, accept4 in x86-64's), so the filter checks it too.
_KEY_NUMBERS: Final = {
    0xC000003E: (248, 249, 250),  # x86-64 (and x32, its bit masked)
    0x40000003: (286, 287, 288),  # i386
    0xC00000B7: (217, 218, 219),  # aarch64
    0x40000028: (309, 310, 311),  # arm (EABI)
    0xC00000F3: (217, 218, 219),  # riscv64
}
# ``os.uname().machine`` of the kernels whose own table is above.
_KEY_MACHINES: Final = ("x86_64", "i386", "i686", "aarch64", "arm64", "armv7l", "armv8l", "riscv64")
# What the filter refuses on this machine (``status``'s ``sandbox.denied_syscalls``).
DENIED: Final = (
    "clone3",
    *NEW_MOUNT_CALLS,
    *IO_URING_CALLS,
    *(KEY_CALLS if os.uname().machine in _KEY_MACHINES else ()),
)

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
_ARCH_OFFSET: Final = 4  # offsetof(struct seccomp_data, arch)
_DENY: Final = -1  # a jump target in ``_program``: the ERRNO return


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _program() -> bytes:
    """The filter (struct sock_filter each)::

    nr = nr & ~x32 bit; if nr == clone3 or nr in the new mount or io_uring calls: DENY
    for each architecture in _KEY_NUMBERS:
        if arch == it: (nr = nr & ~x32 bit; if nr in its key calls: DENY); ALLOW
    ALLOW
    DENY: ERRNO(ENOSYS)
    """
    load_nr = [(_BPF_LD_W_ABS, 0, 0, _NR_OFFSET), (_BPF_ALU_AND_K, 0, 0, ~_X32_SYSCALL_BIT & 0xFFFFFFFF)]
    allow = (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW)
    # (code, jump-if-true, jump-if-false, k): a _DENY jump is resolved below.
    insns: list[tuple[int, int, int, int]] = [*load_nr, (_BPF_JEQ_K, _DENY, 0, SYS_CLONE3)]
    insns += [(_BPF_JEQ_K, _DENY, 0, nr) for nr in (*NEW_MOUNT_CALLS.values(), *IO_URING_CALLS.values())]
    insns.append((_BPF_LD_W_ABS, 0, 0, _ARCH_OFFSET))
    for arch, numbers in _KEY_NUMBERS.items():
        block = [*load_nr, *((_BPF_JEQ_K, _DENY, 0, nr) for nr in numbers), allow]
        insns.append((_BPF_JEQ_K, 0, len(block), arch))  # another architecture: its check next
        insns += block
    insns.append(allow)
    deny = len(insns)
    insns.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS))
    resolved = [(c, deny - pc - 1 if jt == _DENY else jt, jf, k) for pc, (c, jt, jf, k) in enumerate(insns)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in resolved)


def deny_syscalls() -> None:
    """From now on ``clone3``, the new mount calls, the io_uring calls and the key calls fail with ``ENOSYS`` in this process and
    everything it starts. Sets ``no_new_privs``.

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
