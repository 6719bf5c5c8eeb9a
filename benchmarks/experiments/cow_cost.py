"""Experiment: the copy-on-write cost of a forked runner, by phase and by mapping.

An in-process daemon with its zygote (pool 0, no spare: every runner forked at its
spawn) serves N scripted runs waiting in a ``run_command sleep``, one at a time: each
runner's page faults and private memory while it waits (``/proc/PID/stat`` minflt;
``smaps``: Private_Clean + Private_Dirty, i.e. USS, by mapping: heap, anonymous, stack,
libpython / the python binary, other libraries, other files), then its stop: a cancel, and what the runner and the children it reaped
cost from the cancel to its reaping (the zygote's ``cminflt``/``cutime``/``cstime``
grow by exactly that when it reaps the runner). Then the zygote serves ``--churn``
short runs, and the same is measured on N runners forked after them (a zygote's heap
changes as it serves requests: later runners share fewer pages with it).

Each configuration is the zygote with and without its copy-on-write preparation
(``AGENTD_ZYGOTE_PREPARE``, see ``subagent.zygote._prepare_memory``), side by side in
this run.

With ``--phases`` the zygote loads ``cow_probe/`` (a ``sitecustomize``): each runner's
faults and CPU from its fork to its command, then its stop, phase by phase.

    .venv/bin/python benchmarks/experiments/cow_cost.py [N] [--churn K] [--configs off,trim,collapse,on] [--phases]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import final_sweep, install_mark  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs, scripted_spec, wait_event  # noqa: E402

PREPARE_VAR = "AGENTD_ZYGOTE_PREPARE"
FORKS: list[float] = []  # Zygote.spawn_tree durations (request, clone, the runner's reply)


def time_forks() -> None:
    from supervisor.trees import zygote as zygote_mod

    orig = zygote_mod.Zygote.spawn_tree

    async def timed(z: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await orig(z, *a, **k)
        finally:
            FORKS.append(time.perf_counter() - t0)

    zygote_mod.Zygote.spawn_tree = timed  # type: ignore[method-assign, assignment]


KIB = 1024


def stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def faults(pid: int) -> tuple[int, int, float] | None:
    """(minflt, cminflt, cutime+cstime seconds) of pid."""
    f = stat_fields(pid)
    if f is None:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    # fields after the comm: state=0, ... minflt=7, cminflt=8, utime=11, stime=12, cutime=13, cstime=14
    return int(f[7]), int(f[8]), (int(f[13]) + int(f[14])) / hz


def category(path: str) -> str:
    if path == "[heap]":
        return "heap"
    if path == "":
        return "anon"
    if path.startswith("[stack"):
        return "stack"
    if "libpython" in path or path.rsplit("/", 1)[-1].startswith("python3"):
        return "python"
    if ".so" in path:
        return "libs"
    if path.startswith("["):
        return path
    return "files"


def ranges(pid: int) -> list[tuple[int, int]]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [tuple(int(x, 16) for x in ln.split(None, 1)[0].split("-")) for ln in f]  # type: ignore[misc]
    except OSError:
        return []


def smaps(pid: int, parent: list[tuple[int, int]] | None = None) -> dict[str, dict[str, int]] | None:
    """kB per category: private (USS), of it dirty, and AnonHugePages. With ``parent``
    (the zygote's mappings), anonymous memory is split: in a mapping the zygote has too
    (copied on write, or reused free space of its arenas) or in a new one."""
    out: dict[str, dict[str, int]] = {}
    cur: dict[str, int] | None = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for ln in f:
                first = ln.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    parts = ln.split(None, 5)
                    cat = category(parts[5].strip() if len(parts) > 5 else "")
                    if parent is not None and cat in ("anon", "heap"):
                        a, b = (int(x, 16) for x in first.split("-"))
                        shared = any(pa < b and a < pb for pa, pb in parent)
                        cat += " (zygote's)" if shared else " (new)"
                    cur = out.setdefault(cat, {})
                    continue
                if cur is None:
                    continue
                key = first[:-1]
                if key in ("Private_Clean", "Private_Dirty", "AnonHugePages", "Rss"):
                    cur[key] = cur.get(key, 0) + int(ln.split()[1])
    except OSError:
        return None
    return out


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def gated(tag: str) -> dict[str, Any]:
    return scripted_spec(
        [{"tool_calls": [{"name": "run_command", "arguments": {"command": f"sleep {tag}"}}]}],
        final="ok",
        limits={"command_timeout_s": 600},
    )


async def one(manager: Any, zpid: int, tag: str) -> dict[str, Any]:
    n_forks = len(FORKS)
    r = await manager.spawn(gated(tag))
    await wait_event(
        manager, r["run_id"], "tool_call", timeout_s=120, pred=lambda e: e["data"]["record"]["state"] == "running"
    )
    await trio.sleep(0.3)  # settle into the wait
    pid = (await manager.status(r["run_id"]))["pid"]
    f_wait = faults(pid)
    maps = smaps(pid, ranges(zpid))
    kid_faults = 0
    for k in children(pid):
        kf = faults(k)
        kid_faults += kf[0] if kf else 0
        for g in children(k):
            gf = faults(g)
            kid_faults += gf[0] if gf else 0
    z0 = faults(zpid)
    await manager.cancel(r["run_id"])
    await manager.wait_terminal(r["run_id"])
    with trio.move_on_after(10):
        while os.path.exists(f"/proc/{pid}"):  # until the zygote has reaped it
            await trio.sleep(0.005)
    z1 = faults(zpid)
    out: dict[str, Any] = {"pid": pid, "maps": maps, "fork_ms": [x * 1000 for x in FORKS[n_forks:]]}
    if f_wait and z0 and z1:
        out["wait_faults"] = f_wait[0]
        # the runner's whole-life faults (and those of the children it reaped)
        total = z1[1] - z0[1]
        out["life_faults"] = total
        out["stop_faults"] = total - f_wait[0] - kid_faults
        out["life_cpu_ms"] = (z1[2] - z0[2]) * 1000
    return out


async def churn(manager: Any, k: int) -> None:
    spec = scripted_spec(final="ok", tools=[])
    for _ in range(k):
        r = await manager.spawn(spec)
        await manager.wait_terminal(r["run_id"])


PROBE_DIR = Path(__file__).resolve().parent / "cow_probe"


def show_phases(out_dir: str) -> dict[str, dict[str, float]]:
    """The probe's marks (``cow_probe/sitecustomize.py``): per phase, the median faults and
    the mean user and system CPU, over the runners that reached their command."""
    per: dict[str, list[tuple[int, float, float]]] = {}
    order: list[str] = []
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            marks = [(lab, int(fl), float(u), float(sy)) for lab, fl, u, sy in (ln.split() for ln in f)]
        if "command_running" not in {m[0] for m in marks}:
            continue  # not one of the measured runs
        prev = ("", 0, 0.0, 0.0)
        for m in marks:
            if m[0] not in order:
                order.append(m[0])
            per.setdefault(m[0], []).append((m[1] - prev[1], m[2] - prev[2], m[3] - prev[3]))
            prev = m
    out: dict[str, dict[str, float]] = {}
    print("  by phase (each from the previous mark; fork = from the fork to the child's first Python step):")
    for lab in order:
        v = per[lab]
        row = {
            "faults": med([x[0] for x in v]),
            "user_ms": statistics.mean(x[1] for x in v) * 1000,
            "sys_ms": statistics.mean(x[2] for x in v) * 1000,
        }
        out[lab] = row
        print(
            f"      {lab:<18} faults {row['faults']:5.0f}   user {row['user_ms']:5.2f} ms   sys {row['sys_ms']:5.2f} ms",
            flush=True,
        )
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def show(label: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "wait_faults" in r and r.get("maps")]
    cats: dict[str, dict[str, float]] = {}
    for c in sorted({c for r in ok for c in r["maps"]}):
        cats[c] = {
            key: med([r["maps"].get(c, {}).get(key, 0) for r in ok])
            for key in ("Private_Clean", "Private_Dirty", "AnonHugePages", "Rss")
        }
    uss = med([sum(v.get("Private_Clean", 0) + v.get("Private_Dirty", 0) for v in r["maps"].values()) for r in ok])
    summ = {
        "n": len(ok),
        "uss_kib": uss,
        "wait_faults": med([r["wait_faults"] for r in ok]),
        "stop_faults": med([r["stop_faults"] for r in ok]),
        "life_faults": med([r["life_faults"] for r in ok]),
        # clock ticks (10 ms) per runner: the mean over the runners, not a median of ticks
        "life_cpu_ms": statistics.mean([r["life_cpu_ms"] for r in ok]) if ok else float("nan"),
        "maps": cats,
        "fork_ms": med([x for r in ok for x in r["fork_ms"]]),
    }
    print(
        f"  {label}: n={summ['n']} USS {uss / KIB:.2f} MiB; faults fork->waiting {summ['wait_faults']:.0f}, "
        f"stop->reaped {summ['stop_faults']:.0f} (whole life with its reaped children {summ['life_faults']:.0f}); "
        f"CPU, spawn->reaped, with its children, mean {summ['life_cpu_ms']:.1f} ms; "
        f"the fork (Zygote.spawn_tree) p50 {summ['fork_ms']:.2f} ms",
        flush=True,
    )
    for c, v in sorted(cats.items(), key=lambda kv: -(kv[1]["Private_Clean"] + kv[1]["Private_Dirty"])):
        priv = v["Private_Clean"] + v["Private_Dirty"]
        if priv >= 16:
            print(
                f"      {c:<10} private {priv / KIB:6.2f} MiB (dirty {v['Private_Dirty'] / KIB:.2f}), "
                f"rss {v['Rss'] / KIB:6.2f} MiB, THP {v['AnonHugePages'] / KIB:.1f} MiB",
                flush=True,
            )
    return summ


async def run_config(name: str, prepare: str, n: int, k: int, phases: bool = False, alive: int = 0) -> dict[str, Any]:
    probe_out = tempfile.mkdtemp(prefix="agentd-cow-probe-") if phases else ""
    try:
        return await _run_config(name, prepare, n, k, probe_out, alive)
    finally:
        if probe_out:  # (it was left in /tmp)
            shutil.rmtree(probe_out, ignore_errors=True)


async def _run_config(name: str, prepare: str, n: int, k: int, probe_out: str, alive: int) -> dict[str, Any]:
    phases = bool(probe_out)
    os.environ[PREPARE_VAR] = prepare
    if phases:  # the daemon's zygote inherits our environment
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")]))
        os.environ["COW_PROBE_DIR"] = probe_out
    print(f"== zygote {name} ({PREPARE_VAR}={prepare})", flush=True)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agentd-cow-") as tmp:
        async with in_process_daemon(
            Path(tmp), pool_size=0, zygote_spares=0, grace_s=2, max_concurrent=max(64, alive + 16)
        ) as d:
            m = d["manager"]
            with trio.fail_after(180):
                while (await m.summary())["zygote"]["state"] != "ready":
                    await trio.sleep(0.05)
            zpid = (await m.summary())["zygote"]["pid"]
            zm = smaps(zpid) or {}
            anon = sum(v.get("Rss", 0) for c, v in zm.items() if c in ("anon", "heap"))
            thp = sum(v.get("AnonHugePages", 0) for v in zm.values())
            print(f"  zygote: anon+heap RSS {anon / KIB:.1f} MiB, of it THP {thp / KIB:.1f} MiB", flush=True)
            tag = f"{os.getpid()}{int(time.time() * 1000) % 100000}.5"
            await churn(m, 1)
            res["early"] = show("first runners", [await one(m, zpid, tag) for _ in range(n)])
            if phases:
                res["phases"] = show_phases(probe_out)
                os.environ.pop("COW_PROBE_DIR", None)
            if k:
                t0 = time.perf_counter()
                await churn(m, k)
                print(f"  ... {k} short runs served ({time.perf_counter() - t0:.1f} s)", flush=True)
                res["late"] = show(f"runners after {k} more spawns", [await one(m, zpid, tag) for _ in range(n)])
            if alive:
                t0 = time.perf_counter()
                held = [await m.spawn(gated(tag)) for _ in range(alive)]
                for r in held:
                    await wait_event(
                        m,
                        r["run_id"],
                        "tool_call",
                        timeout_s=120,
                        pred=lambda e: e["data"]["record"]["state"] == "running",
                    )
                print(f"  ... {alive} runs waiting meanwhile ({time.perf_counter() - t0:.1f} s)", flush=True)
                res["beside"] = show(f"runners beside {alive} live ones", [await one(m, zpid, tag) for _ in range(n)])
                for r in held:
                    await m.cancel(r["run_id"])
                for r in held:
                    await m.wait_terminal(r["run_id"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", type=int, nargs="?", default=5, help="runners measured per configuration and phase")
    ap.add_argument("--churn", type=int, default=150, help="short runs served between the two measurements")
    ap.add_argument("--alive", type=int, default=0, help="then measure N more beside this many live runs")
    ap.add_argument("--phases", action="store_true", help="faults and CPU by phase (loads cow_probe/ in the zygote)")
    ap.add_argument("--configs", default="off,on", help="zygote preparation: off,trim,collapse,on (in this order)")
    args = ap.parse_args()
    quiet_logs(False)
    time_forks()
    mark = install_mark()
    try:
        for c in args.configs.split(","):
            prepare = {"on": "1", "off": "0"}.get(c, c)
            trio.run(run_config, f"preparation {c}", prepare, args.n, args.churn, args.phases, args.alive)
    finally:
        final_sweep(mark)


if __name__ == "__main__":
    main()
