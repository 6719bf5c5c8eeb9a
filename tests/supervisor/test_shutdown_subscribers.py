"""A stopping daemon cancels every live run; each subscriber still gets its run's terminal
event and its ``end`` before the connection closes (``supervisor.daemon``'s drain,
``control.Subscriptions``). A remote observer (a CLI's ``watch``, the fleet's front, which
concludes a run from that event once the node is gone) must not be left without the fact.

A real daemon process (``tests/children/daemon_main.py``), the fake runner, a real
websocket client.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed

from tests.supervisor.real_daemon import real_daemon, strict_loads

N_RUNS = 8
WAIT_S = 30.0


async def test_every_subscriber_gets_its_runs_terminal_event_and_end_before_a_stopping_daemon_closes(
    tmp_path: Path,
) -> None:
    pushed: list[dict[str, Any]] = []
    closed_by_daemon = False
    with trio.fail_after(120):
        async with real_daemon(tmp_path / "state") as d:
            async with d.connect() as c:
                runs = [
                    (await c.ok("spawn", spec={"task": json.dumps({"snapshots": 1})}))["run_id"] for _ in range(N_RUNS)
                ]
                for run_id in runs:  # each waits for a stop, past its first snapshot
                    assert (await c.wait_kind(run_id, "step_snapshot"))["op"] == "event"
                subs = {(await c.ok("subscribe", run_id=run_id, after_seq=0))["sub"]: run_id for run_id in runs}
                d.proc.send_signal(signal.SIGTERM)  # `systemctl stop`: every run cancelled
                with trio.fail_after(WAIT_S):
                    try:
                        while True:
                            pushed.append(strict_loads(await c.ws.get_message()))
                    except ConnectionClosed:
                        closed_by_daemon = True
                await c.ws._stream.aclose()  # trio-websocket 0.12's client keeps it after a server close
            with trio.fail_after(WAIT_S):
                await d.proc.wait()
    assert closed_by_daemon and d.proc.returncode == 0, d.log_text()[-3000:]
    pushed = c.pushed + pushed  # first what arrived while the subscriptions were being made
    for sub, run_id in subs.items():
        mine = [m for m in pushed if m.get("sub") == sub]
        seqs = [m["seq"] for m in mine if m.get("op") == "event"]
        assert seqs == sorted(set(seqs)), (run_id, seqs)  # in order, none twice
        states = [m["data"]["state"] for m in mine if m.get("op") == "event" and m.get("kind") == "state"]
        ends = [m for m in mine if m.get("op") == "end"]
        assert states and states[-1] == "cancelled", (run_id, states, d.log_text()[-2000:])
        assert len(ends) == 1 and ends[0]["state"] == "cancelled", (run_id, ends)
