"""Run as a run's command (tests/e2e/test_sandbox_nest.py): open up to N inotify
instances and say how many; with HELD and RELEASE (FIFOs the test made), hold them: write
the count to HELD, then wait until the test has opened and closed RELEASE, then let go.

``python inotify_hold.py N [HELD RELEASE]``; prints ``opened=``, ``errno=``, then
``released=``. Small numbers only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import sys

libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    n = int(sys.argv[1])
    held, release = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else (None, None)
    # Opened first, without a writer (O_NONBLOCK: at once): its hang-up is the release.
    wait_fd = os.open(release, os.O_RDONLY | os.O_NONBLOCK) if release else -1
    fds: list[int] = []
    err = 0
    for _ in range(n):
        fd = libc.inotify_init1(os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            break
        fds.append(fd)
    print(f"opened={len(fds)}", flush=True)
    print(f"errno={errno.errorcode.get(err, str(err)) if err else 0}", flush=True)
    if held is not None:
        with open(held, "w") as f:  # the test holds its read end open: no wait
            f.write(f"{len(fds)}\n")
        # A FIFO's read end reports a hang-up only once a writer came and went.
        poller = select.poll()
        poller.register(wait_fd, select.POLLIN)
        poller.poll()
        os.close(wait_fd)
    for fd in fds:
        os.close(fd)
    print(f"released={len(fds)}", flush=True)


if __name__ == "__main__":
    main()
