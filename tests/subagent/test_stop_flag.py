"""The run's stop flag sees a SIGTERM at once, not when the signal task runs.

The task that turns SIGTERM into ``request("signal")`` can run tens of ms late while the
loop goes on without yielding (a probe saw a step, a steer applied, a command spawned and
its side effect written 33 ms after the SIGTERM). The handler notes the signal itself and
every check of the flag applies it.
"""

from __future__ import annotations

import os
import signal

import trio

from subagent.run import _note_sigterm_at_once
from subagent.stop import StopControl


async def test_a_noted_sigterm_is_the_stop_at_the_next_check() -> None:
    seen: list[tuple[str, str]] = []
    stop = StopControl(on_first_stop=lambda reason, during: seen.append((reason, during)))
    stop.note_signal()
    assert not stop.stopped.is_set()  # nothing of trio ran in the handler
    assert stop.requested and stop.reason == "signal" and stop.stopped.is_set()
    stop.request("signal")  # the signal task, late: changes nothing
    assert seen == [("signal", "idle")] and stop.count == 1


async def test_a_tools_start_checks_a_noted_sigterm_first_and_after() -> None:
    stop = StopControl()
    stop.note_signal()
    with stop.starting():
        assert stop.stopped.is_set()  # the caller's check: the tool does not start
    later = StopControl()
    with later.starting():
        assert not later.stopped.is_set()
        later.note_signal()  # while it is being spawned: applied once it has been
        assert not later.stopped.is_set()
    assert later.stopped.is_set() and later.reason == "signal"


async def test_the_runners_sigterm_handler_sets_the_flag_before_any_task_runs() -> None:
    stop = StopControl()
    # Whatever the receiver leaves undelivered at its end is raised again: to this, not to
    # the default action (which would end pytest).
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    try:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            _note_sigterm_at_once(stop)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered, its handler run, before the next line
            at_once = stop.requested, stop.reason
            with trio.fail_after(5):  # trio's receiver still gets it
                received = await signals.__anext__()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert at_once == (True, "signal")
    assert received == signal.SIGTERM
