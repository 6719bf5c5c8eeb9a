"""Experiment: one run whose model turn asks for N tool calls (``limits.max_tool_calls_per_step``).

A real daemon process (``tests/children/daemon_main.py``, the real runner, the scripted
model from a ``script_path``) runs one run whose first turn asks for N calls of an
unknown tool (each fails at once: the cost measured is the calls' bookkeeping, not
their work) while a quiet run waits in a hanging turn and a second client asks for the
quiet run's ``status`` over and over. Printed: the flood's wall time to its end, the
daemon's CPU (all threads) meanwhile, the status replies and the slowest of them, and
how many calls ran and were refused, and the journal's commits meanwhile (all, and the
FULL, fsynced ones: ``status``'s ``journal``). ``--limit`` sets the spec's limit (default:
none given, the runner's default); ``--turns T`` makes it T turns of N calls each;
``--command CMD`` makes each call a real ``run_command`` of CMD (``true``, say) rather
than an unknown tool.

    .venv/bin/python benchmarks/experiments/call_flood.py [N ...] [--limit 1024] [--turns 20 --command true]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import psutil  # noqa: E402
import trio  # noqa: E402

from tests.supervisor.real_daemon import real_daemon  # noqa: E402

TERMINAL = ("completed", "failed", "cancelled", "lost")


def scripted(path: Path, turns: list[Any], limit: int | None) -> dict[str, Any]:
    path.write_text(json.dumps({"turns": turns, "final": "done"}))
    spec: dict[str, Any] = {"task": "t", "model": {"provider": "scripted", "script_path": str(path)}}
    limits: dict[str, Any] = {"max_steps": max(20, len(turns) + 1)}  # the turns, then the answer
    if limit is not None:
        limits["max_tool_calls_per_step"] = limit
    spec["limits"] = limits
    return spec


async def commits(c: Any) -> tuple[int, int]:
    journal = (await c.ok("status"))["summary"]["journal"]
    return int(journal.get("commits", 0)), int(journal.get("durable_commits", 0))


async def one(n: int, limit: int | None, base: Path, turns: int, command: str | None) -> None:
    if command is None:
        calls = [{"name": "nope", "arguments": {"i": i}} for i in range(n)]
    else:
        calls = [{"name": "run_command", "arguments": {"command": command}} for _ in range(n)]
    flood_spec = scripted(base / f"flood-{n}.json", [{"tool_calls": calls}] * turns, limit)
    quiet_spec = scripted(base / "quiet.json", [{"text": "waiting", "hang": True}], None)
    env = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_GRACE_S": "5"}
    async with real_daemon(base / f"state-{n}", env=env) as d, d.connect() as c, d.connect() as other:
        daemon = psutil.Process(d.pid)
        quiet = (await c.ok("spawn", spec=quiet_spec))["run_id"]
        await c.wait_kind(quiet, "step_started", 60)
        commits0 = await commits(other)
        cpu0, t0 = sum(daemon.cpu_times()[:2]), time.monotonic()
        flood = (await c.ok("spawn", spec=flood_spec))["run_id"]
        latencies = []
        while True:
            began = time.monotonic()
            await other.ok("status", run_id=quiet)
            latencies.append(time.monotonic() - began)
            row = await other.ok("status", run_id=flood)
            if row["state"] in TERMINAL:
                break
            await trio.sleep(0.05)
        wall, cpu = time.monotonic() - t0, sum(daemon.cpu_times()[:2]) - cpu0
        commits1 = await commits(other)
        done, durable = commits1[0] - commits0[0], commits1[1] - commits0[1]
        events = (await other.ok("status", run_id=flood))["last_seq"]
        refused = sum(r["refused"] for r in (row.get("result") or {}).get("refused_calls", []))
        print(
            f"N={n} x {turns} turns{'' if command is None else f' of run_command {command!r}'} "
            f"limit={limit or 'default'}: {row['state']} in {wall:.1f} s, daemon CPU {cpu:.2f} s, "
            f"calls recorded {len(row['tool_calls'])}, refused {refused}, events {events}; "
            f"journal commits {done} ({durable} FULL; the status probes' reads are not commits); "
            f"quiet run's status: {len(latencies)} replies, slowest {max(latencies):.3f} s"
        )
        await c.ok("cancel", run_id=quiet)
        await c.wait_end(quiet, 30)


async def main(sizes: list[int], limit: int | None, turns: int, command: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="agentd-call-flood-") as tmp:
        for n in sizes:
            await one(n, limit, Path(tmp), turns, command)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[2000, 15000])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--turns", type=int, default=1, help="turns of N calls each (default 1)")
    parser.add_argument("--command", default=None, help="each call a run_command of this command")
    args = parser.parse_args()
    trio.run(main, args.sizes, args.limit, args.turns, args.command)
