"""Scale: many live runs on one daemon process (``agentd serve``).

For each size (default 200, then 500): that many scripted runs, each waiting in a
``run_command`` (``sleep``); then the daemon's CPU over 10 s idle (psutil ``cpu_times``
of the daemon process, all its threads), its RSS/USS, the RSS/USS of a runner, and
cancel-all (one ``cancel`` of the runs' session) -> every process of every tree dead,
plus survivors. Baselines in the same run: the same daemon idle with no run, and a bare
``python -c 'import time; time.sleep(...)'`` process's RSS/USS.

Memory headroom is measured first (one run's tree USS x size, against MemAvailable less a
reserve for everyone else on the machine); a size that does not fit is scaled down and
the output says so. Spawning is done with the daemon (and so its runners) at nice 10 so
other work on the machine keeps its share; everything is reniced to 0 before measuring.

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--sizes 200,500] [--idle 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from benchmarks._common import (  # noqa: E402
    MARK_VAR,
    PY,
    PidId,
    alive,
    final_sweep,
    header,
    install_mark,
    kill_all,
    line,
    machine,
    mem_available_bytes,
    pids_with,
    row,
    summary,
    write_json,
)
from benchmarks._daemon_proc import DaemonProc  # noqa: E402

SLEEP_ARG = "987.5"  # marks the runs' commands in the process table
RESERVE_BYTES = 4 * 2**30  # left for everyone else on the machine
MIB = 2**20


def spec() -> dict[str, Any]:
    return {
        "task": "benchmark: wait in a command",
        "model": {"provider": "scripted", "script": {"turns": [
            {"tool_calls": [{"name": "run_command", "arguments": {"command": f"sleep {SLEEP_ARG}"}}]}
        ], "final": "ok"}},
        "limits": {"command_timeout_s": 3000},
    }


def run_members(mark: str, daemon_pid: int) -> list[PidId]:
    return pids_with(MARK_VAR, mark, exclude=[daemon_pid])


def sleepers(members: list[PidId]) -> list[int]:
    out = []
    for p in members:
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:1] and argv[0].endswith(b"sleep") and SLEEP_ARG.encode() in argv:
            out.append(p.pid)
    return out


def runners(members: list[PidId]) -> list[int]:
    out = []
    for p in members:
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                if b"subagent.runner" in f.read():
                    out.append(p.pid)
        except OSError:
            continue
    return out


def mem(pid: int) -> tuple[int, int] | None:
    try:
        mi = psutil.Process(pid).memory_full_info()
        return mi.rss, mi.uss
    except psutil.Error:
        return None


def tree_uss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        m = mem(pid)
        if m:
            total += m[1]
    return total


def renice(pids: list[int], value: int) -> None:
    for pid in pids:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, value)
        except OSError:
            pass


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def idle_cpu(pid: int, seconds: float) -> float:
    c0 = cpu_s(pid)
    time.sleep(seconds)
    return cpu_s(pid) - c0


def wait_live(mark: str, d: DaemonProc, n: int, timeout_s: float) -> float | None:
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while time.perf_counter() < deadline:
        if len(sleepers(run_members(mark, d.pid))) >= n:
            return time.perf_counter() - t0
        if d.p.poll() is not None:
            raise RuntimeError(f"the daemon exited: {d.log_tail()}")
        time.sleep(0.5)
    return None


def one_size(mark: str, d: DaemonProc, n: int, idle_s: float, session: str, grace: float) -> dict[str, Any]:
    out: dict[str, Any] = {"size": n}
    daemon = psutil.Process(d.pid)
    with d.client() as c:
        t0 = time.perf_counter()
        for _ in range(n):
            c.spawn(spec(), session_id=session)
        out["spawn_requests_s"] = time.perf_counter() - t0
        took = wait_live(mark, d, n, timeout_s=max(120.0, n * 0.6))
        out["all_live_s"] = None if took is None else out["spawn_requests_s"] + took
        members = run_members(mark, d.pid)
        out["live_in_command"] = len(sleepers(members))
        line(f"  {n} runs requested in {out['spawn_requests_s']:.1f} s; {out['live_in_command']} waiting in their "
             f"command after {out['all_live_s'] if out['all_live_s'] is None else round(out['all_live_s'], 1)} s "
             f"({len(members)} processes)")
        renice([d.pid] + [p.pid for p in members], 0)
        time.sleep(2.0)  # let the spawn work settle
        out["daemon_idle_cpu_s"] = idle_cpu(d.pid, idle_s)
        mi = daemon.memory_full_info()
        out["daemon_rss"], out["daemon_uss"] = mi.rss, mi.uss
        out["daemon_threads"] = daemon.num_threads()
        out["daemon_fds"] = daemon.num_fds()
        rs = runners(members)
        sample = rs[:: max(1, len(rs) // 25)][:25]
        mems = [m for m in (mem(p) for p in sample) if m]
        out["runner_rss"] = [m[0] for m in mems]
        out["runner_uss"] = [m[1] for m in mems]
        out["all_trees_uss"] = tree_uss([p.pid for p in members])
        line(f"  daemon: CPU {out['daemon_idle_cpu_s'] * 1000:.0f} ms over {idle_s:g} s idle; "
             f"RSS {out['daemon_rss'] / MIB:.0f} MiB, USS {out['daemon_uss'] / MIB:.0f} MiB; "
             f"{out['daemon_threads']} threads, {out['daemon_fds']} fds")
        line(f"  runner: RSS p50 {sorted(out['runner_rss'])[len(mems) // 2] / MIB:.1f} MiB, "
             f"USS p50 {sorted(out['runner_uss'])[len(mems) // 2] / MIB:.1f} MiB (sample of {len(mems)}); "
             f"all trees USS {out['all_trees_uss'] / MIB:.0f} MiB")

        # cancel-all: one request cancels the whole session; clock stops when every
        # process of every tree (found before the cancel) is dead.
        members = run_members(mark, d.pid)
        t0 = time.perf_counter()
        reply = c.cancel_session(session)
        out["cancel_reply_s"] = time.perf_counter() - t0
        left = [p for p in members if alive(p)]
        deadline = t0 + 60
        while left and time.perf_counter() < deadline:
            time.sleep(0.02)
            left = [p for p in left if alive(p)]
        out["cancel_all_dead_s"] = None if left else time.perf_counter() - t0
        out["grace_s"] = grace
        out["cancelled_runs"] = len(reply.get("runs", []))
        # every run terminal
        t_term = None
        while time.perf_counter() < deadline + 30:
            runs = c.list_runs(session_id=session, limit=1000)
            if all(r["state"] in ("cancelled", "completed", "failed", "lost") for r in runs):
                t_term = time.perf_counter() - t0
                out["states"] = sorted({r["state"] for r in runs})
                break
            time.sleep(0.1)
        out["cancel_all_terminal_s"] = t_term
    survivors = [p for p in run_members(mark, d.pid) if alive(p)]
    out["survivors"] = [p.pid for p in survivors]
    kill_all(survivors)
    line(f"  cancel-all: reply {out['cancel_reply_s'] * 1000:.0f} ms ({out['cancelled_runs']} runs); "
         f"all {len(members)} processes dead after "
         f"{'-' if out['cancel_all_dead_s'] is None else round(out['cancel_all_dead_s'], 2)} s "
         f"(grace {grace:g} s); "
         f"all runs terminal after {'-' if t_term is None else round(t_term, 2)} s "
         f"{out.get('states')}; survivors {len(out['survivors'])}")
    return out


def per_run_probe(mark: str, d: DaemonProc) -> dict[str, Any]:
    """One run's tree, to size the memory headroom."""
    with d.client() as c:
        c.spawn(spec(), session_id="probe")
        wait_live(mark, d, 1, timeout_s=60)
        time.sleep(0.5)
        members = run_members(mark, d.pid)
        uss = tree_uss([p.pid for p in members])
        r = runners(members)
        rm = mem(r[0]) if r else None
        c.cancel_session("probe")
        kill_deadline = time.monotonic() + 30
        while any(alive(p) for p in members) and time.monotonic() < kill_deadline:
            time.sleep(0.05)
    return {"tree_uss": uss, "tree_processes": len(members), "runner_rss": rm[0] if rm else None, "runner_uss": rm[1] if rm else None}


def bare_python_mem() -> tuple[int, int]:
    p = subprocess.Popen([PY, "-c", "import sys, time; sys.stdout.write('x'); sys.stdout.flush(); time.sleep(60)"],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert p.stdout is not None
    p.stdout.read(1)
    m = mem(p.pid) or (0, 0)
    p.kill()
    p.wait()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 3 and 5, 1 s idle: for the smoke test")
    ap.add_argument("--sizes", default=None, help="comma-separated run counts (default 200,500)")
    ap.add_argument("--idle", type=float, default=None, help="idle window for the daemon's CPU, s (default 10)")
    ap.add_argument("--grace", type=float, default=2.0,
                    help="the daemon's grace (default 2 s): a run inside a command lets it finish, so the "
                         "grace bounds cancel-all")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in (args.sizes or ("3,5" if args.quick else "200,500")).split(",")]
    idle_s = args.idle if args.idle is not None else (1.0 if args.quick else 10.0)
    mark = install_mark()
    m = machine()
    line(f"bench_scale on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {"machine": m, "sizes_asked": sizes, "idle_s": idle_s, "grace_s": args.grace, "results": []}
    d: DaemonProc | None = None
    tmpobj = tempfile.TemporaryDirectory(prefix="agentd-bench-scale-")
    tmp = tmpobj.name
    try:
        if True:
            d = DaemonProc(Path(tmp) / "state", nice=10, max_concurrent=max(sizes) + 10, grace_s=args.grace)
            header("baselines")
            time.sleep(1.0)
            renice([d.pid], 0)
            base_idle = idle_cpu(d.pid, idle_s)
            dm = psutil.Process(d.pid).memory_full_info()
            bare = bare_python_mem()
            out["baseline"] = {"daemon_idle_cpu_s": base_idle, "daemon_rss": dm.rss, "daemon_uss": dm.uss,
                               "bare_python_rss": bare[0], "bare_python_uss": bare[1]}
            line(f"  daemon with no run: CPU {base_idle * 1000:.0f} ms over {idle_s:g} s; RSS {dm.rss / MIB:.0f} MiB, "
                 f"USS {dm.uss / MIB:.0f} MiB")
            line(f"  bare `python -c 'time.sleep()'`: RSS {bare[0] / MIB:.1f} MiB, USS {bare[1] / MIB:.1f} MiB")
            renice([d.pid], 10)
            probe = per_run_probe(mark, d)
            out["probe"] = probe
            avail = mem_available_bytes()
            fit = int(max(0, avail - RESERVE_BYTES) / max(1, probe["tree_uss"] * 1.3))
            line(f"  one run's tree: {probe['tree_processes']} processes, USS {probe['tree_uss'] / MIB:.1f} MiB "
                 f"(runner RSS {(probe['runner_rss'] or 0) / MIB:.1f} MiB, USS {(probe['runner_uss'] or 0) / MIB:.1f} MiB); "
                 f"MemAvailable {avail / 2**30:.1f} GiB -> room for about {fit} runs (reserve {RESERVE_BYTES / 2**30:.0f} GiB, x1.3)")
            for i, n in enumerate(sizes):
                size = n
                if n > fit:
                    size = fit
                    line(f"  !! {n} runs do not fit in memory here; scaling down to {size}")
                header(f"{size} live runs" + (f" (asked {n})" if size != n else ""))
                renice([d.pid], 10)
                res = one_size(mark, d, size, idle_s, session=f"scale-{i}", grace=args.grace)
                res["asked"] = n
                out["results"].append(res)
    finally:
        if d is not None:
            d.stop()
        tmpobj.cleanup()
        header("cleanup")
        out["survivors_at_exit"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
