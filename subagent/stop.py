"""The run's one cancel flag, and the moment it was set.

Invariants: a stop only *sets* the flag (once: the first reason wins and is reported in
one ``stop_requested`` event) and records when (``stopped_at`` on the Trio clock,
``stopped_wall``); the agent loop reads it at the start of each step and before each
tool call, so no tool starts after it. A model request in flight is aborted at once (no
side effects; aborting closes its connection). What happens to a *running* tool is the
tool's own policy (``subagent.stop_policy``): the tool watches ``stopped`` and interrupts,
abandons, cancels or finishes; an explicit ``interrupt_tool`` (a repeated SIGINT) ends it
early whatever its policy. No signals here: the runner's main task turns
SIGTERM into ``request("signal")``, the deadline task into ``request("timeout")``. That task
may run late (the loop can go on for tens of ms without yielding: a step, a steer, a
spawn), so the signal handler also notes the SIGTERM at once (``note_signal``), and every
check of the flag (``requested``, ``starting``) applies a noted one first: nothing starts
once a SIGTERM has arrived, however late the signal task runs.

Whose stop a signal was is decided when it is applied (``resolve``: the runner reads its
stop marker, ``subagent.stopmark``, then): ``"signal"`` stays ``"signal"`` for a stop the
daemon asked for and becomes ``"signalled"`` for a SIGTERM (or SIGINT) no stop of the
daemon's sent; the run still stops, but it is not a cancelled run. The daemon's own
reason for a stop it sent (``user``, ``timeout``, ``approval_timeout``, ``shutdown``, ...)
is kept beside it (``stop_reason``, set by the resolver as it reads the marker), and
``why`` is the reason every place that reports the stop to the model or in a record uses:
the daemon's when there is one, else the applied reason (``signal`` for a runner started
by hand, ``signalled`` for a foreign signal, the runner's own ``timeout`` ...).

A tool's start is one step with the check that no stop came (``starting``): a stop asked
while a command is being spawned (the spawn yields to the loop, where the SIGTERM task
runs) is applied once it is spawned, so the record never says that a tool started after
the stop; the stop then reaches the running command through its policy.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

__all__ = ["StopControl", "import_abortably", "imported_whole"]


class StopControl:
    def __init__(
        self,
        on_first_stop: Callable[[str, str], None] | None = None,
        resolve: Callable[[str], str] | None = None,
    ) -> None:
        self.reason: str | None = None
        # The daemon's reason for a stop it signalled (its stop marker's), set by
        # ``resolve`` when it applies the signal; None otherwise (``why``).
        self.stop_reason: str | None = None
        # The reason a stop is applied with, from the one asked (a signal's sender is
        # looked up as it is applied, after the signal came): identity by default.
        self._resolve = resolve
        self.count = 0
        self.stopped = trio.Event()
        self.stopped_at: float | None = None  # trio clock
        self.stopped_wall: float | None = None
        self._on_first_stop = on_first_stop
        self._model_scope: trio.CancelScope | None = None
        self._abort_kind = "model"
        self.phase = "idle"  # what the run is doing outside a model request or a tool
        self._tool_scope: trio.CancelScope | None = None
        # The call running now ({id, name, on_stop}), for the stop_requested event, and what
        # to do (synchronously) when a stop reaches it; both cleared by ``tool_done``.
        self.running_tool: dict[str, Any] | None = None
        self.on_stop_during_tool: Callable[[], None] | None = None
        # MCP servers the stop closed under their running calls (a session's browser, before
        # the grace ran out): such a call that then fails was ended, not let finish.
        self.closed_servers: set[str] = set()
        self._starting = 0  # tools being started (``starting``)
        self._deferred: str | None = None  # a stop asked meanwhile: applied once it has
        self._signalled = False  # a SIGTERM arrived (``note_signal``): applied at the next check

    @property
    def requested(self) -> bool:
        self._catch_up()
        return self.reason is not None

    @property
    def why(self) -> str | None:
        """Why the run stopped, as a call's record and the model are told: the daemon's
        reason when it sent the stop (``stop_reason``), else the applied ``reason``."""
        return self.stop_reason or self.reason

    @property
    def asked(self) -> bool:
        """Whether any stop has reached the runner: applied, deferred, or a SIGTERM only
        noted so far (nothing is applied here)."""
        return self._asked()

    def note_signal(self) -> None:
        """Called from the SIGTERM handler itself: only notes it (no trio call is safe
        there); the next check of the flag applies it as ``request("signal")``."""
        self._signalled = True

    def _asked(self) -> bool:
        return self.reason is not None or self._deferred is not None or self._signalled

    def _catch_up(self) -> None:
        if self._signalled and self.reason is None and not self._starting:
            self._apply("signal")

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
        if self._starting:
            self._deferred = self._deferred or reason
            return
        self._apply(reason)

    def _apply(self, reason: str) -> None:
        if self.reason is None:
            if self._resolve is not None:
                reason = self._resolve(reason)
            self.reason = reason
            self.stopped_at = trio.current_time()
            self.stopped_wall = time.time()
            if self._on_first_stop is not None:
                self._on_first_stop(reason, self.during)
            self.stopped.set()
            if self.on_stop_during_tool is not None:
                self.on_stop_during_tool()
            if self._model_scope is not None:
                self._model_scope.cancel(reason=f"stop ({reason}) aborts the model request")

    @contextmanager
    def starting(self) -> Iterator[Callable[[], bool]]:
        """A tool's start: the caller checks ``stopped`` and starts the tool inside; a stop
        asked in between is applied on the way out (the tool has started, or failed to).
        Hold it for the start alone (a spawn), never for a wait. It gives whether a stop
        has been asked meanwhile (not yet applied): a command spawned but held at its gate
        is then let go without running (``subagent.tools.commands``)."""
        self._catch_up()  # a SIGTERM that came before: the caller's check sees it
        self._starting += 1
        try:
            yield self._asked
        finally:
            self._starting -= 1
            deferred = self._deferred if not self._starting else None
            if deferred is not None:
                self._deferred = None
                self.count -= 1  # counted when it was asked
                self.request(deferred)
            self._catch_up()  # one that came while it was being started

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
        """A fresh scope the running tool enters; an explicit interrupt cancels it (a stop
        reaches the tool through its own policy, watching ``stopped``)."""
        scope = trio.CancelScope()
        self._tool_scope = scope
        return scope

    def tool_done(self) -> None:
        self._tool_scope = None
        self.running_tool = None
        self.on_stop_during_tool = None


async def import_abortably(
    module: str, abortable: Callable[[str], contextlib.AbstractContextManager[trio.CancelScope]]
) -> bool:
    """Import ``module`` (one that brings in ``openai`` or ``mcp``: 1.2-1.6 s in a cold
    runner) in a worker thread while the loop watches the stop (``abortable("setup")``: a
    scope the stop cancels, ``StopControl.abortable``); False when the stop came first.

    On the loop, an import holds the stop until it is done (the SIGTERM's task cannot
    run). A stop abandons the import (a setup has no side effect to wait for): its thread
    goes on until the process exits, which it then does at once (``runner.start``:
    ``os._exit``); nothing of the run uses the module after a stop in its setup. A forked
    runner has it already (the zygote's ``preload``): no thread. With no thread to be had
    (the run's pids limit) it is imported on the loop.
    """
    if module in sys.modules:
        return True
    with abortable("setup"):
        try:
            await trio.to_thread.run_sync(importlib.import_module, module, abandon_on_cancel=True)
        except RuntimeError:  # no thread could be started
            importlib.import_module(module)
        return True
    return False


def imported_whole(module: str) -> bool:
    """``module`` is imported, whole. A module is in ``sys.modules`` from the start of its
    import: one a stop abandoned (``import_abortably``: its thread still runs it) is there
    half done, marked so as the import system marks it (``__spec__._initializing``)."""
    found = sys.modules.get(module)
    return found is not None and not getattr(getattr(found, "__spec__", None), "_initializing", False)
