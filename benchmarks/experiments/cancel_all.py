"""Experiment: cancel-all of N live runs -> every process dead, with where the time goes.

N scripted runs wait in a ``run_command`` (``sleep``, stop policy ``interrupt``: the
default) on an in-process daemon; then one cancel of every run, side by side
(``RunManager._cancel_many``, what ``Client.cancel_many`` and shutdown reach). Every
member of every tree is watched through a pidfd (an exit is an event: no polling that
competes for the 2 cores), so the figures are the quantiles of the members' deaths, the
runners' and the commands' apart, counted from the cancel; then when every run was
terminal, and the CPU spent meanwhile by the daemon (this process) and by the trees
(their cgroup subtree's ``cpu.stat``). With ``--profile`` the daemon's Trio thread is
sampled (where its time went during the cancel) and the journal's jobs are counted.

    .venv/bin/python benchmarks/experiments/cancel_all.py [N] [--grace S] [--client] [--profile] [--py-spy BIN]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import MARK_VAR, final_sweep, install_mark, pids_with  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs, show_warnings  # noqa: E402
from benchmarks.bench_scale import runners, sleepers, spec  # noqa: E402


def q(xs: list[float], unit: str = "s") -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    pick = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return f"p50 {pick(0.5):.2f} / p90 {pick(0.9):.2f} / p99 {pick(0.99):.2f} / max {xs[-1]:.2f} {unit} (n={len(xs)})"


def cgroup_usage_us(root: Path | None) -> int | None:
    if root is None:
        return None
    try:
        for ln in (root / "cpu.stat").read_text().splitlines():
            if ln.startswith("usage_usec "):
                return int(ln.split()[1])
    except OSError:
        return None
    return None


WATCHER = r"""
import json, os, select, sys, time
pids = json.loads(sys.stdin.readline())
fds = {}
for pid in pids:
    try:
        fds[os.pidfd_open(pid)] = pid
    except OSError:
        pass
print(len(fds), flush=True)
t0 = float(sys.stdin.readline())
poller = select.poll()
for fd in fds:
    poller.register(fd, select.POLLIN)
dead = {}
while len(dead) < len(fds) and time.monotonic() - t0 < float(sys.argv[1]):
    for fd, _ in poller.poll(100):
        poller.unregister(fd)
        dead[fds[fd]] = time.monotonic() - t0
print(json.dumps(dead), flush=True)
"""


class Deaths:
    """A watcher process (not a thread: no share of the daemon's GIL) holds a pidfd of
    every member and records when each becomes readable (the process exited)."""

    def __init__(self, pids: list[int], timeout_s: float) -> None:
        import json
        import subprocess

        self.p = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(pids) + "\n")
        self.p.stdin.flush()
        self.watched = int(self.p.stdout.readline())
        self.dead_at: dict[int, float] = {}

    def start(self, t0: float) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{t0}\n")
        self.p.stdin.flush()

    def collect(self) -> None:
        import json

        assert self.p.stdout is not None
        self.dead_at = {int(k): v for k, v in json.loads(self.p.stdout.readline() or "{}").items()}
        self.p.wait()


CANCELLER = r"""
import json, sys, time
from supervisor.control.client import Client
url, token, ids = json.loads(sys.stdin.readline())
with Client(url, token, timeout_s=300) as c:
    c.status()  # connected
    print("ready", flush=True)
    sys.stdin.readline()
    out = c.cancel_many(ids)
    print(json.dumps({"at": time.monotonic(), "n": len(out["runs"])}), flush=True)
"""


class Canceller:
    """A client process (``Client.cancel_many``: what ``bench_scale`` and a user's script do),
    connected before the clock starts."""

    def __init__(self, url: str, token: str, ids: list[str]) -> None:
        import json
        import subprocess

        self.p = subprocess.Popen(
            [sys.executable, "-c", CANCELLER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).resolve().parent.parent.parent),
        )
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps([url, token, ids]) + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def replied_at(self) -> float:
        import json

        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        self.p.wait()
        return float(json.loads(line)["at"]) if line else float("nan")


class Sampler:
    """Samples the Trio thread's stack every ``every_s`` (a poor man's profiler)."""

    def __init__(self, ident: int, every_s: float = 0.005) -> None:
        self.ident, self.every_s = ident, every_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.n = 0
        self.stop = threading.Event()

    def run(self) -> None:
        root = str(Path(__file__).resolve().parent.parent.parent)
        while not self.stop.wait(self.every_s):
            frame = sys._current_frames().get(self.ident)
            if frame is None:
                continue
            self.n += 1
            stack = traceback.extract_stack(frame)
            seen = set()
            for fs in stack:
                if fs.filename.startswith(root) and "benchmarks" not in fs.filename:
                    key = f"{fs.filename[len(root) + 1 :]}:{fs.name}"
                    if key not in seen:
                        seen.add(key)
                        self.counts[key] += 1
            last = stack[-1]
            self.leaf[f"{last.filename.split('/')[-1]}:{last.name}:{last.lineno}"] += 1

    def report(self) -> None:
        print(f"  Trio thread: {self.n} samples; functions of this tree on the stack (share of samples):")
        for key, c in self.counts.most_common(25):
            print(f"    {100 * c / max(1, self.n):5.1f} %  {key}")
        print("  leaf frames:")
        for key, c in self.leaf.most_common(12):
            print(f"    {100 * c / max(1, self.n):5.1f} %  {key}")


def count_journal_jobs() -> dict[str, Any]:
    """Wrap the journal's worker: how many jobs and commits, their time, jobs by op."""
    from supervisor.store import journal as jmod

    stats: dict[str, Any] = {"n": 0, "groups": 0, "s": 0.0, "by": collections.Counter(), "on": False}
    orig_run, orig_group = jmod._Worker._run, jmod._Worker._run_group

    def note(jobs: list[Any], took: float) -> None:
        stats["n"] += len(jobs)
        stats["groups"] += 1
        stats["s"] += took
        for job in jobs:
            code = getattr(job.fn, "__code__", None)
            names = code.co_names if code is not None else ()
            stats["by"][next((n for n in names if n not in ("_text", "_opt_text")), "?")] += 1

    def _run(self: Any, store: Any, job: Any) -> None:
        t = time.perf_counter()
        try:
            return orig_run(self, store, job)
        finally:
            if stats["on"] and not stats.get("in_group"):
                note([job], time.perf_counter() - t)

    def _run_group(self: Any, store: Any, jobs: Any) -> None:
        t = time.perf_counter()
        stats["in_group"] = True
        try:
            return orig_group(self, store, jobs)
        finally:
            stats["in_group"] = False
            if stats["on"]:
                note(jobs, time.perf_counter() - t)

    jmod._Worker._run = _run  # type: ignore[method-assign]
    jmod._Worker._run_group = _run_group  # type: ignore[method-assign]
    return stats


async def main(opts: argparse.Namespace, mark: str) -> None:
    n, grace, profile = opts.n, opts.grace, opts.profile
    jobs = count_journal_jobs() if profile else None
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process_daemon(Path(tmp), grace_s=grace, max_concurrent=n + 10) as d:
            m = d["manager"]
            helpers = [m._zygote.pid] if m._zygote is not None and m._zygote.pid else []
            print(f"containment: {m.containment.mode}; zygote: {f'pid {helpers}' if helpers else 'off'}")
            t_spawn = time.perf_counter()
            ids = [(await m.spawn(spec()))["run_id"] for _ in range(n)]

            def members() -> list[Any]:
                return pids_with(MARK_VAR, mark, exclude=helpers)

            with trio.fail_after(max(300, n)):
                while len(await trio.to_thread.run_sync(lambda: sleepers(members()))) < n:
                    await trio.sleep(0.5)
            print(f"{n} runs waiting in their command after {time.perf_counter() - t_spawn:.1f} s")
            await trio.sleep(2)
            # The spares parked for the next spawns (the burst of spawns grew them) are
            # no run's: a cancel-all leaves them parked.
            spares = set((await m.summary())["zygote"].get("spares", {}).get("pids", []))
            helpers.extend(spares)
            procs = await trio.to_thread.run_sync(members)
            print(f"  ({len(spares)} parked spares not counted: no run's)")
            pids = [p.pid for p in procs]
            runner_pids = set(runners(procs))
            sleeper_pids = set(sleepers(procs))
            deaths = Deaths(pids, 120)
            root = m.containment.root
            tree_cpu0 = cgroup_usage_us(root)
            terminal_at: list[float] = []
            sampler = Sampler(threading.get_ident()) if profile else None

            async def terminal(run_id: str, t0: float) -> None:
                await m.wait_terminal(run_id)
                terminal_at.append(time.perf_counter() - t0)

            from supervisor.trees import process as _process

            path_a_at: list[float] = []
            _soft = _process.soft_stop

            path_a_cpu: list[float] = []
            path_a_wall: list[float] = []

            sched: list[tuple[float, float, float]] = []  # (wall, on a CPU, waiting for one)

            def schedstat() -> tuple[float, float, float]:
                with open("/proc/thread-self/schedstat") as f:
                    run_ns, wait_ns, _slices = f.read().split()
                return time.perf_counter(), int(run_ns) / 1e9, int(wait_ns) / 1e9

            def soft_stop(tree: Any) -> list[str]:
                if not sched:
                    sched.append(schedstat())
                c, w = time.thread_time(), time.perf_counter()
                out = _soft(tree)
                path_a_cpu.append(time.thread_time() - c)
                path_a_wall.append(time.perf_counter() - w)
                path_a_at.append(time.perf_counter() - t0)
                sched[1:] = [schedstat()]
                return out

            _process.soft_stop = soft_stop  # type: ignore[assignment]
            canceller = await trio.to_thread.run_sync(Canceller, d["url"], d["token"], ids) if opts.client else None
            spy = None
            if opts.py_spy:
                import subprocess

                out = Path(tmp).parent / f"cancel_all-{os.getpid()}.py-spy.txt"
                argv = [
                    opts.py_spy,
                    "record",
                    "-r",
                    "250",
                    "-f",
                    "raw",
                    "--threads",
                    "--nonblocking",
                    "-o",
                    str(out),
                    "--pid",
                    str(os.getpid()),
                    "-d",
                    str(opts.py_spy_s),
                ]
                spy = await trio.to_thread.run_sync(
                    lambda: subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
                print(f"py-spy: {out} (collapsed stacks, {opts.py_spy_s:g} s from the cancel)")
                await trio.sleep(0.5)
            cpu0 = time.process_time()
            t0 = time.perf_counter()  # CLOCK_MONOTONIC, as the watcher's time.monotonic()
            deaths.start(t0)
            if sampler is not None:
                threading.Thread(target=sampler.run, daemon=True).start()
                assert jobs is not None
                jobs["on"] = True
            async with trio.open_nursery() as nursery:
                for run_id in ids:
                    nursery.start_soon(terminal, run_id, t0)
                if canceller is not None:
                    canceller.go()
                    reply = await trio.to_thread.run_sync(canceller.replied_at) - t0
                else:
                    await m._cancel_many(ids, "user")
                    reply = time.perf_counter() - t0
            terminal_s = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            if sampler is not None:
                sampler.stop.set()
                assert jobs is not None
                jobs["on"] = False
            await trio.to_thread.run_sync(deaths.collect)
            if spy is not None:
                await trio.to_thread.run_sync(spy.wait)
            tree_cpu1 = cgroup_usage_us(root)
            dead = deaths.dead_at
            all_dead = max(dead.values()) if len(dead) == deaths.watched else float("nan")
            states = collections.Counter()
            for run_id in ids:
                states[str((await m.status(run_id))["state"])] += 1
            print(
                f"{n} runs ({len(pids)} processes: {len(runner_pids)} runners, {len(sleeper_pids)} commands), "
                f"grace {grace:g} s"
            )
            print(f"  the cancels returned after {reply:.2f} s; all terminal after {terminal_s:.2f} s {dict(states)}")
            print(f"  all processes dead after {all_dead:.2f} s ({len(dead)} of {deaths.watched} watched)")
            print(f"  path A sent:    {q(path_a_at)}")
            if len(sched) == 2:
                (w0, r0, q0), (w1, r1, q1) = sched
                print(
                    f"  the Trio thread from the first path A to the last: {w1 - w0:.2f} s; on a CPU {r1 - r0:.2f} s, "
                    f"waiting for one {q1 - q0:.2f} s, blocked {max(0.0, (w1 - w0) - (r1 - r0) - (q1 - q0)):.2f} s"
                )
            print(
                f"  one path A: wall {q([x * 1000 for x in path_a_wall], 'ms')}; CPU {q([x * 1000 for x in path_a_cpu], 'ms')}; sum wall {sum(path_a_wall):.2f} s, CPU {sum(path_a_cpu):.2f} s"
            )
            print(f"  commands dead:  {q([t for p, t in dead.items() if p in sleeper_pids])}")
            print(f"  runners dead:   {q([t for p, t in dead.items() if p in runner_pids])}")
            print(f"  others dead:    {q([t for p, t in dead.items() if p not in runner_pids | sleeper_pids])}")
            print(f"  runs terminal:  {q(terminal_at)}")
            tree_cpu = None if tree_cpu0 is None or tree_cpu1 is None else (tree_cpu1 - tree_cpu0) / 1e6
            print(
                f"  CPU from the cancel to all terminal: daemon {cpu:.2f} s; the trees (cgroup subtree, to all dead) "
                f"{'-' if tree_cpu is None else f'{tree_cpu:.2f} s'}"
            )
            if sampler is not None:
                sampler.report()
            if jobs is not None:
                print(
                    f"  journal: {jobs['n']} jobs in {jobs['groups']} transactions, {jobs['s']:.2f} s in the worker; by op: {dict(jobs['by'].most_common(10))}"
                )
            show_warnings(print)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", type=int, nargs="?", default=100, help="live runs to cancel (default 100)")
    ap.add_argument("--grace", type=float, default=2.0, help="the daemon's grace, s (default 2)")
    ap.add_argument(
        "--client",
        action="store_true",
        help="cancel through a client process (Client.cancel_many, one request) instead of in-process",
    )
    ap.add_argument("--profile", action="store_true", help="sample the Trio thread; count the journal's jobs")
    ap.add_argument("--py-spy", default=None, metavar="BIN", help="also record every thread with this py-spy binary")
    ap.add_argument("--py-spy-s", type=float, default=5.0, help="py-spy's duration, s (default 5)")
    ap.add_argument("--verbose", action="store_true", help="print the daemon's warnings as they come")
    opts = ap.parse_args()
    quiet_logs(opts.verbose)
    mark = install_mark()
    try:
        trio.run(main, opts, mark)
    finally:
        final_sweep(mark)
