"""The daemon's exception tree.

AgentdError
 ├─ ConfigError            bad configuration value (field, value)
 │   └─ ListenError        a socket cannot be bound at the chosen host or port (field)
 ├─ SpawnError             a run could not be started (run_id)
 ├─ RunNotFound            no run with that id (run_id)
 ├─ JournalError           the durable store failed (path)
 │   └─ JournalUnavailable  it cannot be written now (disk full, read-only, I/O error)
 ├─ ControlProtocolError   a malformed control message (code)
 ├─ DaemonNotRunning       the CLI found no daemon (state_dir)
 └─ DaemonAlreadyRunning   another daemon holds the state dir (state_dir, pid)
"""

from __future__ import annotations

import os

__all__ = [
    "AgentdError",
    "ConfigError",
    "ListenError",
    "SpawnError",
    "RunNotFound",
    "JournalError",
    "JournalUnavailable",
    "ControlProtocolError",
    "DaemonNotRunning",
    "DaemonAlreadyRunning",
]


class AgentdError(Exception):
    """Base of every error agentd raises on purpose."""


class ConfigError(AgentdError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config {field}: {message}")
        self.field = field


class ListenError(ConfigError):
    """A socket of the daemon's cannot be bound for a reason of the user's choosing: its
    host or port. ``field`` is the setting that chose the port (``port``,
    ``dashboard_port``). Build one with ``ListenError.of``."""

    def __init__(self, field: str, message: str) -> None:
        AgentdError.__init__(self, message)
        self.field = field

    @classmethod
    def of(cls, field: str, host: str, port: int, exc: BaseException) -> ListenError | None:
        """The error for ``exc`` raised binding ``host:port``; None if it is not one of
        the user's choosing (then it is a bug or the machine's, and raised as it is)."""
        import errno
        import socket

        other = "with --port" if field == "port" else field
        where = f"cannot listen{' for the dashboard' if field == 'dashboard_port' else ''} on {host}:{port}"
        if isinstance(exc, socket.gaierror):
            return cls(field, f"{where}: {exc.strerror or exc} (no such host; check --host)")
        if isinstance(exc, UnicodeError):  # a name IDNA cannot encode: an empty or too long label
            return cls(field, f"{where}: not a host name ({exc}; check --host)")
        hint = {
            errno.EADDRINUSE: f"another program holds it; pick another {other}, or 0 for any free port",
            errno.EACCES: f"ports below 1024 need privileges; pick another {other}",
            errno.EADDRNOTAVAIL: "no interface has that address; check --host",
        }
        if not isinstance(exc, OSError) or exc.errno not in hint:
            return None
        return cls(field, f"{where}: {os.strerror(exc.errno).lower()} ({hint[exc.errno]})")


class SpawnError(AgentdError):
    def __init__(self, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class RunNotFound(AgentdError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run with id {run_id!r}")
        self.run_id = run_id


class JournalError(AgentdError):
    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class JournalUnavailable(JournalError):
    """The journal cannot be written now (disk full, read-only, I/O error, locked).

    A condition of the store, not of the data: the same write may succeed later. The run
    manager keeps such facts in memory meanwhile and says so (degraded mode).
    """


class ControlProtocolError(AgentdError):
    """A control message that cannot be served. ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DaemonNotRunning(AgentdError):
    def __init__(self, state_dir: str, detail: str = "") -> None:
        msg = f"no agentd daemon is running for state dir {state_dir!r}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
        self.state_dir = state_dir


class DaemonAlreadyRunning(AgentdError):
    def __init__(self, state_dir: str, pid: str = "") -> None:
        who = f" (pid {pid})" if pid else ""
        super().__init__(f"another agentd daemon{who} is already using state dir {state_dir!r}")
        self.state_dir = state_dir
        self.pid = pid
