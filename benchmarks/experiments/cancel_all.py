"""Experiment: cancel-all of N live runs -> every process dead.

The two fixes it once measured by monkeypatching are in the code now: a cgroup tree's
members are read from its cgroup alone (the OS edge's ``ProcessTable.members`` reads
``cgroup.procs``, not the table), and the runs are cancelled side by side
(``RunManager._cancel_many``: each ``cancel`` sends path A and cancels the run's scope
before its first await, so every SIGTERM goes out at once). They carry no session: a
session has one live turn at a time. The daemon runs in-process.

    .venv/bin/python benchmarks/experiments/cancel_all.py [N] [--grace S]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import MARK_VAR, alive, final_sweep, install_mark, pids_with  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs, show_warnings  # noqa: E402
from benchmarks.bench_scale import sleepers, spec  # noqa: E402


async def main(n: int, grace: float, mark: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), grace_s=grace, max_concurrent=n + 10) as d:
            m = d["manager"]
            print("containment:", m.containment.mode)
            ids = [(await m.spawn(spec()))["run_id"] for _ in range(n)]
            with trio.fail_after(300):
                while len(await trio.to_thread.run_sync(lambda: sleepers(pids_with(MARK_VAR, mark)))) < n:
                    await trio.sleep(0.5)
            await trio.sleep(2)
            members = await trio.to_thread.run_sync(lambda: pids_with(MARK_VAR, mark))
            dead_at: list[float] = []

            def watch(t0: float) -> None:
                left = list(members)
                while left and time.perf_counter() - t0 < 120:
                    time.sleep(0.02)
                    left = [p for p in left if alive(p)]
                if not left:
                    dead_at.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            th = threading.Thread(target=watch, args=(t0,), daemon=True)
            th.start()
            await m._cancel_many(ids, "user")
            reply = time.perf_counter() - t0
            for run_id in ids:
                await m.wait_terminal(run_id)
            terminal = time.perf_counter() - t0
            await trio.to_thread.run_sync(th.join, 130)
            print(f"{n} runs ({len(members)} processes), grace {grace:g} s: the cancels returned after {reply:.2f} s; "
                  f"all terminal after {terminal:.2f} s; all processes dead after "
                  f"{dead_at[0] if dead_at else float('nan'):.2f} s")
            show_warnings(print)


if __name__ == "__main__":
    quiet_logs("--verbose" in sys.argv)
    mark = install_mark()
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "100"))
    grace = float(sys.argv[sys.argv.index("--grace") + 1]) if "--grace" in sys.argv else 2.0
    try:
        trio.run(main, n, grace, mark)
    finally:
        final_sweep(mark)
