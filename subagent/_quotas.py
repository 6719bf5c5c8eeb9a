"""A run's share of the kernel's per-user quotas, which it shares with its uid on the host.

The kernel counts some objects per user, not per cgroup: a root daemon's run (uid 0 on
the host) drew on the host's root's quota (``fs.inotify.max_user_instances``, 128 for all
of root: the daemon's ``cgroup.events`` watches, systemd's), a normal user's on that
user's. Inotify instances and watches, fanotify groups and marks, and namespaces are
counted per user namespace *and* charged to each ancestor's (``ucounts``), each level
checked against its own limit: ``limit_user_namespace`` lowers the limits of the run's
own namespace (``/proc/sys/user``, INT_MAX in a new one: no cap but the host's), written
by the runner while it holds CAP_SYS_RESOURCE there, before ``/proc/sys`` is read-only.
No process of the run can raise them: it has no capability in that namespace, and one it
makes sees its own table, whose counts are charged to the run's too. Message queue
bytes and queued signals are rlimits (``limit_rlimits``; they hold without a namespace
too: raising a hard limit needs CAP_SYS_RESOURCE on the host). Terminals: the run's
devpts ``max=`` (``_isolate.private_devpts``). Keys are counted per uid on the host,
whatever the namespace: ``_seccomp`` refuses their calls. Stdlib only.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Mapping
from typing import Final

__all__ = [
    "INOTIFY_INSTANCES",
    "INOTIFY_WATCHES",
    "NAMESPACES",
    "MSGQUEUE_BYTES",
    "SIGPENDING",
    "PTYS",
    "UNCAPPED",
    "user_limits",
    "limit_user_namespace",
    "limit_rlimits",
]

# Per run (each run has its own share; ``max_concurrent`` runs together can hold that many
# times it). inotify instances: the host's root has 128 for everything it runs; a browser
# run (node, Chromium) uses a few.
INOTIFY_INSTANCES: Final = 16
# inotify watches (each ~1 KiB of the run's own memory): the kernel's old default for a
# whole user; a tool watching a big tree (a dev server) may want more.
INOTIFY_WATCHES: Final = 16384
# fanotify (unprivileged since Linux 5.13): 128 groups for all of a user; nothing of a run uses it.
FANOTIFY_GROUPS: Final = 8
FANOTIFY_MARKS: Final = 8192
# Namespaces of each kind the run may make (Chromium's sandbox makes a few).
NAMESPACES: Final = 64
NAMESPACE_KINDS: Final = ("user", "mnt", "ipc", "pid", "net", "uts", "cgroup", "time")
# POSIX message queues, in bytes (a user's default: 819200); two queues of the default
# size (10 messages of 8 KiB).
MSGQUEUE_BYTES: Final = 204800
# Signals queued to the run's processes at once (root's default: ~the RAM's pages / 32).
SIGPENDING: Final = 4096
# Terminals open at once in the run's devpts (all instances but the host's share 3072).
PTYS: Final = 64

USER_LIMITS_DIR: Final = "/proc/sys/user"
# What ``status`` says (``sandbox.problems``) where the namespace's caps could not be set.
UNCAPPED: Final = "the run shares its uid's inotify instances and watches, fanotify groups and namespaces with the host"


def user_limits(inotify_instances: int = INOTIFY_INSTANCES, inotify_watches: int = INOTIFY_WATCHES) -> dict[str, int]:
    """The limits of a run's user namespace (``/proc/sys/user`` names); a 0 is left out
    (no cap of the run's own: the host's)."""
    limits = {
        "max_inotify_instances": inotify_instances,
        "max_inotify_watches": inotify_watches,
        "max_fanotify_groups": FANOTIFY_GROUPS,
        "max_fanotify_marks": FANOTIFY_MARKS,
        **{f"max_{kind}_namespaces": NAMESPACES for kind in NAMESPACE_KINDS},
    }
    return {k: v for k, v in limits.items() if v > 0}


def limit_user_namespace(limits: Mapping[str, int], directory: str = USER_LIMITS_DIR) -> dict[str, int]:
    """Write ``limits`` into this process's user namespace (it must hold CAP_SYS_RESOURCE
    there: a namespace of its own); returns what was set. A limit this kernel does not
    have is skipped.

    Raises:
        OSError: one could not be written (no namespace of its own, /proc/sys read-only).
    """
    done: dict[str, int] = {}
    for name, value in limits.items():
        try:
            fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
        done[name] = value
    return done


def limit_rlimits(msgqueue: int = MSGQUEUE_BYTES, sigpending: int = SIGPENDING) -> dict[str, int]:
    """Lower this process's RLIMIT_MSGQUEUE and RLIMIT_SIGPENDING, soft and hard (never
    raise them); returns what they are now.

    Raises:
        OSError: the kernel refused.
    """
    done: dict[str, int] = {}
    for name, res, value in (
        ("RLIMIT_MSGQUEUE", resource.RLIMIT_MSGQUEUE, msgqueue),
        ("RLIMIT_SIGPENDING", resource.RLIMIT_SIGPENDING, sigpending),
    ):
        _soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(res, (value, value))
        except ValueError as exc:  # (Python's word for EINVAL and EPERM here)
            raise OSError(errno.EPERM, f"setrlimit({name}, {value}): {exc}") from None
        done[name] = value
    return done
