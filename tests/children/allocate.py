"""Allocate memory (and touch every page of it) one MiB at a time: a bounded allocator.

``allocate.py TOTAL_MIB [--wait-before FILE] [--mark N FILE] [--pause-at N FILE]``: waits
(20 s at most) until ``--wait-before`` exists, then allocates up to TOTAL_MIB MiB, writing
each MiB so it is charged; after N MiB it writes ``--mark``'s FILE and waits (20 s at
most) until ``--pause-at``'s FILE exists; prints ``allocated N`` at the end. Under a
memory limit below TOTAL_MIB the kernel's OOM killer kills it (SIGKILL) on the way.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

WAIT_S = 20.0
MIB = 1 << 20


def wait_for(path: str | None) -> None:
    if not path:
        return
    deadline = time.monotonic() + WAIT_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("total", type=int)
    parser.add_argument("--wait-before")
    parser.add_argument("--mark", nargs=2)
    parser.add_argument("--pause-at", nargs=2)
    args = parser.parse_args()
    wait_for(args.wait_before)
    held: list[bytes] = []
    for i in range(1, args.total + 1):
        held.append(b"x" * MIB)  # written: every page charged
        if args.mark and i == int(args.mark[0]):
            Path(args.mark[1]).write_text(str(i))
        if args.pause_at and i == int(args.pause_at[0]):
            wait_for(args.pause_at[1])
    print(f"allocated {len(held)}", flush=True)


if __name__ == "__main__":
    main()
