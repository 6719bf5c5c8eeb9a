"""A model's text goes out while it streams, throttled, and travels once.

In-process agent loop, the scripted model on Trio's virtual clock (``autojump_clock``):
the text streamed so far goes out as a ``step_snapshot`` delta marked
``unfinished_text.streaming`` at most every ``STREAM_SNAPSHOT_EVERY_S`` (the first that
long after the request began: a turn that streams faster sends none); the step's own
snapshot then adds only the rest; a stop mid-stream ends the request at once and the
step's snapshot says its text was cut short.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio

from subagent.emit import Emitter
from subagent.events import (
    STREAM_SNAPSHOT_EVERY_S,
    EventKind,
    ExitCode,
    RunStatus,
    fold_snapshot,
)
from subagent.loop import AgentLoop
from tests.subagent import test_loop


class Caught(Emitter):
    """An emitter that also keeps each event with the Trio time it went out."""

    def __init__(self, tmp_path: Path) -> None:
        fd = os.open(tmp_path / "events", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        super().__init__(tmp_path, err_fd=fd, out_fd=fd)
        self.sent: list[tuple[float, EventKind, dict[str, Any]]] = []
        self.changed = trio.Event()

    def emit(self, event_kind: EventKind, /, **data: Any) -> None:
        super().emit(event_kind, **data)
        self.sent.append((trio.current_time(), event_kind, data))
        self.changed.set()
        self.changed = trio.Event()

    def snapshots(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, d) for t, k, d in self.sent if k == EventKind.STEP_SNAPSHOT]

    def streaming(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, d) for t, d in self.snapshots() if (d.get("unfinished_text") or {}).get("streaming")]


def make_loop(tmp_path: Path, script: dict[str, Any]) -> tuple[AgentLoop, Caught]:
    emitter = Caught(tmp_path)
    return test_loop.make_loop(tmp_path, script, emitter), emitter


def folded(snapshots: list[tuple[float, dict[str, Any]]]) -> dict[str, Any] | None:
    whole: dict[str, Any] | None = None
    for _, d in snapshots:
        whole = fold_snapshot(whole, d)
    return whole


TEXT = "".join(f"word{i:03d} " for i in range(100))  # 800 characters


async def test_a_slow_stream_goes_out_at_most_every_quarter_second_and_its_text_travels_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # 2 characters every 10 ms: 4 s of streaming, then a command, then the answer.
    script = {
        "turns": [
            {
                "text": TEXT,
                "chunk_size": 2,
                "chunk_delay_s": 0.01,
                "tool_calls": [{"name": "run_command", "arguments": {"command": "true"}}],
            }
        ],
        "final": "done",
    }
    loop, caught = make_loop(tmp_path, script)
    outcome = await loop.run()
    assert outcome.status == RunStatus.COMPLETED, outcome
    streaming = caught.streaming()
    times = [t for t, _ in streaming]
    # Throttled: about one per quarter second of the 4 s stream, never two closer.
    assert 12 <= len(streaming) <= 17, times
    assert all(b - a >= STREAM_SNAPSHOT_EVERY_S - 1e-9 for a, b in zip(times, times[1:], strict=False)), times
    assert times[0] >= STREAM_SNAPSHOT_EVERY_S - 1e-9
    # Each is the text streamed so far, at step 1, from the start of the progress.
    for _, d in streaming:
        assert d["unfinished_text"] == {"step": 1, "at": 0, "streaming": True}
        assert d["step"] == 1
    whole_during = folded([s for s in caught.snapshots() if s in streaming])
    assert whole_during is not None and TEXT.startswith(whole_during["progress"])
    # The step's own snapshot adds only the rest: each character travels once.
    snaps = caught.snapshots()
    assert sum(len(d["progress_added"]) for _, d in snaps) == len(TEXT + "\n\ndone")
    after_turn = snaps[len(streaming)][1]
    assert "unfinished_text" not in after_turn  # the turn is whole
    whole = folded(snaps)
    assert whole is not None and whole["progress"] == TEXT + "\n\ndone"
    # The step's assistant_text is whole, once.
    said = [d for _, k, d in caught.sent if k == EventKind.ASSISTANT_TEXT]
    assert [(d["text"], d["complete"]) for d in said] == [(TEXT, True), ("done", True)]


async def test_a_turn_that_streams_fast_sends_no_extra_snapshot(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    script = {
        "turns": [
            {
                "text": TEXT,
                "chunk_size": 4,
                "chunk_delay_s": 0.001,  # 0.2 s in all: under the first send's time
                "tool_calls": [{"name": "run_command", "arguments": {"command": "true"}}],
            }
        ],
        "final": "done",
    }
    loop, caught = make_loop(tmp_path, script)
    outcome = await loop.run()
    assert outcome.status == RunStatus.COMPLETED
    assert caught.streaming() == []
    # As before: after the turn, after its batch, after the answer; no more.
    assert len(caught.snapshots()) == 3


async def test_a_burst_then_silence_goes_out_when_its_time_comes_and_a_stop_then_ends_it_at_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    script = {"turns": [{"text": "all at once, then nothing", "hang": True}]}
    loop, caught = make_loop(tmp_path, script)
    outcome: list[Any] = []

    async def run() -> None:
        outcome.append(await loop.run())

    with trio.fail_after(60):  # virtual seconds
        await _burst_then_stop(loop, caught, outcome, run)
    assert outcome[0].exit_code == ExitCode.CANCELLED
    # The step's snapshot keeps the text (nothing to add) and says it was cut short.
    last = caught.snapshots()[-1][1]
    assert last["progress_added"] == ""
    assert last["unfinished_text"] == {"step": 1, "at": 0, "streaming": False}
    said = [d for _, k, d in caught.sent if k == EventKind.ASSISTANT_TEXT]
    assert [(x["text"], x["complete"]) for x in said] == [("all at once, then nothing", False)]
    result = loop.result(outcome[0])
    assert result["progress"] == "all at once, then nothing"
    assert result["unfinished_text"] == {"step": 1, "at": 0, "streaming": False}


async def _burst_then_stop(loop: AgentLoop, caught: Caught, outcome: list[Any], run: Any) -> None:
    async with trio.open_nursery() as n:
        t0 = trio.current_time()
        n.start_soon(run)
        while not caught.streaming():
            await caught.changed.wait()
        t_shown, d = caught.streaming()[0]
        # Held back when it came (at once), sent when its time came: no later delta needed.
        assert t_shown - t0 == STREAM_SNAPSHOT_EVERY_S
        assert d["progress_added"] == "all at once, then nothing"
        t_stop = trio.current_time()
        loop.stop.request("signal")
        while not outcome:
            await caught.changed.wait()
        assert trio.current_time() == t_stop  # no wait on the stop path
