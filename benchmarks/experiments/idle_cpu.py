"""Experiment: the daemon's idle CPU with N live runs, and with a children-only reaper scan.

The containment's reaper (``Containment.run`` -> ``reap_adopted``) reads the whole process
table every second. Adopted orphans are the daemon's own children, which the kernel lists
in ``/proc/self/task/*/children``; with ``--children-scan`` this process's
``containment.scan_processes`` is replaced, for the reaper only, by a read of those lists
(a stand-in for that fix). No file is edited. Both variants are measured on the same live
runs: first as today, then patched.

    .venv/bin/python benchmarks/experiments/idle_cpu.py [N] [--idle S]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import psutil  # noqa: E402
import trio  # noqa: E402

from benchmarks._common import MARK_VAR, final_sweep, install_mark, pids_with  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs  # noqa: E402
from benchmarks.bench_scale import sleepers, spec  # noqa: E402
from supervisor import containment  # noqa: E402

_orig_scan = containment.scan_processes


def children_scan() -> dict[int, containment.Proc]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            continue
    out = {}
    for pid in pids:
        p = containment.read_proc(pid)
        if p is not None:
            out[pid] = p
    return out


def cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


async def main(n: int, idle_s: float, mark: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), grace_s=1.0, max_concurrent=n + 10) as d:
            m = d["manager"]
            for _ in range(n):
                await m.spawn(spec())
            with trio.fail_after(300):
                while len(await trio.to_thread.run_sync(lambda: sleepers(pids_with(MARK_VAR, mark)))) < n:
                    await trio.sleep(0.5)
            await trio.sleep(3)
            for label in ("as today", "children-only reaper scan"):
                if label != "as today":
                    containment.scan_processes = children_scan  # type: ignore[assignment]
                    await trio.sleep(1.5)
                c0 = cpu()
                await trio.sleep(idle_s)
                print(f"{n} live runs, reaper {label}: daemon CPU {(cpu() - c0) * 1000:.0f} ms over {idle_s:g} s idle "
                      f"({len(os.listdir('/proc'))} /proc entries)")
            containment.scan_processes = _orig_scan  # type: ignore[assignment]
            await m.cancel_session("all")


if __name__ == "__main__":
    quiet_logs("--verbose" in sys.argv)
    mark = install_mark()
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "200"))
    idle = float(sys.argv[sys.argv.index("--idle") + 1]) if "--idle" in sys.argv else 10.0
    try:
        trio.run(main, n, idle, mark)
    finally:
        final_sweep(mark)
