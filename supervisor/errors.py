"""The daemon's exception tree.

   AgentdError
    ├─ ConfigError            bad configuration value (field, value)
    ├─ SpawnError             a run could not be started (run_id)
    ├─ RunNotFound            no run with that id (run_id)
    ├─ JournalError           the durable store failed (path)
│   └─ JournalUnavailable  it cannot be written now (disk full, read-only, I/O error)
    ├─ ControlProtocolError   a malformed control message (code)
    ├─ DaemonNotRunning       the CLI found no daemon (state_dir)
    └─ DaemonAlreadyRunning   another daemon holds the state dir (state_dir, pid)
"""

from __future__ import annotations

__all__ = [
    "AgentdError",
    "ConfigError",
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
