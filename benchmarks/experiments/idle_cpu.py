"""Experiment: the daemon's CPU while idle, with 0 live runs and with N live runs.

An in-process daemon (``supervisor.daemon.serve``, default config: cgroups where the host
allows, the zygote) gets N scripted runs, each waiting in a ``run_command`` (``sleep``);
once all wait, this process's CPU (``CLOCK_PROCESS_CPUTIME_ID``: every thread, ns
resolution, not psutil's 10 ms ticks) is read over ``--windows`` windows of ``--idle`` s
each. The baseline, measured in the same run first: the same daemon with no run.

    .venv/bin/python benchmarks/experiments/idle_cpu.py [N ...] [--idle 10] [--windows 3] [--cgroups off]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import MARK_VAR, final_sweep, install_mark, pids_with  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs  # noqa: E402
from benchmarks.bench_scale import sleepers, spec  # noqa: E402


async def idle_windows(idle_s: float, windows: int) -> list[float]:
    out = []
    for _ in range(windows):
        c0 = time.process_time()
        await trio.sleep(idle_s)
        out.append((time.process_time() - c0) * 1000)
    return out


async def one(n: int, idle_s: float, windows: int, mark: str, cgroups: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), grace_s=1.0, max_concurrent=n + 10, cgroups=cgroups) as d:
            m = d["manager"]
            ids: list[str] = []
            for _ in range(n):
                ids.append((await m.spawn(spec()))["run_id"])
            with trio.fail_after(600):
                while len(await trio.to_thread.run_sync(lambda: sleepers(pids_with(MARK_VAR, mark)))) < n:
                    await trio.sleep(0.5)
            await trio.sleep(3)  # settle: the last runs' events, the zygote's pool
            figures = await idle_windows(idle_s, windows)
            shown = ", ".join(f"{x:.1f}" for x in figures)
            print(
                f"{n:4d} live runs ({m.containment.mode}): daemon CPU per {idle_s:g} s idle: {shown} ms "
                f"(median {sorted(figures)[len(figures) // 2]:.1f}); /proc entries {len(os.listdir('/proc'))}",
                flush=True,
            )
            await m._cancel_many(ids, "user")


async def main(sizes: list[int], idle_s: float, windows: int, mark: str, cgroups: str) -> None:
    for n in [0, *sizes]:
        await one(n, idle_s, windows, mark, cgroups)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int, default=[50])
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--cgroups", default="auto")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    quiet_logs(a.verbose)
    mark = install_mark()
    try:
        trio.run(main, a.sizes, a.idle, a.windows, mark, a.cgroups)
    finally:
        final_sweep(mark)
