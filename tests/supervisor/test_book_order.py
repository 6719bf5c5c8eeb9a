"""A run's state changes are whole: a change whose journal write was under way when the
run's end was written is announced before that end, and never takes the run back from its
terminal state (``RunBook.transition``, ``start`` and ``finish``, under ``Run.state_lock``).

The clean CI run at ``fb6d6a5`` failed on this: a daemon stopping with 8 runs sent one
run's subscriber ``cancelled`` then ``cancelling``. The cancel's ``cancelling`` was written
first, the run's end was written and announced while that write's task waited to resume,
and the late ``cancelling`` came after it (and set the run's state back to it).

A real SQLite journal; the gate holds a change's task just after its write went through.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.core._book import RunBook
from supervisor.core._run import Run
from supervisor.core.token import CancelToken
from supervisor.states import RunState
from supervisor.store.journal import Journal


def hold_after(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[trio.Event, trio.Event]:
    """Journal.<name> goes through, then its caller is held until ``release``; ``written``
    is set once the write is in."""
    real = getattr(Journal, name)
    written, release = trio.Event(), trio.Event()

    async def held(self: Journal, *args: Any, **kwargs: Any) -> Any:
        out = await real(self, *args, **kwargs)
        written.set()
        await release.wait()
        return out

    monkeypatch.setattr(Journal, name, held)
    return written, release


async def state_events(journal: Journal, run_id: str) -> list[str]:
    return [e["data"]["state"] for e in await journal.events_after(run_id) if e["kind"] == "state"]


async def finish_cancelled(book: RunBook, run: Run, finished: trio.Event) -> None:
    await book.finish(run, RunState.CANCELLED, reason="shutdown", result=None, partial=True, error=None, receipt=None)
    finished.set()


async def until(done: Callable[[], bool]) -> None:
    """Poll (under the caller's deadline): the journal's writes run in a thread, so
    ``wait_all_tasks_blocked`` would not wait for them."""
    while not done():
        await trio.sleep(0.001)


@pytest.mark.parametrize("held", ["transition", "start_run"])
async def test_a_runs_end_written_during_a_change_of_its_state_comes_after_that_changes_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        book = RunBook(journal)
        run = Run(run_id="r1", session_id=None, spec={}, timeout_s=None, token=CancelToken("r1"))
        book.live[run.run_id] = run
        await book.create(run, created_at=time.time())
        if held == "transition":  # running, then a cancel's `cancelling` meets the run's end
            assert await book.start(run, process=None)
            assert await book.transition(run, RunState.RUNNING)
            changed, change = RunState.CANCELLING, lambda: book.transition(run, RunState.CANCELLING, reason="shutdown")
        else:  # queued, then its start meets its end
            changed, change = RunState.STARTING, lambda: book.start(run, process=None)
        seen: list[dict[str, Any]] = []
        send, receive = trio.open_memory_channel[dict[str, Any]](100)
        run.subscribers.add(send)
        written, release = hold_after(monkeypatch, held)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(change)
                await written.wait()  # the change is in the journal; its task is held
                finished = trio.Event()
                nursery.start_soon(finish_cancelled, book, run, finished)
                # The end is written and announced, or waits for the change (the fix).
                await until(lambda: finished.is_set() or run.state_lock.statistics().tasks_waiting > 0)
                release.set()
            async for msg in receive:  # the run was let go: its subscribers closed
                seen.append(msg)
        journaled = await state_events(journal, "r1")
    pushed = [m["data"]["state"] for m in seen if m["kind"] == "state"]
    assert pushed[-2:] == [str(changed), "cancelled"], pushed
    assert journaled[-2:] == [str(changed), "cancelled"], journaled
    assert [m["seq"] for m in seen] == sorted(m["seq"] for m in seen)
    assert run.state == RunState.CANCELLED and run.done.is_set()
