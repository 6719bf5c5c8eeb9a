"""agentd's daemon: runs AI sub-agents as supervised processes and stops them for real.

Public names only; the modules behind them are the implementation. The names are
resolved on first use (PEP 562): ``import supervisor.cli`` (every ``agentd`` command)
imports this package first, and must not pay for ``Config``'s dataclass and its imports
when it needs none of them. The CLI (``supervisor.cli``) and the light client
(``supervisor.control.client``) import what they need directly, so that they stay free of trio,
openai and mcp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.config import Config as Config
    from supervisor.errors import AgentdError as AgentdError
    from supervisor.errors import ConfigError as ConfigError
    from supervisor.errors import ControlProtocolError as ControlProtocolError
    from supervisor.errors import DaemonAlreadyRunning as DaemonAlreadyRunning
    from supervisor.errors import DaemonNotRunning as DaemonNotRunning
    from supervisor.errors import JournalError as JournalError
    from supervisor.errors import RunNotFound as RunNotFound
    from supervisor.errors import SpawnError as SpawnError
    from supervisor.states import RunState as RunState

__all__ = [
    "Config",
    "RunState",
    "AgentdError",
    "ConfigError",
    "ControlProtocolError",
    "DaemonAlreadyRunning",
    "DaemonNotRunning",
    "JournalError",
    "RunNotFound",
    "SpawnError",
]

# Each public name and the module that defines it.
_HOME = {
    "Config": "supervisor.config",
    "RunState": "supervisor.states",
    "AgentdError": "supervisor.errors",
    "ConfigError": "supervisor.errors",
    "ControlProtocolError": "supervisor.errors",
    "DaemonAlreadyRunning": "supervisor.errors",
    "DaemonNotRunning": "supervisor.errors",
    "JournalError": "supervisor.errors",
    "RunNotFound": "supervisor.errors",
    "SpawnError": "supervisor.errors",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
