"""Run as a run's command (tests/e2e/test_sandbox_quotas.py): how much of its uid's
kernel quotas, shared with the host's other processes of that uid, the run can take.

Small numbers only: each count tried (argv) is well below the host's limit, and
everything is released before the probe exits. Prints ``key=value`` lines.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import sys

INOTIFY, QUEUES, PTYS, UTS = (int(a) for a in sys.argv[1:5])

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# add_key, keyctl by architecture (the probe's own table: it checks the filter, not with it)
KEYS = {"x86_64": (248, 250), "aarch64": (217, 219), "riscv64": (217, 219)}
_CLONE_NEWUSER, _CLONE_NEWUTS = 0x10000000, 0x04000000


def out(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def err_name(e: int) -> str:
    return errno.errorcode.get(e, str(e)) if e else "0"


def inotify() -> None:
    fds: list[int] = []
    e = 0
    for _ in range(INOTIFY):
        fd = libc.inotify_init1(os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            break
        fds.append(fd)
    out("inotify_opened", len(fds))
    out("inotify_errno", err_name(e))
    for fd in fds:
        os.close(fd)
    path = "/proc/sys/user/max_inotify_instances"
    with open(path) as f:
        out("inotify_max_seen", f.read().strip())
    try:
        with open(path, "w") as f:
            f.write("100000")
        out("inotify_raise", "0")
    except OSError as exc:
        out("inotify_raise", err_name(exc.errno or 0))


def key_count() -> str:
    """This uid's line of /proc/key-users (root's on the host, mapped): its key count."""
    try:
        with open("/proc/key-users") as f:
            for line in f:
                uid, rest = line.split(":", 1)
                if int(uid) == os.getuid():
                    return rest.split()[2].split("/")[0]  # "qnkeys/maxkeys"
    except OSError as exc:
        return f"unreadable:{err_name(exc.errno or 0)}"
    return "none"


def keys() -> None:
    add_key, keyctl = KEYS.get(os.uname().machine, (-1, -1))
    if add_key < 0:
        out("keys", "unknown-arch")
        return
    before = key_count()
    # A key in this process's own keyring: gone when the probe exits.
    rc = libc.syscall(
        ctypes.c_long(add_key), b"user", b"agentd-quota-probe", b"x", ctypes.c_size_t(1), ctypes.c_int(-2)
    )
    out("add_key_errno", err_name(ctypes.get_errno()) if rc < 0 else "0")
    out("keys_before", before)
    out("keys_after", key_count())
    # KEYCTL_GET_KEYRING_ID (0) of the session keyring (-3), not created: whose is it?
    rc = libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0))
    out("keyctl_errno", err_name(ctypes.get_errno()) if rc < 0 else "0")


class _MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]  # fmt: skip


def queues() -> None:
    """POSIX message queues of one 8 KiB message each (~8.2 KiB of RLIMIT_MSGQUEUE)."""
    try:
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
    except OSError:
        rt = libc
    rt.mq_open.restype = ctypes.c_int
    attr = _MqAttr(0, 1, 8192, 0)
    names: list[bytes] = []
    e = refused = 0
    for i in range(QUEUES):
        name = f"/agentd-quota-probe-{os.getpid()}-{i}".encode()
        fd = rt.mq_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, ctypes.byref(attr))
        if fd >= 0:
            os.close(fd)  # (the queue stays, charged, until it is unlinked)
        elif ctypes.get_errno() == errno.EACCES:
            refused += 1  # made (and charged), then its open refused by Landlock (a file open)
        else:
            e = ctypes.get_errno()
            break
        names.append(name)
    out("mq_made", len(names))
    out("mq_open_refused", refused)
    out("mq_errno", err_name(e))
    for name in names:
        rt.mq_unlink(name)  # (no file open: Landlock does not see it)
    soft, hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)
    out("mq_limit", hard)
    try:
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (soft, hard + 1 if hard >= 0 else hard))
        out("mq_raise", "0" if hard >= 0 else "unlimited")
    except ValueError:  # (what Python makes of EPERM here)
        out("mq_raise", "EPERM")
    out("sigpending_limit", resource.getrlimit(resource.RLIMIT_SIGPENDING)[1])


def ptys() -> None:
    fds: list[int] = []
    e = 0
    for _ in range(PTYS):
        try:
            fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC))
        except OSError as exc:
            e = exc.errno or 0
            break
    out("ptys_opened", len(fds))
    out("ptys_errno", err_name(e))
    for fd in fds:
        os.close(fd)


def namespaces() -> None:
    """UTS namespaces, each held by a descriptor, in a child in a user namespace of its own
    (where it may make them): charged to the run's level too (counts are hierarchical)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        made, e, held = 0, 0, []
        if libc.unshare(_CLONE_NEWUSER) != 0:
            e = ctypes.get_errno()
        else:
            for _ in range(UTS):
                if libc.unshare(_CLONE_NEWUTS) != 0:
                    e = ctypes.get_errno()
                    break
                held.append(os.open("/proc/self/ns/uts", os.O_RDONLY | os.O_CLOEXEC))
                made += 1
        os.write(w, f"uts_made={made}\nuts_errno={err_name(e)}\n".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        sys.stdout.write(f.read())
    os.waitpid(pid, 0)


for part in (inotify, keys, queues, ptys, namespaces):
    try:
        part()
    except Exception as exc:  # one part failing does not hide the others
        out(f"{part.__name__}_failed", repr(exc).replace(" ", "_"))
