"""``subagent._seccomp``: clone3 refused with ENOSYS; threads, fork and subprocesses still work."""

from __future__ import annotations

import json
import subprocess
import sys

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

out = {"before": clone3_errno()}
_seccomp.deny_clone3()
out["after"] = clone3_errno()
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
    assert out["thread"] is True
    assert out["fork"] == 7
    assert out["subprocess"] == "ok\n"
    assert out["nested"] == 0  # the filter is inherited, and a new interpreter's threads still start
