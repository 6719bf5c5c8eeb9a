"""The harness itself, under a real systemd: a trivial notify service that talks through
supervisor._sdnotify starts, becomes active only on READY=1, stops cleanly, and keeps its
watchdog happy (and one that does not is caught: the watchdog is really enforced)."""

from __future__ import annotations

import time

import pytest

from tests.systemd.container import CHECKOUT, Container, python_in_container

pytestmark = pytest.mark.systemd

CHILD = CHECKOUT / "tests" / "systemd" / "notify_child.py"


def install_unit(c: Container, name: str, args: str, extra: str = "") -> None:
    c.write(
        f"/run/systemd/system/{name}.service",
        f"""[Unit]
Description=agentd test harness ({name})

[Service]
Type=notify
NotifyAccess=main
ExecStart={python_in_container()} {CHILD} {args}
TimeoutStartSec=30s
TimeoutStopSec=10s
{extra}
""",
    )
    c.systemctl("daemon-reload")


def wait_for(c: Container, unit: str, prop: str, want: set[str], timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        value = c.show(unit, prop)[prop]
        if value in want or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_container_is_a_real_systemd(container: Container) -> None:
    assert container.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert container.run(["systemctl", "is-system-running"]).stdout.strip() == "running"
    assert container.run([python_in_container(), "-c", "import trio, psutil, supervisor"]).returncode == 0


def test_notify_service_is_active_only_after_ready(container: Container) -> None:
    c = container
    c.sh("rm -rf /run/harness; mkdir -p /run/harness; mkfifo /run/harness/started /run/harness/go")
    install_unit(c, "harness-gated", "gated /run/harness/started /run/harness/go")
    c.systemctl("start", "--no-block", "harness-gated.service")
    # The child has started and is blocked before READY=1: systemd must still wait.
    assert c.run(["cat", "/run/harness/started"], timeout_s=30).stdout == "started\n"
    state = c.show("harness-gated.service", "ActiveState", "SubState", "StatusText")
    assert (state["ActiveState"], state["SubState"]) == ("activating", "start")
    assert state["StatusText"] == ""

    c.sh("echo go >/run/harness/go")
    c.systemctl("start", "harness-gated.service", timeout_s=30)  # waits for the start job
    state = c.show("harness-gated.service", "ActiveState", "SubState", "StatusText", "MainPID")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running")
    assert state["StatusText"] == "harness ready"
    main_pid = int(state["MainPID"])
    host_pid = c.host_pid(main_pid)
    assert host_pid is not None

    t0 = time.monotonic()
    c.systemctl("stop", "harness-gated.service", timeout_s=30)
    took = time.monotonic() - t0
    state = c.show("harness-gated.service", "ActiveState", "Result", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    assert took < 10
    assert c.host_pid(main_pid) is None
    journal = c.journal("harness-gated.service")
    assert "Stopped" in journal, journal


def test_watchdog_pings_keep_the_service_up(container: Container) -> None:
    c = container
    install_unit(c, "harness-watchdog", "watchdog", "WatchdogSec=1s\nRestart=no")
    c.systemctl("start", "harness-watchdog.service")
    # WatchdogTimestamp moves on each WATCHDOG=1 (every 0.5 s): watch three full periods.
    seen = c.watch_watchdog("harness-watchdog.service", periods=3)
    assert len(seen) >= 3, seen
    assert seen[-1] - seen[0] >= 2_000_000, seen  # still pinging after two seconds and more
    s = c.show("harness-watchdog.service", "StatusText", "WatchdogUSec")
    assert s == {"StatusText": "harness up, watchdog every 0.5 s", "WatchdogUSec": "1s"}
    c.systemctl("stop", "harness-watchdog.service")
    assert c.show("harness-watchdog.service", "Result")["Result"] == "success"


def test_a_service_that_stops_pinging_is_caught(container: Container) -> None:
    c = container
    install_unit(c, "harness-silent", "silent", "WatchdogSec=1s\nRestart=no")
    c.systemctl("start", "harness-silent.service")
    assert wait_for(c, "harness-silent.service", "Result", {"watchdog"}) == "watchdog"
    assert wait_for(c, "harness-silent.service", "ActiveState", {"failed"}) == "failed"
    c.systemctl("reset-failed", "harness-silent.service")
