"""``python -m subagent.runner [--warm]``: one sub-agent run, from spec on stdin to result.

This module is the entry only: early signal handling, stderr guards, reading and
validating the spec, the exit code. ``subagent.run`` does the run.
Invariants: SIGTERM only sets the stop flag (whose stop it was is read in the run's stop
marker, ``subagent.stopmark``, opened here before the sandbox), however often it comes (a handler is
installed before anything slow; trio's receiver takes over during the run), except while
``--warm`` waits for its spec, when a signal ends the process at once; the stderr guards
are installed before any non-stdlib import, so even an import error reaches stderr as a
JSON ``log`` event and exits ``INTERNAL``; every path ends with one result on stdout (and
in its result file beside ``$AGENTD_RUN_DIR``). Imports follow the spec: a scripted run without MCP
servers imports neither ``openai`` nor ``mcp``.
"""

from __future__ import annotations

import signal

_early_signals: list[int] = []
_waiting_for_spec = False


class _StoppedBeforeSpec(BaseException):
    pass


def _early_handler(signum: int, frame: object) -> None:
    _early_signals.append(signum)
    if _waiting_for_spec:
        raise _StoppedBeforeSpec()


if __name__ == "__main__":  # before anything slow: a SIGTERM now must not kill us raw
    signal.signal(signal.SIGTERM, _early_handler)
    signal.signal(signal.SIGINT, _early_handler)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, NoReturn  # noqa: E402

from subagent.emit import Emitter, bare_result, install_stderr_guards, open_records, set_log_levels  # noqa: E402
from subagent.events import ExitCode, RunStatus  # noqa: E402
from subagent.spec import SpecError, parse_spec_text  # noqa: E402
from subagent.stopmark import SIGNALLED, SIGNALLED_MESSAGE, open_marker, read_marker  # noqa: E402

if TYPE_CHECKING:
    from subagent.sandbox import Ahead

__all__ = ["main", "preload", "read_spec_text", "rehearse", "start"]


def read_spec_text(fd: int = 0) -> tuple[str, bytes]:
    """The spec, and the bytes read past it (steering lines, see ``subagent.steering``).

    The spec is the first line if that is a whole JSON document, else all of stdin until
    EOF. Unbuffered reads, so nothing after the spec line is swallowed by a buffer.
    """
    buf = b""
    while b"\n" not in buf:
        data = os.read(fd, 65536)
        if not data:
            return buf.decode("utf-8", errors="replace"), b""
        buf += data
    first, _, rest = buf.partition(b"\n")
    text = first.decode("utf-8", errors="replace")
    if text.strip():
        try:
            json.loads(text)
            return text, rest
        except ValueError:
            pass
    while data := os.read(fd, 65536):
        rest += data
    return (first + b"\n" + rest).decode("utf-8", errors="replace"), b""


@functools.lru_cache(maxsize=1)
def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m subagent.runner", description="Run one sub-agent from a JSON spec on stdin."
    )
    ap.add_argument("--warm", action="store_true", help="import openai and mcp first, then wait for the spec")
    return ap


def preload() -> None:
    """Import everything a run may need: trio, openai, mcp and the runner's own modules.

    What ``--warm`` does before it waits, and what the zygote (``subagent.zygote``) has
    done before it forks a runner.
    """
    import mcp.client.stdio  # noqa: F401
    import openai  # noqa: F401
    import trio  # noqa: F401

    import subagent.model.openai_provider  # noqa: F401
    import subagent.model.script  # noqa: F401
    import subagent.model.scripted  # noqa: F401
    import subagent.run  # noqa: F401
    import subagent.tools.background  # noqa: F401
    import subagent.tools.browser  # noqa: F401
    import subagent.tools.commands  # noqa: F401
    import subagent.tools.mcp_spawn  # noqa: F401
    import subagent.tools.mcp_tools  # noqa: F401

    _arg_parser()  # built once: a forked runner finds it ready
    set_log_levels()  # set once: a forked runner does not clear every logger's cache again


_warm_imports = preload  # the earlier private name

# What a spare parses while it waits (``rehearse``): a spec of the common shape.
_REHEARSAL_SPEC = json.dumps(
    {
        "task": "rehearsal",
        "run_id": "r-rehearsal",
        "model": {"provider": "scripted", "script": {"turns": [{"text": "t", "tool_calls": []}], "final": "f"}},
        "limits": {"max_steps": 10, "command_timeout_s": 60},
        "sandbox": {"read": ["/"], "write": []},
    }
)


def rehearse() -> None:
    """A spare's rehearsal of a run's first steps while it waits for its run (the zygote's
    ``_park``): its arguments parsed, a spec parsed, events encoded, then a Trio run
    that opens what a run opens first (its signal receiver, a nursery, a task started, a
    stream read to its end), writing nothing anywhere. The pages these write (reference
    counts, caches of objects it shares with the zygote) are then its own before a run
    needs them: fewer copy-on-write faults between its assignment and its first step.

    A SIGTERM or SIGINT that comes meanwhile is delivered again when the receiver closes
    (Trio's redelivery), to the handler the spare had: it ends the spare, as it would have.
    No thread is started, no descriptor is left open."""
    from subagent.events import EventKind, encode_event, make_event
    from subagent.osedge import run_trio

    _arg_parser().parse_args([])
    spec = parse_spec_text(_REHEARSAL_SPEC)
    for kind, data in (
        (EventKind.RUNNER_STARTED, {"pid": 1, "pgid": 1, "run_id": spec.run_id, "session_id": None}),
        (EventKind.STEP_STARTED, {"step": 1}),
        (EventKind.LOG, {"level": "info", "message": "rehearsal"}),
    ):
        encode_event(make_event(kind, **data))
    run_trio(_rehearse_in_trio)


async def _rehearse_in_trio() -> None:
    import trio

    async def read_to_eof(stream: trio.lowlevel.FdStream, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        async with stream:
            while await stream.receive_some(4096):
                pass

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT):
        async with trio.open_nursery() as nursery:
            r, w = os.pipe()
            os.close(w)
            await nursery.start(read_to_eof, trio.lowlevel.FdStream(r))  # the stream closes r


def _prepare_outside(spec: Any, run_dir: Path | None) -> None:
    """What the run needs made outside its grants, before its sandbox closes them."""
    if "run_command" in spec.builtin_tools:
        from subagent import callgroups

        callgroups.open_pool()  # its commands' cgroups, in cgroupfs (see callgroups)
    _prepare_browser(spec, run_dir)


def _prepare_browser(spec: object, run_dir: Path | None) -> None:
    # The browser's dirs and its short temp link (in /tmp) are made before the sandbox
    # closes /tmp; the preset finds them made.
    if getattr(spec, "browser", False) is not False and run_dir is not None:
        from subagent.tools import browser

        try:
            browser.browser_tmpdir(run_dir, create=True)
        except browser.BrowserSetupError:
            pass  # the preset reports it when it starts


def _internal(emitter: Emitter, exc: BaseException) -> int:
    text = "".join(traceback.format_exception(exc))
    message = f"error: internal error in the runner: {type(exc).__name__}: {exc}"
    emitter.log("error", message, code="internal", traceback=text)
    emitter.result(bare_result(str(RunStatus.FAILED), "internal", {"code": "internal", "message": message}))
    return int(ExitCode.INTERNAL)


def main(
    argv: list[str] | None = None,
    *,
    gate: Callable[[], None] | None = None,
    ahead: Ahead | None = None,
    answers: Callable[[], int | None] | None = None,
    records: Callable[[], tuple[int, int] | None] | None = None,
    marker: Callable[[], int | None] | None = None,
) -> int:
    """The whole runner process; returns its exit code (``events.ExitCode``).

    ``gate`` (a spare the zygote forked ahead, ``subagent.zygote``): called once the spec
    is read, the sandbox entered and Trio's loop started, before anything of the run
    happens (a task, an event, a step, a tool); it returns when the run may start (its
    start is journaled) and ends the process otherwise. ``ahead``: the half of the sandbox it made before it had a run
    (``sandbox.prepare_ahead``); ``answers``: its approvals channel, opened then (it may be
    hidden since, under a private /tmp); ``records``: its events and result files, opened
    then as well (``emit.open_records``); ``marker``: its stop marker, opened then too
    (``stopmark.open_marker``).
    """
    global _waiting_for_spec
    gate = _once(gate)
    run_dir_env = os.environ.get("AGENTD_RUN_DIR")
    run_dir = Path(run_dir_env) if run_dir_env else None
    # Its events and result files, opened now: its sandbox closes the way to them.
    emitter = Emitter(run_dir, records=records() if records is not None else open_records(run_dir))
    # Its stop marker too: whether a SIGTERM was the daemon's stop (``subagent.stopmark``).
    marker_fd = marker() if marker is not None else open_marker(run_dir)
    install_stderr_guards(emitter)  # first: even a usage error must reach stderr as JSON
    args = _arg_parser().parse_args(argv)
    # stdout carries the result alone (written with os.write): a library's print goes to the log.
    sys.stdout = sys.stderr
    try:
        if args.warm:
            preload()
            emitter.log("info", "warm: waiting for the spec on stdin", warm=True)
        try:
            _waiting_for_spec = True
            if _early_signals:
                raise _StoppedBeforeSpec()
            text, leftover = read_spec_text()
            _waiting_for_spec = False
        except _StoppedBeforeSpec:
            gate()
            emitter.log("info", "stopped before a spec arrived")
            why = read_marker(marker_fd) if marker_fd is not None else None
            if marker_fd is not None and why is None:  # no stop of the daemon's sent it
                error = {"code": SIGNALLED, "message": SIGNALLED_MESSAGE}
                emitter.result(bare_result(str(RunStatus.FAILED), SIGNALLED, error))
                return int(ExitCode.SIGNALLED)
            extra = {"stop_reason": why} if why is not None else None
            emitter.result(bare_result(str(RunStatus.CANCELLED), "signal", None, extra))
            return int(ExitCode.CANCELLED)
        try:
            spec = parse_spec_text(text)
        except SpecError as exc:
            gate()
            message = f"error: bad run spec: {exc}"
            emitter.log("error", message, code="bad_spec", field=exc.field)
            error = {"code": "bad_spec", "message": message, "field": exc.field}
            emitter.result(bare_result(str(RunStatus.FAILED), "bad_spec", error))
            return int(ExitCode.BAD_SPEC)
        from subagent import sandbox
        from subagent.approvals import open_channel

        # Before the sandbox: the answer channel lives where the run's tools cannot reach.
        answers_fd = (answers or open_channel)()
        try:
            # Before trio (and so before any thread), any tool or any model request.
            report = sandbox.enter(spec, run_dir, prepare=lambda: _prepare_outside(spec, run_dir), ahead=ahead)
        except sandbox.SandboxError as exc:
            gate()
            message = f"error: {exc}"
            emitter.log("error", message, code="sandbox")
            emitter.result(bare_result(str(RunStatus.FAILED), "sandbox", {"code": "sandbox", "message": message}))
            return int(ExitCode.TOOL_SETUP)
        from subagent.osedge import run_trio
        from subagent.run import run

        async def gated() -> int:
            # Trio's loop is up while a spare waits for its `go` (its start is being
            # journaled): no task, event, thread or tool of the run exists yet.
            gate()
            return await run(
                spec,
                emitter,
                run_dir=run_dir,
                stdin_leftover=leftover,
                early_stop=lambda: bool(_early_signals),
                sandbox=report.to_dict(),
                answers_fd=answers_fd,
                stop_marker=marker_fd,
            )

        return run_trio(gated)
    except Exception as exc:  # the task root: anything here is a runner bug
        gate()
        return _internal(emitter, exc)


def _once(gate: Callable[[], None] | None) -> Callable[[], None]:
    """``gate``, passed at most once (every path to a step or a result goes through it)."""
    passed = gate is None

    def through() -> None:
        nonlocal passed
        if not passed:
            passed = True
            assert gate is not None
            gate()

    return through


def start(
    argv: list[str] | None = None,
    *,
    gate: Callable[[], None] | None = None,
    ahead: Ahead | None = None,
    answers: Callable[[], int | None] | None = None,
    records: Callable[[], tuple[int, int] | None] | None = None,
    marker: Callable[[], int | None] | None = None,
) -> NoReturn:
    """Become a runner and run to the end: the one entry of every runner process.

    Both ways a runner process comes to be end here, and only here: ``python -m
    subagent.runner`` (a cold start), and a child the zygote forked once it has made the
    process what a cold start is (session, cgroup, marker, pipes, environment, working
    directory: ``subagent.zygote``). What every runner must do first, whichever way it
    was born (the SIGTERM handler that only sets the stop flag; a sandbox), goes here.
    ``gate``, ``ahead``, ``answers``, ``records``, ``marker``: see ``main``.
    """
    signal.signal(signal.SIGTERM, _early_handler)
    signal.signal(signal.SIGINT, _early_handler)
    code = main(argv, gate=gate, ahead=ahead, answers=answers, records=records, marker=marker)
    sys.stderr.flush()  # a partial line a library left in the log wrapper becomes an event
    # Everything is closed and the result is written (unbuffered, os.write): skip the
    # interpreter's teardown of openai/mcp modules, which costs a noticeable part of a
    # second after a stop.
    os._exit(code)


if __name__ == "__main__":
    start()
