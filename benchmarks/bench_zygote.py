"""The runner zygote against its targets, each beside a baseline measured in the same run.

Targets (issue 15): spawn -> the runner's first ``step_started`` p50 <= 10 ms with openai
and mcp already imported, whether or not a pool was warm; 50 at once <= 300 ms to all
first steps; a runner's USS <= 5 MiB.

The daemon runs in this process (``serve``); the clock starts before ``RunManager.spawn``.
"delivered" is when ``step_started`` reaches a subscriber (journaled, fanned out);
"emitted" is the runner's own timestamp on it. For the zygote the time is also split:
the daemon before the fork (journal writes: the run, its state), the fork itself
(``Zygote.spawn_tree``: request, clone, reply), and the runner from there to its first
step. Every forked runner has openai and mcp imported (the zygote did it); the cold
runner of the baseline runs the same scripted spec, which imports neither.

Configurations: ``spare`` (``zygote_spares 1``, pool 0: the zygote keeps a runner forked
ahead; the one-at-a-time figures wait for it, as a spawn after a pause finds it; the burst
is run three times: the first finds one spare and grows them to its size,
``zygote_spares_max``, the second is served by them, and the third too, with runs that go
on after their first step: a first model turn of ``THINK_S``, as an LLM call takes; in the
first two every run ends right after its first step, so the daemon also ends runs while
later first steps are delivered), ``zygote``
(``zygote_spares 0``: forked at each spawn, the baseline it is compared with), ``zygote
unprepared`` (the same without the zygote's memory preparation, ``AGENTD_ZYGOTE_PREPARE=0``:
its baseline, one at a time and memory only), ``spare,
state on tmpfs`` (the journal on /dev/shm, where fsync is free: what the journal's
durable writes cost), ``cold`` (``zygote=off``, pool 0) and ``warm pool`` (``zygote=off``,
the pre-spawned pool). For a spare the time is split at ``go`` (``Spare.go``: the spare's
acknowledgement read, ``go`` sent, once the run's start is journaled).
Memory: USS/RSS of forked runners waiting in a command, beside cold runners in the same
command, a bare sleeping ``python`` and the zygote itself (its memory is shared by all).

    .venv/bin/python benchmarks/bench_zygote.py [--quick] [--reps N] [--burst N] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import trio  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PY,
    final_sweep,
    header,
    install_mark,
    line,
    machine,
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
from subagent.zygote import PREPARE_VAR  # noqa: E402
from supervisor.trees import zygote as zygote_mod  # noqa: E402

SPEC = scripted_spec(final="ok", tools=[])
# A run that goes on after its first step, as one whose model call takes seconds does: its
# first turn "thinks" for THINK_S. A burst of these measures first steps with no run
# ending meanwhile; a burst of SPEC runs also has the daemon end 50 runs in the window.
THINK_S = 2.0
SPEC_GOES_ON = scripted_spec([{"text": "thinking", "delay_s": THINK_S}], final="ok", tools=[])
MIB = 2**20


# ----------------------------------------------------------------------------- timing the fork


class ForkClock:
    """Records when each ``Zygote.spawn_tree`` call started and ended (this process only)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, bool]] = []
        self._orig = zygote_mod.Zygote.spawn_tree

    def install(self) -> None:
        orig = self._orig
        calls = self.calls

        async def timed(z: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            tree = await orig(z, *a, **k)
            calls.append((t0, time.perf_counter(), tree is not None))
            return tree

        zygote_mod.Zygote.spawn_tree = timed  # type: ignore[method-assign]


CLOCK = ForkClock()


class GoClock:
    """Records when each ``Spare.go`` call (a spare let run) started and ended."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, bool]] = []

    def install(self) -> None:
        orig = zygote_mod.Spare.go
        calls = self.calls

        async def timed(s: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            tree = await orig(s, *a, **k)
            calls.append((t0, time.perf_counter(), tree is not None))
            return tree

        zygote_mod.Spare.go = timed  # type: ignore[method-assign,assignment]


GO = GoClock()


# ----------------------------------------------------------------------------- agentd


async def first_step(
    manager: Any, t0: float | None = None, session: str | None = None, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    t0 = time.perf_counter() if t0 is None else t0
    wall0 = time.time() - (time.perf_counter() - t0)
    n_calls = len(CLOCK.calls)
    n_go = len(GO.calls)
    r = await manager.spawn(SPEC if spec is None else spec, session_id=session)
    ev = await wait_event(manager, r["run_id"], "step_started", timeout_s=60)
    out: dict[str, Any] = {"run_id": r["run_id"]}
    if ev is not None:
        out["delivered"] = ev["_arrived"] - t0
        out["emitted"] = ev["ts"] - wall0
        mine = [c for c in CLOCK.calls[n_calls:] if c[0] >= t0]
        gone = [c for c in GO.calls[n_go:] if c[0] >= t0]
        if len(mine) == 1 and mine[0][2]:
            out["before_fork"] = mine[0][0] - t0
            out["fork"] = mine[0][1] - mine[0][0]
            out["runner"] = out["emitted"] - (mine[0][1] - t0)
        elif len(gone) == 1 and gone[0][2] and not mine:
            out["spare"] = True
            out["before_go"] = gone[0][0] - t0
            out["go"] = gone[0][1] - gone[0][0]
            out["after_go"] = out["emitted"] - (gone[0][1] - t0)
    await manager.wait_terminal(r["run_id"])
    return out


async def wait_spare(manager: Any, timeout_s: float = 30.0, want: int = 1) -> float | None:
    """Seconds until ``want`` spares are parked (None: not within ``timeout_s``)."""
    t0 = time.perf_counter()
    with trio.move_on_after(timeout_s):
        while (await manager.summary())["zygote"]["spares"]["ready"] < want:
            await trio.sleep(0.01)
        return time.perf_counter() - t0
    return None


async def sequential(
    manager: Any, reps: int, *, pool: int = 0, spare: bool = False, session: str | None = None
) -> dict[str, list[float]]:
    """One spawn at a time (``session``: each the next turn of that session, with its history)."""
    keys = ("delivered", "emitted", "before_fork", "fork", "runner", "before_go", "go", "after_go", "popen_pass")
    out: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(reps):
        if pool:
            await wait_pool_warm(manager, pool, timeout_s=120)
        if spare:
            await wait_spare(manager)
        out["popen_pass"].append(await trio.to_thread.run_sync(popen_to_exit, [PY, "-c", "pass"]))
        res = await first_step(manager, session=session)
        for k in keys[:-1]:
            if k in res:
                out[k].append(res[k])
    return out


async def burst(manager: Any, n: int, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    used0 = (await manager.summary())["zygote"].get("spares", {}).get("used", 0)
    t0 = time.perf_counter()

    async def one() -> None:
        results.append(await first_step(manager, t0, spec=spec))

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    delivered = [r["delivered"] for r in results if "delivered" in r]
    used = (await manager.summary())["zygote"].get("spares", {}).get("used", 0) - used0
    line(f"  (of {n}: {used} served by a spare)")
    emitted = [r["emitted"] for r in results if "emitted" in r]
    return {
        "delivered": delivered,
        "emitted": emitted,
        "all_delivered": max(delivered) if len(delivered) == n else None,
        "all_emitted": max(emitted) if len(emitted) == n else None,
        "missing": n - len(delivered),
    }


async def wait_zygote(manager: Any, timeout_s: float = 120.0) -> float | None:
    t0 = time.perf_counter()
    with trio.move_on_after(timeout_s):
        while (await manager.summary())["zygote"]["state"] != "ready":
            await trio.sleep(0.05)
        return time.perf_counter() - t0
    return None


@asynccontextmanager
async def daemon(state: Path, **settings: Any) -> AsyncIterator[Any]:
    async with in_process_daemon(state, **settings) as d:
        m = d["manager"]
        if settings.get("zygote", "auto") == "auto":
            waited = await wait_zygote(m)
            line(f"  zygote ready after {waited if waited is None else round(waited, 2)} s")
        yield m


# ----------------------------------------------------------------------------- memory


def gated_spec(sleep_arg: str) -> dict[str, Any]:
    return scripted_spec(
        [{"tool_calls": [{"name": "run_command", "arguments": {"command": f"sleep {sleep_arg}"}}]}],
        final="ok",
        limits={"command_timeout_s": 600},
    )


def mem_of(pid: int) -> tuple[float, float] | None:
    try:
        mi = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return None
    return mi.uss / MIB, mi.rss / MIB


async def runner_memory(manager: Any, n: int) -> dict[str, Any]:
    """n runs waiting in ``sleep``: their runners' USS/RSS, then all cancelled."""
    tag = f"{os.getpid()}{int(time.time() * 1000) % 100000}.5"
    runs = [await manager.spawn(gated_spec(tag)) for _ in range(n)]
    for r in runs:
        await wait_event(
            manager,
            r["run_id"],
            "tool_call",
            timeout_s=120,
            pred=lambda e: e["data"]["record"]["state"] == "running",
        )
    await trio.sleep(1.0)  # let each runner settle into its wait
    uss, rss = [], []
    for r in runs:
        pid = (await manager.status(r["run_id"]))["pid"]
        got = mem_of(pid) if pid else None
        if got is not None:
            uss.append(got[0])
            rss.append(got[1])
    for r in runs:
        await manager.cancel(r["run_id"])
    for r in runs:
        await manager.wait_terminal(r["run_id"])
    return {"uss_mib": uss, "rss_mib": rss}


def bare_python_memory() -> tuple[float, float] | None:
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"], stdin=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        return mem_of(p.pid)
    finally:
        p.kill()
        p.wait()


# ----------------------------------------------------------------------------- baselines


def popen_to_exit(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, start_new_session=True, stdin=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- main


def show_seq(res: dict[str, list[float]], split: bool) -> None:
    line(row("spawn -> first step, one at a time (delivered)", summary(res["delivered"])))
    line(row("  runner emitted it", summary(res["emitted"])))
    if split and res["fork"]:
        line(row("  = daemon before the fork (journal)", summary(res["before_fork"])))
        line(row("  + the fork (Zygote.spawn_tree)", summary(res["fork"])))
        line(row("  + the runner, forked -> first step", summary(res["runner"])))
    if split and res["go"]:
        line(row("  = daemon before `go` (assign, journal)", summary(res["before_go"])))
        line(row("  + `go` (the spare's ack, `go` sent)", summary(res["go"])))
        line(row("  + the spare, `go` -> first step", summary(res["after_go"])))
    line(row("baseline: Popen `python -c pass` (beside each)", summary(res["popen_pass"])))


def show_burst(res: dict[str, Any], n: int) -> None:
    line(row(f"{n} at once: spawn -> first step (delivered)", summary(res["delivered"]), f"missing={res['missing']}"))
    line(row("  runner emitted it", summary(res["emitted"])))
    all_d, all_e = res["all_delivered"], res["all_emitted"]
    line(
        f"  all {n} first steps: delivered {'-' if all_d is None else f'{all_d * 1000:.0f} ms'}, "
        f"emitted {'-' if all_e is None else f'{all_e * 1000:.0f} ms'}"
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    CLOCK.install()
    GO.install()
    with (
        tempfile.TemporaryDirectory(prefix="agentd-bench-zygote-") as tmp,
        tempfile.TemporaryDirectory(
            prefix="agentd-bench-zygote-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ) as shm,
    ):
        header("zygote with a spare (zygote_spares 1, pool_size 0): openai and mcp imported")
        async with daemon(
            Path(tmp) / "spare", pool_size=0, zygote_spares=1, max_concurrent=max(64, args.burst), grace_s=1
        ) as m:
            await wait_spare(m)
            await first_step(m)
            s_seq = await sequential(m, args.reps, spare=True)
            show_seq(s_seq, split=True)
            line("  the next turn of a session, one at a time:")
            s_turns = await sequential(m, args.reps, spare=True, session="bench-chat")
            show_seq(s_turns, split=True)
            await wait_spare(m)
            s_burst = await burst(m, args.burst)
            show_burst(s_burst, args.burst)
            grew = await wait_spare(m, timeout_s=300, want=args.burst)
            line(
                f"  the spares grew to the burst's {args.burst} in {'-' if grew is None else f'{grew:.2f} s'} after it"
            )
            line("  the same burst again, served by the spares the first grew (zygote_spares_max 64):")
            s_burst2 = await burst(m, args.burst)
            show_burst(s_burst2, args.burst)
            await wait_spare(m, timeout_s=300, want=args.burst)
            line(
                f"  again, runs that go on after their first step (a first model turn of {THINK_S:g} s): no run"
                " ends in the window"
            )
            s_burst3 = await burst(m, args.burst, spec=SPEC_GOES_ON)
            show_burst(s_burst3, args.burst)
            s_mem = await runner_memory(m, args.mem)
            sinfo = (await m.summary())["zygote"]
        out["spare"] = {
            "sequential": s_seq,
            "session_turns": s_turns,
            "burst": s_burst,
            "grew_s": grew,
            "burst_again": s_burst2,
            "burst_goes_on": s_burst3,
            "memory": s_mem,
            "zygote": sinfo,
            "warnings": show_warnings(line),
        }

        header("baseline: zygote without a spare (zygote_spares 0, pool_size 0): every runner forked")
        async with daemon(
            Path(tmp) / "zygote", pool_size=0, zygote_spares=0, max_concurrent=max(64, args.burst), grace_s=1
        ) as m:
            await first_step(m)
            z_seq = await sequential(m, args.reps)
            show_seq(z_seq, split=True)
            line("  the next turn of a session, one at a time:")
            z_turns = await sequential(m, args.reps, session="bench-chat")
            show_seq(z_turns, split=True)
            b_pass = await trio.to_thread.run_sync(burst_popen, args.burst)
            z_burst = await burst(m, args.burst)
            show_burst(z_burst, args.burst)
            line(row(f"baseline: {args.burst} Popen `python -c pass` at once", summary(b_pass)))
            z_mem = await runner_memory(m, args.mem)
            zinfo = (await m.summary())["zygote"]
            zmem = mem_of(zinfo["pid"]) if zinfo.get("pid") else None
        out["zygote"] = {
            "sequential": z_seq,
            "session_turns": z_turns,
            "burst": z_burst,
            "burst_popen_pass": b_pass,
            "memory": z_mem,
            "zygote": zinfo,
            "zygote_mem": zmem,
            "warnings": show_warnings(line),
        }

        header(f"baseline: the zygote without its memory preparation ({PREPARE_VAR}=0; zygote_spares 0, pool_size 0)")
        os.environ[PREPARE_VAR] = "0"  # the daemon's zygote inherits our environment
        try:
            async with daemon(Path(tmp) / "unprepared", pool_size=0, zygote_spares=0, grace_s=1) as m:
                await first_step(m)
                u_seq = await sequential(m, args.reps)
                show_seq(u_seq, split=True)
                u_mem = await runner_memory(m, args.mem)
                uinfo = (await m.summary())["zygote"]
                umem = mem_of(uinfo["pid"]) if uinfo.get("pid") else None
        finally:
            os.environ.pop(PREPARE_VAR, None)
        out["zygote_unprepared"] = {
            "sequential": u_seq,
            "memory": u_mem,
            "zygote_mem": umem,
            "warnings": show_warnings(line),
        }

        if args.burst_spares:
            k = args.burst_spares
            header(f"zygote with {k} spares parked (zygote_spares {k}): a burst of {args.burst} served by spares")
            async with daemon(
                Path(tmp) / "spares", pool_size=0, zygote_spares=k, max_concurrent=max(64, args.burst), grace_s=1
            ) as m:
                parked = await wait_spare(m, timeout_s=300, want=k)
                line(f"  {k} spares parked after {'-' if parked is None else f'{parked:.2f} s'}")
                await wait_spare(m, timeout_s=60, want=k)
                k_burst = await burst(m, args.burst)
                show_burst(k_burst, args.burst)
                refill = await wait_spare(m, timeout_s=300, want=k)
                line(f"  {k} spares parked again {'-' if refill is None else f'{refill:.2f} s'} after the burst")
            out["spares"] = {"spares": k, "parked_s": parked, "burst": k_burst, "refill_s": refill}

        header("zygote with a spare, state dir on tmpfs (journal fsyncs cost nothing): the journal's share")
        async with daemon(Path(shm) / "zygote", pool_size=0, zygote_spares=1, max_concurrent=max(64, args.burst)) as m:
            await wait_spare(m)
            await first_step(m)
            t_seq = await sequential(m, args.reps, spare=True)
            show_seq(t_seq, split=True)
            await wait_spare(m)
            t_burst = await burst(m, args.burst)
            show_burst(t_burst, args.burst)
        out["zygote_tmpfs"] = {"sequential": t_seq, "burst": t_burst, "warnings": show_warnings(line)}

        header("baseline: cold runners (zygote off, pool_size 0)")
        async with daemon(
            Path(tmp) / "cold", zygote="off", pool_size=0, max_concurrent=max(64, args.burst), grace_s=1
        ) as m:
            await first_step(m)
            c_seq = await sequential(m, args.reps)
            show_seq(c_seq, split=False)
            c_burst = await burst(m, args.burst)
            show_burst(c_burst, args.burst)
            c_mem = await runner_memory(m, args.mem)
        out["cold"] = {"sequential": c_seq, "burst": c_burst, "memory": c_mem, "warnings": show_warnings(line)}

        header(f"baseline: warm pool of {args.pool} (zygote off), one at a time")
        async with daemon(Path(tmp) / "warm", zygote="off", pool_size=args.pool) as m:
            fill = await wait_pool_warm(m, args.pool, timeout_s=180)
            line(f"  pool of {args.pool} warm after {fill if fill is None else round(fill, 2)} s")
            await first_step(m)
            w_seq = await sequential(m, args.reps, pool=args.pool)
            show_seq(w_seq, split=False)
        out["warm"] = {"sequential": w_seq, "fill_s": fill, "warnings": show_warnings(line)}

    header("memory: a runner waiting in a command (USS = what it does not share)")
    bare = await trio.to_thread.run_sync(bare_python_memory)
    out["bare_python_mem"] = bare
    line(row("spare-born runner USS (MiB as ms)", summary([x / 1000 for x in s_mem["uss_mib"]])).replace(" ms", " MiB"))
    line(row("forked runner USS (MiB as ms)", summary([x / 1000 for x in z_mem["uss_mib"]])).replace(" ms", " MiB"))
    line(row("forked runner RSS (MiB as ms)", summary([x / 1000 for x in z_mem["rss_mib"]])).replace(" ms", " MiB"))
    line(
        row("baseline: forked runner USS, zygote unprepared", summary([x / 1000 for x in u_mem["uss_mib"]])).replace(
            " ms", " MiB"
        )
    )
    line(row("baseline: cold runner USS", summary([x / 1000 for x in c_mem["uss_mib"]])).replace(" ms", " MiB"))
    line(row("baseline: cold runner RSS", summary([x / 1000 for x in c_mem["rss_mib"]])).replace(" ms", " MiB"))
    if bare:
        line(f"  baseline: a bare sleeping `python`: USS {bare[0]:.1f} MiB, RSS {bare[1]:.1f} MiB")
    if zmem:
        line(
            f"  the zygote itself (shared by every forked runner, paid once): USS {zmem[0]:.1f} MiB, RSS {zmem[1]:.1f} MiB"
        )
    if umem:
        line(f"  baseline: the unprepared zygote: USS {umem[0]:.1f} MiB, RSS {umem[1]:.1f} MiB")

    header("targets (with a spare; without it, the baseline, in brackets)")
    zs, zb = summary(s_seq["emitted"]), s_burst
    zu = summary(z_mem["uss_mib"])
    verdict = [
        (
            "spawn -> first step p50 <= 10 ms (delivered)",
            summary(s_seq["delivered"]).get("p50"),
            summary(z_seq["delivered"]).get("p50"),
            0.010,
        ),
        ("spawn -> first step p50 <= 10 ms (emitted)", zs.get("p50"), summary(z_seq["emitted"]).get("p50"), 0.010),
        (
            f"{args.burst} at once -> all first steps <= 300 ms (delivered)",
            zb["all_delivered"],
            z_burst["all_delivered"],
            0.300,
        ),
        (
            f"{args.burst} at once -> all first steps <= 300 ms (emitted)",
            zb["all_emitted"],
            z_burst["all_emitted"],
            0.300,
        ),
        (
            f"the next {args.burst} at once (spares grown) (delivered)",
            s_burst2["all_delivered"],
            z_burst["all_delivered"],
            0.300,
        ),
        (
            f"the next {args.burst} at once (spares grown) (emitted)",
            s_burst2["all_emitted"],
            z_burst["all_emitted"],
            0.300,
        ),
        (
            f"the next {args.burst}, runs that go on (spares grown) (delivered)",
            s_burst3["all_delivered"],
            z_burst["all_delivered"],
            0.300,
        ),
        (
            f"the next {args.burst}, runs that go on (spares grown) (emitted)",
            s_burst3["all_emitted"],
            z_burst["all_emitted"],
            0.300,
        ),
    ]
    for label, got, base, target in verdict:
        shown = "-" if got is None else f"{got * 1000:.1f} ms"
        before = "-" if base is None else f"{base * 1000:.1f} ms"
        line(f"  {label:<60} {shown} [{before}]  {'met' if got is not None and got <= target else 'MISSED'}")
    u = zu.get("p50")
    line(
        f"  {'forked runner USS p50 <= 5 MiB':<60} {'-' if u is None else f'{u:.1f} MiB'}  {'met' if u is not None and u <= 5 else 'MISSED'}"
    )
    return out


def burst_popen(n: int) -> list[float]:
    import threading

    res: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one() -> None:
        subprocess.run([PY, "-c", "pass"], start_new_session=True, stdin=subprocess.DEVNULL, check=False)
        with lock:
            res.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds): for the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="one-at-a-time repetitions (default 20)")
    ap.add_argument("--burst", type=int, default=None, help="runs requested at once (default 50)")
    ap.add_argument("--pool", type=int, default=None, help="warm pool size of the baseline (default 4)")
    ap.add_argument("--mem", type=int, default=None, help="runners measured for memory (default 10)")
    ap.add_argument(
        "--burst-spares",
        type=int,
        default=0,
        help="also a burst served by this many parked spares (zygote_spares N; default 0: skipped)",
    )
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--verbose", action="store_true", help="show the daemon's warnings")
    args = ap.parse_args()
    args.reps = args.reps or (2 if args.quick else 20)
    args.burst = args.burst or (2 if args.quick else 50)
    args.pool = args.pool or (1 if args.quick else 4)
    args.mem = args.mem or (1 if args.quick else 10)
    quiet_logs(args.verbose)
    mark = install_mark()
    m = machine()
    line(f"bench_zygote on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {}
    try:
        out = trio.run(main_async, args)
    finally:
        header("cleanup")
        survivors = final_sweep(mark)
    out["survivors"] = survivors
    write_json(args.json, out)


if __name__ == "__main__":
    main()
