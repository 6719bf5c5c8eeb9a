"""``subagent._seccomp``: clone3, the new mount calls, io_uring and the key calls refused with ENOSYS; threads, fork,
subprocesses and the calls sharing a key call's number in another table still work."""

from __future__ import annotations

import json
import subprocess
import sys

from subagent import _seccomp
from tests import conftest

# In a child of its own (the filter cannot be lifted): clone3 before and after the filter,
# then what a runner and its tools do that glibc may do through clone3.
CHILD = r"""
import ctypes, errno, json, os, struct, subprocess, sys, threading
from subagent import _seccomp
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def clone3_errno():
    # An invalid size: a kernel that runs clone3 says EINVAL, a refused one ENOSYS.
    args = struct.pack("11Q", 0, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
    buf = ctypes.create_string_buffer(args, len(args))
    rc = libc.syscall(ctypes.c_long(_seccomp.SYS_CLONE3), buf, ctypes.c_size_t(1))
    return ctypes.get_errno() if rc < 0 else 0

# keyctl, add_key by this machine's table; then the number i386's keyctl has (accept4 on
# x86-64): a bad descriptor, not refused.
KEYS = {"x86_64": (250, 248, 288), "aarch64": (219, 217, None)}.get(os.uname().machine)

def errno_of(nr, *args):
    rc = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return ctypes.get_errno() if rc < 0 else 0

def keys():
    if KEYS is None:
        return None
    keyctl, add_key, other = KEYS
    got = {"keyctl": errno_of(keyctl, 0, -3, 0)}  # KEYCTL_GET_KEYRING_ID of the session keyring
    got["add_key"] = errno_of(add_key, 0, 0, 0, 0, 0)  # no type: EFAULT, unless refused
    if other is not None:
        got["other"] = errno_of(other, -1, 0, 0, 0)
    return got

def mounts():
    # Each with arguments the kernel refuses (a bad descriptor or name): EBADF, EFAULT or
    # EINVAL where it runs the call; ENOSYS where the filter refuses it.
    return {name: errno_of(nr, -1, 0, 0, 0, 0) for name, nr in _seccomp.NEW_MOUNT_CALLS.items()}

def urings():
    # A bad descriptor or size: EBADF, EFAULT or EINVAL where the kernel runs the call.
    return {name: errno_of(nr, -1, 0, 0, 0, 0) for name, nr in _seccomp.IO_URING_CALLS.items()}

out = {"before": clone3_errno(), "keys_before": keys(), "mounts_before": mounts(), "urings_before": urings()}
_seccomp.deny_syscalls()
out["after"] = clone3_errno()
out["keys_after"] = keys()
out["mounts_after"] = mounts()
out["urings_after"] = urings()
box = []
t = threading.Thread(target=lambda: box.append(1))
t.start(); t.join()
out["thread"] = box == [1]
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["subprocess"] = subprocess.run(["/bin/sh", "-c", "echo ok"], capture_output=True, text=True).stdout
out["nested"] = subprocess.run([sys.executable, "-c", "import threading; t = threading.Thread(target=print); t.start(); t.join()"]).returncode
print(json.dumps(out))
"""


def test_clone3_is_refused_and_the_rest_works() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    conftest.require(out["before"] != 38, "a kernel with clone3 (5.3+)")
    assert out["after"] == 38  # ENOSYS, as if the kernel had none: glibc then uses clone
    conftest.require(out["keys_before"] is not None, "a machine whose key call numbers the test knows")
    assert out["keys_before"]["keyctl"] != 38 and out["keys_before"]["add_key"] == 14  # EFAULT: the kernel's
    assert out["keys_after"]["keyctl"] == out["keys_after"]["add_key"] == 38, out  # ENOSYS
    if "other" in out["keys_after"]:
        assert out["keys_after"]["other"] == out["keys_before"]["other"] == 9, out  # EBADF: accept4 runs
    assert set(_seccomp.KEY_CALLS) <= set(_seccomp.DENIED)
    assert 38 not in out["mounts_before"].values(), out["mounts_before"]  # the kernel has them (5.12+)
    assert set(out["mounts_after"].values()) == {38}, out["mounts_after"]
    assert set(_seccomp.NEW_MOUNT_CALLS) <= set(_seccomp.DENIED)
    conftest.require(38 not in out["urings_before"].values(), "a kernel with io_uring on (5.1+)")
    assert set(out["urings_after"].values()) == {38}, out["urings_after"]  # ENOSYS
    assert set(_seccomp.IO_URING_CALLS) <= set(_seccomp.DENIED)
    assert out["thread"] is True
    assert out["fork"] == 7
    assert out["subprocess"] == "ok\n"
    assert out["nested"] == 0  # the filter is inherited, and a new interpreter's threads still start
