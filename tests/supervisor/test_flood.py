"""One run's flood of tool calls harms no one else: a step runs at most
``limits.max_tool_calls_per_step`` calls, the rest are refused and said so.

A real daemon, the real runner and its sandbox, the scripted model (``script_path``): a
model turn of thousands of calls cost the daemon an event, a record and journal writes
per call (15,000 calls: ~46 s of its CPU). Speed figures are in ``docs/benchmarks.md``;
this asserts the behaviour.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from tests.supervisor.real_daemon import Client, real_daemon

WAIT_S = 60.0
ENV = {"AGENTD_RUNNER_COMMAND": "", "AGENTD_GRACE_S": "2"}  # the real runner
FLOOD = 3000
# Generous: a status the daemon answers takes milliseconds.
STATUS_BOUND_S = 5.0


def scripted(path: Path, turns: list[Any]) -> dict[str, Any]:
    path.write_text(json.dumps({"turns": turns, "final": "done"}))
    return {"task": "t", "model": {"provider": "scripted", "script_path": str(path)}}


async def events(c: Client, run_id: str) -> list[dict[str, Any]]:
    """Every event the journal holds for the run, page by page."""
    out: list[dict[str, Any]] = []
    while True:
        page = await c.ok("events", run_id=run_id, after_seq=out[-1]["seq"] if out else 0)
        out += page["events"]
        if not page["more"]:
            return out


async def test_a_turn_of_thousands_of_calls_runs_at_most_the_limit_and_the_daemon_answers_others(
    tmp_path: Path,
) -> None:
    calls = [{"name": "nope", "arguments": {"i": i}} for i in range(FLOOD)]
    flood_spec = scripted(tmp_path / "flood.json", [{"tool_calls": calls}, {"text": "waiting", "hang": True}])
    quiet_spec = scripted(tmp_path / "quiet.json", [{"text": "waiting", "hang": True}])
    with trio.fail_after(WAIT_S * 2):
        async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c, d.connect() as other:
            quiet = (await c.ok("spawn", spec=quiet_spec))["run_id"]
            await c.wait_kind(quiet, "step_started", WAIT_S)
            latencies: list[float] = []
            flooded = trio.Event()

            async def poll(client: Client) -> None:
                # Another client's status, over and over, until the flood's turn is over.
                while not flooded.is_set():
                    began = time.monotonic()
                    row = await client.ok("status", run_id=quiet)
                    latencies.append(time.monotonic() - began)
                    assert row["state"] == "running", row
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as n:
                n.start_soon(poll, other)
                flood = (await c.ok("spawn", spec=flood_spec))["run_id"]
                step2 = await c.wait_for(
                    flood, lambda m: m.get("kind") == "step_started" and m["data"].get("step") == 2, WAIT_S
                )
                assert step2["op"] == "event", step2  # not the run's end
                flooded.set()
            assert latencies and max(latencies) < STATUS_BOUND_S, latencies
            said = [
                e for e in await events(c, flood) if e["kind"] == "log" and e["data"].get("code") == "too_many_calls"
            ]
            assert len(said) == 1, said
            data = said[0]["data"]
            assert (data["asked"], data["limit"], data["refused"]) == (FLOOD, 256, FLOOD - 256)
            assert "limits.max_tool_calls_per_step" in data["message"]
            # The record holds the calls that were taken, and no more.
            row = await other.ok("status", run_id=flood)
            assert len(row["tool_calls"]) == 256, len(row["tool_calls"])
            assert {t["state"] for t in row["tool_calls"]} == {"failed"}  # an unknown tool, each told so
            for run in (flood, quiet):
                assert (await c.ok("cancel", run_id=run))["was_active"] is True
            for run in (flood, quiet):
                assert (await c.wait_end(run, WAIT_S))["state"] == "cancelled"
            result = (await other.ok("status", run_id=flood))["result"]
            assert result["refused_calls"][0]["refused"] == FLOOD - 256, result.get("refused_calls")
