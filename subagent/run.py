"""Running one validated spec: set up the model and tools, run the loop, write the result.

Invariants: the trio signal receiver (SIGTERM, SIGINT) is open for the whole run, so a
stop is only ever a flag (``subagent.stop``); every resource (model client, MCP servers,
the browser sweep) is entered in one ``AsyncExitStack`` and closed before the result is
written; setup failures map to their exit codes (``SetupFailure``); whatever got this far
ends with exactly one result (stdout and its result file). A stop that came during setup
makes the run ``cancelled``, never ``failed``.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from subagent.approvals import AnswerChannel, ApprovalGate
from subagent.emit import Emitter, bare_result
from subagent.events import EventKind, ExitCode, RunStatus, StopPolicy
from subagent.loop import AgentLoop, RunOutcome, stopped_outcome
from subagent.model.provider import ModelError, Provider
from subagent.spec import McpServerSpec, RunSpec
from subagent.steering import SteeringQueue, read_steering
from subagent.stop import StopControl, import_abortably, imported_whole
from subagent.stopmark import SIGNALLED, read_marker
from subagent.tools.background import BackgroundCommands
from subagent.tools.toolbox import ToolBox

__all__ = ["run", "SetupFailure"]

logger = logging.getLogger(__name__)


class SetupFailure(Exception):
    def __init__(self, exit_code: ExitCode, code: str, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.code = code
        self.message = message


OPENAI_PROVIDER_MODULE = "subagent.model.openai_provider"  # its import brings in openai


class _StoppedInSetup(Exception):
    """The stop came while the run was being set up, before it had a provider."""


async def _make_provider(spec: RunSpec, stop: StopControl) -> Provider:
    """The run's model. ``openai`` is imported (1.2 s in a cold runner) in a worker thread a
    stop abandons (``import_abortably``): on the loop, it held the stop until it was done.

    Raises:
        _StoppedInSetup: the stop came first.
    """
    m = spec.model
    if m.provider == "scripted":
        from subagent.model.script import Script, ScriptError
        from subagent.model.scripted import ScriptedProvider

        try:
            if m.script is not None:
                return ScriptedProvider(Script.from_dict(dict(m.script)))
            if m.script_path is not None:
                return ScriptedProvider(Script.load(m.script_path))
        except ScriptError as exc:
            raise SetupFailure(ExitCode.BAD_SPEC, "bad_spec", f"error: bad model script: {exc}") from None
        return ScriptedProvider()
    if not await import_abortably(OPENAI_PROVIDER_MODULE, stop.abortable):
        raise _StoppedInSetup()
    from subagent.model.openai_provider import OpenAIProvider

    try:
        return OpenAIProvider(model=m.name, base_url=m.base_url, request_timeout_s=m.request_timeout_s)
    except ModelError as exc:
        raise SetupFailure(ExitCode.MODEL_ERROR, exc.kind, f"error: {exc.message}") from None


BROWSER_SWEEP_TIMEOUT_S = 10.0  # bounds the last sweep of a run's browser, after its server closed (s)


async def _end_browser(base: Path, profile: str | None = None) -> None:
    # Chromium's helpers lose the env marker and live in their own session: the preset
    # finds them by profile path. Runs after the browser server's own close.
    from subagent.tools import browser

    with trio.CancelScope(shield=True):
        with trio.move_on_after(BROWSER_SWEEP_TIMEOUT_S):
            left = await browser.end_browser_processes(base, profile_dir=profile)
            if left:
                logger.warning("browser processes still alive after the sweep: %s", left)
            await trio.to_thread.run_sync(browser.release_browser_dir, base, abandon_on_cancel=True)


def _server_specs(
    spec: RunSpec, run_dir: Path | None, stack: AsyncExitStack, sandbox: dict[str, Any] | None = None
) -> dict[str, McpServerSpec]:
    servers = dict(spec.mcp_servers)
    if spec.browser is not False:
        try:
            from subagent.tools import browser
        except ImportError as exc:
            raise SetupFailure(
                ExitCode.TOOL_SETUP, "tool_setup", f"error: the browser preset is not available: {exc}"
            ) from None
        options = {} if spec.browser is True else dict(spec.browser)
        base = run_dir or Path.cwd()
        # A session's turn keeps the session's profile; any other run gets a throwaway one.
        profile = spec.session.browser_profile
        # Pushed before the server starts, so it runs after the server is closed.
        stack.push_async_callback(_end_browser, base, profile)
        try:
            from subagent.sandbox import browser_sandbox

            entry = browser.browser_server_config(base, options, sandbox=browser_sandbox(sandbox), profile_dir=profile)
            servers["browser"] = McpServerSpec.from_dict(entry, "browser")
        except Exception as exc:  # BrowserSetupError, a SpecError in its entry: a setup failure
            raise SetupFailure(ExitCode.TOOL_SETUP, "tool_setup", f"error: browser setup failed: {exc}") from None
    return servers


async def _start_servers(
    specs: dict[str, McpServerSpec], stack: AsyncExitStack, run_dir: Path | None, stop: StopControl, emitter: Emitter
) -> dict[str, Any]:
    if not specs:
        return {}
    from subagent.tools.mcp_spawn import import_mcp_tools, prespawn

    # Spawn every server first, then pay for importing mcp while they boot. Their groups
    # are ended side by side at the run's end (after the SDK's own close of each started
    # one): one after another, servers that ignore SIGTERM took a kill grace each, and a
    # stop during setup outlasted the daemon's grace.
    ends: list[Callable[[], Awaitable[None]]] = []

    async def end_all() -> None:
        async with trio.open_nursery() as nursery:
            for end in ends:
                nursery.start_soon(end)

    stack.push_async_callback(end_all)
    spawned = []
    for name, s in specs.items():
        if stop.requested:
            # No server is started once the stop came (before the setup, or while the
            # servers before this one were spawned): it would start after the stop.
            break

        def on_group(pgid: int, alive: bool, name: str = name) -> None:
            emitter.emit(EventKind.PROCESS_GROUP, pgid=pgid, pid=pgid, kind="mcp_server", name=name, alive=alive)

        spawned.append(await prespawn(name, s, stack, run_dir=run_dir, on_group=on_group, ends=ends))
    if stop.requested or not await import_mcp_tools(stop.abortable):
        # Nor is mcp imported for nothing, nor waited for (a cold runner's import takes
        # most of a second or more): the servers spawned are ended at once, as below.
        for p in spawned:
            _kill_group_now(p.process)
        return {}
    from subagent.tools.mcp_tools import McpSetupError, start_server

    servers = {}
    for p in spawned:
        if stop.requested:
            break
        try:
            servers[p.name] = await start_server(p, specs[p.name], stack, abortable=stop.abortable)
        except McpSetupError as exc:
            if stop.requested:
                break  # the stop aborted the startup: not a setup failure
            code = ExitCode.TOOL_PROTOCOL if exc.protocol else ExitCode.TOOL_SETUP
            raise SetupFailure(code, "tool_protocol" if exc.protocol else "tool_setup", f"error: {exc}") from None
    if stop.requested:
        # A stop during setup: no server has run a tool yet, and none is waited for (one
        # that ignores SIGTERM cost the SDK's close and a kill grace each).
        for p in spawned:
            _kill_group_now(p.process)
    return servers


def _kill_group_now(process: Any) -> None:
    """SIGKILL a server's group, its leader not reaped yet (so the group id is still its)."""
    if process is None or process.returncode is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _watch_signals(signals: Any, stop: StopControl, emitter: Emitter) -> None:
    # SIGTERM is idempotent (the daemon's path A and path B both send one). SIGINT: the
    # first is a stop like SIGTERM, a repeat also interrupts the running tool (ctrl-C twice).
    async for signum in signals:
        if signum == signal.SIGINT and stop.requested:
            if stop.interrupt_tool():
                emitter.log("warning", "a repeated SIGINT interrupts the running tool")
        else:
            stop.request("signal")


def _note_sigterm_at_once(stop: StopControl) -> None:
    """Wrap trio's SIGTERM handler (installed by ``open_signal_receiver``, which puts the
    one it replaced back at its end) so that the handler also notes the stop at once: the
    signal task that requests it may run only after the loop has started a step or a tool.
    SIGINT is left to that task alone (a repeat is told from the first there)."""
    wake = signal.getsignal(signal.SIGTERM)
    if not callable(wake):
        return

    def handler(signum: int, frame: Any) -> None:
        stop.note_signal()
        wake(signum, frame)

    signal.signal(signal.SIGTERM, handler)


def _signal_sender(reason: str, marker: int | None, stop: StopControl) -> str:
    """The reason a stop asked as ``reason`` is applied with: a signal (``"signal"``) is
    the daemon's stop if its stop marker holds the stop's reason (noted as
    ``stop.stop_reason``), else ``"signalled"``: no stop of the daemon's sent it. Read after
    the signal came: the daemon writes the marker before it signals. Without a marker (a
    runner started by hand) a signal is a stop, as it always was."""
    if reason != "signal" or marker is None:
        return reason
    why = read_marker(marker)
    if why is None:
        return SIGNALLED
    stop.stop_reason = why
    return reason


async def _deadline(seconds: float, stop: StopControl) -> None:
    await trio.sleep(seconds)
    stop.request("timeout")


def _imported() -> dict[str, bool]:
    return {"openai": imported_whole("openai"), "mcp": imported_whole("mcp")}  # (not an abandoned import)


async def run(
    spec: RunSpec,
    emitter: Emitter,
    *,
    run_dir: Path | None,
    stdin_leftover: bytes | None = None,
    early_stop: Callable[[], bool] = lambda: False,
    sandbox: dict[str, Any] | None = None,
    answers_fd: int | None = None,
    stop_marker: int | None = None,
) -> int:
    """Run one spec to its end; write the result; return the exit code.

    ``stdin_leftover`` (bytes read past the spec) turns on the steering reader on stdin;
    ``early_stop()``: whether a SIGTERM came before trio's signal receiver took over;
    ``sandbox``: the report of ``subagent.sandbox.enter`` (in ``runner_started`` and the result);
    ``answers_fd``: the approval answer channel (``subagent.approvals.open_channel``);
    ``stop_marker``: the run's stop marker (``subagent.stopmark.open_marker``): a signal
    is the daemon's stop only if it holds the stop's reason; without one (a runner started
    by hand), every SIGTERM is a stop.
    """
    run_id = spec.run_id or os.environ.get("AGENTD_RUN_ID")
    if run_id:
        # A warm runner was started before its run had an id: pass it on to every child.
        os.environ["AGENTD_RUN_ID"] = run_id
    emitter.run_id = run_id

    # The daemon's reason for its stop is read from the marker when its signal is applied
    # (``stop.stop_reason``).
    def resolve(reason: str) -> str:
        return _signal_sender(reason, stop_marker, stop)

    def on_first_stop(reason: str, during: str) -> None:
        extra: dict[str, Any] = {"tool": stop.running_tool} if during == "tool" and stop.running_tool else {}
        if stop.stop_reason is not None:
            extra["stop_reason"] = stop.stop_reason
        emitter.emit(EventKind.STOP_REQUESTED, reason=reason, during=during, **extra)

    stop = StopControl(on_first_stop=on_first_stop, resolve=resolve)
    loop: AgentLoop | None = None
    # The outcome was decided before any stop reached the runner (its own failure, not
    # the stop's doing: the daemon does not take it for a cancel, ``failed_before_stop``).
    before_stop = False
    outcome = RunOutcome(RunStatus.FAILED, ExitCode.INTERNAL, reason="internal")
    steering = SteeringQueue(emit=lambda **kw: emitter.emit(EventKind.STEERING, **kw))
    background: BackgroundCommands | None = None
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            _note_sigterm_at_once(stop)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, stop, emitter)
                channel = AnswerChannel(answers_fd, warn=lambda msg: emitter.log("warning", msg))
                await nursery.start(channel.run)
                if spec.limits.deadline_s is not None:
                    nursery.start_soon(_deadline, spec.limits.deadline_s, stop)
                if stdin_leftover is not None:
                    nursery.start_soon(
                        read_steering,
                        stdin_leftover,
                        steering,
                        lambda: loop.steps if loop is not None else 0,
                        lambda msg: emitter.log("warning", msg),
                    )
                emitter.emit(
                    EventKind.RUNNER_STARTED,
                    pid=os.getpid(),
                    pgid=os.getpgid(0),
                    run_id=run_id,
                    session_id=spec.session_id,
                    provider=spec.model.provider,
                    sandbox=sandbox,
                )
                if early_stop():
                    stop.request("signal")
                async with AsyncExitStack() as stack:
                    try:
                        stop.phase = "setup"
                        provider = await _make_provider(spec, stop)
                        stack.push_async_callback(provider.aclose)
                        servers = await _start_servers(
                            _server_specs(spec, run_dir, stack, sandbox), stack, run_dir, stop, emitter
                        )
                        if "browser" in servers:  # resumed if stopped, a session's closed: before its server
                            from subagent.session_browser import before_the_close

                            base, profile = run_dir or Path.cwd(), spec.session.browser_profile
                            before_the_close(servers["browser"], base, profile, stack, nursery, stop, emitter)
                        stop.phase = "idle"

                        def on_group(pgid: int, alive: bool, kind: str, name: str, on_stop: str | None) -> None:
                            # on_stop tells the daemon's path A whether it may SIGTERM this group.
                            extra = {} if on_stop is None else {"on_stop": on_stop}
                            emitter.emit(
                                EventKind.PROCESS_GROUP, pgid=pgid, pid=pgid, kind=kind, name=name, alive=alive, **extra
                            )

                        if "run_command" in spec.builtin_tools:
                            bg_policy = spec.stop_policy.run_command
                            background = BackgroundCommands(
                                run_dir,
                                lambda pgid, alive, name: on_group(
                                    pgid, alive, "command", f"[background] {name}", bg_policy
                                ),
                                spec.limits.max_output_bytes,
                            )
                            await nursery.start(background.run)
                            bg = background
                            # After a stop that interrupts commands, they get its command grace.
                            grace = spec.stop_policy.command_grace_s if bg_policy == StopPolicy.INTERRUPT else None
                            stack.push_async_callback(lambda: bg.aclose(grace if stop.requested else None))
                        tools = ToolBox(
                            builtins=spec.builtin_tools,
                            limits=spec.limits,
                            servers=servers,
                            on_group=on_group,
                            background=background,
                            stop_policy=spec.stop_policy,
                            preset_servers=frozenset({"browser"}) if spec.browser is not False else frozenset(),
                        )
                        gate = ApprovalGate(spec.approval, channel, resolve=tools.where) if spec.approval.any else None
                        loop = AgentLoop(
                            spec=spec,
                            provider=provider,
                            tools=tools,
                            stop=stop,
                            emitter=emitter,
                            run_id=run_id,
                            steering=steering,
                            approvals=gate,
                        )
                        outcome = await loop.run()
                        before_stop = not stop.asked
                    except _StoppedInSetup:
                        outcome = stopped_outcome(stop.reason)
                    except SetupFailure as exc:
                        before_stop = not stop.asked
                        emitter.log("error", exc.message, code=exc.code)
                        outcome = RunOutcome(
                            RunStatus.FAILED,
                            exc.exit_code,
                            reason=exc.code,
                            error={"code": exc.code, "message": exc.message},
                        )
                nursery.cancel_scope.cancel(reason="run finished")
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))
        emitter.log(
            "error",
            f"error: internal error in the runner: {type(exc).__name__}: {exc}",
            code="internal",
            traceback=text,
        )
        outcome = RunOutcome(
            RunStatus.FAILED,
            ExitCode.INTERNAL,
            reason="internal",
            error={"code": "internal", "message": f"{type(exc).__name__}: {exc}"},
        )
    if loop is not None and background is not None:
        # Its background commands were ended with the run (its exit stack): a call whose
        # command still ran then, or when the stop came, says it no longer runs.
        loop.settle_background(background.ends())
    if loop is None and stop.requested and outcome.exit_code != ExitCode.INTERNAL:
        outcome = stopped_outcome(stop.reason)
    extra: dict[str, Any] = {
        "run_id": run_id,
        "session_id": spec.session_id,
        "provider": spec.model.provider,
        "imported": _imported(),
    }
    extra["sandbox"] = sandbox
    if stop.stop_reason is not None and outcome.reason == "signal":
        extra["stop_reason"] = stop.stop_reason  # whose stop it was: the daemon's, and why
    extra["unapplied_steering"] = steering.unapplied(loop.steps if loop is not None else 0)
    if before_stop and outcome.status == RunStatus.FAILED:
        extra["failed_before_stop"] = True
    result = (
        loop.result(outcome, **extra)
        if loop is not None
        else bare_result(str(outcome.status), outcome.reason, outcome.error, extra)
    )
    emitter.result(result)
    return int(outcome.exit_code)
