"""A run's browser before its server is closed: resumed if the run stopped it, and a
session's browser closed (``browser_close``) so that it writes what it holds.

Invariants: the run's ``AsyncExitStack`` unwinds in reverse, so what ``before_the_close``
pushes (after the browser server was started) runs before that server's close: first the
resume (``subagent.tools.browser.resume_stopped_browser``: a browser the run's own
command stopped, SIGSTOP, can neither answer nor close), then a session's ``browser_close``
(bounded). A stop whose grace runs out while the run is busy gets the same, shortly before
the grace ends (``save_session_browser_before_the_grace``). Nothing here ends a process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import trio

from subagent.emit import Emitter
from subagent.stop import StopControl

__all__ = [
    "BROWSER_CLOSE_TIMEOUT_S",
    "BROWSER_SAVE_RESERVE_S",
    "GRACE_ENV",
    "SessionBrowser",
    "before_the_close",
    "save_session_browser_before_the_grace",
]

logger = logging.getLogger(__name__)

# Bounds closing a session's browser before its server goes (seconds): ``browser_close`` lets Chromium
# shut down and write its cookies (@playwright/mcp ends it abruptly when its stdin closes: lost).
BROWSER_CLOSE_TIMEOUT_S = 5.0
# The daemon's grace (seconds), for the runner to see it coming: ``AGENTD_STOP_GRACE_S``.
GRACE_ENV = "AGENTD_STOP_GRACE_S"
# What a session's browser is given, before the grace runs out, to shut down and write
# its state (seconds).
BROWSER_SAVE_RESERVE_S = 2.0


class SessionBrowser:
    """Closing a session's browser (``browser_close``: Chromium shuts down and writes what
    it holds, a login's cookie, to the session's profile), once: at the run's end, or
    before a stop's grace runs out; whoever comes second waits for the first."""

    def __init__(self, server: Any, resume: Callable[[], object], name: str = "browser") -> None:
        self.server = server
        self.resume = resume  # SIGCONT what of it the run stopped (SIGSTOP): stopped, it cannot close
        self.name = name  # the server's name in the run's toolbox
        self._started = False
        self._done = trio.Event()

    async def close(self, timeout_s: float = BROWSER_CLOSE_TIMEOUT_S) -> None:
        # Teardown, not a tool call of the model's: it runs after a stop too (a stop must
        # not log the user out), bounded, and a browser that does not answer is ended as
        # before (its server's close).
        with trio.CancelScope(shield=True), trio.move_on_after(timeout_s):
            if self._started:
                await self._done.wait()
                return
            self._started = True
            try:
                await self.server.call("browser_close", {})
            except Exception as exc:  # a dead or broken server: the normal close ends it
                logger.warning("closing the session's browser failed: %s", exc)
            finally:
                self._done.set()


def stop_grace_s() -> float | None:
    try:
        grace = float(os.environ.get(GRACE_ENV, ""))
    except ValueError:
        return None
    return grace if grace >= 0 and grace != float("inf") else None


async def save_session_browser_before_the_grace(stop: StopControl, browser: SessionBrowser, emitter: Emitter) -> None:
    """A stop whose grace runs out while the run is still busy (a call its policy lets
    finish) ends in SIGKILL, the browser with it: what it had not written (a login's
    cookie) was lost to the session's next turn. Shortly before that, the browser is
    closed as at the run's end (beside the call still running, which then ends with it),
    resumed first if the run stopped it (SIGSTOP: it would neither answer nor write)."""
    grace = stop_grace_s()
    if grace is None:
        return
    await stop.stopped.wait()
    assert stop.stopped_at is not None
    # (A grace shorter than the reserve: half of it for the call, half for the browser.)
    await trio.sleep_until(stop.stopped_at + max(grace - BROWSER_SAVE_RESERVE_S, grace / 2))
    emitter.log(
        "warning",
        "the stop's grace is running out with the run still busy: the session's browser is closed now "
        "so that what it holds (a login) is kept for the next turn",
    )
    stop.closed_servers.add(browser.name)
    browser.resume()
    await browser.close(min(BROWSER_SAVE_RESERVE_S, grace / 2))


def before_the_close(
    server: Any,
    base: Path,
    profile: str | None,
    stack: AsyncExitStack,
    nursery: trio.Nursery,
    stop: StopControl,
    emitter: Emitter,
) -> None:
    """Called right after the browser server started: a session's browser is closed before
    its server (``profile``: the session's), and before that, or before the server's close,
    whatever of the browser the run stopped is resumed."""
    from subagent.tools.browser import resume_stopped_browser

    resume = partial(resume_stopped_browser, base, profile)
    if profile is not None:
        session_browser = SessionBrowser(server, resume)
        stack.push_async_callback(session_browser.close)
        nursery.start_soon(save_session_browser_before_the_grace, stop, session_browser, emitter)
    stack.callback(resume)  # pushed last, run first: a stopped browser cannot close
