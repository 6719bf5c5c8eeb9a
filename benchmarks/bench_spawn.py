"""Spawn latency: a spawn request to the runner's first ``step_started`` event.

The daemon runs in this process (``serve``); a spawn is ``RunManager.spawn`` and the clock
stops when the ``step_started`` event reaches a subscriber (journaled and fanned out).
"emitted" is the runner's own timestamp on that event (wall clock), so the daemon's
delivery cost is the difference. Cases: one run at a time and N at once, with no pool
(cold ``python -m subagent.runner`` per run) and with a warm pool (``pool_size``).

The runner zygote is off here (``zygote=off``: cold means a new Python per runner, warm
the pre-spawned pool); ``bench_zygote.py`` measures runners forked by the zygote.

Baselines, measured in the same run: a bare ``Popen`` of ``python -c pass`` in a new
session (to its exit), a cold ``python -c 'import openai, mcp'`` (to its exit), and a bare
runner without the daemon (``Popen`` of ``python -m subagent.runner``, spec on stdin,
clock stops at ``step_started`` on its stderr).

    .venv/bin/python benchmarks/bench_spawn.py [--quick] [--reps N] [--burst N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PY,
    final_sweep,
    header,
    install_mark,
    line,
    machine,
    remove_run_dir,
    row,
    summary,
    write_json,
)
from benchmarks._daemon import (  # noqa: E402
    in_process_daemon,
    quiet_logs,
    scripted_spec,
    show_warnings,
    wait_event,
    wait_pool_warm,
)

SPEC = scripted_spec(final="ok", tools=[])


# ----------------------------------------------------------------------------- baselines


def popen_to_exit(argv: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    p.wait()
    return time.perf_counter() - t0


def bare_runner_first_step() -> float | None:
    """Popen the runner without a daemon; seconds until step_started on its stderr."""
    with tempfile.TemporaryDirectory(prefix="agentd-bench-") as d:
        env = dict(__import__("os").environ, AGENTD_RUN_DIR=d)
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [PY, "-m", "subagent.runner"],
            cwd=d,
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write((json.dumps(SPEC) + "\n").encode())
        p.stdin.close()
        took = None
        for raw in p.stderr:
            if b'"step_started"' in raw:
                took = time.perf_counter() - t0
                break
        p.stderr.close()
        p.wait()
        remove_run_dir(d, records_only=True)  # beside the directory, which its own cleanup removes
        return took


def burst_popen(n: int) -> list[float]:
    """n bare Popens of ``python -c pass`` at once; each one's start-to-exit from a common t0."""
    out: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one() -> None:
        p = subprocess.Popen([PY, "-c", "pass"], start_new_session=True, stdin=subprocess.DEVNULL)
        p.wait()
        with lock:
            out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ----------------------------------------------------------------------------- agentd


async def one_first_step(manager: Any, t0: float | None = None) -> dict[str, Any]:
    t0 = time.perf_counter() if t0 is None else t0
    wall0 = time.time() - (time.perf_counter() - t0)
    r = await manager.spawn(SPEC)
    ev = await wait_event(manager, r["run_id"], "step_started", timeout_s=60)
    out: dict[str, Any] = {"run_id": r["run_id"]}
    if ev is not None:
        out["delivered"] = ev["_arrived"] - t0
        out["emitted"] = ev["ts"] - wall0
        out["replayed"] = ev["_replayed"]
    await manager.wait_terminal(r["run_id"])
    return out


async def sequential(
    manager: Any, reps: int, *, pool: int, baselines: dict[str, list[float]]
) -> dict[str, list[float]]:
    delivered: list[float] = []
    emitted: list[float] = []
    for _ in range(reps):
        if pool:
            await wait_pool_warm(manager, pool, timeout_s=60)
        # The baseline right beside each sample, so both see the same machine load.
        baselines.setdefault("popen_pass", []).append(await trio.to_thread.run_sync(popen_to_exit, [PY, "-c", "pass"]))
        res = await one_first_step(manager)
        if "delivered" in res:
            delivered.append(res["delivered"])
            emitted.append(res["emitted"])
        if not pool:
            took = await trio.to_thread.run_sync(bare_runner_first_step)
            if took is not None:
                baselines.setdefault("bare_runner", []).append(took)
    return {"delivered": delivered, "emitted": emitted}


async def burst(manager: Any, n: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def one() -> None:
        results.append(await one_first_step(manager, t0))

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    delivered = [r["delivered"] for r in results if "delivered" in r]
    return {
        "delivered": delivered,
        "emitted": [r["emitted"] for r in results if "emitted" in r],
        "all_started": max(delivered) if delivered else None,
        "missing": n - len(delivered),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, list[float]] = {}
    out: dict[str, Any] = {"machine": machine(), "args": vars(args)}

    header("baselines")
    n_imp = 1 if args.quick else max(2, args.reps // 4)
    imp = [await trio.to_thread.run_sync(popen_to_exit, [PY, "-c", "import openai, mcp"]) for _ in range(n_imp)]
    base["import_openai_mcp"] = imp

    with tempfile.TemporaryDirectory(prefix="agentd-bench-spawn-") as tmp:
        header("agentd, pool_size 0 (a cold runner per run)")
        async with in_process_daemon(
            Path(tmp) / "cold", zygote="off", pool_size=0, max_concurrent=max(64, args.burst)
        ) as d:
            m = d["manager"]
            await one_first_step(m)  # warm the page cache and the journal
            cold_seq = await sequential(m, args.reps, pool=0, baselines=base)
            line(row("spawn -> first step, one at a time (delivered)", summary(cold_seq["delivered"])))
            line(row("  of which: runner emitted it", summary(cold_seq["emitted"])))
            line(row("baseline: bare runner (Popen, no daemon)", summary(base.get("bare_runner", []))))
            line(row("baseline: Popen `python -c pass`", summary(base["popen_pass"])))
            line(row("baseline: cold `import openai, mcp`", summary(base["import_openai_mcp"])))
            b_pass = await trio.to_thread.run_sync(burst_popen, args.burst)
            cold_burst = await burst(m, args.burst)
            line(
                row(
                    f"spawn -> first step, {args.burst} at once (delivered)",
                    summary(cold_burst["delivered"]),
                    f"missing={cold_burst['missing']}",
                )
            )
            line(row("  of which: runner emitted it", summary(cold_burst["emitted"])))
            line(row(f"baseline: {args.burst} Popen `python -c pass` at once", summary(b_pass)))
        out["cold"] = {
            "sequential": cold_seq,
            "burst": cold_burst,
            "burst_popen_pass": b_pass,
            "warnings": show_warnings(line),
        }

        header(f"agentd, warm pool (pool_size {args.pool} one at a time, {args.burst} for the burst)")
        async with in_process_daemon(
            Path(tmp) / "warm", zygote="off", pool_size=args.pool, max_concurrent=max(64, args.burst)
        ) as d:
            m = d["manager"]
            fill = await wait_pool_warm(m, args.pool, timeout_s=120)
            line(f"  pool of {args.pool} warm after {fill if fill is None else round(fill, 2)} s")
            await one_first_step(m)
            n_before = len(base["popen_pass"])
            warm_seq = await sequential(m, args.reps, pool=args.pool, baselines=base)
            line(row("spawn -> first step, one at a time (delivered)", summary(warm_seq["delivered"])))
            line(row("  of which: runner emitted it", summary(warm_seq["emitted"])))
            line(row("baseline: Popen `python -c pass` (same phase)", summary(base["popen_pass"][n_before:])))
        out["warm"] = {"sequential": warm_seq, "fill_s": fill, "warnings": show_warnings(line)}

        async with in_process_daemon(
            Path(tmp) / "warmburst", zygote="off", pool_size=args.burst, max_concurrent=max(64, args.burst)
        ) as d:
            m = d["manager"]
            fill = await wait_pool_warm(m, args.burst, timeout_s=180)
            line(f"  pool of {args.burst} warm after {fill if fill is None else round(fill, 2)} s")
            b_pass2 = await trio.to_thread.run_sync(burst_popen, args.burst)
            warm_burst = await burst(m, args.burst)
            line(
                row(
                    f"spawn -> first step, {args.burst} at once (delivered)",
                    summary(warm_burst["delivered"]),
                    f"missing={warm_burst['missing']}",
                )
            )
            line(row("  of which: runner emitted it", summary(warm_burst["emitted"])))
            line(row(f"baseline: {args.burst} Popen `python -c pass` at once", summary(b_pass2)))
            if warm_burst["missing"]:
                line(
                    f"  !! {warm_burst['missing']} of {args.burst} runs ended without a step_started in their journal "
                    "(see the daemon warnings below)"
                )
        out["warm"].update(
            {
                "burst": warm_burst,
                "burst_fill_s": fill,
                "burst_popen_pass": b_pass2,
                "burst_warnings": show_warnings(line),
            }
        )
    out["baselines"] = base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds): for the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="one-at-a-time repetitions (default 20)")
    ap.add_argument("--burst", type=int, default=None, help="runs requested at once (default 50)")
    ap.add_argument("--pool", type=int, default=None, help="pool_size for one-at-a-time (default 4)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--verbose", action="store_true", help="show the daemon's warnings")
    args = ap.parse_args()
    args.reps = args.reps or (2 if args.quick else 20)
    args.burst = args.burst or (2 if args.quick else 50)
    args.pool = args.pool or (1 if args.quick else 4)
    quiet_logs(args.verbose)
    mark = install_mark()
    m = machine()
    line(f"bench_spawn on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    try:
        out = trio.run(main_async, args)
    finally:
        header("cleanup")
        survivors = final_sweep(mark)
    out["survivors"] = survivors
    write_json(args.json, out)


if __name__ == "__main__":
    main()
