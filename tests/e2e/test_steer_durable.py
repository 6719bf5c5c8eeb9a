"""Acceptance: a steer is journaled before it can reach the runner (``_steers.send_steer``).

Real daemon processes, the real runner with the scripted model, a real journal. The daemon
is held (fault injection, ``AGENTD_TEST_HOLD_AT=steer_between``) after the first of a
steer's two steps, its journal write and its write into the runner's stdin, and killed -9
there. The stdin first: the runner read and queued the steer, and the next daemon's
journal had no ``steer_sent`` for it. The journal first: the journal holds it, the runner
never had it, and the run's end reports it never read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from subagent.emit import record_paths
from supervisor.store.journal import Journal
from tests.e2e.test_approvals import SCENARIO_S
from tests.e2e.test_conversations import Session
from tests.supervisor.test_restart_stop import daemon, kill9

TEXT = "look at the logs too"


def hanging() -> dict[str, Any]:
    script = {"turns": [{"text": "thinking", "hang": True}]}
    return {"task": "t", "model": {"provider": "scripted", "script": script}}


async def test_a_steer_whose_daemon_died_between_journaling_and_sending_it_is_journaled_and_never_read(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0, test_hold_at="steer_between") as (d1, c):
            rid = str((await c.call("spawn", spec=hanging()))["run_id"])
            await Session(c).wait(rid, lambda m: m["kind"] == "step_started")  # it reads its input
            st = await c.call("status", run_id=rid)
            events_file = record_paths(Path(st["run_dir"]))[0]
            c.n += 1
            await c.ws.send_message(json.dumps({"id": c.n, "op": "steer", "run_id": rid, "text": TEXT}))
            assert d1.stdout is not None
            out = b""
            while b"at steer_between" not in out:
                chunk = await d1.stdout.receive_some()
                assert chunk, out
                out += chunk
            await kill9(d1, c)
            assert b'"steering"' not in events_file.read_bytes()  # its runner never had it
        async with daemon(state, grace_s=5.0) as (_d2, c):
            s = Session(c)
            assert (await c.call("cancel", run_id=rid))["was_active"] is True
            final = await s.end(rid)
            events = (await c.call("events", run_id=rid))["events"]
    assert [e["data"]["text"] for e in events if e["kind"] == "steer_sent"] == [TEXT], events
    # Held before its write: its runner never had it, and its end says so.
    assert final["state"] == "cancelled", final
    assert final["result"]["unapplied_steering"] == [TEXT]
    (told,) = [e["data"] for e in events if e["kind"] == "steering"]
    assert (told["state"], told["text"], told.get("unread")) == ("unapplied", TEXT, True), told


async def test_a_steer_journaled_unsent_is_not_counted_as_sent(tmp_path: Path) -> None:
    """A restarted daemon's account of what it sent (``steering_texts``) leaves out a steer
    a ``steer_unsent`` took back: its end does not report it as sent and never read."""
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        await journal.create_run("r1", session_id=None, spec={}, created_at=time.time(), timeout_s=None)
        events = [
            ("steer_sent", {"text": "a"}),
            ("steer_sent", {"text": "b"}),
            ("steer_unsent", {"text": "b", "why": "x"}),
        ]
        await journal.append_events("r1", [(k, d, time.time()) for k, d in events], durable=True)
        sent, read, settled = await journal.steering_texts("r1")
    assert (sent, read, settled) == (["a"], [], [])
