"""The fleet beside a local daemon: spawn latency, a burst, and cancel-all across nodes.

Both sides run the same stand-in runner (``tests/children/fake_runner.py``: starts,
reports, waits for its stop), so the figures are agentd's and Ray's, not a model's.
Local: one ``agentd serve``. Fleet: a 3-node local Ray cluster (``ray.cluster_utils``,
loopback), ``agentd fleet up`` and the front (``agentd fleet serve``); the same client
talks to either. Measured: spawn reply (request to reply), spawn to ``running`` (the
node's state event, seen through the socket), p50 over one-at-a-time reps; a burst of N
spawns to all running; cancel-all of M live runs (a cancel of each, all sent at once on
one connection: ``Client.cancel_many``) to its replies and to every run terminal. (Runs
carry no session: a session has one live turn at a time.) Figures are printed, never asserted.

    .venv/bin/python benchmarks/bench_fleet.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import final_sweep, install_mark  # noqa: E402
from supervisor.control.client import Client  # noqa: E402
from tests.fleet.cluster import AGENTD, ENV, FleetCluster  # noqa: E402

WAIT = {"task": json.dumps({"snapshots": 1})}


def _until(client: Client, run_id: str, state: str) -> None:
    for ev in client.follow(run_id):
        if ev["kind"] == "state" and ev["data"]["state"] in (state, "completed", "failed", "cancelled", "lost"):
            return


def _end(client: Client, run_id: str) -> None:
    follow = client.follow(run_id, after_seq=2**62)
    for _ in follow:
        pass


def measure(client: Client, reps: int, burst: int, cancel_all: int) -> dict[str, Any]:
    reply, running = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        run_id = client.spawn(WAIT)["run_id"]
        reply.append(time.perf_counter() - t0)
        _until(client, run_id, "running")
        running.append(time.perf_counter() - t0)
        client.cancel(run_id)
        _end(client, run_id)
    t0 = time.perf_counter()
    ids = [client.spawn(WAIT)["run_id"] for _ in range(burst)]
    replied = time.perf_counter() - t0
    for run_id in ids:
        _until(client, run_id, "running")
    burst_running = time.perf_counter() - t0
    client.cancel_many(ids)
    for run_id in ids:
        _end(client, run_id)
    ids = [client.spawn(WAIT)["run_id"] for _ in range(cancel_all)]
    for run_id in ids:
        _until(client, run_id, "running")
    t0 = time.perf_counter()
    out = client.cancel_many(ids)
    cancel_reply = time.perf_counter() - t0
    for run_id in ids:
        _end(client, run_id)
    cancel_done = time.perf_counter() - t0
    states = {client.status(r)["state"] for r in ids}
    return {
        "spawn_reply_p50_ms": 1000 * statistics.median(reply),
        "spawn_to_running_p50_ms": 1000 * statistics.median(running),
        f"burst_{burst}_replies_s": replied,
        f"burst_{burst}_all_running_s": burst_running,
        f"cancel_all_{cancel_all}_reply_s": cancel_reply,
        f"cancel_all_{cancel_all}_all_terminal_s": cancel_done,
        "cancel_all_states": sorted(states),
        "cancel_all_was_active": sum(1 for r in out["runs"] if r["was_active"]),
    }


def local(slots: int, reps: int, burst: int, cancel_all: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agentd-bench-") as d:
        env = {**os.environ, **ENV}
        proc = subprocess.Popen(
            [AGENTD, "--state-dir", d, "serve", "--max-concurrent", str(slots), "--log-level", "warning"],
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not (Path(d) / "daemon.json").exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the local daemon did not start")
                time.sleep(0.05)
            with Client(state_dir=d, timeout_s=120) as c:
                return measure(c, reps, burst, cancel_all)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def fleet(slots: int, reps: int, burst: int, cancel_all: int) -> dict[str, Any]:
    fc = FleetCluster.start(slots=slots)
    try:
        fc.start_front()
        with fc.client() as c:
            c.timeout_s = 120
            return measure(c, reps, burst, cancel_all)
    finally:
        fc.stop_front()
        fc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    mark = install_mark()
    reps, burst, cancel_all = (5, 10, 15) if args.quick else (20, 50, 100)
    per_node = cancel_all // 3 + 2  # 3 nodes hold them all at once
    print(
        f"fleet benchmark: {reps} reps, burst {burst}, cancel-all {cancel_all} ({os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f})"
    )
    results = {"local": local(3 * per_node, reps, burst, cancel_all), "fleet": fleet(per_node, reps, burst, cancel_all)}
    keys = [k for k in results["local"] if not k.startswith("cancel_all_states") and k != "cancel_all_was_active"]
    print(f"{'':36} {'local daemon':>14} {'fleet (3 nodes)':>16}")
    for k in keys:
        lv, fv = results["local"][k], results["fleet"][k]
        print(f"{k:36} {lv:14.3f} {fv:16.3f}")
    for side in ("local", "fleet"):
        print(
            f"{side}: cancel-all ended {results[side]['cancel_all_states']}, was_active {results[side]['cancel_all_was_active']}"
        )
    results["survivors"] = final_sweep(mark, exclude=[os.getpid()])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
