"""The ``agentd`` command line: a thin shell over the control client and the daemon.

The only module that prints or picks exit codes. Its import path stays light: a command
that talks to a running daemon imports click, the client (its websocket is ``wsproto``
and ``h11``) and nothing else (no trio, no openai, no mcp); ``serve``
imports the daemon when it runs; ``logs`` reads the journal file itself. Every expected
failure, a usage error included, prints one line ``error: ...`` and exits with its own
code (``ExitCode``); ``--json`` turns every command's output into JSON (one object per
line for streams). The global options (``--json``, ``--state-dir``) are accepted before
or after the command: ``_Group`` adds them to every command registered on it, so a
command added later (``@cli.command()``, a subgroup's commands) gets them too.
Leaving ``watch`` (Ctrl-C, a dropped connection) never stops a run: only ``cancel`` does.

Size: one module on purpose: click is kept to this file (STYLE §5: the CLI is a shell; one
command per function, each a few dozen lines); splitting it would scatter the global options.
"""

from __future__ import annotations

import gc

# A cold command's imports (click, its command objects built below, then the client's
# in ``_import_client``) make tens of thousands of objects and no garbage: 30 passes of
# the cyclic GC over them cost ~7 % of the imports, ~3 ms of a ~55 ms command. Paused
# until the end of this module (``_GC_WAS_ENABLED``).
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()

import contextlib  # noqa: E402
import enum  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Final, NoReturn  # noqa: E402

import click  # noqa: E402

from supervisor.errors import (  # noqa: E402
    AgentdError,
    ConfigError,
    ControlProtocolError,
    DaemonAlreadyRunning,
    DaemonNotRunning,
    JournalError,
    RunNotFound,
    SpawnError,
)

if TYPE_CHECKING:
    from supervisor.control.client import Client, ConnectionLost

__all__ = ["main", "cli", "ExitCode", "build_spec"]


class ExitCode(enum.IntEnum):
    OK = 0  # also: the run completed (spawn --wait, watch, cancel)
    RUN_FAILED = 1  # the run failed
    USAGE = 2  # bad option or argument, unreadable or invalid file, bad config, a port serve cannot bind
    NO_DAEMON = 3  # no daemon answers for this state dir (logs: no readable journal there)
    NOT_FOUND = 4  # no such run
    REFUSED = 5  # the daemon refused the request: bad spec, bad token, its own error
    DISCONNECTED = 6  # the connection dropped and could not be resumed
    RUN_CANCELLED = 7  # the run was cancelled (by a user or a timeout)
    RUN_LOST = 8  # the daemon restarted and found the run's process gone
    ALREADY_RUNNING = 9  # serve: another daemon holds this state dir
    # cancel: no daemon runs; the stop was not delivered but recorded in the state dir
    # (``pending-stops/``), and the daemon applies it when it starts, before the run goes on
    # (one that started meanwhile and did not answer: as soon as it has found its runs again).
    STOP_PENDING = 10
    INTERRUPTED = 130  # Ctrl-C: the CLI stopped watching; the run goes on
    # stdout closed (`agentd watch RUN | head -n1`) under a command whose exit code is the
    # run's outcome: 128 + SIGPIPE, as a shell shows a process SIGPIPE killed (0 said
    # "completed" of a run still going). Other commands exit 0 then.
    BROKEN_PIPE = 141


OUTCOME_EXIT = {
    "completed": ExitCode.OK,
    "failed": ExitCode.RUN_FAILED,
    "cancelled": ExitCode.RUN_CANCELLED,
    "lost": ExitCode.RUN_LOST,
}

# A follow with after_seq past any real event: no replay, only the terminal state.
_ONLY_THE_END = 2**62
# The largest `--after` (what the protocol takes; SQLite's integers end at 2**63 - 1, and
# `logs --after 2**63` was an OverflowError with a traceback).
MAX_AFTER_SEQ: Final = 2**62
# The longest run id (the protocol's MAX_ID_CHARS): `logs`, reading the journal itself,
# refuses a longer one as the daemon does for the other commands.
MAX_RUN_ID_CHARS: Final = 256


class CliError(click.ClickException):
    """An expected failure: one line on stderr, a distinct exit code, no traceback."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        # click types exit_code a ClassVar, but reads it from the instance (e.exit_code):
        # one exception class with the exit code of each failure.
        self.exit_code = exit_code  # type: ignore[misc]

    def show(self, file: Any = None) -> None:
        prefix = ""
        if os.environ.get("JOURNAL_STREAM"):  # (cheap first: the import is for this case only)
            from supervisor._sdnotify import stderr_is_journal

            prefix = "<3>" if stderr_is_journal() else ""  # journald files it as an error
        click.echo(f"{prefix}error: {self.format_message()}", err=True)


def _usage_error(exc: click.UsageError) -> CliError:
    """click's usage error (usage line, hint, message: three lines) as one line with a hint."""
    message = exc.format_message().strip()
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    message = message.removesuffix(".")
    command = exc.ctx.command_path if exc.ctx is not None else "agentd"
    return CliError(f"{message} (try '{command} --help')", ExitCode.USAGE)


def _translate(exc: AgentdError) -> CliError:
    from supervisor.control.client import ConnectionLost

    if isinstance(exc, DaemonNotRunning):
        message = str(exc)
        ctx = click.get_current_context(silent=True)
        if ctx is not None and ctx.find_root().params.get("use_fleet"):  # the front, not a daemon
            from supervisor.control.client import START_HINT

            message = message.replace("no agentd daemon is running", "no agentd fleet front is running")
            message = message.replace(START_HINT, "start one with `agentd fleet serve`")
        return CliError(message, ExitCode.NO_DAEMON)
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
    if isinstance(exc, JournalError):  # logs, reading the file: nothing usable at this state dir
        return CliError(str(exc), ExitCode.NO_DAEMON)
    if isinstance(exc, ControlProtocolError):
        # bad_args: what the user typed (an empty run id, a session id too long): a usage
        # error, as one the CLI caught itself would be.
        code = {"not_found": ExitCode.NOT_FOUND, "bad_args": ExitCode.USAGE}.get(exc.code, ExitCode.REFUSED)
        return CliError(f"{exc} ({exc.code})", code)
    return CliError(str(exc), ExitCode.REFUSED)


class _Text(click.ParamType[str]):
    """A free-text value (a task, a reason, a session or run id): text, so an argument
    that is not valid UTF-8 (a Latin-1 file name pasted into a task, say) is a usage error
    naming the byte, not a lone surrogate the daemon refuses as an odd spec. Every
    parameter a command declares with click's default ``STRING`` gets it (``_Group``);
    paths keep click's ``Path``, which takes any bytes a file name may hold."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                try:  # as typed: the bytes that are not UTF-8 as \xNN
                    shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                except UnicodeEncodeError:  # a surrogate no byte made (not from argv)
                    shown = value.encode("utf-8", "backslashreplace").decode()
                self.fail(f"'{shown}' is not valid UTF-8 (at character {exc.start + 1})", param, ctx)
        return value


_TEXT: Final = _Text()


class _StateDir(click.Path):
    """``--state-dir``: made absolute (a runner works in its run dir, so a relative one
    named files that were not there once it had moved); an empty one is a usage error
    (click took it for ".", while an empty ``AGENTD_STATE_DIR`` means the default)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("expected a directory, got an empty string", param, ctx)
        rv = super().convert(value, param, ctx)
        return Path(os.fsdecode(rv)).absolute()


def _translate_spawn(exc: AgentdError) -> CliError:
    """A spawn's error: the daemon's ``bad_args`` about the spec (a text SQLite cannot
    store, a lone surrogate) is a refused spec, exit 5 as README says, not a usage error;
    about what was typed on the command line (``--session``) it stays one (exit 2)."""
    error = _translate(exc)
    if (
        isinstance(exc, ControlProtocolError)
        and exc.code == "bad_args"
        and not any(f"'{arg}'" in str(exc) for arg in ("session_id", "model_key", "timeout_s", "interrupt", "key"))
    ):
        error.exit_code = ExitCode.REFUSED  # type: ignore[misc]
    return error


def _if_sent(exc: AgentdError, error: CliError, said: str) -> CliError:
    """``error``, saying ``said`` too when ``exc`` is a connection lost after the request
    went out (the daemon may have acted on it)."""
    if getattr(exc, "sent", False):
        return CliError(f"{error.format_message()}; {said}", error.exit_code)
    return error


def _set_state_dir(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.find_object(Obj).state_dir = value  # type: ignore[union-attr]


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_object(Obj).as_json = True  # type: ignore[union-attr]


_STATE_DIR_HELP = "The daemon's state dir (token, endpoint, journal). Env: AGENTD_STATE_DIR."
_JSON_HELP = "Machine-readable output (JSON; one object per line for streams)."


def _global_options() -> list[click.Parameter]:
    """``--state-dir`` and ``--json`` as a command's own options (after its name)."""
    return [
        click.Option(
            ["--state-dir"],
            type=_StateDir(file_okay=False, path_type=Path),
            expose_value=False,
            callback=_set_state_dir,
            help=_STATE_DIR_HELP,
        ),
        click.Option(["--json"], is_flag=True, expose_value=False, callback=_set_json, help=_JSON_HELP),
    ]


class _Group(click.Group):
    """The command group: global options on every command, errors as one line.

    Every command added (``@cli.command()``, ``cli.add_command``, a subgroup made with
    ``@cli.group()``, which is a ``_Group`` too, and its commands) gets ``--state-dir``
    and ``--json`` so they may follow the command's name; an expected failure
    (``AgentdError``) or a usage error becomes one ``error:`` line and its exit code.
    """

    group_class = type  # subgroups are _Groups: their commands get the global options too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy: dict[str, tuple[str, str]] = {}

    def add_lazy_command(self, name: str, module: str, attr: str) -> None:
        """A command defined in ``module`` as ``attr``, imported the first time it is needed."""
        self._lazy[name] = (module, attr)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self._lazy:
            import importlib

            module, attr = self._lazy[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self._lazy})

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        # A subgroup gets them too: `agentd session --json close S` as well as before
        # `session` or after `close`.
        taken = {opt for p in cmd.params for opt in p.opts}
        cmd.params.extend(p for p in _global_options() if not taken & set(p.opts))
        for p in cmd.params:
            if p.type is click.STRING:
                p.type = _TEXT
        super().add_command(cmd, name)

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # `agentd` alone: the help text is the answer
        except click.UsageError as exc:
            raise _usage_error(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _usage_error(exc) from None
        except AgentdError as exc:
            raise _translate(exc) from None
        except KeyboardInterrupt:
            raise CliError(
                "interrupted (runs go on; stop one with `agentd cancel RUN`)", ExitCode.INTERRUPTED
            ) from None
        except BrokenPipeError:
            # `agentd logs RUN | head`: the reader left; not an error worth a traceback.
            # Point stdout at devnull so the interpreter's final flush does not fail too.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise SystemExit(ExitCode.BROKEN_PIPE if _outcome_command[0] else 0) from None


# Whether this command's exit code is a run's outcome (watch, spawn --wait, logs -f,
# cancel): a closed stdout then exits BROKEN_PIPE, never 0. Set by the command.
_outcome_command = [False]


def _exit_is_the_outcome() -> None:
    _outcome_command[0] = True


class Obj:
    """The command's context object: global options and the client, opened on first use.

    A plain class: defining a dataclass would cost every command ~0.4 ms.
    """

    def __init__(self, state_dir: Path | None, as_json: bool) -> None:
        self.state_dir = state_dir
        self.as_json = as_json
        self._client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            self._client = _import_client()(state_dir=self.state_dir)
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


def _import_client() -> type[Client]:
    """``supervisor.control.client.Client``, imported with the cyclic GC paused.

    The import (the client, ``wsproto``, ``h11``: ~15 ms) makes tens of thousands of
    objects, none of them garbage; the collector's passes over them cost ~1-2 ms of a cold
    command (measured with benchmarks/bench_cli.py).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from supervisor.control.client import Client
    finally:
        if was_enabled:
            gc.enable()
    return Client


_EPILOG = """\b
--json and --state-dir go before or after the command.
Exit codes: 0 ok (run completed), 1 run failed, 2 usage or bad file,
3 no daemon, 4 no such run, 5 refused by the daemon, 6 connection lost,
7 run cancelled, 8 run lost, 9 daemon already running,
10 cancel found no daemon: the stop recorded for the next one, 130 interrupted.
spawn --wait, watch, cancel and logs -f exit with the run's outcome (0, 1, 7, 8),
or 141 when their output is closed first (`watch RUN | head -n1`).
Leaving `watch` or `spawn --wait` never stops a run: `cancel` does."""


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EPILOG)
@click.option(
    "--state-dir",
    envvar="AGENTD_STATE_DIR",
    type=_StateDir(file_okay=False, path_type=Path),
    help=_STATE_DIR_HELP,
)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.option(
    "--fleet",
    "use_fleet",
    is_flag=True,
    envvar="AGENTD_FLEET",
    help="Talk to the fleet front (`agentd fleet serve`, state dir <state dir>/fleet) instead of this machine's daemon.",
)
@click.version_option(package_name="agentd", prog_name="agentd")
@click.pass_context
def cli(ctx: click.Context, state_dir: Path | None, as_json: bool, use_fleet: bool = False) -> None:
    """agentd: run AI sub-agents as supervised processes, and stop them for real."""
    if use_fleet:
        from supervisor.fleet.cli import fleet_state_dir

        state_dir = fleet_state_dir(state_dir)
    obj = Obj(state_dir, as_json)
    ctx.obj = obj
    _outcome_command[0] = False
    ctx.call_on_close(obj.close)


def main(argv: list[str] | None = None) -> NoReturn:
    """The ``agentd`` console script.

    A client command ends with ``os._exit`` once its output is flushed and its connection
    closed: the interpreter's teardown of the modules it loaded (click, wsproto, h11) is
    ~10 ms of a ~60 ms command, and nothing is left for it to do (no atexit handler, no
    buffered file). A process that ran trio (``serve``: the daemon, its threads, its log)
    exits the normal way.
    """
    _safe_output()
    try:
        cli.main(args=argv, prog_name="agentd")
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if "trio" in sys.modules:
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except OSError:  # the reader left (`agentd logs RUN | head`)
        if _outcome_command[0]:
            code = ExitCode.BROKEN_PIPE
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)


def _safe_output() -> None:
    """What a run wrote (a model's text, a tool's output) is printed as text, never as
    terminal control: on a terminal, control characters (an escape sequence that retitles
    the window or clears the screen, a carriage return that hides a line) are shown as
    ``\\xNN``. Text no encoding takes (a lone surrogate, half a character) is replaced, on
    a terminal or not: it raised in ``click.echo``, mid-output, with a traceback."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass
    try:
        tty = sys.stdout.isatty()
        buffer = sys.stdout.buffer
    except (AttributeError, ValueError, OSError):
        return
    if tty:
        sys.stdout = _Shown(buffer, encoding="utf-8", errors="replace", line_buffering=True)


class _Shown(io.TextIOWrapper):
    """A terminal's stdout: control characters other than newline and tab shown as text,
    and so are the invisible characters that reorder or hide text (bidi embeddings,
    overrides, isolates and marks; zero-width spaces): a task or an output could otherwise
    show a terminal something other than what it holds. The zero-width joiners stay (emoji
    sequences, Indic and Persian scripts need them)."""

    def write(self, s: str) -> int:
        super().write(_CONTROL.sub(_visible, s))
        return len(s)


_CONTROL: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]"
)


def _visible(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


# ----------------------------------------------------------------------------- serve


@cli.command()
@click.option("--host", help="Address to bind (default 127.0.0.1).")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    help="Port to bind, 0..65535 (default 0: any free port, published in the state dir).",
)
@click.option("--grace", "grace_s", type=float, help="Seconds between SIGTERM and SIGKILL of a run's tree.")
@click.option("--max-concurrent", type=int, help="Runs allowed at once; more wait in a queue.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), help="TOML config file.")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
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
    from supervisor import _sdnotify

    handler = logging.StreamHandler(sys.stderr)
    if _sdnotify.stderr_is_journal():  # under systemd: each line with its priority
        handler.setFormatter(_sdnotify.JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    from subagent.osedge import run_trio
    from supervisor.daemon import serve as serve_daemon

    try:
        run_trio(serve_daemon, config)
    except KeyboardInterrupt:
        click.get_current_context().exit(ExitCode.INTERRUPTED)
    except BaseExceptionGroup as group:
        # An expected failure raised inside the daemon's nurseries arrives wrapped.
        leaves = _leaves(group)
        if not all(isinstance(e, AgentdError) for e in leaves):
            raise
        raise leaves[0] from None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside nested groups, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


# ----------------------------------------------------------------------------- spawn


# A spec or MCP config file is read up to this much: /dev/zero or an endless pipe is
# refused, not swallowed. A bound on reading, not the daemon's limit: it refuses a message
# over its max_message_bytes (1 MiB by default) itself, with its own error.
JSON_FILE_MAX_BYTES: Final = 16 * 1024 * 1024


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid json")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected finite numbers, got {text[:32]} (out of range)")
    return value


def _read_json_file(path: Path, what: str) -> Any:
    """A json file (a pipe or ``/dev/stdin`` too) as the daemon would take it: strict json
    (no NaN or Infinity), UTF-8, at most ``JSON_FILE_MAX_BYTES``. Errors are CliErrors."""
    name = repr(str(path))
    try:
        with path.open("rb") as f:
            data = f.read(JSON_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise CliError(f"cannot read {what} {name}: {exc.strerror or exc}", ExitCode.USAGE) from None
    if len(data) > JSON_FILE_MAX_BYTES:
        raise CliError(f"{what} {name} is larger than {JSON_FILE_MAX_BYTES} bytes", ExitCode.USAGE)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"{what} {name} is not UTF-8 text: {exc}", ExitCode.USAGE) from None
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise CliError(f"{what} {name} is not valid json: nested too deeply", ExitCode.USAGE) from None
    except ValueError as exc:
        raise CliError(f"{what} {name} is not valid json: {exc}", ExitCode.USAGE) from None


class _Seconds(click.FloatRange):
    """A positive, finite number of seconds (click's range lets ``nan`` and ``inf`` by)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number of seconds.", param, ctx)
        return rv


def _from_file(base: Path, value: Any) -> Any:
    """A relative path as written in a file in ``base``: absolute, taken from ``base``; one
    in a home directory (``~/data``, ``~user/data``) expanded, as a shell would.

    Anything else (absolute, empty, not a string) as it was: the spec's own checks judge it."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        # (The expansion was dropped: '~/data' was sent as written, a grant refused as not
        # absolute, a script_path read from the run dir's '~' and refused as in the state dir.)
        return str(path) if value.startswith("~") else value
    return str((base / path).absolute())


def _base_dir(file: Path) -> Path:
    """The directory a file's relative paths are taken from: the file's own, or the current
    one for a file read through a descriptor (``/dev/stdin``, ``/dev/fd/N``, ``<(...)``,
    ``/proc/self/fd/N``): its name says nothing of where it was written (``/dev`` or
    ``/dev/fd`` were taken for its directory: a grant ``data`` became ``/dev/data``)."""
    try:
        parent = Path(os.path.realpath(file.parent))
    except OSError:
        return file.parent
    if parent == Path("/dev") or (parent.name == "fd" and parent.parent.parent == Path("/proc")):
        return Path.cwd()
    return file.parent


def _servers_from(file: Path, servers: Any) -> Any:
    """MCP servers as written in ``file``: a relative ``cwd`` is the file's directory's, and so
    is a relative ``command`` path (one with a ``/``) of a server with no ``cwd`` (with one,
    the server's process is started there, as a shell would)."""
    if not isinstance(servers, dict):
        return servers
    base = _base_dir(file)
    out: dict[Any, Any] = {}
    for name, server in servers.items():
        if isinstance(server, dict):
            server = dict(server)
            command = server.get("command")
            if "cwd" in server:
                server["cwd"] = _from_file(base, server["cwd"])
            elif isinstance(command, str) and "/" in command:
                server["command"] = _from_file(base, command)
        out[name] = server
    return out


def _paths_from(spec_file: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """A spec file's relative paths, taken from the file's directory (``_base_dir``) as written (the runner
    works in its run dir, where they would mean nothing): ``model.script_path``, the
    ``sandbox`` grants (``read``, ``write``, ``workdir``) and the MCP servers' ``cwd`` (and
    ``command``, see ``_servers_from``). Other values are left to the spec's checks."""
    base = _base_dir(spec_file)
    spec = dict(spec)
    m = spec.get("model")
    if isinstance(m, dict) and "script_path" in m:
        spec["model"] = {**m, "script_path": _from_file(base, m["script_path"])}
    box = spec.get("sandbox")
    if isinstance(box, dict):
        box = dict(box)
        for key in ("read", "write"):
            if isinstance(box.get(key), list):
                box[key] = [_from_file(base, p) for p in box[key]]
        if "workdir" in box:
            box["workdir"] = _from_file(base, box["workdir"])
        spec["sandbox"] = box
    if "mcpServers" in spec:
        spec["mcpServers"] = _servers_from(spec_file, spec["mcpServers"])
    return spec


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

    Options override the file. Paths become absolute: the runner's cwd is its run dir, so a
    file's relative paths are taken from its directory (``_paths_from``).

    Raises:
        CliError: an unreadable or invalid file, or no task anywhere.
    """
    spec: dict[str, Any] = {}
    if spec_file is not None:
        loaded = _read_json_file(spec_file, "spec file")
        if not isinstance(loaded, dict):
            raise CliError(
                f"spec file {str(spec_file)!r}: expected a json object, got {type(loaded).__name__}", ExitCode.USAGE
            )
        spec = _paths_from(spec_file, loaded)
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
        merged.update(_servers_from(mcp_config, servers))
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
@click.option(
    "--session",
    "session_id",
    help="Session (conversation) the run is the next turn of: it starts from the session's history.",
)
@click.option(
    "--interrupt",
    is_flag=True,
    help="With --session: stop the session's live turn first (a normal cancel, waited for); without it a session with a live turn refuses a new one.",
)
@click.option(
    "--timeout", "timeout_s", type=_Seconds(min=0, min_open=True), help="Stop the run after this many seconds."
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Most model turns the run may take.")
@click.option(
    "--spec",
    "spec_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A whole run spec as JSON. Repeat it to start several runs in one call: one run id per line, in order.",
)
@click.option(
    "--model-key-env",
    metavar="VAR",
    help="Read this run's model API key from environment variable VAR (of this shell) and hand it to "
    "the runner only: it is never written to the journal, events or logs.",
)
@click.option(
    "--key",
    help="An idempotency key: a spawn whose key already started a run prints that run and starts nothing "
    "(send a spawn whose answer was lost again with its key).",
)
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
    interrupt: bool,
    timeout_s: float | None,
    max_steps: int | None,
    spec_files: tuple[Path, ...],
    model_key_env: str | None,
    key: str | None,
    wait: bool,
) -> None:
    """Start a sub-agent on TASK and print its run id.

    A model named with --model (or a spec with provider "openai") needs an API key where
    the runner runs: OPENAI_API_KEY in the daemon's environment (under systemd the file
    /etc/agentd/agentd.env, see systemd/agentd.env.example), or this run's own key with
    --model-key-env VAR. Without one the daemon refuses the run (exit 5).

    Several --spec files start several runs (the other options apply to each; not
    --session, whose turns run one at a time), sent together on one connection; a spec
    the daemon refuses is one error line naming its file, the others still start, and the
    exit code is the first failure's.
    """
    if interrupt and session_id is None:
        raise CliError("--interrupt needs --session: it stops that session's live turn", ExitCode.USAGE)
    model_key = None
    if model_key_env is not None:
        model_key = os.environ.get(model_key_env)
        if not model_key or not model_key.strip():
            raise CliError(
                f"--model-key-env: environment variable {model_key_env!r} is not set or empty in this shell",
                ExitCode.USAGE,
            )
    if wait:
        _exit_is_the_outcome()
    if wait and len(spec_files) > 1:
        raise CliError("--wait follows one run: give it one --spec", ExitCode.USAGE)
    if key is not None and len(spec_files) > 1:
        raise CliError("--key names one run: give it one --spec", ExitCode.USAGE)
    if session_id is not None and len(spec_files) > 1:
        raise CliError("--session takes one --spec: a session runs one turn at a time", ExitCode.USAGE)
    specs = [
        build_spec(
            task,
            spec_file=spec_file,
            model=model,
            provider=provider,
            script=script,
            mcp_config=mcp_config,
            browser=browser,
            max_steps=max_steps,
        )
        for spec_file in (spec_files or (None,))
    ]
    client = obj.client()
    if len(specs) > 1:
        _spawn_several(obj, client, specs, spec_files, timeout_s=timeout_s, model_key=model_key)
        return
    try:
        result = client.spawn(
            specs[0], session_id=session_id, timeout_s=timeout_s, model_key=model_key, interrupt=interrupt, key=key
        )
    except AgentdError as exc:
        said = "the spec was sent and may have started (check with `agentd list`)"
        if key is not None:
            said = "the spec was sent and may have started (spawn it again with the same --key: it starts once)"
        raise _if_sent(exc, _translate_spawn(exc), said) from None
    run_id = str(result["run_id"])

    def human() -> None:
        click.echo(run_id)
        if result.get("existing") is True:
            # The run id alone read as a new run: a person could not tell a key used before.
            first = result.get("session_id")
            whose = f"a turn of session {first!r}" if first else "not a turn of any session"
            asked = f", not a turn of session {session_id!r} as asked" if session_id and session_id != first else ""
            click.echo(
                f"note: --key {key!r} was used before: {run_id} is the run it made ({whose}{asked}; "
                f"now {result.get('state')}); nothing new was started",
                err=True,
            )

    obj.emit(result, human)
    if wait:
        _follow_to_end(obj, run_id, after_seq=0)


def _spawn_several(
    obj: Obj,
    client: Client,
    specs: list[dict[str, Any]],
    spec_files: tuple[Path, ...],
    **options: Any,
) -> None:
    """Start a run per spec, pipelined on one connection; print each run id in order."""
    failed: CliError | None = None
    for path, result in zip(spec_files, client.spawn_many(specs, **options), strict=True):
        if isinstance(result, AgentdError):
            error = _translate_spawn(result)
            message = error.format_message()
            if error.exit_code == ExitCode.DISCONNECTED and not message.startswith("not sent"):
                # Sent, and no answer came: the daemon may have started it.
                message += "; the spec was sent and may have started (check with `agentd list`)"
            click.echo(f"error: spec file {str(path)!r}: {message}", err=True)
            failed = failed or error
            continue
        obj.emit(result, lambda: click.echo(str(result["run_id"])))  # noqa: B023 (emit calls it at once)
    if failed is not None:
        click.get_current_context().exit(failed.exit_code)


# ----------------------------------------------------------------------------- watch, logs


# How much of a call's arguments `watch` shows when it awaits approval.
APPROVAL_ARGS_WIDTH = 500


def _short(text: Any, width: int = 100) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= width else s[: width - 1] + "…"


def _lookalikes(*texts: Any) -> str:
    """A note naming the look-alike characters in what a person approves (a Cyrillic
    ``а`` in ``pаypal``, fullwidth ``ｒｍ``: ``supervisor/_lookalikes.py``), or "". For
    the human display only: ``--json`` keeps the raw text."""
    from supervisor._lookalikes import lookalike_note

    return lookalike_note(" ".join(str(t) for t in texts))


def _tail(text: Any, width: int = 100) -> str:
    """The end of a text on one line: a live run's latest words."""
    s = " ".join(str(text).split())
    return s if len(s) <= width else "…" + s[-(width - 1) :]


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
        record = d.get("record")
        rec = record if isinstance(record, dict) else d
        detail = rec.get("error") or rec.get("reason")
        if rec.get("state") == "running" and not detail:
            # The same state again: what changed (the stop reached it; its request went out).
            if rec.get("stop_requested_at") is not None:
                detail = "a stop reached it"
            elif rec.get("sent_at") is not None:
                detail = "sent to its server"
        name = rec.get("name")
        text = f"tool {name} {rec.get('state')}" + (f": {_short(detail, 80)}" if detail else "") + _lookalikes(name)
    elif kind == "process_group":
        alive = "" if d.get("alive", True) else " ended"
        # Its name is a command's line: what runs, look-alikes named.
        text = f"process group {d.get('pgid')} ({d.get('kind')} {d.get('name')}){alive}{_lookalikes(d.get('name'))}"
    elif kind == "step_snapshot" and "progress_at" in d:
        # A delta: what the model said since the last snapshot, and the calls that changed.
        calls = d.get("tool_calls_changed")
        n = len(calls) if isinstance(calls, list) else 0
        said = _short(d.get("progress_added") or "", 80)
        unfinished = d.get("unfinished_text")
        unfinished = unfinished if isinstance(unfinished, dict) else {}
        if unfinished.get("streaming"):
            # The model's text as it streams (the step's own snapshot follows at its end).
            text = f"step {d.get('step')} streaming: " + (f"+{said}" if said else "no new text")
        else:
            text = f"snapshot after step {d.get('step')}: " + (f"+{said}" if said else "no new text")
        if n:
            text += f" ({n} tool call{'s' if n != 1 else ''} updated)"
        if unfinished and not unfinished.get("streaming"):
            text += " (its text was cut short)"
    elif kind == "step_snapshot":
        text = f"snapshot after step {d.get('step')}: {_short(d.get('progress', ''), 80)}"
    elif kind == "stop_requested":
        text = f"stop requested ({d.get('reason')}, during {d.get('during')})"
    elif kind == "steering":
        text = f"steering {d.get('state')}: {_short(d.get('text', ''), 80)}"
    elif kind == "disk_full":
        text = f"stopped by the daemon, the disk is full: {_short(d.get('message', ''), 160)}"
    elif kind == "journal_gap":
        text = f"facts may be missing: {_short(d.get('message', ''), 160)}"
    elif kind == "steer_sent":
        text = f"steering sent: {_short(d.get('text', ''), 80)}"
    elif kind == "steer_unsent":
        text = f"steering not sent ({_short(str(d.get('why', '')), 60)}): {_short(d.get('text', ''), 80)}"
    elif kind == "approval_requested":
        # The person deciding sees what they would let run, and the commands that answer it.
        run, call = event.get("run_id") or "RUN", d.get("call_id")
        args = str(d.get("arguments", ""))
        shown = _short(args, APPROVAL_ARGS_WIDTH)
        if shown.endswith("…") and len(" ".join(args.split())) > APPROVAL_ARGS_WIDTH:  # what is cut is said
            shown += f" [cut: {len(args)} characters in all; `agentd status {run} --json` shows them whole]"
        text = (
            f"awaiting approval: {d.get('name')} {shown}{_lookalikes(d.get('name'), args)} "
            f"(call {call}; `agentd approve {run} {call}` or `agentd deny {run} {call} --reason TEXT`)"
        )
    elif kind == "approval_sent":
        text = f"approval answer sent: call {d.get('call_id')} {d.get('decision')}" + (
            f" ({_short(d['reason'], 60)})" if d.get("reason") else ""
        )
    elif kind == "approval_unsent":
        text = f"approval answer not sent: call {d.get('call_id')} ({_short(str(d.get('why', '')), 60)})"
    elif kind == "approval_answered":
        text = f"approval: call {d.get('call_id')} {d.get('decision')}" + (
            f" ({_short(d['reason'], 60)})" if d.get("reason") else ""
        )
    elif kind == "session":
        profile = ", browser profile kept by the session" if d.get("browser_profile") else ""
        text = f"turn of session {d.get('session_id')}: {d.get('turns')} earlier turn(s), {d.get('messages')} history message(s){profile}"
    elif kind == "log":
        level = str(d.get("level", "info"))
        message = str(d.get("message", ""))
        if message.lower().startswith(f"{level.lower()}: "):  # "[error] error: ..." says it twice
            message = message[len(level) + 2 :]
        text = f"[{level}] {_short(message)}"
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
        obj.emit(event, lambda: click.echo(format_event(event)))  # noqa: B023 (emit calls it at once)
    state = follow.state or "unknown"
    end = {"end": True, "run_id": run_id, "state": state, "last_seq": follow.last_seq}
    obj.emit(end, lambda: click.echo(f"run {run_id} {state}"))
    click.get_current_context().exit(OUTCOME_EXIT.get(state, ExitCode.RUN_FAILED))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--after", "after_seq", type=click.IntRange(0, MAX_AFTER_SEQ), default=0, help="Start after this event number."
)
@pass_obj
def watch(obj: Obj, run_id: str, after_seq: int) -> None:
    """Show a run's progress live until it ends (resumes after a dropped connection).

    The exit code is the run's outcome: 0 completed, 1 failed, 7 cancelled, 8 lost
    (141 if stdout is closed first: `watch RUN | head`).
    """
    _exit_is_the_outcome()
    _follow_to_end(obj, run_id, after_seq=after_seq)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--after", "after_seq", type=click.IntRange(0, MAX_AFTER_SEQ), default=0, help="Start after this event number."
)
@click.option(
    "-f", "--follow", "follow", is_flag=True, help="Keep printing new events until the run ends (needs the daemon)."
)
@pass_obj
def logs(obj: Obj, run_id: str, after_seq: int, follow: bool) -> None:
    """Print a run's events from the journal.

    Reads the journal file in the state dir directly (read-only): no daemon is needed.
    With -f, a run still live is followed through the daemon until it ends, and the exit
    code is its outcome, as for watch.
    """
    from supervisor.config import JOURNAL_FILE, default_state_dir
    from supervisor.store._read import JournalReader

    if follow:
        _exit_is_the_outcome()
    if len(run_id) > MAX_RUN_ID_CHARS:  # (as the daemon refuses it for every other command)
        raise CliError(f"expected 'run_id' of at most {MAX_RUN_ID_CHARS} chars, got {len(run_id)}", ExitCode.USAGE)
    state_dir = obj.state_dir if obj.state_dir is not None else default_state_dir()
    last = after_seq
    try:
        front = not (state_dir / JOURNAL_FILE).is_file() and (state_dir / "daemon.json").is_file()
    except OSError as exc:  # a state dir under a directory this user cannot search
        raise CliError(
            f"cannot read the journal in {str(state_dir)!r}: {exc.strerror or exc}", ExitCode.NO_DAEMON
        ) from None
    if front:
        # A server with no journal of its own here (the fleet front: `--fleet`): its
        # events come over the socket.
        client = obj.client()
        for event in client.iter_events(run_id, after_seq=after_seq):
            last = event["seq"]
            obj.emit(event, lambda: click.echo(format_event(event)))  # noqa: B023 (emit calls it at once)
        if follow:
            _follow_to_end(obj, run_id, after_seq=last)
        return
    with JournalReader(state_dir / JOURNAL_FILE) as journal:
        for event in journal.events_after(run_id, after_seq):
            last = event["seq"]
            obj.emit(event, lambda: click.echo(format_event(event)))  # noqa: B023 (emit calls it at once)
        state = journal.run_state(run_id)
    if not follow:
        return
    if state not in OUTCOME_EXIT:
        _follow_to_end(obj, run_id, after_seq=last)
    end = {"end": True, "run_id": run_id, "state": state, "last_seq": last}
    obj.emit(end, lambda: click.echo(f"run {run_id} {state}"))
    click.get_current_context().exit(OUTCOME_EXIT[state])


# ----------------------------------------------------------------------------- cancel


@cli.command()
@click.argument("run_id", metavar="RUN", required=False)
@click.option("--session", "session_id", help="Cancel the live run(s) of this session instead.")
@click.option(
    "--turn",
    metavar="RUN",
    help="With --session: the turn meant (its run id); if it has ended, nothing is stopped.",
)
@click.option("--reason", default="user", show_default=True, help="Recorded with the stop.")
@click.option("--no-wait", is_flag=True, help="Return once the stop is sent, without waiting for the end.")
@pass_obj
def cancel(obj: Obj, run_id: str | None, session_id: str | None, turn: str | None, reason: str, no_wait: bool) -> None:
    """Stop a run: print whether it was active and, once reached, its terminal state.

    --session stops whichever turn of the session is live when the cancel arrives (a
    stop meant for a turn that has ended meanwhile stops the next one); --turn names the
    turn meant, and only that one is ever stopped.

    The exit code is the run's outcome, like watch: 0 completed (it ended before the stop
    reached it), 1 failed, 7 cancelled, 8 lost; for --session, the first of lost, failed,
    cancelled that one of its runs ended in (4: no run ever had that session). With
    --no-wait: 0 once the stop is sent.

    No daemon running: the stop is recorded in the state dir and the daemon applies it
    when it starts, before the run goes on (exit 10, said on stderr).
    """
    if turn is not None and session_id is None:
        raise CliError(
            "--turn names a turn of a --session (to stop a run by its id: agentd cancel RUN)", ExitCode.USAGE
        )
    if (run_id is None) == (session_id is None):
        raise CliError("expected a RUN or --session, not both and not neither", ExitCode.USAGE)
    if not no_wait:
        _exit_is_the_outcome()
    client = obj.client()
    # A daemon that is starting (finding its runs again) answers once it has: the stop
    # waits for it (``Client.stop_delivery_s``), and the person is told why it takes time.
    client.on_stop_wait = lambda why: click.echo(f"note: {why}", err=True)

    def send() -> dict[str, Any]:
        if session_id is not None:
            return client.cancel_session(session_id, reason=reason, turn=turn)
        assert run_id is not None
        return client.cancel(run_id, reason=reason)

    try:
        result = send()
    except DaemonNotRunning as exc:
        # A daemon that holds the state dir all the same (starting, or its endpoint or token
        # file unreadable): the stop is delivered to it, waited for; one that cannot be
        # reached at all is handed the stop as a note, which a running daemon watches for.
        try:
            reached = _reach_the_lock_holder(client, send, exc)
        except _Unreachable as cut_off:
            _nothing_to_record(obj, client.state_dir, exc, run_id)
            note = _record_pending_stop(
                client.state_dir, exc, run_id=run_id, session_id=session_id, turn=turn, reason=reason
            )
            _report_pending_stop(
                obj,
                note,
                exc,
                run_id=run_id,
                session_id=session_id,
                turn=turn,
                reason=reason,
                holder=(cut_off, _wait_taken(note, NOTE_TAKEN_WAIT_S)),
            )
        if reached is not None:
            result = reached
        else:
            # No daemon: the runs go on (the next one re-adopts them), so the stop is
            # recorded for it rather than lost. Then tried once more: a daemon that started
            # meanwhile may have read the notes before this one was there.
            _nothing_to_record(obj, client.state_dir, exc, run_id)
            note = _record_pending_stop(
                client.state_dir, exc, run_id=run_id, session_id=session_id, turn=turn, reason=reason
            )
            from supervisor.control.client import ConnectionLost

            try:
                result = send()
            except DaemonNotRunning:
                _report_pending_stop(obj, note, exc, run_id=run_id, session_id=session_id, turn=turn, reason=reason)
            except ConnectionLost as lost:
                # A daemon started meanwhile and did not answer (still finding its runs
                # again): the note is on disk, read by it or not; a bare exit 6 hid both.
                _report_pending_stop(
                    obj, note, exc, run_id=run_id, session_id=session_id, turn=turn, reason=reason, unanswered=lost
                )
            with contextlib.suppress(OSError):
                note.unlink()  # delivered after all (a daemon that applied it too: a cancel is idempotent)
    runs = [r for r in result.get("runs", []) if isinstance(r, dict)] if session_id is not None else [result]
    final: dict[str, str] = {str(r["run_id"]): str(r.get("state")) for r in runs}
    # Wait for every run not yet ended: the one this stop reached, and one an earlier
    # stop is still ending (was_active false, state cancelling).
    targets = [rid for rid, state in final.items() if state not in OUTCOME_EXIT]
    # What the daemon answered is printed before the wait (flushed): a Ctrl-C or a dropped
    # connection during the wait lost it, and the stop had been sent. One run: its line is
    # ended by the terminal state ("R: stop sent (was active); cancelled").
    one_line = len(runs) == 1 and not no_wait and not obj.as_json
    waited = not no_wait and bool(targets)
    if waited and not obj.as_json:
        for r in runs:
            if r.get("was_active"):
                click.echo(f"{r['run_id']}: stop sent (was active)", nl=not one_line)
        sys.stdout.flush()
    if waited:
        try:
            for rid in targets:
                follow = client.follow(rid, after_seq=_ONLY_THE_END)
                for _ in follow:
                    pass
                final[rid] = follow.state or final[rid]
        except BaseException as exc:
            if obj.as_json:  # what the daemon answered, the state then (one object, as ever)
                click.echo(json.dumps(result, default=str))
            elif one_line and runs[0].get("was_active"):
                click.echo("")  # the line printed before the wait ends here
            if isinstance(exc, KeyboardInterrupt):
                what = f"run {run_id} is" if run_id else f"runs of session {session_id} are"
                raise CliError(
                    f"interrupted: the stop was sent and the {what} stopping (`agentd status` shows when it ends)",
                    ExitCode.INTERRUPTED,
                ) from None
            raise
    out = {**result, "state": final.get(run_id, result.get("state"))} if run_id else {**result, "final": final}

    def human() -> None:
        for r in runs:
            rid = str(r["run_id"])
            if r.get("was_active") and waited:
                click.echo(f"; {final[rid]}" if one_line else f"{rid}: {final[rid]}")
            elif r.get("was_active"):
                ending = f"; {final[rid]}" if not no_wait else f" (state: {final[rid]})"
                click.echo(f"{rid}: stop sent (was active){ending}")
            else:
                click.echo(f"{rid}: was not active (state: {final[rid]})")
        if not runs:
            click.echo(f"session {session_id}: no live run")
        if turn is not None and not result.get("was_active"):
            live = result.get("live_run")
            now = f"its live turn is {live}, not stopped" if live is not None else "no turn of it is live"
            click.echo(f"session {session_id}: turn {turn} had ended; {now}")
        # The journal could not take the stop: it goes on, but a daemon killed now would
        # not know it was asked (the --json reply carries the same "warning").
        for warning in dict.fromkeys(str(r["warning"]) for r in [result, *runs] if r.get("warning")):
            click.echo(f"warning: {warning}", err=True)

    obj.emit(out, human)
    if not no_wait:
        codes = {OUTCOME_EXIT.get(state, ExitCode.RUN_FAILED) for state in final.values()}
        for code in (ExitCode.RUN_LOST, ExitCode.RUN_FAILED, ExitCode.RUN_CANCELLED):
            if code in codes:
                click.get_current_context().exit(code)


def _reach_the_lock_holder(
    client: Client, send: Callable[[], dict[str, Any]], exc: DaemonNotRunning
) -> dict[str, Any] | None:
    """The reply of the daemon that holds the state dir though it could not be reached;
    None when no daemon holds it (the stop is to be recorded for the next one).

    One that has not published its address yet (starting) is tried again for up to
    ``stop_delivery_s``; one whose endpoint file names it (its token or its socket is what
    fails) at once. Raises ``_Unreachable`` when it cannot be reached: the stop is then
    handed to it as a note, which a running daemon watches for and applies at once
    (``supervisor.core._pendingwatch``; before that watch, such a note waited for the
    daemon's next start while the run went on, and the CLI said so, exit 3)."""
    from supervisor.config import ENDPOINT_FILE, TOKEN_FILE
    from supervisor.control import _pendingstops
    from supervisor.control._statefiles import read_endpoint

    state_dir = client.state_dir
    holder = _pendingstops.lock_holder(state_dir)
    if holder is None:
        return None
    deadline = time.monotonic() + client.stop_delivery_s
    told = False
    while True:
        try:
            published = read_endpoint(state_dir / ENDPOINT_FILE).get("pid")
        except (OSError, ValueError):
            published = None
        if published == holder or time.monotonic() >= deadline:
            break
        if not told and client.on_stop_wait is not None:
            told = True
            client.on_stop_wait(
                f"a daemon (pid {holder}) holds the state dir but has not published its address ({exc}); "
                f"still trying to deliver the stop, for up to {client.stop_delivery_s:g} s"
            )
        time.sleep(0.1)
        holder = _pendingstops.lock_holder(state_dir)
        if holder is None:
            return None  # it exited
        try:
            return send()
        except DaemonNotRunning as again:
            exc = again
    raise _Unreachable(
        holder,
        f"{exc}; yet a daemon (pid {holder}) holds the state dir and cannot be reached (check its "
        f"{ENDPOINT_FILE!r} and {TOKEN_FILE!r} files)",
    )


# How long ``cancel`` waits for a running daemon it cannot reach to take the note it was
# handed (its watch of ``pending-stops/`` applies one within milliseconds of its rename).
NOTE_TAKEN_WAIT_S: Final = 5.0


class _Unreachable(Exception):
    """A daemon holds the state dir (``holder``: its pid) and cannot be reached."""

    def __init__(self, holder: int, message: str) -> None:
        super().__init__(message)
        self.holder = holder


def _wait_taken(note: Path, within_s: float) -> bool:
    """Whether ``note`` was taken (applied and removed by a daemon) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while note.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _nothing_to_record(obj: Obj, state_dir: Path, exc: DaemonNotRunning, run_id: str | None) -> None:
    """Before a run's stop is recorded for a daemon: the journal, read-only, says whether
    there is such a run and whether it is still live. Unknown: exit 4, nothing recorded
    (a typo was "stop recorded", exit 10). Ended: what ``cancel`` of an ended run says with
    a daemon ("was not active", its outcome's exit code). Unreadable: recorded anyway (the
    daemon decides). A session's note is not checked here."""
    if run_id is None:
        return
    from supervisor.config import JOURNAL_FILE
    from supervisor.errors import JournalError, RunNotFound
    from supervisor.store._read import JournalReader

    try:
        with JournalReader(state_dir / JOURNAL_FILE) as journal:
            state = journal.run_state(run_id)
    except RunNotFound:
        raise CliError(
            f"{exc}; and the journal of {str(state_dir)!r} has no run {run_id!r}: nothing to stop, nothing recorded",
            ExitCode.NOT_FOUND,
        ) from None
    except JournalError:
        return
    if state not in OUTCOME_EXIT:
        return
    out = {"run_id": run_id, "was_active": False, "state": state, "delivered": False, "pending": False}
    obj.emit(out, lambda: click.echo(f"{run_id}: was not active (state: {state}; read from the journal, no daemon)"))
    click.get_current_context().exit(OUTCOME_EXIT[state])


def _record_pending_stop(
    state_dir: Path, exc: DaemonNotRunning, *, run_id: str | None, session_id: str | None, turn: str | None, reason: str
) -> Path:
    """The stop, written for the next daemon on ``state_dir`` (``_pendingstops``): its note.
    Not for a state dir no daemon ever used (no journal: no run to stop) nor the fleet's
    front (its nodes' daemons are not here): the error stands then."""
    from supervisor.config import JOURNAL_FILE
    from supervisor.control import _pendingstops

    ctx = click.get_current_context(silent=True)
    if (ctx is not None and ctx.find_root().params.get("use_fleet")) or not (state_dir / JOURNAL_FILE).is_file():
        raise _translate(exc) from None
    try:
        return _pendingstops.write(state_dir, reason=reason, run_id=run_id, session_id=session_id, turn=turn)
    except ValueError as bad:
        raise CliError(str(bad), ExitCode.USAGE) from None
    except OSError as failed:
        raise CliError(f"{exc}; the stop could not be recorded for it either: {failed}", ExitCode.NO_DAEMON) from None


def _report_pending_stop(
    obj: Obj,
    note: Path,
    exc: DaemonNotRunning,
    *,
    run_id: str | None,
    session_id: str | None,
    turn: str | None,
    reason: str,
    unanswered: ConnectionLost | None = None,
    holder: tuple[_Unreachable, bool] | None = None,
) -> NoReturn:
    """Say that the stop waits for a daemon (stderr; ``--json``: an object), exit 10.

    ``unanswered``: a daemon started after the note was written and did not answer the
    stop tried again; it applies the note at its start if it read it then, else as soon as
    it runs (``supervisor.core._pendingwatch``); the note gone says it was taken.
    ``holder``: a daemon that runs and cannot be reached was handed the note (and whether
    it took it within ``NOTE_TAKEN_WAIT_S``)."""
    what = f"run {run_id}" if run_id is not None else f"session {session_id}" + (f" (turn {turn})" if turn else "")
    out: dict[str, Any] = {"delivered": False, "pending": True, "pending_stop": str(note), "reason": reason}
    out.update({"run_id": run_id} if run_id is not None else {"session_id": session_id, "turn": turn})
    check = f"agentd status {run_id}" if run_id is not None else f"agentd history {session_id}"
    if holder is not None:
        cut_off, taken = holder
        message = (
            f"the stop of {what} could not be sent: {cut_off}; it was handed to that daemon as a note, "
            f"{str(note)!r}, "
            + (
                "which it took (applied and removed): the stop is under way"
                if taken
                else f"which it has not taken within {NOTE_TAKEN_WAIT_S:g} s (a daemon watching its "
                "pending-stops/ applies one within a second; else it is applied at its next start)"
            )
            + f": check `{check}`"
        )
        out.update({"daemon_pid": cut_off.holder, "note_taken": taken})
        line = "stop handed to the daemon as a note" + (" and taken" if taken else ", not taken yet")
    elif unanswered is None:
        message = (
            f"the stop of {what} was not delivered now: {exc}; it is recorded in {str(note)!r} and the daemon "
            "applies it when it starts, before the run goes on"
        )
        line = "stop recorded, not delivered (no daemon)"
    else:
        taken = not note.exists()
        sent = " (the stop was sent to it too: whether it took it is unknown)" if unanswered.sent else ""
        message = (
            f"the stop of {what} was not delivered: no daemon ran, so it was recorded in {str(note)!r}; "
            f"then a daemon started meanwhile did not answer ({unanswered}){sent}; "
            + (
                "it has read the note and removed it (a daemon applies a note naming a live run before the run goes on)"
                if taken
                else "it applies the note once it has found its runs again (it reads the notes then, and applies "
                "one written later as soon as it appears), and removes it"
            )
            + f": check `{check}` and press Stop again once the daemon answers"
        )
        out.update({"daemon_started": True, "note_taken": taken, "sent": unanswered.sent})
        line = "stop recorded, not delivered (a daemon started meanwhile and did not answer)"
    obj.emit({**out, "message": message}, lambda: click.echo(f"{run_id or session_id}: {line}"))
    click.echo(f"warning: {message}", err=True)
    click.get_current_context().exit(ExitCode.STOP_PENDING)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("text")
@click.pass_obj
def steer(obj: Obj, run_id: str, text: str) -> None:
    """Give a running run extra input, applied at its next step (not a stop)."""
    result = obj.client().steer(run_id, text)
    if not result.get("accepted") and not obj.as_json:
        # A user error: one line on stderr (--json keeps its object on stdout, exit 5 too).
        raise CliError(
            f"{run_id}: not accepted ({result.get('why', 'not running')}; state: {result.get('state')})",
            ExitCode.REFUSED,
        )
    obj.emit(result, lambda: click.echo(f"{run_id}: queued for the next step"))
    if not result.get("accepted"):
        click.get_current_context().exit(ExitCode.REFUSED)


# ----------------------------------------------------------------------------- approvals


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("call_id", metavar="CALL")
@pass_obj
def approve(obj: Obj, run_id: str, call_id: str) -> None:
    """Let a tool call awaiting approval run (CALL: its id, shown by status and watch)."""
    result = obj.client().approve(run_id, call_id)
    obj.emit(result, lambda: click.echo(f"{run_id}: call {call_id} approved"))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("call_id", metavar="CALL")
@click.option("--reason", help='Told to the model: "denied by the user: REASON".')
@pass_obj
def deny(obj: Obj, run_id: str, call_id: str, reason: str | None) -> None:
    """Refuse a tool call awaiting approval: it never runs, the model is told, the turn goes on."""
    result = obj.client().deny(run_id, call_id, reason=reason)
    obj.emit(result, lambda: click.echo(f"{run_id}: call {call_id} denied"))


# ----------------------------------------------------------------------------- sessions


def _message_lines(m: dict[str, Any]) -> list[str]:
    role = str(m.get("role"))
    content = m.get("content")
    if role == "tool":
        return [f"  <- {m.get('tool_call_id')}: {_short(content or '', 110)}"]
    if role == "system":
        return [f"  note: {_short(content or '', 110)}"]
    lines = [f"  {role}: {_short(content, 110)}"] if content else []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments", "")
        lines.append(f"  -> {c.get('id')}: {fn.get('name')} {_short(args, 90)}{_lookalikes(fn.get('name'), args)}")
    return lines


@cli.command()
@click.argument("session_id", metavar="SESSION")
@pass_obj
def history(obj: Obj, session_id: str) -> None:
    """Print a session's transcript, turn by turn, as its next turn will see it."""
    pages = obj.client().history_pages(session_id)
    if obj.as_json:
        click.echo(json.dumps(_whole_history(pages), default=str))
        return
    n = 0
    for page in pages:
        turns = page.get("turns") or []
        if n == 0 and page.get("closed_at"):
            click.echo(f"session {session_id} (closed {_when(page['closed_at'])})")
        for t in turns:
            n += 1
            state = str(t.get("state")) + (f" ({t['reason']})" if t.get("reason") else "")
            click.echo(f"turn {t.get('turn', n)}  {t.get('run_id')}  {state}  {_when(t.get('created_at'))}")
            for m in t.get("messages") or []:
                for line in _message_lines(m):
                    click.echo(line)
    if n == 0:
        click.echo(f"session {session_id}: no turns")


def _whole_history(pages: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """A paged history as one reply: every page's turns and messages, in order."""
    whole: dict[str, Any] = {}
    for page in pages:
        if not whole:
            whole = dict(page)
            continue
        whole["turns"] = [*whole.get("turns", []), *(page.get("turns") or [])]
        whole["messages"] = [*whole.get("messages", []), *(page.get("messages") or [])]
        whole.update({k: page.get(k) for k in ("closed_at", "live_run", "turn_count", "more")})
    if whole.get("complete") is False:  # every page read
        whole.update(first_turn=1, complete=not whole.get("more"))
    return whole


@cli.command()
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@pass_obj
def sessions(obj: Obj, limit: int) -> None:
    """List sessions (conversations), most recently active first."""
    rows = obj.client().sessions(limit=limit)

    def human() -> None:
        if not rows:
            click.echo("no sessions")
            return
        header = ("SESSION", "TURNS", "LAST", "STATE", "LIVE", "PROFILE", "CLOSED")
        cells = [
            (
                str(r.get("session_id")),
                str(r.get("turns")),
                _when(r.get("last_at")),
                str(r.get("last_state")),
                str(r.get("live_run") or "-"),
                "yes" if r.get("profile") else "-",
                _when(r["closed_at"]) if r.get("closed_at") else "-",
            )
            for r in rows
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        for line in (header, *cells):
            click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())

    obj.emit({"sessions": rows}, human)


@cli.group(name="session")
def session_group() -> None:
    """Act on one session (conversation)."""


@session_group.command(name="close")
@click.argument("session_id", metavar="SESSION")
@pass_obj
def session_close(obj: Obj, session_id: str) -> None:
    """Close a session: stop its live turn, remove its browser profile; it takes no new turn."""
    try:
        result = obj.client().close_session(session_id)
    except AgentdError as exc:
        said = "the close was sent and may have been done (check with `agentd sessions`)"
        raise _if_sent(exc, _translate(exc), said) from None

    def human() -> None:
        parts = [
            f"session {session_id} closed" if result.get("was_open") else f"session {session_id} was closed already"
        ]
        if result.get("stopped"):
            parts.append(f"stopped {', '.join(result['stopped'])}")
        if result.get("profile_removed"):
            parts.append("browser profile removed")
        click.echo("; ".join(parts))

    obj.emit(result, human)


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
        (_run_id(r), _state_cell(r), str(r.get("session_id") or "-"), _when(r.get("created_at")), _task(r))
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    for line in (header, *cells):
        click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def _state_cell(row: dict[str, Any]) -> str:
    state = str(row.get("state", "?"))
    # Re-adopted at a restart, its events file not read yet: its state may be behind.
    return f"{state}?" if row.get("catching_up") is True else state


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
    names = dict.fromkeys(str(c.get("name")) for c in calls if isinstance(c, dict))
    return f"{len(calls)}: " + _short(", ".join(parts), 120) + _lookalikes(*names)


def _receipt_summary(receipt: Any) -> str | None:
    if not isinstance(receipt, dict):
        return None
    parts = []
    if receipt.get("cancel_reason"):
        parts.append(f"reason {receipt['cancel_reason']}")
    if isinstance(receipt.get("cancel_to_tree_dead_s"), (int, float)):
        parts.append(f"cancel to tree dead {receipt['cancel_to_tree_dead_s']:.2f} s")
    path_b = receipt.get("path_b")
    if not isinstance(path_b, dict):
        path_b = {}
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


def _model(spec: Any) -> str | None:
    """The provider and model a run uses, from its spec (the daemon fills in the provider)."""
    if not isinstance(spec, dict):
        return None
    m = spec.get("model")
    m = m if isinstance(m, dict) else {}
    provider = m.get("provider")
    if provider is None:
        return None
    if provider == "scripted":
        if m.get("script_path"):
            return f"scripted (script {m['script_path']})"
        return "scripted (inline script)" if m.get("script") is not None else "scripted (the built-in script)"
    where = f" at {m['base_url']}" if m.get("base_url") else ""
    return f"{provider} {m['name']}{where}" if m.get("name") else f"{provider} (its default model){where}"


def _print_run(run: dict[str, Any]) -> None:
    """The facts a person asks about a run; ``--json`` has the whole record."""
    rows: list[tuple[str, str]] = [("run", _run_id(run))]
    state = str(run.get("state"))
    rows.append(("state", state + (f" ({run['reason']})" if run.get("reason") else "")))
    if run.get("catching_up") is True:
        rows.append(("catching up", "re-adopted at a restart; what it did meanwhile is still being read"))
    if run.get("session_id"):
        rows.append(("session", str(run["session_id"])))
    if _task(run):
        rows.append(("task", _task(run)))
    model = _model(run.get("spec"))
    if model:
        rows.append(("model", model))
    times = [
        f"{k.removesuffix('_at')} {_when(run.get(k))}" for k in ("created_at", "started_at", "ended_at") if run.get(k)
    ]
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
    snapshot = run.get("partial_snapshot")
    if not isinstance(result, dict) and isinstance(snapshot, dict):
        # A live run: what it has said so far, the model's text as it streams included.
        said = str(snapshot.get("progress") or "")
        rows.append(("progress", f"step {snapshot.get('step')}: " + (_tail(said, 100) if said else "(no text yet)")))
    shown = result if isinstance(result, dict) else snapshot
    unfinished = shown.get("unfinished_text") if isinstance(shown, dict) else None
    if isinstance(unfinished, dict):
        live = run.get("state") not in OUTCOME_EXIT
        if unfinished.get("streaming") and live:
            rows.append(("streaming", f"the model is writing step {unfinished.get('step')}'s text"))
        else:
            rows.append(("cut short", f"step {unfinished.get('step')}'s text: the model's stream ended before it did"))
    if run.get("partial"):
        rows.append(("partial", "yes: the result is the last step snapshot"))
    if run.get("error"):
        rows.append(("error", _short(json.dumps(run["error"], default=str), 120)))
    rows.append(("tool calls", _tool_summary(run.get("tool_calls"))))
    for a in run.get("approvals") or []:
        if isinstance(a, dict):
            rows.append(
                (
                    "awaiting",
                    f"call {a.get('call_id')}: {a.get('name')} {_short(a.get('arguments', ''), 60)}"
                    f"{_lookalikes(a.get('name'), a.get('arguments', ''))} (approve or deny)",
                )
            )
    detail = run.get("receipt", {}).get("stop_detail") if isinstance(run.get("receipt"), dict) else None
    if isinstance(detail, dict) and detail.get("message"):
        rows.append(("stopped", f"by the daemon: {detail['message']}"))
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
        doing = "stopping" if (result.get("summary") or {}).get("stopping") is True else "running"
        click.echo(
            f"agentd {d.get('version', '?')} {doing}: pid {d.get('pid')}, up {_duration(float(d.get('uptime_s', 0)))}, "
            f"{d.get('url')}, state dir {d.get('state_dir')}"
        )
        journal = (result.get("summary") or {}).get("journal") or {}
        if journal.get("writable") is False:
            click.echo(
                f"degraded: the journal cannot be written ({journal.get('error')}); "
                f"{journal.get('pending_writes', '?')} writes wait in memory, not durable yet"
            )
        lost = journal.get("unwritten_before_restart")
        if isinstance(lost, dict):
            named = lost.get("runs")
            runs: list[Any] = named if isinstance(named, list) else []
            click.echo(
                f"journal: the previous daemon (pid {lost.get('pid', '?')}) ended while writes waited in its memory "
                f"for the journal: the last facts of {len(runs) + int(lost.get('more') or 0)} runs may be missing"
                + (f" ({', '.join(map(str, runs[:5]))}{', ...' if len(runs) > 5 else ''})" if runs else "")
                + ("; which runs is not known" if lost.get("unreadable") else "")
            )
        for restored in journal.get("restored") or []:
            if isinstance(restored, dict) and isinstance(restored.get("at"), (int, float)):
                kept = restored.get("kept_aside")
                click.echo(
                    f"journal: its file was {'removed' if restored.get('found') == 'missing' else 'replaced'} "
                    f"under the daemon and put back at {_when(float(restored['at']))}"
                    + (f"; the file found there is kept as {kept}" if kept else "")
                )
        disk = (result.get("summary") or {}).get("disk") or {}
        for fs in disk.get("watched") or []:
            if (
                isinstance(fs, dict)
                and isinstance(fs.get("free_bytes"), int)
                and isinstance(fs.get("min_free_bytes"), int)
            ):
                if fs["free_bytes"] < fs["min_free_bytes"]:
                    click.echo(
                        f"low on disk: {fs.get('path')} has {fs['free_bytes'] // 2**20} MiB free, "
                        f"below its low-water mark of {fs['min_free_bytes'] // 2**20} MiB"
                    )
                free, mark = fs.get("free_inodes"), fs.get("min_free_inodes")
                if isinstance(free, int) and isinstance(mark, int) and free < mark:
                    click.echo(f"low on inodes: {fs.get('path')} has {free} free, below its low-water mark of {mark}")
        last = disk.get("last_stop")
        if isinstance(last, dict) and disk.get("runs_stopped"):
            click.echo(
                f"runs stopped for filling the disk: {disk['runs_stopped']} (last: {last.get('run_id')}, "
                f"{_when(last.get('at'))})"
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
    type=click.Choice(
        ["queued", "starting", "running", "awaiting_approval", "cancelling", "completed", "failed", "cancelled", "lost"]
    ),
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
@click.option(
    "--open",
    "open_browser",
    is_flag=True,
    help="Also open the link in a web browser ($BROWSER), by way of a private page, not its command line.",
)
@pass_obj
def dashboard(obj: Obj, open_browser: bool) -> None:
    """Print a one-time login link to the daemon's web dashboard."""
    from supervisor.config import ENDPOINT_FILE, default_state_dir
    from supervisor.control import _dashlink
    from supervisor.control._statefiles import read_endpoint
    from supervisor.control.client import locate

    state_dir = obj.state_dir if obj.state_dir is not None else default_state_dir()
    _, token = locate(state_dir)
    try:
        dashboard_url = read_endpoint(state_dir / ENDPOINT_FILE).get("dashboard_url")
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the daemon's endpoint: {exc}", ExitCode.NO_DAEMON) from exc
    if not isinstance(dashboard_url, str):
        raise CliError('this daemon serves no dashboard (its config says dashboard = "off")', ExitCode.REFUSED)
    url = _dashlink.login_url(dashboard_url, _dashlink.mint_login_token(token))
    opened: bool | None = None
    if open_browser:
        from supervisor.control import _dashopen

        # The browser gets a private page that sends it on, not the link: its argv is in
        # /proc/<pid>/cmdline for any process that sees it (``_dashopen``).
        opened = _dashopen.open_link(url, state_dir)

    def human() -> None:
        click.echo(url)
        click.echo(f"(a one-time link, valid {_dashlink.LOGIN_TTL_S // 60} minutes)", err=True)
        if opened is False:
            click.echo("could not open a browser: open the link above by hand", err=True)

    obj.emit({"url": url, "expires_in_s": _dashlink.LOGIN_TTL_S, "opened": opened}, human)


# `agentd fleet ...` lives in its own module, imported when a fleet command runs or the
# help lists the commands (Ray loads only when a fleet command runs).
cli.add_lazy_command("fleet", "supervisor.fleet.cli", "fleet")

if _GC_WAS_ENABLED:
    gc.enable()


if __name__ == "__main__":  # pragma: no cover
    main()
