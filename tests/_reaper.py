"""Run a command (the test suite) under a child subreaper of its own.

``python -m tests._reaper -- CMD ...`` makes this process a child subreaper
(``PR_SET_CHILD_SUBREAPER``), starts CMD and reaps every process that is orphaned below
it, until CMD exits; it then exits with CMD's status. Whatever the suite starts, however
it double-forks or ``setsid()``s, stays a descendant of this process, so the suite's leak
check (``tests/conftest.py``) can find a test's processes by descent instead of by
guessing from command lines, and never has to touch a process that is not its own.

This process only ever starts one child (CMD), so a ``waitpid(-1)`` loop here steals
nobody's child: everything else it reaps was adopted. Stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["REAPER_VAR", "main"]

# Set in CMD's environment to this process's pid; the leak check trusts it only when it
# is also the parent of the pytest process.
REAPER_VAR = "AGENTD_TEST_REAPER"
_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests._reaper -- CMD [ARGS...]", file=sys.stderr)
        return 2
    if not _set_subreaper():
        os.execvp(argv[0], argv)  # no subreaper here: run the command as it is
    env = dict(os.environ)
    env[REAPER_VAR] = str(os.getpid())
    # Ctrl-C reaches the whole foreground group; the command decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
