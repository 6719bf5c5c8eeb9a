"""A run and what the kernel checks by uid alone, not as files Landlock sees: System V
IPC, terminals.

A segment has no path; a terminal's path is granted (the device class whole). So a run
of the daemon's uid reached the host's and the other runs' segments and terminals, and
left segments that outlived it. Each run now has its own IPC namespace (freed with its
last process) and devpts (``subagent/_isolate.py``). The daemon runs in-process
(``tests/e2e/test_sandbox.py``'s fixture); the runs are real runners whose commands try
what a prompt-injected model would.
"""

from __future__ import annotations

import ctypes
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from tests import conftest
from tests.e2e.test_sandbox import SCENARIO_S, Daemon, command, outputs, scripted
from tests.e2e.test_sandbox import daemon as daemon  # noqa: F401 - the fixture
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture
from tests.e2e.test_sandbox import state_dir as state_dir  # noqa: F401 - the fixture

_IPC_CREAT = 0o1000
_IPC_RMID = 0
HOST_BYTES = b"host-segment-7f3a"

# In the run: attach the host's segment (its id in argv[1]) and overwrite it; make a
# segment of its own (key argv[2]) and leave it, as a run that outlives its stop would.
SYSV = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
p = libc.shmat(int(sys.argv[1]), None, 0)
if p is None or p == ctypes.c_void_p(-1).value:
    print("host_attach=denied", ctypes.get_errno())
else:
    ctypes.memmove(p, b"written-by-a-run!", 17)
    print("host_attach=0")
own = libc.shmget(int(sys.argv[2]), 1 << 20, 0o1600)
print("own_segment=%d" % own)
"""


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    return libc


def host_segments() -> dict[int, int]:
    """The host's System V shared memory segments: key -> id."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return {int(r[0]): int(r[1]) for r in rows if len(r) > 1}


@contextmanager
def host_segment() -> Iterator[tuple[int, int]]:
    """A segment of the host's (this process's uid), holding HOST_BYTES: (id, address)."""
    libc = _libc()
    shmid = libc.shmget(0, 4096, _IPC_CREAT | 0o600)  # IPC_PRIVATE
    assert shmid >= 0, ctypes.get_errno()
    addr = libc.shmat(shmid, None, 0)
    try:
        ctypes.memmove(addr, HOST_BYTES, len(HOST_BYTES))
        yield shmid, addr
    finally:
        libc.shmdt(ctypes.c_void_p(addr))
        libc.shmctl(shmid, _IPC_RMID, None)


def own_namespace(st: dict[str, Any]) -> None:
    conftest.require("/tmp" in st["sandbox"].get("private", []), "a run with its own namespaces (user namespaces)")


async def test_a_run_reaches_no_host_sysv_segment_and_leaves_none(daemon: Daemon) -> None:  # noqa: F811
    d = daemon
    key = int.from_bytes(uuid.uuid4().bytes[:3], "big") + 0x100000  # never IPC_PRIVATE
    with host_segment() as (shmid, addr):
        try:
            with trio.fail_after(SCENARIO_S):
                r = await d.m.spawn(scripted([command(f"{sys.executable} -c '{SYSV}' {shmid} {key}")]))
                st = await d.m.wait_terminal(r["run_id"])
            own_namespace(st)
            assert st["state"] == "completed", st
            (out,) = outputs(st)
            assert "host_attach=denied" in out, out
            assert ctypes.string_at(addr, len(HOST_BYTES)) == HOST_BYTES
            assert "own_segment=-1" not in out, out  # it could make one: in its own namespace
            # What the run made is not the host's: nothing of it outlives the run there.
            assert key not in host_segments(), out
        finally:
            leaked = host_segments().get(key)
            if leaked is not None:
                _libc().shmctl(leaked, _IPC_RMID, None)


async def test_a_run_reaches_no_host_terminal_and_has_its_own(daemon: Daemon) -> None:  # noqa: F811
    d = daemon
    master, slave = os.openpty()  # a terminal of the host's: a person's shell, say
    try:
        name = os.ttyname(slave)
        probe = "; ".join(
            [
                f"echo injected-by-a-run > {name}; echo write=$?",
                f"{sys.executable} -c 'import os; m, s = os.openpty(); print(\"own=\" + os.ttyname(s))'",
            ]
        )
        with trio.fail_after(SCENARIO_S):
            r = await d.m.spawn(scripted([command(probe)]))
            st = await d.m.wait_terminal(r["run_id"])
        own_namespace(st)
        assert st["state"] == "completed", st
        (out,) = outputs(st)
        os.set_blocking(master, False)
        try:
            typed = os.read(master, 4096)
        except BlockingIOError:
            typed = b""
        assert b"injected" not in typed, (typed, out)
        assert "write=0" not in out, out
        assert "own=/dev/pts/" in out, out  # a terminal of its own still opens
        assert "/dev/pts" in st["sandbox"]["private"], st["sandbox"]
    finally:
        os.close(master)
        os.close(slave)
