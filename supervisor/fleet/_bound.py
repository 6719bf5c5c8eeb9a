"""Run a command whose life is bound to its parent's: ``python -m supervisor.fleet._bound PPID -- CMD...``.

A node agent starts its agentd daemon through this babysitter, so the daemon gets
SIGTERM (its ``systemctl stop`` path: every run cancelled through both paths, then
exit) when the agent dies, whether it ended cleanly, was killed, or its node was lost.
Two links, because a Ray worker that exits SIGKILLs its direct children: the babysitter
dies with the agent's thread (``PR_SET_PDEATHSIG`` SIGKILL, or Ray's own kill), and the
daemon, its child, gets SIGTERM when the babysitter is gone. SIGTERM/SIGINT sent to the
babysitter are passed on; it exits with the daemon's status. Stdlib only, Linux only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    res: int = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return res == 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m supervisor.fleet._bound PPID -- CMD [ARGS...]", file=sys.stderr)
        return 2
    ppid = int(argv[0])
    cmd = argv[2:]
    if not _pdeathsig(signal.SIGKILL) or os.getppid() != ppid:
        return 1  # the parent is already gone (or the kernel refused): start nothing
    me = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            if _pdeathsig(signal.SIGTERM) and os.getppid() == me:
                os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            _pid, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
