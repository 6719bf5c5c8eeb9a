"""Experiment: does the warm pool's refill storm slow a burst, and would a serial refill help?

Today ``WarmPool.run`` refills by spawning a new warm runner as soon as one is taken,
without waiting for the previous one to finish its imports: after a burst of N spawns,
N fresh runners import openai+mcp (about 1 s of CPU each) while the N runs start. With
``--serial`` this process's pool waits, after each refill spawn, until the new runner
blocks reading its spec (``/proc/<pid>/wchan``) before the next one: a stand-in for the
fix "append to ``_ready`` only once the runner said it is warm".

With ``--progress-drain``, ``process.drain_bounded`` (how the run manager reads a runner's
pipes) is replaced by a version whose after-exit bound counts only time the pipe is idle
(it restarts after each chunk is handled), instead of cutting the read 2 s after exit
even while buffered events are still being journaled. No file is edited.

    .venv/bin/python benchmarks/experiments/pool_refill.py [N] [--serial] [--progress-drain] [--verbose]
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio

from benchmarks._common import final_sweep, install_mark, row, summary
from benchmarks._daemon import in_process_daemon, quiet_logs, show_warnings, wait_pool_warm, wchan
from benchmarks.bench_spawn import burst
from supervisor.trees import pool, process
from supervisor.trees._drain import DRAIN_AFTER_EXIT_S


async def progress_drain(stream, sink, *, process, after_exit_s=DRAIN_AFTER_EXIT_S):  # type: ignore[no-untyped-def]
    state = {"deadline": math.inf, "scope": None, "exited": False}

    async def watch() -> None:
        await process.wait()
        state["exited"] = True
        state["deadline"] = trio.current_time() + after_exit_s
        if state["scope"] is not None:
            state["scope"].deadline = state["deadline"]

    eof = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        while True:
            with trio.CancelScope(deadline=state["deadline"]) as sc:
                state["scope"] = sc
                try:
                    chunk = await stream.receive_some()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    eof = True
                    break
            state["scope"] = None
            if sc.cancelled_caught:
                break
            if not chunk:
                eof = True
                break
            await sink(bytes(chunk))
            if state["exited"]:
                state["deadline"] = trio.current_time() + after_exit_s
        nursery.cancel_scope.cancel()
    if not eof:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    return eof


_orig_new_tree = pool.new_tree


async def serial_new_tree(config, containment, *, warm, extra_env=None):  # type: ignore[no-untyped-def]
    w = await _orig_new_tree(config, containment, warm=warm, extra_env=extra_env)
    if warm:
        with trio.move_on_after(30):
            while "pipe" not in wchan(w.tree.pid):
                await trio.sleep(0.02)
    return w


async def main(n: int) -> None:
    if "--serial" in sys.argv:
        pool.new_tree = serial_new_tree  # type: ignore[assignment]
    if "--progress-drain" in sys.argv:
        process.drain_bounded = progress_drain  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), pool_size=n, max_concurrent=max(64, n)) as d:
            m = d["manager"]
            t0 = time.perf_counter()
            fill = await wait_pool_warm(m, n, timeout_s=300)
            print(
                f"refill {'serial' if '--serial' in sys.argv else 'as today'}: pool of {n} warm after {fill} s "
                f"({time.perf_counter() - t0:.1f} s)"
            )
            r = await burst(m, n)
            print(
                row(f"spawn -> first step, {n} at once (delivered)", summary(r["delivered"])), f"missing {r['missing']}"
            )
            print(row("  runner emitted it", summary(r["emitted"])))
            print("drain:", "idle-bounded" if "--progress-drain" in sys.argv else "as today")
            show_warnings(print)


if __name__ == "__main__":
    quiet_logs("--verbose" in sys.argv)
    mark = install_mark()
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "50"))
    try:
        trio.run(main, n)
    finally:
        final_sweep(mark)
