"""A run and what the kernel checks by uid alone, not as files Landlock sees: System V
IPC, terminals, cgroups, a unix socket's ``connect()``.

A segment has no path; a terminal's path is granted (the device class whole); a cgroup
is entered at a child's birth (``clone3(CLONE_INTO_CGROUP)``) by the file mode of its
``cgroup.procs``, no file opened. So a run of the daemon's uid reached the host's and the
other runs' segments and terminals, and started a child outside its cgroup that outlived
it; and it connected to a socket a tool of another run listened on in its run
directory. Each run now has its own IPC namespace (freed with its last process) and
devpts, the daemon's directories are covered in its view (``subagent/_isolate.py``), and
``clone3`` is refused (``subagent/_seccomp.py``). The
daemon runs in-process (``tests/e2e/test_sandbox.py``'s fixture); the runs are real
runners whose commands try what a prompt-injected model would.
"""

from __future__ import annotations

import ctypes
import os
import re
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


# In the run: a child born in the cgroup v2 hierarchy's root (or argv[1]), outside the
# run's cgroup, as clone3(CLONE_INTO_CGROUP) makes one; it leaves the session and sleeps.
ESCAPE = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
root = next(line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup2 " in line)
fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
args = struct.pack("11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd)
buf = ctypes.create_string_buffer(args, len(args))
pid = libc.syscall(ctypes.c_long(435), buf, ctypes.c_size_t(len(args)))
if pid == 0:
    os.setsid()
    null = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(null, i)
    os.execv("/bin/sleep", ["sleep", "60"])
elif pid < 0:
    print("clone3=%d" % ctypes.get_errno(), flush=True)
else:
    print("escaped=%d" % pid, flush=True)
"""


async def test_a_run_starts_no_child_outside_its_cgroup(daemon: Daemon) -> None:  # noqa: F811
    d = daemon
    escaped: list[int] = []
    try:
        with trio.fail_after(SCENARIO_S):
            r = await d.m.spawn(scripted([command(f"{sys.executable} -c '{ESCAPE}'")]))
            st = await d.m.wait_terminal(r["run_id"])
        conftest.require(st.get("containment") == "cgroup", "cgroup containment (a cgroup v2 the daemon may write)")
        (out,) = outputs(st)
        escaped = [int(p) for p in re.findall(r"escaped=(\d+)", out)]
        assert not escaped, f"a child of the run was born outside its cgroup and outlived it: {out}"
        assert "clone3=38" in out, out  # ENOSYS: what a kernel without clone3 says
        assert "clone3" in st["sandbox"]["denied_syscalls"], st["sandbox"]
        assert st["state"] == "completed", st
    finally:
        # The run's escaped child (it named itself, and carries this test's mark): end it,
        # as the stop did not, before the daemon cleans its cgroups up.
        for p in conftest.leftovers(os.environ[conftest.MARK_VAR], set()):
            if p.pid in escaped:
                conftest.kill_exactly(p)


# In one run: a unix socket in its run directory (a tool's server, Chromium's singleton
# socket in its TMPDIR), waiting for one connection; what it gets is printed.
LISTEN = r"""
import socket
s = socket.socket(socket.AF_UNIX)
s.bind("listening.sock")
s.listen(1)
c, _ = s.accept()
print("got=" + c.recv(100).decode(), flush=True)
"""
# In another: connect to that socket (argv[1]) and write to it.
CONNECT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    s.sendall(b"from-another-run")
    print("connect=0")
except OSError as exc:
    print("connect=%d" % exc.errno)
"""


async def test_a_run_cannot_connect_to_a_socket_in_another_runs_directory(daemon: Daemon) -> None:  # noqa: F811
    # Landlock keeps a run from opening another run's files, not from connect() to a unix
    # socket there: the daemon's directories are covered in the run's view.
    d = daemon
    with trio.fail_after(SCENARIO_S):
        other = await d.m.spawn(scripted([command(f"{sys.executable} -c '{LISTEN}'")]))
        st = await d.m.status(other["run_id"])
        while not st.get("run_dir"):
            await trio.sleep(0.02)
            st = await d.m.status(other["run_id"])
        sock = os.path.join(st["run_dir"], "listening.sock")
        while not os.path.exists(sock):  # (the other run's command is starting)
            await trio.sleep(0.02)
        r = await d.m.spawn(scripted([command(f"{sys.executable} -c '{CONNECT}' {sock}")]))
        st = await d.m.wait_terminal(r["run_id"])
        own_namespace(st)
        await d.m.cancel(other["run_id"])
        other_st = await d.m.wait_terminal(other["run_id"])
    (out,) = outputs(st)
    assert "connect=0" not in out, out
    assert "from-another-run" not in outputs(other_st)[0], outputs(other_st)
    assert st["state"] == "completed", st
