"""Experiment: the floor under cancel-all, what the kernel alone spends ending forked runners.

A process imports what a zygote imports (``runner.preload``: trio, openai, mcp, the
runner's modules), prepares its memory as the zygote does (``_prepare_memory``), freezes
the GC, and forks N children that do nothing but wait (``signal.pause``). It then
SIGKILLs them all at once and reaps each with ``wait4``: each child's CPU (user and
system; the exit's teardown of its address space runs in the child and is counted
there) and the wall time from the first kill to the last reap. Beside it, in the same
run, the same with the children of a bare Python (nothing imported).

This is what no runner code can go below: a runner that did no work at all at its stop
(no Python, no copy-on-write fault, no result written) would still cost this much to end.
On 2 cores, N children need at least ``N * cpu_per_child / 2`` of wall time.

The children are this process's own (forked here, unreaped until the end), so every
signal goes to a process shown to be ours.

    .venv/bin/python benchmarks/experiments/exit_floor.py [N] [--configs bare,zygote,zygote-touched,zygote-unprepared]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def child_config(config: str, n: int) -> dict[str, float]:
    """Run in a fresh interpreter (``--child``): import, fork N waiters, kill, reap.

    ``-touched`` configs: each child first writes (the same value back) one byte in
    ``TOUCHED_PAGES`` pages spread over the parent's anonymous memory, as a runner's
    reference counts do before it waits (~2,300 faults, run I), which also splits the
    huge pages it writes to: its exit then takes down 4 KiB entries, as a real runner's."""
    touch = TOUCHED_PAGES if config.endswith("-touched") else 0
    config = config.removesuffix("-touched")
    if config.startswith("zygote"):
        from subagent import runner, zygote

        runner.preload()
        gc.collect()
        gc.freeze()
        if config == "zygote":
            zygote._prepare_memory()
    rss_kib = _rss_kib(os.getpid())
    r, w = os.pipe()
    pids: list[int] = []
    fork_started = time.perf_counter()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            if touch:
                _touch_pages(touch)
            os.write(w, b".")
            os.close(w)
            while True:
                signal.pause()
        pids.append(pid)
    os.close(w)
    got = 0
    while got < n:  # every child is past its fork and waiting
        chunk = os.read(r, n - got)
        if not chunk:
            break
        got += len(chunk)
    os.close(r)
    fork_s = time.perf_counter() - fork_started
    before = {pid: _oncpu_s(pid) for pid in pids}  # each child's CPU up to its wait
    cpu: list[float] = []
    exit_cpu: list[float] = []
    killed = time.perf_counter()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        _, _, usage = os.wait4(pid, 0)
        total = usage.ru_utime + usage.ru_stime
        cpu.append(total)
        exit_cpu.append(max(0.0, total - before[pid]))
    wall = time.perf_counter() - killed
    return {
        "n": n,
        "rss_mib": rss_kib / 1024,
        "fork_s": fork_s,
        "kill_to_all_reaped_s": wall,
        "cpu_per_child_ms_p50": statistics.median(cpu) * 1000,
        "exit_cpu_per_child_ms_p50": statistics.median(exit_cpu) * 1000,
        "exit_cpu_all_s": sum(exit_cpu),
        "cpu_all_children_s": sum(cpu),
    }


# How many pages a "-touched" child writes to: about what a forked runner copies on its
# way to waiting in a command (cow_cost: ~2,300 faults).
TOUCHED_PAGES = 2300
PAGE = 4096


def _touch_pages(count: int) -> None:
    """Write one byte, its own value, in ``count`` pages spread evenly over this process's
    anonymous writable memory (its heap included): copy-on-write faults, nothing changed."""
    import ctypes

    pages: list[int] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] not in ("[heap]",)):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pages.extend(range(start, end, PAGE))
    if not pages:
        return
    step = max(1, len(pages) // count)
    for addr in pages[::step][:count]:
        byte = ctypes.c_char.from_address(addr)
        byte.value = byte.value


def _oncpu_s(pid: int) -> float:
    """A task's time on a CPU so far (``/proc/PID/schedstat``, ns): the main thread's,
    which for these single-threaded children is the process's."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=500)
    ap.add_argument("--configs", default="bare,zygote,zygote-touched")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child_config(args.child, args.n)))
        return 0
    print(f"exit floor: {args.n} forked children, SIGKILLed at once; load {os.getloadavg()[0]:.2f}")
    for config in args.configs.split(","):
        out = subprocess.run(
            [sys.executable, __file__, str(args.n), "--child", config],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        fig = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  {config:<22} parent RSS {fig['rss_mib']:6.1f} MiB  fork {fig['fork_s']:5.2f} s  "
            f"kill -> all reaped {fig['kill_to_all_reaped_s']:5.2f} s  "
            f"CPU per child p50 {fig['cpu_per_child_ms_p50']:5.2f} ms; of it from the kill "
            f"{fig['exit_cpu_per_child_ms_p50']:5.2f} ms, all {fig['exit_cpu_all_s']:5.2f} s"
        )
    print(f"  load now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
