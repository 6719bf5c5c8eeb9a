"""Steering lines on stdin after the spec: queued, applied at a step boundary, or reported."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import trio

from subagent.events import EventKind, ExitCode
from tests.subagent.harness import spec, start_runner


def steer(text: str) -> bytes:
    return (json.dumps({"steer": text}) + "\n").encode()


async def test_steering_sent_with_the_spec_is_applied_before_the_first_model_call(tmp_path: Path) -> None:
    data = (json.dumps(spec(script={"final": "ok"})) + "\n").encode() + steer("use French")
    async with start_runner(data, tmp_path) as r:
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    states = [(e.data["state"], e.data["text"]) for e in r.of(EventKind.STEERING)]
    assert states == [("queued", "use French"), ("applied", "use French")]
    assert {"role": "user", "content": "use French"} in result["messages"]
    assert result["unapplied_steering"] == []


async def test_steering_that_arrives_during_the_final_answer_gets_another_step(tmp_path: Path) -> None:
    script = {"turns": [{"text": "first answer", "delay_s": 1.0}, "after steering"]}
    async with start_runner(spec(script=script), tmp_path, stdin_close=False) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED)
        assert r.proc.stdin is not None
        await r.proc.stdin.send_all(steer("also count the files"))
        await r.proc.stdin.aclose()
        rc, result = await r.finish()
    assert rc == ExitCode.COMPLETED
    states = [e.data["state"] for e in r.of(EventKind.STEERING)]
    if result["steps"] == 2:  # the usual case: queued while the answer streamed
        assert result["final_text"] == "after steering"
        assert states == ["queued", "applied"]
    else:  # a machine so slow the answer was complete first: never applied, never lost
        assert result["final_text"] == "first answer"
        assert states in ([], ["queued", "unapplied"])  # [] if it came after the runner stopped reading
        assert result["unapplied_steering"] == (["also count the files"] if states else [])


async def test_steering_never_applied_is_reported_when_the_run_is_cancelled(tmp_path: Path) -> None:
    script = {"turns": [{"text": "thinking", "hang": True}]}
    async with start_runner(spec(script=script), tmp_path, stdin_close=False) as r:
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEP_STARTED)
        assert r.proc.stdin is not None
        await r.proc.stdin.send_all(b"not json\n" + steer("stop after this"))
        with trio.fail_after(10):
            await r.wait_event(EventKind.STEERING)
        r.signal(signal.SIGTERM)
        rc, result = await r.finish()
    assert rc == ExitCode.CANCELLED
    assert result["unapplied_steering"] == ["stop after this"]
    assert [e.data["state"] for e in r.of(EventKind.STEERING)] == ["queued", "unapplied"]
    assert any("not json" in e.data["message"] for e in r.of(EventKind.LOG))
