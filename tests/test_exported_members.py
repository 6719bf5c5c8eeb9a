import subprocess
import sys

import supervisor


def test_the_public_names_of_supervisor_are_pinned() -> None:
    assert sorted(supervisor.__all__) == sorted([
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
    ])
    for name in supervisor.__all__:
        assert getattr(supervisor, name).__module__.startswith("supervisor.")


def test_importing_the_package_stays_light() -> None:
    code = "import sys, supervisor; print(sorted(m for m in ('trio', 'openai', 'mcp', 'psutil') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_public_names_load_on_first_use() -> None:
    # Every `agentd` command imports the package: Config's module (a dataclass and its
    # imports) loads only for a name that needs it.
    code = (
        "import sys, supervisor; before = 'supervisor.config' in sys.modules; "
        "from supervisor import RunState, Config; "
        "print(before, 'supervisor.config' in sys.modules, Config.__module__, RunState.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "supervisor.config", "supervisor.states"]
