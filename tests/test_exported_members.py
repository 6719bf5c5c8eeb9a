import json
import subprocess
import sys

import supervisor


def test_the_public_names_of_supervisor_are_pinned() -> None:
    assert sorted(supervisor.__all__) == sorted(
        [
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
    )
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


def test_the_public_names_of_the_os_edge_are_pinned() -> None:
    import subagent.osedge as osedge

    assert sorted(osedge.__all__) == sorted(
        [
            "Kernel",
            "LinuxKernel",
            "LINUX",
            "Proc",
            "ProcessId",
            "parse_stat",
            "ProcessTable",
            "Targets",
            "parse_var",
            "Delivery",
            "signal_process",
            "resume_stopped",
            "signal_group",
            "group_exists",
            "kill_cgroup",
            "open_pidfd",
            "Runtime",
            "TrioRuntime",
            "Signalled",
            "Escalation",
            "escalate",
            "POLL_S",
            "Watch",
            "WatchSet",
            "IN_MODIFY",
            "IN_DELETE",
            "run_trio",
        ]
    )
    for name in osedge.__all__:
        assert hasattr(osedge, name), name


def test_the_presets_interface_is_pinned() -> None:
    import subagent.presets as presets

    assert sorted(presets.__all__) == ["PresetError", "available", "check_presets", "release_run_dir"]


def test_the_layer_packages_import_nothing() -> None:
    # Their docstrings say what is inside; a cold CLI or a runner pays only for what it uses.
    code = (
        "import json, sys, supervisor, subagent; before = set(sys.modules); "
        "import supervisor.control, supervisor.core, supervisor.store, supervisor.trees, subagent.tools, subagent.model; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == sorted(
        [
            "supervisor.control",
            "supervisor.core",
            "supervisor.store",
            "supervisor.trees",
            "subagent.tools",
            "subagent.model",
        ]
    )
