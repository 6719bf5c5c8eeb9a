"""Scale: many live runs on one daemon process (``agentd serve``).

For each size (default 200, then 500): that many scripted runs, each waiting in a
``run_command`` (``sleep``); then the daemon's CPU over 10 s idle (psutil ``cpu_times``
of the daemon process, all its threads), its RSS/USS, the RSS/USS of a runner, and
cancel-all (one ``cancel`` naming every run: ``Client.cancel_many``) -> every process of every tree dead (pidfds),
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
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from benchmarks._common import (  # noqa: E402
    MARK_VAR,
    PY,
    Deaths,
    PidId,
    alive,
    cmdline,
    final_sweep,
    header,
    install_mark,
    kill_all,
    line,
    machine,
    mem_available_bytes,
    pids_with,
    write_json,
)
from benchmarks._daemon_proc import DaemonProc  # noqa: E402

SLEEP_ARG = "987.5"  # marks the runs' commands in the process table
RESERVE_BYTES = 4 * 2**30  # left for everyone else on the machine
MIB = 2**20


def spec() -> dict[str, Any]:
    return {
        "task": "benchmark: wait in a command",
        "model": {
            "provider": "scripted",
            "script": {
                "turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": f"sleep {SLEEP_ARG}"}}]}],
                "final": "ok",
            },
        },
        "limits": {"command_timeout_s": 3000},
    }


def run_members(mark: str, d: DaemonProc) -> list[PidId]:
    """Every process of the runs' trees: marked, and neither the daemon nor its zygote nor
    the zygote's parked spares (which carry the mark too, and live as long as the daemon:
    counted, they were survivors of every cancel and kept the waits below to their
    deadlines). Spares are asked for before and after the listing: one forked or taken
    between is known either way."""
    before = d.helper_pids()
    found = pids_with(MARK_VAR, mark, exclude=[d.pid])
    helpers = {*before, *d.helper_pids()}
    return [p for p in found if p.pid not in helpers]


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
    """Set the nice value of every thread of each process (setpriority on a pid reaches
    only its main thread; threads started while it was niced keep their own value)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, value)
            except OSError:
                pass


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def cpu_text(s: float) -> str:
    """psutil cpu_times count 10 ms clock ticks: 0 means under one tick."""
    return "< 10 ms (0 ticks)" if s < 0.005 else f"{s * 1000:.0f} ms"


def idle_cpu(pid: int, seconds: float) -> float:
    c0 = cpu_s(pid)
    time.sleep(seconds)
    return cpu_s(pid) - c0


def wait_live(mark: str, d: DaemonProc, n: int, timeout_s: float) -> float | None:
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while time.perf_counter() < deadline:
        if len(sleepers(run_members(mark, d))) >= n:
            return time.perf_counter() - t0
        if d.p.poll() is not None:
            raise RuntimeError(f"the daemon exited: {d.log_tail()}")
        time.sleep(0.5)
    return None


def grow(mark: str, d: DaemonProc, c: Any, n: int, spawned: list[str]) -> dict[str, Any]:
    """Spawn runs until ``n`` are live in their command (their ids go to ``spawned``);
    returns how long it took. (Not one session: a session has one live turn at a time.)"""
    have = len(sleepers(run_members(mark, d)))
    t0 = time.perf_counter()
    for _ in range(max(0, n - have)):
        spawned.append(c.spawn(spec())["run_id"])
    requests_s = time.perf_counter() - t0
    took = wait_live(mark, d, n, timeout_s=max(120.0, n * 0.6))
    members = run_members(mark, d)
    out = {
        "spawned": n - have,
        "spawn_requests_s": requests_s,
        "all_live_s": None if took is None else requests_s + took,
        "live_in_command": len(sleepers(members)),
        "processes": len(members),
    }
    line(
        f"  {out['spawned']} more runs requested in {requests_s:.1f} s; {out['live_in_command']} waiting in their "
        f"command after {'-' if took is None else round(out['all_live_s'], 1)} s ({len(members)} processes; "
        "spawned at nice 10)"
    )
    return out


def measure(mark: str, d: DaemonProc, idle_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    daemon = psutil.Process(d.pid)
    members = run_members(mark, d)
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
    out["processes"] = len(members)
    line(
        f"  daemon: CPU {cpu_text(out['daemon_idle_cpu_s'])} over {idle_s:g} s idle; "
        f"RSS {out['daemon_rss'] / MIB:.0f} MiB, USS {out['daemon_uss'] / MIB:.0f} MiB; "
        f"{out['daemon_threads']} threads, {out['daemon_fds']} fds"
    )
    if mems:
        line(
            f"  runner: RSS p50 {sorted(out['runner_rss'])[len(mems) // 2] / MIB:.1f} MiB, "
            f"USS p50 {sorted(out['runner_uss'])[len(mems) // 2] / MIB:.1f} MiB (sample of {len(mems)}); "
            f"all {len(members)} processes of the trees: USS {out['all_trees_uss'] / MIB:.0f} MiB"
        )
    return out


def cancel_all(mark: str, d: DaemonProc, run_ids: list[str], grace: float, deadline_s: float) -> dict[str, Any]:
    """One cancel naming every run (``Client.cancel_many``); the clock stops when every
    process found before it has exited (each watched through a pidfd: no /proc polling
    that would take CPU from what is measured) and when every run is terminal."""
    out: dict[str, Any] = {"grace_s": grace}
    members = run_members(mark, d)
    deaths = Deaths(members)
    reply: dict[str, Any] = {}

    def send() -> None:
        with d.client(timeout_s=deadline_s) as c:
            t = time.perf_counter()
            try:
                reply["result"] = c.cancel_many(run_ids)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                reply["error"] = repr(exc)
            reply["took"] = time.perf_counter() - t

    t0 = time.perf_counter()
    deaths.start(t0)
    th = threading.Thread(target=send, daemon=True)
    th.start()
    dead_at = term_at = None
    with d.client(timeout_s=30) as c:
        while time.perf_counter() - t0 < deadline_s and (dead_at is None or term_at is None):
            time.sleep(0.05)
            if dead_at is None and deaths.all_dead:
                dead_at = max(deaths.dead_at.values(), default=0.0)
            if term_at is None:
                try:
                    wanted = set(run_ids)
                    runs = [r for r in c.list_runs(limit=1000) if r["id"] in wanted]
                except Exception:  # noqa: BLE001 - a slow daemon: try again
                    continue
                if runs and all(r["state"] in ("cancelled", "completed", "failed", "lost") for r in runs):
                    term_at = time.perf_counter() - t0
                    out["states"] = sorted({r["state"] for r in runs})
                time.sleep(0.2)
    th.join(5)
    deaths.close()
    times = sorted(deaths.dead_at.values())
    out.update(
        {
            "processes": len(members),
            "cancel_reply_s": reply.get("took"),
            "cancel_error": reply.get("error"),
            "cancelled_runs": len((reply.get("result") or {}).get("runs", [])),
            "all_dead_s": dead_at,
            "all_terminal_s": term_at,
            "dead_p50_s": times[len(times) // 2] if times else None,
            "dead_p90_s": times[int(len(times) * 0.9)] if times else None,
        }
    )
    left = set(deaths.left())
    still = [p for p in members if p.pid in left and alive(p)]
    out["survivors"] = [{"pid": p.pid, "cmdline": cmdline(p.pid)} for p in still]
    kill_all(still)
    fmt = lambda x: "-" if x is None else f"{x:.2f} s"  # noqa: E731
    line(
        f"  cancel-all (one cancel naming every run): replied after {fmt(out['cancel_reply_s'])}; of {len(members)} "
        f"processes half dead after {fmt(out['dead_p50_s'])}, 90 % after {fmt(out['dead_p90_s'])}, all after {fmt(dead_at)} "
        f"(grace {grace:g} s); all runs terminal after {fmt(term_at)} {out.get('states', '')}; survivors at {deadline_s:g} s: "
        f"{len(still)}"
    )
    for sv in out["survivors"][:5]:
        line(f"     survivor pid {sv['pid']}: {sv['cmdline']}")
    return out


def daemon_warnings(d: DaemonProc) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ln in d.log_tail(50_000_000).splitlines():
        if " WARNING " not in ln and " ERROR " not in ln:
            continue
        msg = re.sub(r"\b(r|t)-[0-9a-f]{16}\b", r"\1-*", ln.split(": ", 1)[-1])
        msg = re.sub(r"\d+(\.\d+)?", "N", msg)[:120]
        counts[msg] = counts.get(msg, 0) + 1
    for msg, n in sorted(counts.items(), key=lambda kv: -kv[1])[:8]:
        line(f"  daemon log x{n}: {msg}")
    return counts


def per_run_probe(mark: str, d: DaemonProc) -> dict[str, Any]:
    """One run's tree, to size the memory headroom."""
    with d.client() as c:
        probe_id = c.spawn(spec())["run_id"]
        wait_live(mark, d, 1, timeout_s=60)
        time.sleep(0.5)
        members = run_members(mark, d)
        uss = tree_uss([p.pid for p in members])
        r = runners(members)
        rm = mem(r[0]) if r else None
        c.cancel(probe_id)
        kill_deadline = time.monotonic() + 30
        while any(alive(p) for p in members) and time.monotonic() < kill_deadline:
            time.sleep(0.05)
    return {
        "tree_uss": uss,
        "tree_processes": len(members),
        "runner_rss": rm[0] if rm else None,
        "runner_uss": rm[1] if rm else None,
    }


def bare_python_mem() -> tuple[int, int]:
    p = subprocess.Popen(
        [PY, "-c", "import sys, time; sys.stdout.write('x'); sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    p.stdout.read(1)
    m = mem(p.pid) or (0, 0)
    p.kill()
    p.wait()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 2 and 3, 0.5 s idle, grace 0.5 s: for the smoke test")
    ap.add_argument("--sizes", default=None, help="comma-separated run counts (default 200,500)")
    ap.add_argument("--idle", type=float, default=None, help="idle window for the daemon's CPU, s (default 10)")
    ap.add_argument(
        "--grace",
        type=float,
        default=None,
        help="the daemon's grace (default 2 s): a run inside a command lets it finish, so the grace bounds cancel-all",
    )
    ap.add_argument(
        "--cancel-deadline",
        type=float,
        default=None,
        help="how long cancel-all may take before what still runs counts as survivors (default 120 s)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in (args.sizes or ("2,3" if args.quick else "200,500")).split(",")]
    idle_s = args.idle if args.idle is not None else (0.5 if args.quick else 10.0)
    if args.grace is None:
        args.grace = 0.5 if args.quick else 2.0
    if args.cancel_deadline is None:
        args.cancel_deadline = 30.0 if args.quick else 120.0
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
            waited = d.wait_zygote()
            header("baselines")
            line(
                f"  runners forked by the zygote: {f'yes, ready after {waited:.1f} s' if waited is not None else 'no (cold)'}"
            )
            time.sleep(1.0)
            renice([d.pid], 0)
            base_idle = idle_cpu(d.pid, idle_s)
            dm = psutil.Process(d.pid).memory_full_info()
            bare = bare_python_mem()
            out["baseline"] = {
                "daemon_idle_cpu_s": base_idle,
                "daemon_rss": dm.rss,
                "daemon_uss": dm.uss,
                "bare_python_rss": bare[0],
                "bare_python_uss": bare[1],
            }
            line(
                f"  daemon with no run: CPU {cpu_text(base_idle)} over {idle_s:g} s; RSS {dm.rss / MIB:.0f} MiB, "
                f"USS {dm.uss / MIB:.0f} MiB"
            )
            line(f"  bare `python -c 'time.sleep()'`: RSS {bare[0] / MIB:.1f} MiB, USS {bare[1] / MIB:.1f} MiB")
            renice([d.pid], 10)
            probe = per_run_probe(mark, d)
            out["probe"] = probe
            avail = mem_available_bytes()
            fit = int(max(0, avail - RESERVE_BYTES) / max(1, probe["tree_uss"] * 1.3))
            line(
                f"  one run's tree: {probe['tree_processes']} processes, USS {probe['tree_uss'] / MIB:.1f} MiB "
                f"(runner RSS {(probe['runner_rss'] or 0) / MIB:.1f} MiB, USS {(probe['runner_uss'] or 0) / MIB:.1f} MiB); "
                f"MemAvailable {avail / 2**30:.1f} GiB -> room for about {fit} runs (reserve {RESERVE_BYTES / 2**30:.0f} GiB, x1.3)"
            )
            spawned: list[str] = []
            with d.client() as c:
                for n in sizes:
                    size = min(n, fit)
                    header(f"{size} live runs" + (f" (asked {n}: scaled down to fit in memory)" if size != n else ""))
                    renice([d.pid], 10)
                    res = {"asked": n, "size": size, **grow(mark, d, c, size, spawned), **measure(mark, d, idle_s)}
                    out["results"].append(res)
            header(f"cancel-all of {out['results'][-1]['size']} live runs")
            out["cancel_all"] = cancel_all(mark, d, spawned, args.grace, deadline_s=args.cancel_deadline)
            out["daemon_warnings"] = daemon_warnings(d)
    finally:
        if d is not None:
            d.stop()
        tmpobj.cleanup()
        header("cleanup")
        out["survivors_at_exit"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
