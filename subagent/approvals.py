"""Approvals in the runner: which calls wait for a person's OK, and the wait itself.

A call the spec's ``approval`` names (``needs_approval``) is announced like any other,
then waits before it runs: its record says ``approval: pending`` with its deadline, an
``approval_requested`` event names it, and the run's answers arrive on the *answer
channel*, a FIFO the daemon made outside the run's sandbox (``AGENTD_ANSWERS``) and the
runner opened before it sandboxed itself (``open_channel``): its tools cannot open it, so a
run cannot approve its own calls, and a daemon that restarts reaches a re-adopted runner
through it as the first one did. One JSON line per answer:
``{"call_id": ..., "decision": "approve"|"deny", "reason": ...}``. The first answer to a
call is its answer; a later one, or one to a call not waiting, is ignored: a restarted
daemon sends again an answer it journaled and may not have written.

The wait ends with the first of: the answer, the run's stop (the call is then
``rejected``: it never ran; its reason is the stop's ``why``: the daemon's reason,
``user``, ``approval_timeout``, ..., when its stop marker gave one), or the backstop (``timeout_s`` + ``BACKSTOP_S`` with no
answer: the runner stops itself with reason ``approval_timeout``; the daemon stops the run
at the deadline itself, so this only matters without one).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from subagent.spec import ApprovalSpec
from subagent.stop import StopControl

__all__ = [
    "ANSWERS_ENV",
    "Answer",
    "AnswerChannel",
    "ApprovalGate",
    "open_channel",
    "MAX_ANSWER_LINE_BYTES",
    "MAX_APPROVAL_ARGUMENTS_CHARS",
]

logger = logging.getLogger(__name__)

ANSWERS_ENV: Final = "AGENTD_ANSWERS"
# Beyond the approval's own timeout, how long the runner waits before it stops itself
# (seconds): the daemon's stop at the deadline comes first when there is a daemon.
BACKSTOP_S: Final = 5.0
# A longer line on the channel is not an answer (bytes). The daemon's longest answer fits:
# a deny's reason of 1000 characters and a call id of 256, written as ASCII JSON where a
# character outside the BMP is 12 bytes (two \u escapes), is ~15 KB. A line may be longer
# than PIPE_BUF, so it can be torn by a daemon that dies while writing it: each answer
# starts with a newline, which ends such a fragment (dropped, as any line that is not an
# answer) before the answer is read. The daemon is the channel's only writer and writes
# one answer at a time.
MAX_ANSWER_LINE_BYTES: Final = 16 * 1024
# The longest arguments a call that needs approval may have (characters): its
# ``approval_requested`` event carries them whole. A longer event line is cut to fit
# (``emit``: a string of 1 MB became its first 64 Ki characters and "...[cut]"), and a
# person was asked about a command whose end they could not see (spaces, collapsed on a
# page, then "; curl ... | sh"). A character is at most 12 bytes in an event line (two
# \u escapes), so these fit ``MAX_EVENT_LINE_BYTES`` with room for the rest.
MAX_APPROVAL_ARGUMENTS_CHARS: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class Answer:
    decision: str  # "approved" | "denied" | "rejected" (the stop ended the wait) | "timeout"
    reason: str | None = None


def open_channel(environ: dict[str, str] | None = None) -> int | None:
    """Open the answer FIFO named by ``AGENTD_ANSWERS`` (before the sandbox closes it).

    Opened read-write, so it never reads EOF however often the daemon (or a new daemon)
    opens and closes its end. Returns the fd (not inherited by children), or None.
    """
    path = (os.environ if environ is None else environ).get(ANSWERS_ENV)
    if not path:
        return None
    try:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        logger.warning(
            "the answer channel %s cannot be opened: %s (calls that need approval will wait in vain)", path, exc
        )
        return None


@dataclass
class AnswerChannel:
    """Answers by call id, read from the channel's fd by ``run`` (a task)."""

    fd: int | None
    warn: Callable[[str], None] = lambda msg: None
    _answers: dict[str, Answer] = field(default_factory=dict)
    _changed: trio.Event = field(default_factory=trio.Event)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.fd is None:
            task_status.started()
            return
        stream = trio.lowlevel.FdStream(self.fd)
        self.fd = None  # the stream owns it now
        task_status.started()
        buf = bytearray()
        async with stream:
            while True:
                try:
                    data = await stream.receive_some(MAX_ANSWER_LINE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, _, rest = bytes(buf).partition(b"\n")
                    buf = bytearray(rest)
                    self._take(line)
                if len(buf) > MAX_ANSWER_LINE_BYTES:
                    self.warn("ignored an over-long line on the answer channel")
                    buf.clear()

    def _take(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        call_id = obj.get("call_id") if isinstance(obj, dict) else None
        decision = obj.get("decision") if isinstance(obj, dict) else None
        if not isinstance(call_id, str) or decision not in ("approve", "deny"):
            self.warn(f"ignored a line on the answer channel that is not an answer: {line[:200]!r}")
            return
        reason = obj.get("reason")
        reason = reason.strip() or None if isinstance(reason, str) else None
        if call_id not in self._answers:  # the first answer to a call is the answer
            self._answers[call_id] = Answer("approved" if decision == "approve" else "denied", reason)
            self._changed.set()
            self._changed = trio.Event()

    async def wait(self, call_id: str) -> Answer:
        while call_id not in self._answers:
            await self._changed.wait()
        return self._answers[call_id]


@dataclass
class ApprovalGate:
    """The spec's approval rules, for the tools this run offers."""

    spec: ApprovalSpec
    channel: AnswerChannel
    # (exposed name) -> (server, tool) for MCP tools; built-ins map to None.
    resolve: Callable[[str], tuple[str, str] | None] = lambda name: None

    def needs_approval(self, name: str, arguments: dict[str, Any]) -> bool:
        if not self.spec.any:
            return False
        tools = set(self.spec.tools)
        if name in tools:
            return True
        where = self.resolve(name)
        if where is not None:
            server, tool = where
            if (
                server in self.spec.servers
                or f"{server}/{tool}" in tools
                or f"{server}__{tool}" in tools
                or tool in tools
            ):
                return True
        if name == "run_command" and self.spec.commands:
            command = arguments.get("command")
            if isinstance(command, str):
                text = command.strip()
                return any(fnmatch.fnmatchcase(text, pattern) for pattern in self.spec.commands)
        return False

    async def wait(self, call_id: str, stop: StopControl) -> Answer:
        """The call's answer; ``rejected`` if the stop comes first (also one already set)."""
        if stop.requested:
            return Answer("rejected", stop.why)
        outcome: list[Answer] = []
        async with trio.open_nursery() as nursery:

            async def answer() -> None:
                outcome.append(await self.channel.wait(call_id))
                nursery.cancel_scope.cancel(reason="answered")

            async def stopped() -> None:
                await stop.stopped.wait()
                outcome.append(Answer("rejected", stop.why))
                nursery.cancel_scope.cancel(reason="the stop ends the wait for approval")

            async def backstop() -> None:
                await trio.sleep(self.spec.timeout_s + BACKSTOP_S)
                stop.request("approval_timeout")

            nursery.start_soon(answer)
            nursery.start_soon(stopped)
            nursery.start_soon(backstop)
        if stop.requested:
            # The answer and the stop came together (the person approved as another
            # pressed Stop): the stop wins, whichever task appended first. The call never
            # starts (it was let start, a background command ran after the stop).
            return Answer("rejected", stop.why)
        return outcome[0]
