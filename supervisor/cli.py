"""The ``agentd`` command line: a thin shell over the control client and the daemon.

The only module that prints or picks exit codes. Its import path stays light: a command
that talks to a running daemon imports click, the stdlib client and nothing else (no
trio, no openai, no mcp); ``serve`` imports the daemon when it runs. Every expected
failure prints one line ``error: ...`` and exits with its own code (``ExitCode``);
``--json`` turns every command's output into JSON (one object per line for streams).
Leaving ``watch`` (Ctrl-C, a dropped connection) never stops a run: only ``cancel`` does.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from supervisor.errors import (
    AgentdError,
    ConfigError,
    ControlProtocolError,
    DaemonAlreadyRunning,
    DaemonNotRunning,
    RunNotFound,
    SpawnError,
)

if TYPE_CHECKING:
    from supervisor.client import Client

__all__ = ["main", "cli", "ExitCode", "build_spec"]


class ExitCode(enum.IntEnum):
    OK = 0  # also: the run completed (spawn --wait, watch)
    RUN_FAILED = 1  # the run failed
    USAGE = 2  # bad option or argument, unreadable or invalid file, bad config
    NO_DAEMON = 3  # no daemon answers for this state dir
    NOT_FOUND = 4  # no such run
    REFUSED = 5  # the daemon refused the request: bad spec, bad token, its own error
    DISCONNECTED = 6  # the connection dropped and could not be resumed
    RUN_CANCELLED = 7  # the run was cancelled (by a user or a timeout)
    RUN_LOST = 8  # the daemon restarted and found the run's process gone
    ALREADY_RUNNING = 9  # serve: another daemon holds this state dir
    INTERRUPTED = 130  # Ctrl-C: the CLI stopped watching; the run goes on


OUTCOME_EXIT = {
    "completed": ExitCode.OK,
    "failed": ExitCode.RUN_FAILED,
    "cancelled": ExitCode.RUN_CANCELLED,
    "lost": ExitCode.RUN_LOST,
}

# A follow with after_seq past any real event: no replay, only the terminal state.
_ONLY_THE_END = 2**62


class CliError(click.ClickException):
    """An expected failure: one line on stderr, a distinct exit code, no traceback."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _translate(exc: AgentdError) -> CliError:
    from supervisor.client import ConnectionLost

    if isinstance(exc, DaemonNotRunning):
        return CliError(str(exc), ExitCode.NO_DAEMON)
    if isinstance(exc, DaemonAlreadyRunning):
        return CliError(str(exc), ExitCode.ALREADY_RUNNING)
    if isinstance(exc, RunNotFound):
        return CliError(str(exc), ExitCode.NOT_FOUND)
    if isinstance(exc, SpawnError):
        return CliError(f"the daemon refused the spec: {exc}", ExitCode.REFUSED)
    if isinstance(exc, ConnectionLost):
        return CliError(str(exc), ExitCode.DISCONNECTED)
    if isinstance(exc, ConfigError):
        return CliError(str(exc), ExitCode.USAGE)
    if isinstance(exc, ControlProtocolError):
        return CliError(f"{exc} ({exc.code})", ExitCode.REFUSED)
    return CliError(str(exc), ExitCode.REFUSED)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AgentdError as exc:
            raise _translate(exc) from None
        except KeyboardInterrupt:
            raise CliError("interrupted (runs go on; stop one with `agentd cancel RUN`)", ExitCode.INTERRUPTED) from None
        except BrokenPipeError:
            # `agentd logs RUN | head`: the reader left; not an error worth a traceback.
            # Point stdout at devnull so the interpreter's final flush does not fail too.
            import os

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise SystemExit(0) from None


@dataclass
class Obj:
    state_dir: Path | None
    as_json: bool
    _client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            from supervisor.client import Client

            self._client = Client(state_dir=self.state_dir)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def emit(self, obj: Any, human: Callable[[], None]) -> None:
        if self.as_json:
            click.echo(json.dumps(obj, default=str))
        else:
            human()


pass_obj = click.make_pass_decorator(Obj)


_EPILOG = """\b
Exit codes: 0 ok (run completed), 1 run failed, 2 usage or bad file,
3 no daemon, 4 no such run, 5 refused by the daemon, 6 connection lost,
7 run cancelled, 8 run lost, 9 daemon already running, 130 interrupted.
Leaving `watch` or `spawn --wait` never stops a run: `cancel` does."""


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EPILOG)
@click.option(
    "--state-dir",
    envvar="AGENTD_STATE_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="The daemon's state dir (token, endpoint, journal). Env: AGENTD_STATE_DIR.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (JSON; one object per line for streams).")
@click.version_option(package_name="agentd", prog_name="agentd")
@click.pass_context
def cli(ctx: click.Context, state_dir: Path | None, as_json: bool) -> None:
    """agentd: run AI sub-agents as supervised processes, and stop them for real."""
    obj = Obj(state_dir, as_json)
    ctx.obj = obj
    ctx.call_on_close(obj.close)


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="agentd")


# ----------------------------------------------------------------------------- serve


@cli.command()
@click.option("--host", help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to bind (default 0: any free port, published in the state dir).")
@click.option("--grace", "grace_s", type=float, help="Seconds between SIGTERM and SIGKILL of a run's tree.")
@click.option("--max-concurrent", type=int, help="Runs allowed at once; more wait in a queue.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), help="TOML config file.")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@pass_obj
def serve(
    obj: Obj,
    host: str | None,
    port: int | None,
    grace_s: float | None,
    max_concurrent: int | None,
    config_file: Path | None,
    log_level: str,
) -> None:
    """Run the daemon in the foreground until SIGTERM or Ctrl-C."""
    import logging

    from supervisor.config import Config

    config = Config.load(
        state_dir=obj.state_dir,
        config_file=config_file,
        host=host,
        port=port,
        grace_s=grace_s,
        max_concurrent=max_concurrent,
    )
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    import trio

    from supervisor.daemon import serve as serve_daemon

    try:
        trio.run(serve_daemon, config)
    except KeyboardInterrupt:
        click.get_current_context().exit(ExitCode.INTERRUPTED)
    except BaseExceptionGroup as group:
        # An expected failure raised inside the daemon's nurseries arrives wrapped.
        expected, rest = group.split(AgentdError)
        if expected is None or rest is not None:
            raise
        first: BaseException = expected
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


# ----------------------------------------------------------------------------- spawn


def _read_json_file(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}", ExitCode.USAGE) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CliError(f"{what} {str(path)!r} is not valid json: {exc}", ExitCode.USAGE) from None


def build_spec(
    task: str | None,
    *,
    spec_file: Path | None = None,
    model: str | None = None,
    provider: str | None = None,
    script: Path | None = None,
    mcp_config: Path | None = None,
    browser: bool = False,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """The run spec (``subagent.spec`` shape) from a spec file and command-line options.

    Options override the file. Paths become absolute: the runner's cwd is its run dir.

    Raises:
        CliError: an unreadable or invalid file, or no task anywhere.
    """
    spec: dict[str, Any] = {}
    if spec_file is not None:
        loaded = _read_json_file(spec_file, "spec file")
        if not isinstance(loaded, dict):
            raise CliError(f"spec file {str(spec_file)!r}: expected a json object, got {type(loaded).__name__}", ExitCode.USAGE)
        spec = loaded
    if task is not None:
        spec["task"] = task
    if not isinstance(spec.get("task"), str) or not spec["task"].strip():
        raise CliError("expected a TASK argument (or a spec file with a 'task')", ExitCode.USAGE)
    if model is not None or provider is not None or script is not None:
        m = spec.get("model")
        m = dict(m) if isinstance(m, dict) else {}
        if model is not None:
            m["name"] = model
        if script is not None:
            if not script.is_file():
                raise CliError(f"script file {str(script)!r} does not exist", ExitCode.USAGE)
            m["script_path"] = str(script.resolve())
            m.setdefault("provider", "scripted")
        if provider is not None:
            m["provider"] = provider
        spec["model"] = m
    if mcp_config is not None:
        cfg = _read_json_file(mcp_config, "mcp config")
        servers = cfg.get("mcpServers") if isinstance(cfg, dict) else None
        if not isinstance(servers, dict):
            raise CliError(
                f"mcp config {str(mcp_config)!r}: expected an object with an 'mcpServers' object", ExitCode.USAGE
            )
        merged = dict(spec.get("mcpServers") or {})
        merged.update(servers)
        spec["mcpServers"] = merged
    if browser:
        spec["browser"] = True
    if max_steps is not None:
        limits = spec.get("limits")
        limits = dict(limits) if isinstance(limits, dict) else {}
        limits["max_steps"] = max_steps
        spec["limits"] = limits
    return spec


@cli.command()
@click.argument("task", required=False)
@click.option("--model", help="Model name (e.g. gpt-4o-mini).")
@click.option("--provider", type=click.Choice(["openai", "scripted"]), help="Model provider.")
@click.option("--script", type=click.Path(dir_okay=False, path_type=Path), help="Script file for the scripted model.")
@click.option(
    "--mcp-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help='MCP servers file in the Claude Desktop shape: {"mcpServers": {...}}.',
)
@click.option("--browser", is_flag=True, help="Give the agent a browser (Playwright MCP).")
@click.option("--session", "session_id", help="Session (conversation) the run belongs to.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), help="Stop the run after this many seconds.")
@click.option("--max-steps", type=click.IntRange(min=1), help="Most model turns the run may take.")
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path), help="A whole run spec as JSON.")
@click.option("--wait", is_flag=True, help="Follow the run to its end; the exit code reflects the outcome.")
@pass_obj
def spawn(
    obj: Obj,
    task: str | None,
    model: str | None,
    provider: str | None,
    script: Path | None,
    mcp_config: Path | None,
    browser: bool,
    session_id: str | None,
    timeout_s: float | None,
    max_steps: int | None,
    spec_file: Path | None,
    wait: bool,
) -> None:
    """Start a sub-agent on TASK and print its run id."""
    spec = build_spec(
        task,
        spec_file=spec_file,
        model=model,
        provider=provider,
        script=script,
        mcp_config=mcp_config,
        browser=browser,
        max_steps=max_steps,
    )
    client = obj.client()
    result = client.spawn(spec, session_id=session_id, timeout_s=timeout_s)
    run_id = str(result["run_id"])
    obj.emit(result, lambda: click.echo(run_id))
    if wait:
        _follow_to_end(obj, run_id, after_seq=0)


# ----------------------------------------------------------------------------- watch, logs


def _short(text: Any, width: int = 100) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= width else s[: width - 1] + "…"


def format_event(event: dict[str, Any]) -> str:
    """One human progress line for an event."""
    kind = str(event.get("kind"))
    d = event.get("data") or {}
    if not isinstance(d, dict):
        d = {"value": d}
    if kind == "state":
        text = f"state: {d.get('state')}" + (f" ({d['reason']})" if d.get("reason") else "")
    elif kind == "runner_started":
        text = f"runner started (pid {d.get('pid')}, provider {d.get('provider')})"
    elif kind == "step_started":
        text = f"step {d.get('step')}"
    elif kind == "assistant_text":
        text = f"assistant: {_short(d.get('text', ''))}"
    elif kind == "tool_call":
        rec = d.get("record") if isinstance(d.get("record"), dict) else d
        detail = rec.get("error") or rec.get("reason")
        text = f"tool {rec.get('name')} {rec.get('state')}" + (f": {_short(detail, 80)}" if detail else "")
    elif kind == "process_group":
        alive = "" if d.get("alive", True) else " ended"
        text = f"process group {d.get('pgid')} ({d.get('kind')} {d.get('name')}){alive}"
    elif kind == "step_snapshot":
        text = f"snapshot after step {d.get('step')}: {_short(d.get('progress', ''), 80)}"
    elif kind == "stop_requested":
        text = f"stop requested ({d.get('reason')}, during {d.get('during')})"
    elif kind == "steering":
        text = f"steering {d.get('state')}: {_short(d.get('text', ''), 80)}"
    elif kind == "log":
        text = f"[{d.get('level', 'info')}] {_short(d.get('message', ''))}"
    else:
        text = f"{kind} {_short(json.dumps(d, default=str), 90)}"
    ts = event.get("ts")
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) else "--:--:--"
    return f"#{event.get('seq'):<4} {clock}  {text}"


def _follow_to_end(obj: Obj, run_id: str, *, after_seq: int) -> NoReturn:
    follow = obj.client().follow(run_id, after_seq=after_seq)
    reconnects = 0
    for event in follow:
        if follow.reconnects != reconnects:
            reconnects = follow.reconnects
            if not obj.as_json:
                click.echo(f"(connection to the daemon dropped; resumed after #{event['seq'] - 1})", err=True)
        obj.emit(event, lambda: click.echo(format_event(event)))
    state = follow.state or "unknown"
    end = {"end": True, "run_id": run_id, "state": state, "last_seq": follow.last_seq}
    obj.emit(end, lambda: click.echo(f"run {run_id} {state}"))
    click.get_current_context().exit(OUTCOME_EXIT.get(state, ExitCode.RUN_FAILED))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--after", "after_seq", type=click.IntRange(min=0), default=0, help="Start after this event number.")
@pass_obj
def watch(obj: Obj, run_id: str, after_seq: int) -> None:
    """Show a run's progress live until it ends (resumes after a dropped connection).

    The exit code is the run's outcome: 0 completed, 1 failed, 7 cancelled, 8 lost.
    """
    _follow_to_end(obj, run_id, after_seq=after_seq)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--after", "after_seq", type=click.IntRange(min=0), default=0, help="Start after this event number.")
@click.option("-f", "--follow", "follow", is_flag=True, help="Keep printing new events until the run ends.")
@pass_obj
def logs(obj: Obj, run_id: str, after_seq: int, follow: bool) -> None:
    """Print a run's events from the journal."""
    client = obj.client()
    last = after_seq
    for event in client.iter_events(run_id, after_seq=after_seq):
        last = event["seq"]
        obj.emit(event, lambda: click.echo(format_event(event)))
    if follow:
        _follow_to_end(obj, run_id, after_seq=last)


# ----------------------------------------------------------------------------- cancel


@cli.command()
@click.argument("run_id", metavar="RUN", required=False)
@click.option("--session", "session_id", help="Cancel the live run(s) of this session instead.")
@click.option("--reason", default="user", show_default=True, help="Recorded with the stop.")
@click.option("--no-wait", is_flag=True, help="Return once the stop is sent, without waiting for the end.")
@pass_obj
def cancel(obj: Obj, run_id: str | None, session_id: str | None, reason: str, no_wait: bool) -> None:
    """Stop a run: print whether it was active and, once reached, its terminal state."""
    if (run_id is None) == (session_id is None):
        raise CliError("expected a RUN or --session, not both and not neither", ExitCode.USAGE)
    client = obj.client()
    if session_id is not None:
        result = client.cancel_session(session_id, reason=reason)
        runs = [r for r in result.get("runs", []) if isinstance(r, dict)]
        targets = [str(r["run_id"]) for r in runs if r.get("was_active")]
    else:
        assert run_id is not None
        result = client.cancel(run_id, reason=reason)
        runs = [result]
        targets = [run_id] if result.get("was_active") else []
    final: dict[str, str] = {str(r["run_id"]): str(r.get("state")) for r in runs}
    if not no_wait:
        for rid in targets:
            follow = client.follow(rid, after_seq=_ONLY_THE_END)
            for _ in follow:
                pass
            final[rid] = follow.state or final[rid]
    out = {**result, "state": final.get(run_id, result.get("state"))} if run_id else {**result, "final": final}

    def human() -> None:
        for r in runs:
            rid = str(r["run_id"])
            if r.get("was_active"):
                ending = f"; {final[rid]}" if not no_wait else f" (state: {final[rid]})"
                click.echo(f"{rid}: stop sent (was active){ending}")
            else:
                click.echo(f"{rid}: was not active (state: {final[rid]})")
        if not runs:
            click.echo(f"session {session_id}: no live run")

    obj.emit(out, human)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("text")
@click.pass_obj
def steer(obj: Obj, run_id: str, text: str) -> None:
    """Give a running run extra input, applied at its next step (not a stop)."""
    result = obj.client().steer(run_id, text)

    def human() -> None:
        if result.get("accepted"):
            click.echo(f"{run_id}: queued for the next step")
        else:
            click.echo(f"{run_id}: not accepted ({result.get('why', 'not running')}; state: {result.get('state')})")

    obj.emit(result, human)
    if not result.get("accepted"):
        click.get_current_context().exit(ExitCode.REFUSED)


# ----------------------------------------------------------------------------- status, list


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    if time.time() - ts < 86400:
        return time.strftime("%H:%M:%S", time.localtime(ts))
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _run_id(row: dict[str, Any]) -> str:
    return str(row.get("run_id") or row.get("id") or "?")


def _task(row: dict[str, Any]) -> str:
    task = row.get("task")
    spec = row.get("spec")
    if task is None and isinstance(spec, dict):
        task = spec.get("task")
    return _short(task or "", 50)


def _table(rows: list[dict[str, Any]]) -> None:
    header = ("RUN", "STATE", "SESSION", "CREATED", "TASK")
    cells = [
        (_run_id(r), str(r.get("state", "?")), str(r.get("session_id") or "-"), _when(r.get("created_at")), _task(r))
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    for line in (header, *cells):
        click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _tool_summary(calls: Any) -> str:
    if not isinstance(calls, list) or not calls:
        return "none"
    counts: dict[str, int] = {}
    for c in calls:
        if isinstance(c, dict):
            key = f"{c.get('name')} {c.get('state')}"
            counts[key] = counts.get(key, 0) + 1
    parts = [f"{n}x {k}" if n > 1 else k for k, n in counts.items()]
    return f"{len(calls)}: " + _short(", ".join(parts), 120)


def _receipt_summary(receipt: Any) -> str | None:
    if not isinstance(receipt, dict):
        return None
    parts = []
    if receipt.get("cancel_reason"):
        parts.append(f"reason {receipt['cancel_reason']}")
    if isinstance(receipt.get("cancel_to_tree_dead_s"), (int, float)):
        parts.append(f"cancel to tree dead {receipt['cancel_to_tree_dead_s']:.2f} s")
    path_b = receipt.get("path_b") if isinstance(receipt.get("path_b"), dict) else {}
    if path_b.get("escalated"):
        parts.append("escalated to SIGKILL")
    survivors = path_b.get("survivors")
    if survivors:
        parts.append(f"{len(survivors)} survivor(s)")
    elif path_b:
        parts.append("no survivors")
    if receipt.get("exit_code") is not None:
        parts.append(f"exit code {receipt['exit_code']}")
    return ", ".join(parts) or _short(json.dumps(receipt, default=str), 120)


def _print_run(run: dict[str, Any]) -> None:
    """The facts a person asks about a run; ``--json`` has the whole record."""
    rows: list[tuple[str, str]] = [("run", _run_id(run))]
    state = str(run.get("state"))
    rows.append(("state", state + (f" ({run['reason']})" if run.get("reason") else "")))
    if run.get("session_id"):
        rows.append(("session", str(run["session_id"])))
    if _task(run):
        rows.append(("task", _task(run)))
    times = [f"{k.removesuffix('_at')} {_when(run.get(k))}" for k in ("created_at", "started_at", "ended_at") if run.get(k)]
    if isinstance(run.get("started_at"), (int, float)) and isinstance(run.get("ended_at"), (int, float)):
        times.append(f"took {run['ended_at'] - run['started_at']:.1f} s")
    if times:
        rows.append(("time", ", ".join(times)))
    if run.get("pid") is not None:
        rows.append(("process", f"pid {run.get('pid')}, pgid {run.get('pgid')}"))
    if run.get("containment"):
        rows.append(("containment", str(run["containment"])))
    result = run.get("result")
    if isinstance(result, dict):
        text = result.get("final_text") or result.get("progress") or ""
        rows.append(("result", f"{result.get('status')}" + (f": {_short(text, 100)}" if text else "")))
    if run.get("partial"):
        rows.append(("partial", "yes: the result is the last step snapshot"))
    if run.get("error"):
        rows.append(("error", _short(json.dumps(run["error"], default=str), 120)))
    rows.append(("tool calls", _tool_summary(run.get("tool_calls"))))
    receipt = _receipt_summary(run.get("receipt"))
    if receipt:
        rows.append(("teardown", receipt))
    if run.get("last_seq") is not None:
        rows.append(("events", f"{run['last_seq']} (agentd logs {_run_id(run)})"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k.ljust(width)}  {v}")


@cli.command()
@click.argument("run_id", metavar="RUN", required=False)
@pass_obj
def status(obj: Obj, run_id: str | None) -> None:
    """Show one run, or (without RUN) the daemon and its live runs."""
    client = obj.client()
    if run_id is not None:
        run = client.status(run_id)
        obj.emit(run, lambda: _print_run(run))
        return
    result = client.status()

    def human() -> None:
        d = result.get("daemon", {})
        click.echo(
            f"agentd {d.get('version', '?')} running: pid {d.get('pid')}, up {_duration(float(d.get('uptime_s', 0)))}, "
            f"{d.get('url')}, state dir {d.get('state_dir')}"
        )
        live = result.get("live_runs", [])
        if live:
            click.echo(f"{len(live)} live run{'s' if len(live) != 1 else ''}:")
            _table(live)
        else:
            click.echo("no live runs")

    obj.emit(result, human)


@cli.command(name="list")
@click.option(
    "--state",
    type=click.Choice(["queued", "starting", "running", "cancelling", "completed", "failed", "cancelled", "lost"]),
    help="Only runs in this state.",
)
@click.option("--session", "session_id", help="Only runs of this session.")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@pass_obj
def list_(obj: Obj, state: str | None, session_id: str | None, limit: int) -> None:
    """List recent runs, newest first."""
    runs = obj.client().list_runs(limit=limit, state=state, session_id=session_id)
    obj.emit({"runs": runs}, lambda: _table(runs) if runs else click.echo("no runs"))



# ----------------------------------------------------------------------------- dashboard


@cli.command()
@click.option("--open", "open_browser", is_flag=True, help="Also open the link in a web browser ($BROWSER).")
@pass_obj
def dashboard(obj: Obj, open_browser: bool) -> None:
    """Print a one-time login link to the daemon's web dashboard."""
    from supervisor import _dashlink
    from supervisor._statefiles import read_endpoint
    from supervisor.client import locate
    from supervisor.config import ENDPOINT_FILE, default_state_dir

    state_dir = obj.state_dir if obj.state_dir is not None else default_state_dir()
    _, token = locate(state_dir)
    try:
        dashboard_url = read_endpoint(state_dir / ENDPOINT_FILE).get("dashboard_url")
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the daemon's endpoint: {exc}", ExitCode.NO_DAEMON) from exc
    if not isinstance(dashboard_url, str):
        raise CliError("this daemon serves no dashboard (its config says dashboard = \"off\")", ExitCode.REFUSED)
    url = _dashlink.login_url(dashboard_url, _dashlink.mint_login_token(token))
    opened: bool | None = None
    if open_browser:
        import webbrowser

        opened = webbrowser.open(url)

    def human() -> None:
        click.echo(url)
        click.echo(f"(a one-time link, valid {_dashlink.LOGIN_TTL_S // 60} minutes)", err=True)
        if opened is False:
            click.echo("could not open a browser: open the link above by hand", err=True)

    obj.emit({"url": url, "expires_in_s": _dashlink.LOGIN_TTL_S, "opened": opened}, human)


if __name__ == "__main__":  # pragma: no cover
    main()
