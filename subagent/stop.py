"""The run's one cancel flag, and what a stop is allowed to interrupt.

Invariants: a stop only *sets* the flag (once: the first reason wins and is reported in
one ``stop_requested`` event); the agent loop reads it at the start of each step and
after each tool batch. The one thing a stop interrupts at once is a model request in
flight (no side effects; aborting closes its connection). A running tool finishes; only
an explicit ``interrupt_tool`` (a repeated SIGINT) ends it early (its record says so). Pure trio, no signals here: the
runner's main task turns SIGTERM into ``request("signal")``, the deadline task into
``request("timeout")``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
from contextlib import contextmanager

import trio

__all__ = ["StopControl"]


class StopControl:
    def __init__(self, on_first_stop: Callable[[str, str], None] | None = None) -> None:
        self.reason: str | None = None
        self.count = 0
        self.stopped = trio.Event()
        self._on_first_stop = on_first_stop
        self._model_scope: trio.CancelScope | None = None
        self._abort_kind = "model"
        self.phase = "idle"  # what the run is doing outside a model request or a tool
        self._tool_scope: trio.CancelScope | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    @property
    def during(self) -> str:
        if self._model_scope is not None:
            return self._abort_kind
        if self._tool_scope is not None:
            return "tool"
        return self.phase

    def request(self, reason: str) -> None:
        """Ask the run to stop. Idempotent: asking again changes nothing.

        The daemon's two cancel paths both send SIGTERM, so a repeated SIGTERM must not
        escalate; escalation is ``interrupt_tool`` (a repeated SIGINT) or SIGKILL.
        """
        self.count += 1
        if self.reason is None:
            self.reason = reason
            if self._on_first_stop is not None:
                self._on_first_stop(reason, self.during)
            self.stopped.set()
            if self._model_scope is not None:
                self._model_scope.cancel(reason=f"stop ({reason}) aborts the model request")

    def interrupt_tool(self) -> bool:
        """Interrupt the running tool (its record says so). Returns whether one was running."""
        if self._tool_scope is None:
            return False
        self._tool_scope.cancel(reason="an explicit interrupt ends the running tool")
        return True

    def model_request(self) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """Scope for one model request: cancelled at once by a stop (also one already set)."""
        return self.abortable("model")

    @contextmanager
    def abortable(self, kind: str) -> Iterator[trio.CancelScope]:
        """Scope for work without side effects (a model request, a tool server's startup)."""
        with trio.CancelScope() as scope:
            self._model_scope = scope
            self._abort_kind = kind
            if self.requested:
                scope.cancel(reason="stop already requested")
            try:
                yield scope
            finally:
                self._model_scope = None

    def tool_interrupt(self) -> trio.CancelScope:
        """A fresh scope the running tool enters; only a second stop cancels it."""
        scope = trio.CancelScope()
        self._tool_scope = scope
        return scope

    def tool_done(self) -> None:
        self._tool_scope = None
