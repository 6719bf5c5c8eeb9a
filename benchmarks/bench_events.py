"""Events: ``step_snapshot`` events per second delivered to 10 websocket subscribers.

The daemon is its own process (``agentd serve``); each subscriber is its own process
(``benchmarks/children/subscriber.py``, the stdlib client's ``follow``).
  flood  a stand-in runner (``benchmarks/children/flood_runner.py``) waits until the 10
         subscribers are attached, then writes N snapshots as fast as it can: the rate is
         the daemon's (journal + fan-out + websocket) capacity.
  real   a real scripted runner, N steps each calling a tool that does not exist (the
         call fails at once, no process), so each step is a model turn + a snapshot.
Baseline, same run: the flood runner's stderr read straight from a pipe (no daemon).

    .venv/bin/python benchmarks/bench_events.py [--quick] [--n N] [--subs 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import BENCH_CHILDREN, PY, final_sweep, header, install_mark, line, machine, write_json  # noqa: E402
from benchmarks._daemon_proc import DaemonProc  # noqa: E402

FLOOD = [PY, str(BENCH_CHILDREN / "flood_runner.py")]
SUBSCRIBER = [PY, str(BENCH_CHILDREN / "subscriber.py")]


def baseline_pipe(n: int) -> float:
    """Snapshots per second the flood runner's stderr gives a plain pipe reader."""
    p = subprocess.Popen(FLOOD, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stderr is not None
    p.stdin.write((json.dumps({"run_id": "b", "task": json.dumps({"n": n})}) + "\n").encode())
    p.stdin.close()
    first = last = None
    count = 0
    for raw in p.stderr:
        if b'"step_snapshot"' in raw:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            count += 1
    p.wait()
    return count / (last - first) if count > 1 and last and first and last > first else float("nan")


def follow_with(d: DaemonProc, run_id: str, subs: int, go: Path | None) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            SUBSCRIBER + [d.url, d.token, run_id], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        for _ in range(subs)
    ]
    for p in procs:
        assert p.stdout is not None
        p.stdout.readline()  # "ready"
    t_go = time.time()
    if go is not None:
        go.write_text("go")
    results = []
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.read()
        p.wait(timeout=300)
        try:
            results.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            results.append({"count": 0})
    counts = [r.get("count", 0) for r in results]
    lasts = [r["last"] for r in results if r.get("last")]
    firsts = [r["first"] for r in results if r.get("first")]
    rates = [r["count"] / (r["last"] - r["first"]) for r in results if r.get("count", 0) > 1 and r["last"] > r["first"]]
    span = (max(lasts) - min(firsts)) if lasts and firsts else float("nan")
    return {
        "counts": counts,
        "per_subscriber_rate": sorted(rates),
        "aggregate_rate": sum(counts) / span if span and span == span and span > 0 else float("nan"),
        "go_to_last_s": (max(lasts) - t_go) if lasts else None,
        "span_s": span,
        "states": sorted({str(r.get("state")) for r in results}),
    }


def show(label: str, n: int, r: dict[str, Any]) -> None:
    rates = r["per_subscriber_rate"]
    med = rates[len(rates) // 2] if rates else float("nan")
    line(
        f"  {label}: {len(r['counts'])} subscribers got {min(r['counts']) if r['counts'] else 0}..{max(r['counts']) if r['counts'] else 0} "
        f"of {n} snapshots; per subscriber {med:,.0f}/s (min {rates[0] if rates else float('nan'):,.0f}); "
        f"all subscribers together {r['aggregate_rate']:,.0f}/s; first->last {r['span_s']:.2f} s; states {r['states']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts, 2 subscribers: for the smoke test")
    ap.add_argument("--n", type=int, default=None, help="snapshots in the flood (default 3000)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the real scripted run (default 300)")
    ap.add_argument("--subs", type=int, default=None, help="subscribers (default 10)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.n or (50 if args.quick else 3000)
    steps = args.steps or (10 if args.quick else 300)
    subs = args.subs or (2 if args.quick else 10)
    mark = install_mark()
    m = machine()
    line(f"bench_events on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {"machine": m, "n": n, "steps": steps, "subs": subs}
    tmp = tempfile.TemporaryDirectory(prefix="agentd-bench-events-")
    d = d2 = None
    try:
        header(f"step_snapshot delivery to {subs} websocket subscribers")
        base = baseline_pipe(n)
        out["baseline_pipe_rate"] = base
        line(f"  baseline: the flood runner's stderr read from a pipe, no daemon: {base:,.0f} snapshots/s")

        d = DaemonProc(Path(tmp.name) / "flood", runner_command=" ".join(FLOOD))
        go = Path(tmp.name) / "go"
        with d.client() as c:
            run_id = c.spawn({"task": json.dumps({"n": n, "size": 200, "go": str(go)})})["run_id"]
        r = follow_with(d, run_id, subs, go)
        out["flood"] = r
        show(f"flood ({n} snapshots of 200 chars)", n, r)
        d.stop()
        d = None

        d2 = DaemonProc(Path(tmp.name) / "real")
        turns: list[Any] = [{"delay_s": 3.0, "tool_calls": [{"name": "noop", "arguments": {}}]}]
        turns += [{"tool_calls": [{"name": "noop", "arguments": {}}]} for _ in range(steps - 1)]
        spec = {
            "task": "benchmark: many steps",
            "builtin_tools": [],
            "model": {"provider": "scripted", "script": {"turns": turns, "final": "ok"}},
            "limits": {"max_steps": steps + 1},
        }
        with d2.client() as c:
            run_id = c.spawn(spec)["run_id"]
        r2 = follow_with(d2, run_id, subs, None)
        out["real"] = r2
        show(f"real scripted runner ({steps} steps)", steps, r2)
    finally:
        for x in (d, d2):
            if x is not None:
                x.stop()
        tmp.cleanup()
        header("cleanup")
        out["survivors"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
