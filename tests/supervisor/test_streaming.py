"""A model's text is shown while it streams, and kept when its runner dies or is stopped.

Real daemon (in-process ``serve``), real runners: the ``openai`` provider against the
local OpenAI-compatible server streaming slowly, and the scripted model. While the model
streams, the runner sends the text so far as ``step_snapshot`` deltas (throttled, see
``subagent.events.STREAM_SNAPSHOT_EVERY_S``); the daemon folds them into the run's
partial result, so ``status`` shows the text before the step ends, a runner SIGKILLed
mid-stream leaves it in the run's result (marked as cut short), and a stop mid-stream
keeps it and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.events import fold_snapshot
from subagent.history import HISTORY_CUT_SHORT
from subagent.model.fake_openai import FakeOpenAI
from supervisor.cli import _print_run, format_event
from tests.supervisor.test_snapshots import all_events, in_process_daemon, kill_runner
from tests.supervisor.test_stop_tools import wait_event

TEXT = "Reading the logs first: " + " ".join(f"line{i}" for i in range(40))


def streamed_whole(run_id: str) -> Any:
    """A predicate over a run's events: true once its folded snapshots hold all of TEXT, streaming."""
    state: dict[str, Any] = {"whole": None}

    def pred(e: dict[str, Any]) -> bool:
        if e["kind"] != "step_snapshot":
            return False
        state["whole"] = fold_snapshot(state["whole"], e["data"])
        unfinished = state["whole"].get("unfinished_text") or {}
        return bool(state["whole"]["progress"] == TEXT and unfinished.get("streaming"))

    return pred


async def test_status_shows_a_slow_stream_before_its_step_ends_and_a_sigkilled_runner_leaves_it_in_its_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Over HTTP, a few characters every 20 ms, then the stream stays open and silent.
    script = {"turns": [{"text": TEXT, "chunk_size": 12, "chunk_delay_s": 0.02, "hang": True}]}
    fake = FakeOpenAI(script)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(fake.serve)
            spec = {"task": "t", "model": {"provider": "openai", "name": "fake", "base_url": fake.base_url}}
            async with in_process_daemon(tmp_path, monkeypatch) as m:
                rid = (await m.spawn(spec))["run_id"]
                await wait_event(m, rid, streamed_whole(rid))
                live = await m.status(rid)
                events = await all_events(m, rid)
                kill_runner(live["pid"])  # by pidfd, the pid this daemon reports
                st = await m.wait_terminal(rid)
            nursery.cancel_scope.cancel()
    # Before the step ended (no assistant_text yet), status had the text, streaming.
    assert [e for e in events if e["kind"] == "assistant_text"] == []
    snap = live["partial_snapshot"]
    assert snap["progress"] == TEXT and snap["step"] == 1
    assert snap["unfinished_text"] == {"step": 1, "at": 0, "streaming": True}
    _print_run(live)
    shown = capsys.readouterr().out
    assert "line39" in shown and "the model is writing step 1's text" in shown
    streaming = [format_event(e) for e in events if e["kind"] == "step_snapshot"]
    assert streaming and all("  step 1 streaming: +" in line for line in streaming), streaming
    # The runner died mid-stream: its streamed text is the run's partial result, cut short.
    assert (st["state"], st["reason"], st["partial"]) == ("failed", "runner_died", True), st
    assert st["result"]["progress"] == TEXT
    assert st["result"]["unfinished_text"] == {"step": 1, "at": 0, "streaming": True}
    _print_run(st)
    assert "cut short" in capsys.readouterr().out


async def test_a_stop_mid_stream_ends_the_stream_at_once_keeps_its_text_and_says_it_was_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = {"turns": [{"text": TEXT, "chunk_size": 12, "chunk_delay_s": 0.02, "hang": True}]}
    spec = {"task": "t", "model": {"provider": "scripted", "script": script}}
    with trio.fail_after(30):
        async with in_process_daemon(tmp_path, monkeypatch) as m:
            rid = (await m.spawn(spec))["run_id"]
            await wait_event(m, rid, streamed_whole(rid))
            live = await m.status(rid)
            t0 = trio.current_time()
            await m.cancel(rid)
            st = await m.wait_terminal(rid)
            took = trio.current_time() - t0
            events = await all_events(m, rid)
    assert live["partial_snapshot"]["progress"] == TEXT
    assert (st["state"], st["reason"], st["partial"]) == ("cancelled", "user", False), st
    assert took < 2.0  # the grace: a model request is aborted at once, never waited for
    result = st["result"]
    assert result["progress"] == TEXT
    assert result["unfinished_text"] == {"step": 1, "at": 0, "streaming": False}
    said = [e["data"] for e in events if e["kind"] == "assistant_text"]
    assert [(d["text"], d["complete"]) for d in said] == [(TEXT, False)]
    # The journaled snapshots: the text once (streamed), then the step's, adding nothing.
    snaps = [e["data"] for e in events if e["kind"] == "step_snapshot"]
    assert sum(len(d["progress_added"]) for d in snaps) == len(TEXT)
    assert snaps[-1]["unfinished_text"] == {"step": 1, "at": 0, "streaming": False}
    whole: dict[str, Any] | None = None
    for d in snaps:
        whole = fold_snapshot(whole, d)
    assert whole is not None and whole["progress"] == TEXT


async def test_a_session_turn_whose_runner_was_sigkilled_mid_stream_hands_its_streamed_text_on_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Turn 1 streams slowly and its runner is SIGKILLed mid-stream: its text is in its
    # partial result alone (no assistant_text). Turn 2's model is told it, cut short, once.
    script = {"turns": [{"text": TEXT, "chunk_size": 12, "chunk_delay_s": 0.02, "hang": True}], "final": "ok"}
    fake = FakeOpenAI(script)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(fake.serve)
            model = {"provider": "openai", "name": "fake", "base_url": fake.base_url}
            async with in_process_daemon(tmp_path, monkeypatch) as m:
                first = (await m.spawn({"task": "read the logs", "model": model}, session_id="s1"))["run_id"]
                await wait_event(m, first, streamed_whole(first))
                kill_runner((await m.status(first))["pid"])  # by pidfd, the pid this daemon reports
                st = await m.wait_terminal(first)
                second = (await m.spawn({"task": "go on", "model": model}, session_id="s1"))["run_id"]
                await fake.wait_for(lambda f: len(f.chat_requests) >= 2)
                if (await m.status(second))["state"] not in ("completed", "failed", "cancelled"):
                    await m.cancel(second)  # (without the history, turn 2 replays the hanging turn)
                await m.wait_terminal(second)
            nursery.cancel_scope.cancel()
    assert (st["state"], st["partial"], st["result"]["progress"]) == ("failed", True, TEXT), st
    messages = fake.chat_requests[1].body["messages"]
    said = [m for m in messages if m["role"] == "assistant"]
    assert said == [{"role": "assistant", "content": f"{TEXT}\n{HISTORY_CUT_SHORT}"}], messages
    assert [m["content"] for m in messages if m["role"] == "user"] == ["read the logs", "go on"], messages
    assert sum(TEXT in str(m.get("content")) for m in messages) == 1  # told once
