"""Memory: the daemon's RSS while 20 subscriptions to a 1,000-event run are never read.

A client that subscribes and then reads nothing makes the daemon hold what it was about
to send: before issue 10 each such subscription held a whole replay page (500 events,
~11 MB of 22 KB snapshots) and 20 on one connection took the daemon from 35 to 523 MB.
Replay pages are now bounded in bytes (``Limits.replay_page_bytes``), so is each
subscriber's live buffer. The daemon is its own process (``agentd serve``); the run is a
flooding stand-in runner (N snapshots of S characters); the subscriptions share one
websocket that reads nothing after the handshake.

Baselines, same daemon, same run: its RSS before any subscription, and after the same
number of subscriptions read to their end. Stated bound: the unread subscriptions add at
most BOUND_MB (2 MB each), whatever the run's size. No figure is asserted.

    .venv/bin/python benchmarks/bench_subscriptions.py [--quick] [--subs 20] [--n 1000] [--size 22000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402
from trio_websocket import open_websocket_url  # noqa: E402

from benchmarks._common import BENCH_CHILDREN, PY, final_sweep, header, install_mark, line, machine, write_json  # noqa: E402
from benchmarks._daemon_proc import DaemonProc  # noqa: E402

FLOOD = [PY, str(BENCH_CHILDREN / "flood_runner.py")]
MB = 1024 * 1024
BOUND_PER_SUB_MB = 2.0
# How long RSS must stay flat (and the longest we watch it) once the frames are sent.
SETTLE_S = 2.0
WATCH_S = 20.0


def rss(pid: int) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    return 0


async def watch_rss(pid: int) -> int:
    """The highest RSS seen until it stayed flat (within 1 MB) for SETTLE_S."""
    peak = rss(pid)
    flat_since = time.monotonic()
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline and time.monotonic() - flat_since < SETTLE_S:
        await trio.sleep(0.1)
        now = rss(pid)
        if now > peak + MB:
            flat_since = time.monotonic()
        peak = max(peak, now)
    return peak


async def subscriptions(d: DaemonProc, run_id: str, subs: int, *, read: bool) -> int:
    headers = [(b"authorization", f"Bearer {d.token}".encode())]
    async with open_websocket_url(d.url, extra_headers=headers, max_message_size=64 * MB) as ws:
        for i in range(subs):
            await ws.send_message(json.dumps({"id": i, "op": "subscribe", "run_id": run_id}))
        if not read:
            return await watch_rss(d.pid)  # the websocket's reader stops after one message
        ends = 0
        peak = rss(d.pid)
        with trio.fail_after(120):
            while ends < subs:
                msg = json.loads(await ws.get_message())
                ends += msg.get("op") == "end"
                peak = max(peak, rss(d.pid))
        return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 events of 2,000 chars, 4 subscriptions")
    ap.add_argument("--subs", type=int, default=None, help="unread subscriptions (default 20)")
    ap.add_argument("--n", type=int, default=None, help="events in the run (default 1000)")
    ap.add_argument("--size", type=int, default=None, help="characters per snapshot (default 22000)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    subs = args.subs or (4 if args.quick else 20)
    n = args.n or (100 if args.quick else 1000)
    size = args.size or (2000 if args.quick else 22000)
    mark = install_mark()
    m = machine()
    line(f"bench_subscriptions on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {"machine": m, "subs": subs, "n": n, "size": size, "bound_mb": BOUND_PER_SUB_MB * subs}
    tmp = tempfile.TemporaryDirectory(prefix="agentd-bench-subs-")
    d = None
    try:
        header(f"daemon RSS: {subs} unread subscriptions to a run of {n} events x {size} chars")
        d = DaemonProc(Path(tmp.name) / "state", runner_command=" ".join(FLOOD))
        with d.client() as c:
            run_id = c.spawn({"task": json.dumps({"n": n, "size": size})})["run_id"]
            for _ in c.follow(run_id):  # until the run has ended: every event is journaled
                pass
        base = rss(d.pid)
        out["baseline_idle_rss_mb"] = base / MB
        line(f"  baseline: the daemon with the finished run, no subscription: {base / MB:.1f} MB")
        # Unread first: freed memory is kept by the allocator, so whatever ran before
        # would hide growth.
        unread = trio.run(lambda: subscriptions(d, run_id, subs, read=False))
        grew = (unread - base) / MB
        out["unread_peak_rss_mb"] = unread / MB
        out["unread_growth_mb"] = grew
        within = "within" if grew <= BOUND_PER_SUB_MB * subs else "ABOVE"
        line(
            f"  {subs} unread subscriptions (peak until flat): {unread / MB:.1f} MB (+{grew:.1f} MB, "
            f"{grew / subs:.2f} MB each); bound {BOUND_PER_SUB_MB * subs:.0f} MB: {within}"
        )
        drained = trio.run(lambda: subscriptions(d, run_id, subs, read=True))
        out["read_peak_rss_mb"] = drained / MB
        line(
            f"  baseline: the same {subs} subscriptions read to their end (peak): {drained / MB:.1f} MB (+{(drained - base) / MB:.1f})"
        )
        line(f"  the run's events: {n * size / MB:.1f} MB of snapshot text; before issue 10: +488 MB for 20")
        with d.client() as c:
            out["daemon_alive"] = c.ping()["pong"]
    finally:
        if d is not None:
            d.stop()
        tmp.cleanup()
        header("cleanup")
        out["survivors"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
