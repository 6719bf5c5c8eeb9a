"""Fork sleeping children until a fork is refused, or MAX of them: a bounded fork bomb.

``fork_until_refused.py MAX [--wait-before FILE] [--write FILE] [--wait-after FILE]``:
waits (20 s at most) until ``--wait-before`` exists, forks up to MAX children that sleep
(their stdio on /dev/null, so the command's output ends with this process), writes how
many it made to ``--write``, waits until ``--wait-after`` exists (its children still
alive: the run stays at its limit meanwhile), then prints ``made N errno E`` (E: the
errno of the refused fork, or None), kills and reaps its children and exits.

``fork_until_refused.py --bomb FILE``: a fork bomb that ignores SIGTERM and never ends by
itself, bounded without a limit too (each process keeps 6 children, 3 levels deep: 259
at most; the leaves exit at once and are forked again, so it forks all the time); it
writes FILE when a fork is first refused.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import time
from pathlib import Path

WAIT_S = 20.0


def wait_for(path: str | None) -> None:
    if not path:
        return
    end = time.monotonic() + WAIT_S
    while not Path(path).exists() and time.monotonic() < end:
        time.sleep(0.01)


def bomb(flag: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    depth = 0
    live: set[int] = set()
    while True:
        while live:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
        if depth == 3:
            os._exit(0)
        if len(live) >= 6:
            time.sleep(0.001)
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            if exc.errno == errno.EAGAIN and not os.path.exists(flag):
                Path(flag).write_text("refused")
            time.sleep(0.001)
            continue
        if pid == 0:
            depth += 1
            live = set()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            continue
        live.add(pid)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("max", type=int, nargs="?", default=0)
    parser.add_argument("--bomb")
    parser.add_argument("--wait-before")
    parser.add_argument("--write")
    parser.add_argument("--wait-after")
    args = parser.parse_args()
    if args.bomb:
        print("bombing", flush=True)
        bomb(args.bomb)
    wait_for(args.wait_before)
    children: list[int] = []
    err: int | None = None
    while len(children) < args.max:
        try:
            pid = os.fork()
        except OSError as exc:
            err = exc.errno
            break
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    if args.write:
        Path(args.write).write_text(str(len(children)))
    wait_for(args.wait_after)
    print(f"made {len(children)} errno {err}", flush=True)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
