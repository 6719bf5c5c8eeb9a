"""Experiment: where the daemon's time goes on the spawn path of a run a spare takes, from
``RunManager.spawn`` to ``go``, and on to the first step delivered to a subscriber.

Wraps the path's steps in this process only (no file is edited), spawns N runs one at a
time with one spare parked, and prints each segment's median (state dir on tmpfs unless
``--disk``, so that the fsync is apart from the rest).

    .venv/bin/python benchmarks/experiments/spawn_path.py [N] [--disk] [--pause S]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import final_sweep, install_mark, row, summary  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs, scripted_spec, wait_event  # noqa: E402
from supervisor.core import runs as runs_mod  # noqa: E402
from supervisor.core._book import RunBook  # noqa: E402
from supervisor.store.journal import Journal  # noqa: E402
from supervisor.trees import zygote as zygote_mod  # noqa: E402
from supervisor.trees.containment import Containment  # noqa: E402

marks: dict[str, float] = {}
# Between a spare reported ready and the next spawn (``--pause S``): a spare forked a moment
# ago may still be making its sandbox ahead when the run comes.
PAUSE_S = float(sys.argv[sys.argv.index("--pause") + 1]) if "--pause" in sys.argv else 0.0


def mark(name: str) -> None:
    marks.setdefault(name, time.perf_counter())


def wrap_async(owner: Any, attr: str, label: str) -> None:
    real = getattr(owner, attr)

    @functools.wraps(real)
    async def timed(*a: Any, **k: Any) -> Any:
        mark(f"{label} in")
        try:
            return await real(*a, **k)
        finally:
            mark(f"{label} out")

    setattr(owner, attr, timed)


def wrap_sync(owner: Any, attr: str, label: str) -> None:
    real = getattr(owner, attr)

    @functools.wraps(real)
    def timed(*a: Any, **k: Any) -> Any:
        mark(f"{label} in")
        try:
            return real(*a, **k)
        finally:
            mark(f"{label} out")

    setattr(owner, attr, timed)


def install() -> None:
    wrap_async(runs_mod.RunManager, "_create", "create")
    wrap_sync(runs_mod.RunManager, "_assign_spare", "assign")
    wrap_async(RunBook, "create", "book.create")
    wrap_async(Journal, "create_run", "journal")
    wrap_async(runs_mod.RunManager, "_execute", "execute")
    wrap_async(zygote_mod.Spare, "go", "go")
    wrap_sync(zygote_mod, "decode", "ack")  # the spare's acknowledgement read (and other replies)
    wrap_sync(Containment, "track", "track")
    real_call = Journal._call

    async def call(self: Journal, fn: Any) -> Any:
        def in_thread(s: Any) -> Any:
            mark("thread in")
            try:
                return fn(s)
            finally:
                mark("thread out")

        return await real_call(self, in_thread)

    Journal._call = call  # type: ignore[method-assign]


SEGMENTS = [
    ("spawn() -> _create", "t0", "create in"),
    ("_create -> assign spare", "create in", "assign in"),
    ("assign spare (spec to the spare)", "assign in", "assign out"),
    ("-> journal call", "assign out", "journal in"),
    ("journal: to its thread", "journal in", "thread in"),
    ("journal: the commit (in its thread)", "thread in", "thread out"),
    ("journal: back to Trio", "thread out", "journal out"),
    ("book.create out -> spawn() returns", "book.create out", "returned"),
    ("spawn() returns -> _execute starts", "returned", "execute in"),
    ("_execute -> go", "execute in", "go in"),
    ("go (ack read, go sent)", "go in", "go out"),
    ("  go -> its ack read", "go in", "ack out"),
    ("  ack read -> track", "ack out", "track in"),
    ("  track", "track in", "track out"),
    ("  track -> go returns", "track out", "go out"),
    ("go -> step emitted (runner)", "go out", "emitted"),
    ("  go -> runner_started emitted", "go out", "runner_started"),
    ("  runner_started -> step_started emitted", "runner_started", "emitted"),
    ("emitted -> delivered", "emitted", "delivered"),
    ("total: spawn() -> delivered", "t0", "delivered"),
]


async def main(n: int, disk: bool) -> None:
    install()
    spec = scripted_spec(final="ok", tools=[])
    base = None if disk else ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    got: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    with tempfile.TemporaryDirectory(prefix="agentd-spawn-path-", dir=base) as tmp:
        async with in_process_daemon(Path(tmp) / "state", pool_size=0, zygote_spares=1, grace_s=1) as d:
            m = d["manager"]
            with trio.fail_after(120):
                while (await m.summary())["zygote"]["spares"]["ready"] < 1:
                    await trio.sleep(0.02)
            for i in range(n + 1):
                with trio.fail_after(60):
                    while (await m.summary())["zygote"]["spares"]["ready"] < 1:
                        await trio.sleep(0.005)
                await trio.sleep(PAUSE_S)
                marks.clear()
                t0 = time.perf_counter()
                wall0 = time.time()
                marks["t0"] = t0
                r = await m.spawn(spec)
                marks["returned"] = time.perf_counter()
                ev = await wait_event(m, r["run_id"], "step_started")
                await m.wait_terminal(r["run_id"])
                if ev is None or i == 0:  # the first one warms the path
                    continue
                marks["delivered"] = ev["_arrived"]
                marks["emitted"] = t0 + (ev["ts"] - wall0)
                started = [e for e in await m.events_after(r["run_id"], 0) if e["kind"] == "runner_started"]
                if started:
                    marks["runner_started"] = t0 + (started[0]["ts"] - wall0)
                for name, a, b in SEGMENTS:
                    if a in marks and b in marks:
                        got[name].append(marks[b] - marks[a])
    print(f"spawn path of a run a spare takes, {n} one at a time, state on {'disk' if disk else 'tmpfs'}")
    for name, _, _ in SEGMENTS:
        if got[name]:
            print(row(name, summary(got[name])))
    total = statistics.median(got["total: spawn() -> delivered"]) if got["total: spawn() -> delivered"] else 0
    print(f"(median total {total * 1000:.1f} ms)")


if __name__ == "__main__":
    bench_mark = install_mark()
    quiet_logs(False)
    args = [a for a in sys.argv[1:2] if not a.startswith("--")]
    try:
        trio.run(main, int(args[0]) if args else 30, "--disk" in sys.argv)
    finally:
        final_sweep(bench_mark)
