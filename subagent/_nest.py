"""The nest: one user namespace the daemon holds, all its runs' namespaces its children.

The kernel's per-user counts (inotify instances and watches, fanotify groups and marks,
namespaces) are charged at every level of a user namespace chain, to the uid that made
the namespace below, each level checked against its own ``/proc/sys/user`` limits
(``ucounts``). Each run caps its own namespace (``_quotas``), but ``max_concurrent`` runs
at their caps add up: eight runs at 16 inotify instances held all 128 of the host's root
(its daemon's, systemd's). So the daemon has one namespace made, the nest, whose limits
bound every run together (``totals``), and each runner joins it (``join``: ``setns``,
single-threaded, after what it does as the host's root and before its own ``unshare``),
so its own namespace is the nest's child and all it counts is charged at the nest too.

The holder (``python -m subagent._nest LIMITS``, stdin a unix socket; ``main``) makes
it: a new user namespace mapping the daemon's uid and gid as they are (only those: a
run's own namespace maps only its runner's uid anyway, and a process may map its own id
without CAP_SETUID in the host's namespace, which the systemd unit's root lacks), its
limits written while it holds CAP_SYS_RESOURCE there, then its descriptor sent to the
daemon, which holds it (the nest lives as long as that or a run in it) and gives
it to its runners as ``NEST_ENV`` names it: the descriptor's number, or why there is no
nest. The holder exits at once. Nothing else changes: the host sees the same uids, the
daemon's signals reach the runs, cgroups and Landlock are as they were. Stdlib only.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from collections.abc import Mapping, MutableMapping
from typing import Final

from subagent import _isolate, _quotas

__all__ = [
    "NEST_ENV",
    "INOTIFY_INSTANCES_TOTAL",
    "INOTIFY_WATCHES_TOTAL",
    "UNBOUNDED",
    "totals",
    "make",
    "join",
    "forget",
    "main",
]

# What a runner reads to find the nest: a descriptor number it inherited, else why the
# daemon has none (a runner started by something else has neither: no runs to bound).
NEST_ENV: Final = "AGENTD_RUN_NEST"
# All runs together (the daemon's ``run_inotify_instances_total``): half the host's
# default 128 for root, the other half left to the host (the daemon's own watch, systemd).
# A browser run holds 2 (Chromium), so 32 browser runs at once fill it.
INOTIFY_INSTANCES_TOTAL: Final = 64
# Watches (~1 KiB of kernel memory each): four runs at their cap.
INOTIFY_WATCHES_TOTAL: Final = 65536
# fanotify: half the host's default 128 groups per user; marks, four runs at their cap.
FANOTIFY_GROUPS_TOTAL: Final = 64
FANOTIFY_MARKS_TOTAL: Final = 4 * _quotas.FANOTIFY_MARKS
# Namespaces of each kind (Chromium's sandbox makes a few per browser run): 64 runs at
# their cap, far below the host's (~96k each here).
NAMESPACES_TOTAL: Final = 64 * _quotas.NAMESPACES
# The runs' own namespaces are user namespaces of the nest too, one per run (and one
# more for the browser check): room for them beyond what their tools make.
_RUNS_OWN: Final = 2 * 64

# What ``status`` says (``sandbox.problems``) of a run outside a nest.
UNBOUNDED: Final = (
    "all runs together share their uid's inotify instances and watches, fanotify groups and namespaces with the "
    "host (no nest bounds their total)"
)

_CLONE_NEWUSER: Final = 0x10000000


def totals(
    inotify_instances: int = INOTIFY_INSTANCES_TOTAL, inotify_watches: int = INOTIFY_WATCHES_TOTAL
) -> dict[str, int]:
    """The nest's limits (``/proc/sys/user`` names); a 0 is left out (the host's only)."""
    limits = {
        "max_inotify_instances": inotify_instances,
        "max_inotify_watches": inotify_watches,
        "max_fanotify_groups": FANOTIFY_GROUPS_TOTAL,
        "max_fanotify_marks": FANOTIFY_MARKS_TOTAL,
        **{f"max_{kind}_namespaces": NAMESPACES_TOTAL for kind in _quotas.NAMESPACE_KINDS},
    }
    limits["max_user_namespaces"] += _RUNS_OWN
    return {k: v for k, v in limits.items() if v > 0}


_c = _isolate.libc  # the C library, loaded once


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def make(limits: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Move this (single-threaded) process into a new user namespace, its own uid and gid
    mapped as they are on the host, and set its ``limits``; returns a descriptor of it and
    what was set.

    Raises:
        OSError: the kernel refused (no user namespaces here, /proc/sys read-only).
    """
    uid, gid = os.geteuid(), os.getegid()
    if _c().unshare(_CLONE_NEWUSER) != 0:
        raise _fail("unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny")  # (a process may map its own gid only so)
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    done = _quotas.limit_user_namespace(limits)
    return os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC), done


def join(environ: MutableMapping[str, str] | None = None) -> tuple[dict[str, int], str | None]:
    """Join the nest ``NEST_ENV`` names (``setns``: this process must be single-threaded
    and hold no capability it still needs in the host's namespace), and forget it.

    Returns the nest's limits as this process now reads them, and None; or nothing and
    why it is not in a nest (None and None: no nest named, none asked).
    """
    environ = os.environ if environ is None else environ
    value = environ.pop(NEST_ENV, None)
    if value is None:
        return {}, None
    if not value.isdigit():
        return {}, value or "no nest"
    fd = int(value)
    try:
        if _c().setns(fd, _CLONE_NEWUSER) != 0:
            raise _fail("setns")
    except OSError as exc:
        return {}, f"cannot join the nest: {exc.strerror or exc}"
    finally:
        _close(fd)
    # /proc/sys/user shows the namespace of the process that reads it: the nest's now.
    seen: dict[str, int] = {}
    for name in totals():
        try:
            with open(os.path.join(_quotas.USER_LIMITS_DIR, name)) as f:
                seen[name] = int(f.read())
        except (OSError, ValueError):
            continue
    return seen, None


def forget(environ: MutableMapping[str, str] | None = None) -> None:
    """Close the nest's descriptor unjoined (a runner without a sandbox)."""
    value = (os.environ if environ is None else environ).pop(NEST_ENV, None)
    if value is not None and value.isdigit():
        _close(int(value))


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def main() -> int:
    """The holder: make the nest (``make``, the limits from argv as JSON), send its
    descriptor on stdin (a unix socket) with ``{"limits": ...}``, or ``{"error": ...}``."""
    sock = socket.socket(fileno=os.dup(0))
    try:
        limits = {str(k): int(v) for k, v in json.loads(sys.argv[1]).items()}
        fd, done = make(limits)
    except (OSError, ValueError, IndexError, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        sock.send(json.dumps({"error": why}).encode())
        return 1
    socket.send_fds(sock, [json.dumps({"limits": done}).encode()], [fd])
    return 0


if __name__ == "__main__":
    sys.exit(main())
