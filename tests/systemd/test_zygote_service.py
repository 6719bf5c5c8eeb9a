"""The runner zygote under the hardened unit (issue 15): runs are forked there too.

The unit's seccomp filter (RestrictNamespaces=, SystemCallFilter=) may refuse clone3; the
zygote then forks and the child joins its cgroup itself. Either way a run is forked, gets
its own cgroup under the service's, shows its marker, and nothing is left after a stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.systemd.agentd_support import (
    TIMEOUT_STOP_S,
    UNIT,
    call,
    cli,
    container_processes,
    install,
    poll,
    require_daemon,
    stop_and_check,
    stored_run,
)
from tests.systemd.container import Container

pytestmark = pytest.mark.systemd

SPEC = {
    "task": "wait in a command",
    "model": {
        "provider": "scripted",
        "script": {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 600"}}]}]},
    },
}


@pytest.fixture
def service(container: Container) -> Iterator[Container]:
    require_daemon()
    install(container)
    yield container
    container.systemctl("stop", UNIT, check=False, timeout_s=TIMEOUT_STOP_S + 10)
    container.systemctl("reset-failed", UNIT, check=False)


def test_runs_are_forked_by_the_zygote_under_the_unit(service: Container) -> None:
    c = service
    c.systemctl("start", UNIT, timeout_s=60)
    zygote = poll(
        "the zygote to be ready",
        lambda: (z := call(c, "status")["summary"]["zygote"])["state"] == "ready" and z,
        timeout_s=60,
    )
    c.write("/run/agentd-test/zygote-run.json", json.dumps(SPEC))
    run_id = cli(c, "spawn", "--spec", "/run/agentd-test/zygote-run.json")["run_id"]
    poll("sleep 600 to start", lambda: container_processes(c, "sleep 600"))
    summary = call(c, "status")["summary"]["zygote"]
    assert summary["spawned"] == 1 and summary["cold_fallbacks"] == 0, summary
    assert summary["pid"] == zygote["pid"]
    run = cli(c, "status", run_id)
    assert run["containment"] == "cgroup", run
    assert "/system.slice/agentd.service/" in run["cgroup"], run
    runner_cgroup = c.run(["cat", f"/proc/{run['pid']}/cgroup"]).stdout
    assert run["tree_id"] in runner_cgroup, runner_cgroup
    runner_env = c.run(["cat", f"/proc/{run['pid']}/environ"]).stdout.split("\0")
    assert f"AGENTD_TREE={run['tree_id']}" in runner_env
    assert not [v for v in runner_env if v.startswith(("NOTIFY_SOCKET=", "WATCHDOG_"))]
    stop_and_check(c)
    assert stored_run(c, run_id)["state"] == "cancelled"
    assert container_processes(c, "sleep 600", "subagent.runner", "subagent.zygote", "agentd serve") == []
