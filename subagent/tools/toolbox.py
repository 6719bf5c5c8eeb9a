"""The tools one run offers the model, and the execution of one call.

Invariants: a tool name the model sees maps to exactly one executor (built-in, or one
MCP server's tool: exposed under its own name when that is unique and no other tool's
qualified name, always also as ``<server>__<tool>``, given a hashed suffix when
sanitising or the 64-character cut made it another's); no name is offered twice;
``execute`` never raises for a tool's own failure: it returns a ``ToolOutcome`` whose
state says what really happened (succeeded, failed, cancelled by the stop or an explicit
interrupt, or unknown when we stopped waiting but the tool may still act); outputs are
bounded to ``limits.max_output_bytes``. Every tool has a ``StopPolicy`` (``policy``), and
a running call applies it the moment the run's stop is set: a command is interrupted (or
finishes), an MCP call is abandoned, told to stop, or let finish; the outcome's
``stop_effect`` says which happened.

Size: the one place where a call meets its tool and the run's stop (naming, the start
guard, each tool kind's stop policy): split by tool kind, the stop's rules would be
repeated in each part, and one missed (a background command started after the stop).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import trio

from subagent.events import StopEffect, StopPolicy, ToolCallState
from subagent.spec import Limits, StopPolicySpec
from subagent.stop import StopControl
from subagent.stop_policy import command_policy, mcp_policy
from subagent.stopmark import SIGNALLED
from subagent.tools.background import COMMAND_OUTPUT_TOOL, BackgroundCommands
from subagent.tools.commands import (
    RUN_COMMAND_TOOL,
    STOP_SETTLE_S,
    CommandOutcome,
    format_outcome,
    killed_by_signal,
    run_command,
)

if TYPE_CHECKING:
    from subagent.tools.mcp_tools import McpServer

__all__ = ["ToolOutcome", "ToolBox", "bound_text"]

logger = logging.getLogger(__name__)

_LOST = "connection_lost: the server's connection ended during the call"
REASON_STOPPED_BEFORE_START = "stopped_before_start: a stop was requested before this call started"
_NAME_OK = re.compile(r"[^A-Za-z0-9_-]")
_NAME_MAX: Final = 64  # the longest function name the model APIs accept


@dataclass(slots=True)
class ToolOutcome:
    state: ToolCallState
    output: str | None  # known output (bounded)
    truncated: bool = False
    error: str | None = None
    reason: str | None = None
    stop_effect: StopEffect | None = None  # set when the tool applied its stop policy
    # The tool's own work ended before any stop was asked; only its clean-up (a command's
    # output drained, what it left running ended) was under way when one came.
    finished_before_stop: bool = False
    background_id: str | None = None  # the background command it started (``bg1``, ...)


def bound_text(text: str, max_bytes: int) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text, False
    return data[:max_bytes].decode("utf-8", "ignore"), True


def _run_command_schema(with_background: bool) -> dict[str, Any]:
    if not with_background:
        return RUN_COMMAND_TOOL
    fn = dict(RUN_COMMAND_TOOL["function"])
    params = dict(fn["parameters"])
    params["properties"] = {
        **params["properties"],
        "background": {
            "type": "boolean",
            "description": "Start it in the background and return at once with an id (read it with command_output); it is stopped when the run ends.",
        },
    }
    fn["parameters"] = params
    return {"type": "function", "function": fn}


def _safe_name(name: str) -> str:
    return _NAME_OK.sub("_", name)[:_NAME_MAX]


def _unique_name(name: str, key: str, taken: set[str]) -> str:
    """``name`` with a suffix (hash of ``key``) that no name in ``taken`` has, within 64 chars."""
    for n in itertools.count():
        suffix = "_" + hashlib.sha256(f"{key}\0{n}".encode("utf-8", "surrogatepass")).hexdigest()[:8]
        candidate = name[: _NAME_MAX - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
    raise AssertionError("unreachable")


class ToolBox:
    def __init__(
        self,
        *,
        builtins: tuple[str, ...],
        limits: Limits,
        servers: Mapping[str, McpServer],
        on_group: Callable[[int, bool, str, str, str | None], None],
        background: BackgroundCommands | None = None,
        stop_policy: StopPolicySpec | None = None,
        preset_servers: frozenset[str] = frozenset(),
    ) -> None:
        self.limits = limits
        self.stop_policy = stop_policy or StopPolicySpec()
        self._preset_servers = preset_servers
        self.background = background
        self.servers = dict(servers)
        self._on_group = on_group
        self._builtins = set(builtins)
        if "run_command" in self._builtins and background is not None:
            self._builtins.add("command_output")
        # name -> (server, tool name, tool object); both plain and qualified names resolve.
        self._mcp: dict[str, tuple[str, str, Any]] = {}
        self._exposed: list[str] = sorted(self._builtins)
        entries = [(s.name, t.name, t) for s in servers.values() for t in s.tools]
        qualified = self._qualify(entries)
        qualified_set = frozenset(qualified)
        # The qualified names are settled before any plain one: a plain name never takes
        # one, so ``<server>__<tool>`` reaches that server's tool whatever another lists.
        counts: dict[str, int] = {}
        for _server, tool, _t in entries:
            counts[_safe_name(tool)] = counts.get(_safe_name(tool), 0) + 1
        for entry, q in zip(entries, qualified, strict=True):
            plain = _safe_name(entry[1])
            self._mcp[q] = entry
            if counts[plain] == 1 and plain not in self._builtins and plain not in qualified_set:
                self._mcp[plain] = entry
                self._exposed.append(plain)
            else:
                self._exposed.append(q)

    def _qualify(self, entries: list[tuple[str, str, Any]]) -> list[str]:
        """Each tool's ``<server>__<tool>`` name, unique among them and the built-ins.

        Sanitising and the 64-character cut can give two tools one name (real APIs refuse
        a repeated function name, and one of them would be unreachable). A name that is
        ``<server>__<tool>`` verbatim keeps it before one that only became it; a later
        claimant gets a suffix from a hash of its (server, tool), so its name does not
        depend on what else the servers list.
        """
        wanted = [(s, t, _safe_name(f"{s}__{t}")) for s, t, _ in entries]
        order = sorted(range(len(entries)), key=lambda i: wanted[i][2] != f"{wanted[i][0]}__{wanted[i][1]}")
        taken = set(self._builtins)
        out = [""] * len(entries)
        for i in order:
            server, tool, name = wanted[i]
            if name in taken:
                name = _unique_name(name, f"{server}\0{tool}", taken)
                logger.warning("mcp tool %r of server %r is offered as %r: its name is taken", tool, server, name)
            taken.add(name)
            out[i] = name
        return out

    def names(self) -> list[str]:
        return list(self._exposed)

    def server_of(self, name: str) -> str | None:
        """The MCP server a tool name reaches, or None (a built-in, or no such tool)."""
        entry = self._mcp.get(name)
        return None if entry is None else entry[0]

    def has(self, name: str) -> bool:
        return name in self._builtins or name in self._mcp

    def where(self, name: str) -> tuple[str, str] | None:
        """The (server, tool) an MCP tool name reaches; None for a built-in or no such tool."""
        if name in self._builtins or name not in self._mcp:
            return None
        server, tool, _ = self._mcp[name]
        return server, tool

    def policy(self, name: str) -> StopPolicy | None:
        """What a stop does to a running call of ``name`` (None: no such tool)."""
        if name == "run_command" and name in self._builtins:
            return command_policy(self.stop_policy)
        if name == "command_output" and name in self._builtins:
            return StopPolicy.ABANDON  # reads a file: nothing to stop
        if name in self._mcp:
            server, tool, t = self._mcp[name]
            return mcp_policy(
                self.stop_policy, server, tool, getattr(t, "annotations", None), preset=server in self._preset_servers
            )
        return None

    def schemas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "run_command" in self._builtins:
            out.append(_run_command_schema(self.background is not None))
        if "command_output" in self._builtins:
            out.append(COMMAND_OUTPUT_TOOL)
        for name in self._exposed:
            if name in self._builtins:
                continue
            server, _tool, t = self._mcp[name]
            schema = dict(getattr(t, "input_schema", None) or {"type": "object", "properties": {}})
            schema.setdefault("type", "object")
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": (getattr(t, "description", None) or f"{server} tool {t.name}")[:1024],
                        "parameters": schema,
                    },
                }
            )
        return out

    def protocol_errors(self) -> list[tuple[str, str]]:
        return [(s.name, e) for s in self.servers.values() for e in s.protocol_errors]

    async def execute(
        self,
        name: str,
        arguments: dict[str, Any],
        interrupt: trio.CancelScope,
        stop: StopControl | None = None,
        on_output: Callable[[str, bool], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> ToolOutcome:
        """Run one call. ``interrupt``: an explicit interrupt ends it whatever its policy;
        ``stop``: the run's stop, applied to the running call by its policy;
        ``on_output(text, truncated)``: a command's output so far, once it runs past the stop;
        ``on_sent()``: an MCP call's request was handed to its server's transport (at once
        after the hand-off; never for a call that was not sent)."""
        stop = stop if stop is not None else StopControl()
        if name == "run_command" and "run_command" in self._builtins:
            if arguments.get("background") is True and self.background is not None:
                return await self._start_background(arguments, stop)
            return await self._run_command(arguments, interrupt, stop, on_output)
        if name == "command_output" and "command_output" in self._builtins and self.background is not None:
            known, text = self.background.output(str(arguments.get("id", "")))
            bounded, truncated = bound_text(text, self.limits.max_output_bytes)
            if not known:
                return ToolOutcome(ToolCallState.FAILED, bounded, error=text, reason="unknown_command_id")
            return ToolOutcome(ToolCallState.SUCCEEDED, bounded, truncated)
        server_name, tool, _ = self._mcp[name]
        policy = self.policy(name) or StopPolicy.FINISH
        return await self._call_mcp(server_name, tool, arguments, interrupt, stop, policy, on_sent)

    async def _start_background(self, args: dict[str, Any], stop: StopControl) -> ToolOutcome:
        assert self.background is not None
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolOutcome(
                ToolCallState.FAILED,
                None,
                error="invalid_arguments: 'command' must be a non-empty string",
                reason="invalid_arguments",
            )
        with stop.starting() as asked:  # as a foreground command: no start once the stop is set
            launched = None if stop.stopped.is_set() else await self.background.launch(command, asked)
        if launched is None:
            return ToolOutcome(
                ToolCallState.NOT_STARTED,
                None,
                reason=REASON_STOPPED_BEFORE_START,
                stop_effect=StopEffect.STOPPED_BEFORE_START,
            )
        text, job_id = launched
        if job_id is None:
            return ToolOutcome(ToolCallState.FAILED, text, error=text, reason="spawn_failed")
        return ToolOutcome(ToolCallState.SUCCEEDED, text, background_id=job_id)

    async def _run_command(
        self,
        args: dict[str, Any],
        interrupt: trio.CancelScope,
        stop: StopControl,
        on_output: Callable[[str, bool], None] | None = None,
    ) -> ToolOutcome:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolOutcome(
                ToolCallState.FAILED,
                None,
                error="invalid_arguments: 'command' must be a non-empty string",
                reason="invalid_arguments",
            )
        timeout = self.limits.command_timeout_s
        asked = args.get("timeout_s")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
            timeout = min(timeout, float(asked))
        policy = command_policy(self.stop_policy)
        interruptible = policy is StopPolicy.INTERRUPT
        outcome = await run_command(
            command,
            timeout_s=timeout,
            max_output_bytes=self.limits.max_output_bytes,
            interrupt=interrupt,
            stop=stop.stopped,
            interrupt_on_stop=interruptible,
            kill_grace_s=self.stop_policy.command_grace_s,
            on_group=lambda pgid, alive: self._on_group(pgid, alive, "command", command[:200], str(policy)),
            starting=stop.starting(),
            on_output=on_output,
        )
        if outcome.not_started:
            return ToolOutcome(
                ToolCallState.NOT_STARTED,
                None,
                reason=REASON_STOPPED_BEFORE_START,
                stop_effect=StopEffect.STOPPED_BEFORE_START,
            )
        # A command killed by the stop's signal was interrupted, whatever its policy: a stop
        # that comes as it spawns reaches it before it leaves the runner's process group.
        if not outcome.by_stop and await _killed_by_the_stop(outcome, stop):
            outcome.by_stop = True
        foreign = stop.reason == SIGNALLED
        text = format_outcome(outcome, foreign_signal=foreign)
        if outcome.spawn_error is not None:
            return ToolOutcome(ToolCallState.FAILED, text, error=outcome.spawn_error, reason="spawn_failed")
        if outcome.by_stop:
            after = _command_stop_to_end(outcome, stop)
            how = f"; it ended on {outcome.ended_by} {_ms(after)} after the stop" if after is not None else ""
            reason = f"interrupted: interrupted by the stop (SIGTERM to its process group){how}"
            if foreign:
                reason = (
                    "interrupted: the run stopped on a SIGTERM not sent by agentd's stop "
                    f"(SIGTERM to its process group){how}"
                )
            if policy is not StopPolicy.INTERRUPT:
                reason = f"interrupted: killed by {outcome.ended_by} as the stop came (it was spawning; its policy would have let it finish)"
            return ToolOutcome(
                ToolCallState.CANCELLED, text, outcome.truncated, reason=reason, stop_effect=StopEffect.INTERRUPTED
            )
        if outcome.interrupted:
            return ToolOutcome(
                ToolCallState.CANCELLED,
                text,
                outcome.truncated,
                reason="interrupted: an explicit interrupt ended the command",
            )
        if outcome.timed_out:
            return ToolOutcome(
                ToolCallState.FAILED, text, outcome.truncated, error=f"timed out after {timeout:g} s", reason="timeout"
            )
        return ToolOutcome(
            ToolCallState.SUCCEEDED, text, outcome.truncated, finished_before_stop=outcome.finished_before_stop
        )

    async def _call_mcp(
        self,
        server_name: str,
        tool: str,
        args: dict[str, Any],
        interrupt: trio.CancelScope,
        stop: StopControl,
        policy: StopPolicy,
        on_sent: Callable[[], None] | None = None,
    ) -> ToolOutcome:
        if stop.requested:  # no call starts after the stop
            return ToolOutcome(
                ToolCallState.NOT_STARTED,
                None,
                reason=REASON_STOPPED_BEFORE_START,
                stop_effect=StopEffect.STOPPED_BEFORE_START,
            )
        server = self.servers[server_name]
        if server.protocol_errors:  # a server that broke the protocol gets no new call
            return ToolOutcome(
                ToolCallState.FAILED,
                None,
                error=f"not sent: the server broke the protocol earlier in the run: {server.protocol_errors[0]}",
                reason="tool_protocol",
            )
        call = trio.CancelScope()
        broke = trio.CancelScope()
        effect: list[StopEffect] = []
        unanswerable: list[str] = []  # the server was stopped at the stop: no wait
        wait_s = self.stop_policy.cancel_wait_s

        async def apply_stop() -> None:
            await stop.stopped.wait()
            tap = server.tap
            if tap is not None and tap.stop is stop and tap.in_flight is None:
                return  # not handed to the transport yet: it never will be (StoppedBeforeSend)
            if policy is StopPolicy.ABANDON:
                effect.append(StopEffect.ABANDONED)
                # Cancelling the SDK's request makes it send notifications/cancelled itself.
                call.cancel(reason="the stop abandons a read-only call")
                return
            with trio.move_on_after(wait_s):
                await server.cancel_in_flight(f"the run was stopped ({stop.reason})")
            # A server stopped (SIGSTOP, by the run's own command) answers nothing until
            # resumed, which only its close does: its wait would be the stop's time lost.
            if not server.stopped():
                await trio.sleep(wait_s)  # the answer may still come: then it is the real result
            else:
                unanswerable.append(server.name)
            effect.append(StopEffect.CANCEL_UNANSWERED)
            call.cancel(reason="no answer after notifications/cancelled")

        async def end_at_the_break() -> None:
            await server.broken.wait()
            broke.cancel(reason="the server broke the protocol")

        async with trio.open_nursery() as nursery:
            if policy in (StopPolicy.ABANDON, StopPolicy.CANCEL):
                nursery.start_soon(apply_stop)
            nursery.start_soon(end_at_the_break)
            try:
                outcome = await self._mcp_outcome(server, tool, args, interrupt, call, broke, stop, on_sent)
            finally:
                nursery.cancel_scope.cancel(reason="the call ended")
        if call.cancelled_caught and effect:
            if effect[0] is StopEffect.ABANDONED:
                reason = "abandoned: a read-only call abandoned at the stop; notifications/cancelled was sent"
            elif unanswerable:
                reason = (
                    "interrupted: notifications/cancelled was sent at the stop, but the server's process was "
                    "stopped (SIGSTOP) and could not answer; the call was abandoned at once and the server may "
                    "have acted"
                )
            else:
                reason = (
                    f"interrupted: notifications/cancelled was sent at the stop and no answer came within "
                    f"{wait_s:g} s; the call was abandoned and the server may have acted"
                )
            return ToolOutcome(ToolCallState.CANCELLED, None, reason=reason, stop_effect=effect[0])
        return outcome

    async def _mcp_outcome(
        self,
        server: McpServer,
        tool: str,
        args: dict[str, Any],
        interrupt: trio.CancelScope,
        call: trio.CancelScope,
        broke: trio.CancelScope,
        stop: StopControl,
        on_sent: Callable[[], None] | None = None,
    ) -> ToolOutcome:
        """One call's outcome. ``call``: the stop's scope; ``broke``: cancelled when the
        server breaks the protocol."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        from subagent.tools.mcp_tools import StoppedBeforeSend, UnsendableArguments

        timeout = self.limits.command_timeout_s
        result: tuple[bool, str] | None = None
        try:
            with trio.move_on_after(timeout) as timer:
                with interrupt, call, broke:
                    result = await server.call(tool, args, stop=stop, on_sent=on_sent)
        except UnsendableArguments as exc:
            return ToolOutcome(
                ToolCallState.FAILED, None, error=f"invalid_arguments: {exc}", reason="invalid_arguments"
            )
        except StoppedBeforeSend:
            # The stop came on the SDK's way to the transport: the call was never sent.
            return ToolOutcome(
                ToolCallState.NOT_STARTED,
                None,
                reason=REASON_STOPPED_BEFORE_START,
                stop_effect=StopEffect.STOPPED_BEFORE_START,
            )
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                # The call was sent; whether the server acted before it went away is unknown.
                return ToolOutcome(ToolCallState.UNKNOWN, None, error=f"mcp error: {exc.error.message}", reason=_LOST)
            return ToolOutcome(
                ToolCallState.FAILED, None, error=f"mcp error {exc.code}: {exc.error.message}", reason="mcp_error"
            )
        except RuntimeError as exc:
            # The SDK checked the answer and rejected it (output schema, unexpected result
            # kind): the tool ran, but what it returned is unusable.
            return ToolOutcome(ToolCallState.FAILED, None, error=str(exc), reason="invalid_result")
        except Exception as exc:  # the transport broke: the server may or may not have acted
            logger.warning("mcp call %s.%s broke: %s", server.name, tool, exc)
            return ToolOutcome(ToolCallState.UNKNOWN, None, error=f"{type(exc).__name__}: {exc}", reason=_LOST)
        # The SDK hands a bad stdout line to the session's handler in a task of its own,
        # queued before the answer that followed it: one checkpoint lets it be recorded.
        await trio.lowlevel.checkpoint()
        if interrupt.cancelled_caught:
            return ToolOutcome(
                ToolCallState.CANCELLED,
                None,
                reason="interrupted: an explicit interrupt abandoned the call; the server may have acted",
            )
        if call.cancelled_caught:
            return ToolOutcome(ToolCallState.CANCELLED, None, reason="interrupted: the stop abandoned the call")
        if broke.cancelled_caught:
            # The SDK dropped a line it could not take: it may have been this call's answer.
            return ToolOutcome(
                ToolCallState.UNKNOWN,
                None,
                error=f"the server broke the protocol during the call: {server.protocol_errors[0]}",
                reason="tool_protocol: stopped waiting when the server wrote a line that is not JSON-RPC; "
                "its answer may have been lost and the server may have acted",
            )
        if timer.cancelled_caught or result is None:
            return ToolOutcome(
                ToolCallState.UNKNOWN,
                None,
                error=f"no answer within {timeout:g} s",
                reason="timeout: stopped waiting; the server may still act",
            )
        is_error, text = result
        bounded, truncated = bound_text(text, self.limits.max_output_bytes)
        if is_error:
            return ToolOutcome(
                ToolCallState.FAILED, bounded, truncated, error="the tool reported an error", reason="tool_error"
            )
        return ToolOutcome(ToolCallState.SUCCEEDED, bounded, truncated)


async def _killed_by_the_stop(outcome: CommandOutcome, stop: StopControl) -> bool:
    """Did the daemon's path A kill this command for the run's stop?

    Path A signals the runner and the command's group at once, so the command's death can
    be seen here before the runner's own SIGTERM has set the stop flag: a command killed
    by SIGTERM/SIGKILL waits (bounded) for that flag.
    """
    if not killed_by_signal(outcome.exit_code):
        return False
    if not stop.requested:
        with trio.move_on_after(STOP_SETTLE_S):
            await stop.stopped.wait()
    return stop.requested


def _command_stop_to_end(outcome: CommandOutcome, stop: StopControl) -> float | None:
    start = outcome.stop_at if outcome.stop_at is not None else stop.stopped_at
    if start is None or outcome.ended_at is None:
        return None
    return max(0.0, outcome.ended_at - start)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
