"""Experiment: how long does starting one runner block the daemon's event loop, and what
would spawning without ``preexec_fn`` (cgroup joined by an exec wrapper) change?

Monkeypatches ``supervisor.trees._spawn._open_leader`` in this process only (no file is
edited), runs a cold burst of N spawns (``bench_spawn.burst``) and reports the time each
``open_process`` call held the Trio thread, and the burst's spawn -> first step.

    .venv/bin/python benchmarks/experiments/spawn_blocking.py [N] [--wrapper]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import final_sweep, install_mark, row, summary  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs  # noqa: E402
from benchmarks.bench_spawn import burst  # noqa: E402
from supervisor.trees import process  # noqa: E402

held: list[float] = []
_orig_open_process = trio.lowlevel.open_process
WRAPPER = 'echo 0 > "$0" && exec "$@"'


async def timed_open_process(argv, **kw):  # type: ignore[no-untyped-def]
    if "--wrapper" in sys.argv and kw.get("preexec_fn") is not None:
        procs = kw.pop("preexec_fn").__closure__[0].cell_contents.decode()  # the cgroup.procs path
        argv = ["/bin/sh", "-c", WRAPPER, procs, *argv]
    t0 = time.perf_counter()
    p = await _orig_open_process(argv, **kw)
    held.append(time.perf_counter() - t0)
    return p


async def main(n: int) -> None:
    process.trio.lowlevel.open_process = timed_open_process  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), pool_size=0, max_concurrent=max(64, n)) as d:
            m = d["manager"]
            print("containment:", m.containment.mode, "| wrapper" if "--wrapper" in sys.argv else "| preexec_fn")
            r = await burst(m, 1)
            held.clear()
            r = await burst(m, n)
            print(row("open_process held the Trio thread", summary(held)), f"sum {sum(held):.2f} s")
            print(row(f"spawn -> first step, {n} at once (delivered)", summary(r["delivered"])))
            print(row("  runner emitted it", summary(r["emitted"])))


if __name__ == "__main__":
    quiet_logs("--verbose" in sys.argv)
    mark = install_mark()
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "50"))
    try:
        trio.run(main, n)
    finally:
        final_sweep(mark)
