"""agentd's daemon: runs AI sub-agents as supervised processes and stops them for real.

Public names only; the modules behind them are the implementation. The CLI
(``supervisor.cli``) and the light client (``supervisor.client``) import what they need
directly, so that ``import supervisor.cli`` stays free of trio, openai and mcp.
"""

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
