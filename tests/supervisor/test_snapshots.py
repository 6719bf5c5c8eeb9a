"""Step snapshots grow with the run, not with its square; the partial result stays whole.

A runner sends each ``step_snapshot`` as a delta since its last one (the text said since,
the records changed since); the daemon folds them into the whole snapshot, the run's
partial result, and journals the deltas. Sent whole, a 150-step run journaled 301
snapshots, 74 MB. Real daemons, the real runner with the scripted model: a runner
SIGKILLed mid-run leaves its whole progress and every call as the run's partial result,
across a daemon restart too.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.events import SnapshotDeltas, fold_snapshot
from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests.supervisor.test_restart_stop import daemon, kill9, wait_call_running
from tests.supervisor.test_stop_tools import wait_event


@asynccontextmanager
async def in_process_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunManager]:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = Config.load(state_dir=tmp_path / "state", environ={}, grace_s=2.0)
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(cfg, stop=stop, task_status=task_status))
        yield info["manager"]
        stop.set()


def snapshot_bytes(events: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(e["data"])) for e in events if e["kind"] == "step_snapshot")


def folded(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The whole snapshot the journaled ``step_snapshot`` events make, in order."""
    whole: dict[str, Any] | None = None
    for e in events:
        if e["kind"] == "step_snapshot":
            whole = fold_snapshot(whole, e["data"])
    return whole


async def all_events(m: RunManager, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while page := await m.events_after(run_id, out[-1]["seq"] if out else 0):
        out += page
    return out


async def all_events_over(c: Any, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while True:
        reply = await c.call("events", run_id=run_id, after_seq=out[-1]["seq"] if out else 0)
        out += reply["events"]
        if not reply["more"]:
            return out


def kill_runner(pid: int) -> None:
    fd = os.pidfd_open(pid)  # by pidfd: never another process that got its number
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ the wire


def test_deltas_fold_back_into_each_whole_snapshot_and_a_delta_read_again_changes_nothing() -> None:
    deltas = SnapshotDeltas()
    whole: dict[str, Any] | None = None
    progress, records, sent = "", [], []
    for step in range(1, 6):
        progress += ("\n\n" if progress else "") + f"said {step}"
        records = [*records, {"id": f"c{step}", "state": "not_started"}]
        for state in ("not_started", "succeeded"):  # after the turn, after its batch
            records = [
                *records[:-1],
                {"id": f"c{step}", "state": state, "output": "x" if state != "not_started" else None},
            ]
            delta = {**deltas.next(step=step, progress=progress, records=records), "_id": "r"}
            sent.append(delta)
            whole = fold_snapshot(whole, delta)
            assert whole == {
                "step": step,
                "progress": progress,
                "tool_calls": records,
                "_id": "r",
                "snapshot_n": len(sent),
            }
    # Only what changed travels: each record twice (announced, ended), each text once.
    assert sum(len(d["tool_calls_changed"]) for d in sent) == 2 * 5
    assert "".join(d["progress_added"] for d in sent) == progress
    # Read again (a restarted daemon's events file): nothing changes, in any order.
    for d in reversed(sent):
        assert fold_snapshot(whole, d) is whole
    # A runner of the previous version sends whole snapshots: each replaces the last.
    old = {"step": 9, "progress": "all of it", "tool_calls": [], "_id": "r"}
    assert fold_snapshot(whole, old) == old
    # A delta whose earlier text never arrived keeps what did.
    gap = {"step": 2, "snapshot_n": 3, "progress_at": 50, "progress_added": "later", "tool_calls_changed": []}
    assert fold_snapshot({"progress": "early", "tool_calls": [], "snapshot_n": 1}, gap)["progress"] == "earlylater"
    with pytest.raises(ValueError):
        fold_snapshot(None, {"snapshot_n": 1, "progress_at": "0"})


# ------------------------------------------------------------------------------ one daemon


N_STEPS = 24
TEXT_CHARS = 2000


def long_run(n: int) -> dict[str, Any]:
    """``n`` steps, each a long text and a short command; the last command never ends."""
    turns = [
        {
            "text": f"step {i}: " + "x" * TEXT_CHARS,
            "tool_calls": [{"name": "run_command", "arguments": {"command": f"echo out-{i}"}}],
        }
        for i in range(1, n)
    ]
    turns.append(
        {"text": f"step {n}: waiting", "tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 300"}}]}
    )
    script = {"turns": turns, "chunk_size": 4096}
    return {"task": "t", "limits": {"max_steps": n + 2}, "model": {"provider": "scripted", "script": script}}


async def test_a_long_run_journals_snapshots_in_linear_bytes_and_a_sigkill_keeps_its_whole_partial_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = long_run(N_STEPS)
    texts = [t["text"] for t in spec["model"]["script"]["turns"]]
    async with in_process_daemon(tmp_path, monkeypatch) as m:
        with trio.fail_after(90):
            r = await m.spawn(spec)
            rid = r["run_id"]
            # The last command runs: every earlier step's snapshots are out.
            await wait_event(
                m,
                rid,
                lambda e: e["kind"] == "process_group" and e["data"]["alive"] and "sleep 300" in e["data"]["name"],
            )
            before = await m.status(rid)
            kill_runner(before["pid"])  # no result, no last words
            st = await m.wait_terminal(rid)
            events = await all_events(m, rid)
    assert (st["state"], st["reason"], st["partial"]) == ("failed", "runner_died", True), st
    result = st["result"]
    # Whole: all that was said, every call, as the runner's last snapshot had them.
    assert result["progress"] == "\n\n".join(texts)
    assert result["step"] == N_STEPS
    assert [c["id"] for c in result["tool_calls"]] == [f"call_{i}_1" for i in range(1, N_STEPS + 1)]
    assert all(
        c["state"] == "succeeded" and f"out-{i}" in c["output"] for i, c in enumerate(result["tool_calls"][:-1], 1)
    )
    assert result["tool_calls"][-1]["state"] == "not_started"  # announced: the snapshot after its turn
    # The journal's snapshot events make exactly that partial result.
    assert folded(events) == result == before["partial_snapshot"]
    # Linear: the snapshots journaled hold about what the result holds (each text once,
    # each record announced and ended), not every step's copy of all before it (then
    # about N_STEPS times the result).
    total = snapshot_bytes(events)
    assert total <= 2 * len(json.dumps(result)), (total, len(json.dumps(result)))


# ------------------------------------------------------------------------------ a restart


async def test_a_readopted_run_folds_the_snapshots_sent_while_no_daemon_watched_and_keeps_a_whole_partial_result(
    tmp_path: Path,
) -> None:
    """The daemon is SIGKILLed mid-run; the runner goes on (its snapshots go to its events
    file only); a new daemon re-adopts it and reads them, then more come; then the runner
    is SIGKILLed. The partial result has every step's text and call, before, during and
    after the daemon's absence, and the journal's snapshots stay linear."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir()
    go1, go2, in3 = shared / "go1", shared / "go2", shared / "in3"
    filler = "y" * 20_000

    def turn(i: int, command: str) -> dict[str, Any]:
        return {
            "text": f"step {i} {filler}",
            "tool_calls": [{"name": "run_command", "arguments": {"command": command}}],
        }

    turns = [
        turn(1, "echo one"),
        turn(2, f"while [ ! -e {go1} ]; do sleep 0.02; done; echo two"),
        turn(3, f"touch {in3}; while [ ! -e {go2} ]; do sleep 0.02; done; echo three"),
        turn(4, "sleep 300"),
    ]
    spec = {
        "task": "t",
        "model": {"provider": "scripted", "script": {"turns": turns, "chunk_size": 4096}},
        "sandbox": {"write": [str(shared)]},
    }
    with trio.fail_after(90):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_2_1")
            runner = (await c.call("status", run_id=rid))["pid"]
            await kill9(d1, c)
        go1.touch()  # on to step 3 with no daemon: its snapshots go to its events file
        while not in3.exists():
            await trio.sleep(0.02)
        async with daemon(state, grace_s=5.0) as (d2, c):
            go2.touch()  # on to step 4, the new daemon watching
            await wait_call_running(c, rid, "call_4_1")
            before = await c.call("status", run_id=rid)
            assert before["pid"] == runner
            kill_runner(runner)
            assert await c.wait_for(rid) == "failed"
            final = await c.call("status", run_id=rid)
            events = await all_events_over(c, rid)
    assert (final["reason"], final["partial"]) == ("runner_died", True), final
    result = final["result"]
    assert result["progress"] == "\n\n".join(t["text"] for t in turns)
    assert [(x["id"], x["state"]) for x in result["tool_calls"]] == [
        ("call_1_1", "succeeded"),
        ("call_2_1", "succeeded"),
        ("call_3_1", "succeeded"),
        ("call_4_1", "not_started"),
    ]
    assert folded(events) == result == before["partial_snapshot"]
    total = snapshot_bytes(events)
    assert total <= 2 * len(json.dumps(result)), (total, len(json.dumps(result)))
