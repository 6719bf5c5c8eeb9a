"""Exec a command whose life is bound to its parent: ``python -m supervisor.fleet._bound PPID -- CMD...``.

A node agent starts its agentd daemon through this: the daemon gets SIGTERM (its
``systemctl stop`` path: every run cancelled through both paths, then exit) when the
agent's thread that started it dies, whether the agent ended cleanly, was killed, or
its node was lost. ``PR_SET_PDEATHSIG`` survives ``execve``; if the parent is already
gone (or was never PPID), nothing is started. Stdlib only, Linux only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m supervisor.fleet._bound PPID -- CMD [ARGS...]", file=sys.stderr)
        return 2
    ppid = int(argv[0])
    cmd = argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"_bound: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}", file=sys.stderr)
        return 1
    if os.getppid() != ppid:  # the parent died before the death signal was armed
        return 1
    os.execvp(cmd[0], cmd)
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
